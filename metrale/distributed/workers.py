"""The other ranks of a tensor-parallel engine, and how rank 0 keeps them in step.

Rank 0 (the engine's process) starts N - 1 worker processes (spawned, `startup.start`), each
building its shard of the target and a KV pool of as many pages as rank 0's, holding its own KV
heads. Every call the engine makes on its model, `forward(input_ids, positions, meta)` and
`compute_logits(hidden, rows)`, is first sent to the workers as a command word and its operands (the
reference system's protocol, generalised to a batched step), so all ranks run the same forward and
their collectives stay matched; a worker keeps its last hidden states for the `compute_logits` that
follows. Only rank 0 samples, drafts and emits.

Commands travel over one pipe per worker, not through the group: a worker may wait for its next
command as long as the engine idles, and sees its pipe close if rank 0 dies. The collectives of
the forward run under `distributed_timeout_s`. A worker reports that its shard is built (or why
not) before the engine starts; one that raises later exits, and rank 0's next collective fails:
the engine then raises `DistributedError` rather than hang. Workers ignore SIGINT (a terminal's
Ctrl-C reaches them too): rank 0 decides when they stop. On rank 0 a Ctrl-C is held back while
the ranks run a command (`HeldInterrupt`) and raised once it is done, so the ranks stay in step
and the engine goes on serving; anything that still escapes a command midway (a second Ctrl-C)
ends the engine and stops its workers at once. `shutdown` stops them and tears the group down;
so does dropping the engine. One tensor-parallel engine runs in a process at a time: it owns
torch.distributed's default group.
"""

from __future__ import annotations

import logging
import signal
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection as mp_connection

import torch
import torch.distributed as dist

from metrale.distributed.parallel import DistributedError, set_collective_group
from metrale.models.attention import AttentionMetadata
from metrale.models.gdn_state import GDNState, StateMode
from metrale.speculative.ep import (
    CMD_FORWARD,
    CMD_LOGITS,
    CMD_STATE_RESET,
    CMD_STOP,
    CMD_VERIFY_COMMIT,
)

log = logging.getLogger(__name__)


def _meta_fields(meta: AttentionMetadata) -> dict:
    return {
        "slot_mapping": meta.slot_mapping,
        "positions": meta.positions,
        "query_start_loc": meta.query_start_loc,
        "seq_lens": meta.seq_lens,
        "block_tables": meta.block_tables,
        "max_query_len": meta.max_query_len,
        "max_seq_len": meta.max_seq_len,
        "page_size": meta.page_size,
    }


class TPModel:
    """Rank 0's handle on the sharded target: calls are sent to the workers, then run here;
    everything else is the local shard's."""

    def __init__(self, model, workers: list, pipes: list, device: torch.device) -> None:
        self._model, self._workers, self._pipes, self._device = model, workers, pipes, device
        self._stopped = False
        # set once a call failed: the ranks may be out of step, so `shutdown` only kills
        self._broken = False
        # dropped without `shutdown` (or at exit): the workers are killed, the group torn down
        self._finalizer = weakref.finalize(self, _stop, workers, pipes, False)

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def _call(self, payload: list, local: Callable):
        """One command on every rank: `payload` to the workers, then `local()` here (this
        rank's part), with a Ctrl-C held until both are done. A failure breaks the engine
        (the ranks may be out of step); an exception that is no failure of the step (a second
        Ctrl-C, a SystemExit) escaping midway also stops the workers at once: they may wait
        in a collective this rank left, or read a command half the ranks got."""
        if self._broken:
            raise DistributedError("the tensor-parallel engine stopped after an earlier failure")
        if self._stopped:
            raise DistributedError("the tensor-parallel engine was shut down")
        message = [_cpu(x) for x in payload]
        with HeldInterrupt() as held:
            try:
                for pipe in self._pipes:
                    pipe.send(message)
                return local()
            except BaseException as e:
                if isinstance(e, Exception) and e is not held.escaped:
                    raise self._failure(e) from e  # any failure of a rank is fatal
                # (a second Ctrl-C: whatever the handler raised, the user's own exception too)
                self._broken = True
                self.shutdown()
                raise

    def _failure(self, e: Exception) -> DistributedError:
        self._broken = True
        # A worker killed mid-step breaks rank 0's collective before it shows as exited: a
        # moment for its pipe to close (its files go first) and then to be reaped, so the
        # error names it.
        gone = mp_connection.wait([p.sentinel for p in self._workers], timeout=0.5)
        for p in self._workers:
            if p.sentinel in gone:
                p.join(timeout=1)
        dead = [(i + 1, p.exitcode) for i, p in enumerate(self._workers) if not p.is_alive()]
        if dead:
            ranks = ", ".join(f"rank {r} (exit code {c})" for r, c in dead)
            return DistributedError(f"tensor-parallel worker stopped: {ranks}")
        return DistributedError(f"tensor-parallel step failed: {type(e).__name__}: {e}")

    def __call__(self, input_ids, positions, meta, state=None):
        addressing = None if state is None else (state.read, state.mode.value, state.rows)

        def here():
            if state is None:
                return self._model(input_ids, positions, meta)
            return self._model(input_ids, positions, meta, state)

        payload = [CMD_FORWARD, input_ids, positions, _meta_fields(meta), addressing]
        return self._call(payload, here)

    def make_state(self, num_entries: int, ssm_dtype: torch.dtype = torch.float32) -> TPGDNState:
        """This rank's state pool (the workers made theirs of as many entries, of the same
        type, at start-up), whose resets and commits every rank applies."""
        pool = self._model.make_state(num_entries, ssm_dtype)
        return TPGDNState(pool.conv, pool.ssm, call=self._call)

    forward = __call__

    def compute_logits(self, hidden, rows=None, out=None):
        return self._call([CMD_LOGITS, rows], lambda: self._model.compute_logits(hidden, rows, out))

    def shutdown(self) -> None:
        """Stop the workers (a stop command, then a join; kill any that stays, or all after a
        failure, as they may wait in a collective) and tear the group down."""
        if self._stopped:
            return
        # Every Ctrl-C held to the end: interrupted midway, the group stayed formed and the
        # process could start no other tensor-parallel engine (found in review).
        with HeldInterrupt(every=True):
            graceful = not self._broken and all(p.is_alive() for p in self._workers)
            if graceful:
                try:
                    for pipe in self._pipes:
                        pipe.send([CMD_STOP])
                except Exception:  # noqa: BLE001 (stopping anyway)
                    graceful = False
            _stop(self._workers, self._pipes, graceful)
            self._stopped = True
            self._finalizer.detach()


@dataclass
class TPGDNState(GDNState):
    """Rank 0's recurrent-state pool (and its views): resets and commits go to every rank."""

    call: Callable | None = None  # `TPModel._call`

    def reset(self, entries: torch.Tensor) -> None:
        self.call([CMD_STATE_RESET, entries], lambda: GDNState.reset(self, entries))

    def commit(self, num_rows: torch.Tensor) -> None:
        self.call([CMD_VERIFY_COMMIT, num_rows], lambda: GDNState.commit(self, num_rows))


class HeldInterrupt:
    """Holds a Ctrl-C (SIGINT) back while the ranks run a command, then raises it. Rank 0
    interrupted mid-forward left the workers in collectives it never joined, and its next
    command met them out of step: a wait to the collective timeout, or gloo aborting a
    process on mismatched sizes (found in review). A second Ctrl-C is not held (a rank that
    never answers), unless `every` (a teardown, whose waits are bounded); what the handler
    raises then is `escaped`. Only in the main thread (where Python runs signal handlers) and
    over a Python handler (not an ignored or default SIGINT, which keep their meaning)."""

    def __init__(self, every: bool = False) -> None:
        self.every = every

    def __enter__(self) -> HeldInterrupt:
        self.previous, self.held, self.escaped = None, None, None
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):
                self.previous = previous
                signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum, frame) -> None:
        if self.held is not None and not self.every:
            try:
                self.previous(signum, frame)
            except BaseException as e:
                self.escaped = e
                raise
        self.held = (signum, frame)

    def __exit__(self, kind, value, tb) -> bool:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            if self.held is not None and kind is None:
                self.previous(*self.held)  # (Python's default handler raises KeyboardInterrupt)
        return False


def _cpu(x):
    if isinstance(x, (tuple, list)):
        return type(x)(_cpu(y) for y in x)
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    return x.cpu() if isinstance(x, torch.Tensor) else x


def _stop(workers: list, pipes: list, graceful: bool) -> None:
    """Join the workers (after a stop command: they are exiting), else kill them; then the
    group goes."""
    for p in workers:
        if graceful:
            p.join(timeout=10)
        if p.is_alive():
            p.kill()
        p.join(timeout=5)
    for pipe in pipes:
        pipe.close()
    set_collective_group(None)
    if dist.is_initialized():
        dist.destroy_process_group()


def _on(device: torch.device, x):
    return x.to(device) if isinstance(x, torch.Tensor) else x


@torch.inference_mode()
def _serve(model, pool: GDNState | None, device: torch.device, pipe) -> None:
    """The worker's loop: run each command rank 0 sends, until CMD_STOP."""
    hidden = view = None
    while True:
        payload = [_on(device, x) for x in pipe.recv()]
        word = payload[0]
        if word == CMD_STOP:
            return
        if word == CMD_FORWARD:
            ids, positions, fields, addressing = payload[1:]
            meta = AttentionMetadata(**{k: _on(device, v) for k, v in fields.items()})
            if addressing is None:
                hidden = model(ids, positions, meta)
            else:
                read, mode, rows = (_on(device, x) for x in addressing)
                view = pool.view(read, StateMode(mode), rows)
                hidden = model(ids, positions, meta, view)
        elif word == CMD_LOGITS:
            model.compute_logits(hidden, payload[1])
        elif word == CMD_STATE_RESET:
            pool.reset(payload[1])
        elif word == CMD_VERIFY_COMMIT:
            view.commit(payload[1])
        else:
            raise RuntimeError(f"unknown command word {word:#x}")
