"""Starting a tensor-parallel engine's workers: rank 0 hosts the group's store, spawns ranks
1..N-1, watches each join, forms the group and waits for every shard (`start`); a worker's life
from its spawn to its command loop (`_worker_main`, then `workers._serve`).

Split out of `workers.py`, which keeps what runs once the group is formed: rank 0's model handle
(`TPModel`) and the workers' command loop. Every failure while starting ends it at once with a
`DistributedError` naming the rank (or a `ShardSettingsError`, a ValueError, for settings a
worker's device has no room for), never a hang: a worker that exits or says why is seen by its
pipe or its exit, whichever comes first.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
import traceback
from multiprocessing import connection as mp_connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from metrale.distributed import workers as tp_workers
from metrale.distributed.parallel import DistributedError, TPGroup, set_collective_group

# Seconds the ranks wait for each other while starting (spawning, importing torch, building a
# shard of a large checkpoint): at least this, whatever the collectives' timeout.
STARTUP_TIMEOUT = 600.0
# How often rank 0 looks at its workers while they join the group's store.
JOIN_POLL = 0.05


def _joined_key(rank: int) -> str:
    return f"metrale/joined/{rank}"


def _init_group(rank: int, size: int, store, device: torch.device, timeout: float):
    """Form the default group over the store rank 0 hosts (`store`: it on rank 0, its (host,
    port) on a worker) with a start-up's patience, then the group of the forward's collectives
    under `timeout`."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    if rank:  # a worker: rank 0 sees it join once all that may fail before the group did not
        host, port = store
        patience = datetime.timedelta(seconds=max(timeout, STARTUP_TIMEOUT))
        store = dist.TCPStore(host, port, size, is_master=False, timeout=patience)
        store.set(_joined_key(rank), "1")
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=max(timeout, STARTUP_TIMEOUT)),
    )
    group = dist.new_group(
        list(range(size)), timeout=datetime.timedelta(seconds=timeout), backend=backend
    )
    set_collective_group(group)


def start(build, size: int, expert_parallel: bool, device: torch.device, timeout: float):
    """Start ranks 1..size-1, each running `build(rank, tp, device)` (-> its model with its KV
    bound, and its recurrent-state pool or None) and then the command loop; join the group as
    rank 0 and wait for every worker's shard. Returns (TPGroup, worker processes, pipes)."""
    if dist.is_initialized():
        # (torch.distributed has one default group a process: forming it again failed, and
        # that failure's clean-up tore down the group the running engine used)
        raise DistributedError(
            "torch.distributed's default group is already formed in this process (another "
            "tensor-parallel engine runs here): shut that engine down first"
        )
    patience = max(timeout, STARTUP_TIMEOUT)
    # Rank 0 hosts the group's store, bound before any worker starts (no port picked and then
    # taken by another process meanwhile), and watches the workers join it.
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        size,
        is_master=True,
        timeout=datetime.timedelta(seconds=patience),
        wait_for_workers=False,
    )
    address = ("127.0.0.1", store.port)
    ctx = mp.get_context("spawn")
    workers, pipes = [], []
    for rank in range(1, size):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(
            target=_worker_main,
            args=(rank, size, expert_parallel, address, build, str(device), timeout, theirs),
            daemon=True,
            name=f"metrale-tp{rank}",
        )
        proc.start()
        theirs.close()
        workers.append(proc)
        pipes.append(ours)
    try:
        # every worker running (a spawned child that fails to start, as a script without an
        # `if __name__ == "__main__":` guard does, is seen by its exit, not by a timeout)
        for rank, (proc, pipe) in enumerate(zip(workers, pipes, strict=True), 1):
            _expect(rank, proc, pipe, "started", patience)
        _await_joined(store, workers, pipes, patience)
        _init_group(0, size, store, device, timeout)
        for rank, (proc, pipe) in enumerate(zip(workers, pipes, strict=True), 1):
            _expect(rank, proc, pipe, "ready", patience)
    except BaseException as e:  # (a Ctrl-C while shards build too: the group goes)
        tp_workers._stop(workers, pipes, False)
        # the store's port stayed bound while the error's frames held it (review)
        traceback.clear_frames(e.__traceback__)
        store = None
        if not isinstance(e, Exception) or isinstance(e, (DistributedError, ShardSettingsError)):
            raise
        raise DistributedError(f"tensor-parallel group did not form: {e}") from e
    return TPGroup(0, size, expert_parallel), workers, pipes


def _await_joined(store, workers: list, pipes: list, patience: float) -> None:
    """Wait until every worker has joined the group's store, which each does just before it
    forms the group, once all that may fail before then did not. A worker that says why it
    cannot, or exits, before it joins ends the wait at once: rank 0 otherwise waited in the
    group's formation for the start-up's patience (ten minutes) for a rank already gone. (One
    that fails inside the formation itself, after it joined, still costs that wait.)"""
    deadline = time.monotonic() + patience
    waiting = list(range(1, len(workers) + 1))
    while waiting:
        waiting = [r for r in waiting if not store.check([_joined_key(r)])]
        for rank in waiting:
            proc, pipe = workers[rank - 1], pipes[rank - 1]
            # why it cannot (`_worker_main` sends its exception and exits), or its exit
            if pipe.poll() or not proc.is_alive():
                _expect(
                    rank,
                    proc,
                    pipe,
                    "joined",
                    0,
                    "exited before it joined the group (exit code {code})",
                )
        if waiting and time.monotonic() > deadline:
            raise DistributedError(f"rank {waiting[0]} did not join the group in {patience:g} s")
        if waiting:
            time.sleep(JOIN_POLL)


class ShardSettingsError(ValueError):
    """A worker refused the engine's settings while building its shard (a KV pool the device
    has no room for): a ValueError naming them, as on one device, not a failed group."""


# What a worker that exits while it starts is told (`_expect`'s `gone`)
EXITED_STARTING = (
    "exited while starting (exit code {code}); a script that starts a tensor-parallel engine "
    'needs an `if __name__ == "__main__":` guard'
)


def _expect(rank: int, proc, pipe, word: str, patience: float, gone: str = EXITED_STARTING):
    """Wait for a worker to say `word`; a DistributedError if it says why not, exits (`gone`,
    its exit code filled in), or stays silent for `patience` seconds, a `ShardSettingsError`
    if it refused the settings."""
    ready = mp_connection.wait([pipe, proc.sentinel], timeout=patience)
    status = None
    if pipe in ready:
        try:
            status = pipe.recv()
        except EOFError:  # the worker is gone: its pipe closed with it
            proc.join(timeout=10)
    if status is not None:
        if isinstance(status, tuple):  # (the worker's exception type, its message)
            kind, message = status
            if kind == "ValueError":  # its settings (a KV pool without room): the caller's
                raise ShardSettingsError(f"rank {rank}: {message}")
            raise DistributedError(f"rank {rank} could not build its shard: {kind}: {message}")
        if status != word:
            raise DistributedError(f"rank {rank} could not build its shard: {status}")
    elif ready:
        proc.join(timeout=10)
        raise DistributedError(f"rank {rank} " + gone.format(code=proc.exitcode))
    else:
        raise DistributedError(f"rank {rank} did not start in {patience:g} s")


def _worker_main(
    rank: int, size: int, ep: bool, address: tuple, build, device: str, timeout: float, pipe
):
    pipe.send("started")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the workers stop
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", rank)
    try:
        _init_group(rank, size, address, dev, timeout)
        model, pool = build(rank, TPGroup(rank, size, ep), dev)
    except Exception as e:  # noqa: BLE001 (reported to rank 0, which raises it)
        pipe.send((type(e).__name__, str(e)))
        os._exit(1)
    pipe.send("ready")
    try:
        tp_workers._serve(model, pool, dev, pipe)
    except EOFError:  # rank 0 is gone
        os._exit(0)
    except Exception:  # noqa: BLE001 (reported; exiting makes rank 0's collective fail)
        traceback.print_exc()
        os._exit(1)
    dist.destroy_process_group()
