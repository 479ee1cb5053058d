"""A tensor-parallel engine under interrupts and misuse (`distributed/workers.py`): a Ctrl-C on
rank 0 mid-forward is raised once the ranks finish the command, and they stay in step; anything
else escaping a command midway stops the workers at once; a second engine in the process is
refused without harming the first; a Ctrl-C while shards build tears the group down; a worker
killed mid-step is named. (Found in review: each left the ranks out of step, a hang, a gloo
abort, or a process whose later engines all failed.)"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch.distributed as dist

from metrale import LLM, SamplingParams
from metrale.distributed import startup, workers
from metrale.distributed.parallel import DistributedError
from metrale.distributed.workers import HeldInterrupt

PROMPTS = [[(5 * i + 2 * j) % 400 + 3 for j in range(4 + 3 * i)] for i in range(3)]

needs_main_thread = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread()
    or signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
    reason="Python's SIGINT handler in the main thread",
)


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def tp_llm(path, **kw) -> LLM:
    return LLM(path, device="cpu", dtype="float32", tensor_parallel_size=2, **kw)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]


@pytest.fixture(scope="module")
def want(tiny_model_dir):
    return tokens(LLM(tiny_model_dir, device="cpu", dtype="float32"))


def a_new_engine_gives(path, want) -> None:
    """A new tensor-parallel engine forms its group in this process and gives 1-rank tokens."""
    llm = tp_llm(path)
    try:
        assert tokens(llm) == want
    finally:
        llm.shutdown()


def two_ctrl_cs() -> None:
    signal.raise_signal(signal.SIGINT)
    signal.raise_signal(signal.SIGINT)


def patch_layer(llm: LLM, before) -> None:
    """Rank 0's second layer runs `before()` once, then its own forward."""
    layer = llm.engine.runner.model._model.model.layers[1]
    forward, calls = layer.forward, []

    def patched(*args, **kwargs):
        if not calls:
            calls.append(1)
            before()
        return forward(*args, **kwargs)

    layer.forward = patched


@needs_main_thread
def test_held_interrupt_raises_after_the_block_and_a_second_at_once():
    ran = []
    with pytest.raises(KeyboardInterrupt), HeldInterrupt():
        signal.raise_signal(signal.SIGINT)
        ran.append("after the first")
    assert ran == ["after the first"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt), HeldInterrupt():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        ran.append("after the second")  # never: the second is not held
    assert ran == ["after the first"]
    with HeldInterrupt():  # nothing held: nothing raised
        ran.append("quiet")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@needs_main_thread
def test_held_interrupt_keeps_an_ignored_sigint_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with HeldInterrupt():
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


@needs_main_thread
def test_ctrl_c_mid_forward_is_raised_after_it_and_the_ranks_stay_in_step(tiny_model_dir, want):
    llm = tp_llm(tiny_model_dir, distributed_timeout_s=10)
    try:
        patch_layer(llm, lambda: signal.raise_signal(signal.SIGINT))
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, greedy(), use_tqdm=False)
        # without the hold: the workers sat in collectives rank 0 left, and this timed out or
        # a process aborted on mismatched sizes
        assert tokens(llm) == want
        assert all(p.is_alive() for p in llm.engine.runner.model._workers)
    finally:
        llm.shutdown()


def test_an_exception_escaping_a_command_stops_the_workers_at_once(tiny_model_dir, want):
    llm = tp_llm(tiny_model_dir, distributed_timeout_s=60)
    procs = llm.engine.runner.model._workers

    def escape():
        raise KeyboardInterrupt  # not a signal: nothing holds it

    patch_layer(llm, escape)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert not any(p.is_alive() for p in procs)  # killed, not left in an all-reduce
        with pytest.raises(DistributedError, match="earlier failure"):
            llm.generate(PROMPTS, greedy(), use_tqdm=False)
    finally:
        llm.shutdown()
    assert not dist.is_initialized()
    a_new_engine_gives(tiny_model_dir, want)  # the group was torn down


def test_a_second_engine_is_refused_and_the_first_goes_on(tiny_model_dir, want):
    first = tp_llm(tiny_model_dir)
    try:
        with pytest.raises(DistributedError, match="shut that engine down first"):
            tp_llm(tiny_model_dir)
        assert tokens(first) == want  # its group survived the refusal
    finally:
        first.shutdown()


def test_a_ctrl_c_while_shards_build_tears_the_group_down(tiny_model_dir, want, monkeypatch):
    expect = startup._expect

    def interrupted(rank, proc, pipe, word, patience):
        if word == "ready":
            raise KeyboardInterrupt
        return expect(rank, proc, pipe, word, patience)

    monkeypatch.setattr(startup, "_expect", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tp_llm(tiny_model_dir)
    monkeypatch.setattr(startup, "_expect", expect)
    assert not dist.is_initialized()
    a_new_engine_gives(tiny_model_dir, want)


def test_a_worker_killed_mid_step_is_named(tiny_model_dir):
    llm = tp_llm(tiny_model_dir, distributed_timeout_s=20)
    worker = llm.engine.runner.model._workers[0]
    patch_layer(llm, lambda: os.kill(worker.pid, signal.SIGKILL))
    try:
        with pytest.raises(DistributedError, match=r"worker stopped: rank 1 \(exit code -9\)"):
            llm.generate(PROMPTS, greedy(), use_tqdm=False)
    finally:
        llm.shutdown()


@needs_main_thread
def test_ctrl_c_during_shutdown_and_a_burst_mid_forward_still_tear_everything_down(
    tiny_model_dir, want, monkeypatch
):
    """Every Ctrl-C of a teardown is held to its end: interrupted midway, the group stayed
    formed and the process could start no other tensor-parallel engine (found in review)."""
    stop = workers._stop

    def interrupted_stop(*args):
        two_ctrl_cs()
        stop(*args)

    monkeypatch.setattr(workers, "_stop", interrupted_stop)
    llm = tp_llm(tiny_model_dir)
    procs = llm.engine.runner.model._workers
    with pytest.raises(KeyboardInterrupt):
        llm.shutdown()  # two Ctrl-Cs inside: held, raised once it is done
    assert not dist.is_initialized() and not any(p.is_alive() for p in procs)
    # a burst mid-forward: the second escapes the command, and a third lands in the teardown
    # that follows it
    llm = tp_llm(tiny_model_dir)
    procs = llm.engine.runner.model._workers
    patch_layer(llm, two_ctrl_cs)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert not dist.is_initialized() and not any(p.is_alive() for p in procs)
    llm.shutdown()
    monkeypatch.setattr(workers, "_stop", stop)
    a_new_engine_gives(tiny_model_dir, want)


class Stop(Exception):
    """What a user's own SIGINT handler raises."""


@needs_main_thread
def test_a_users_sigint_handler_that_raises_stops_the_workers_at_once(tiny_model_dir):
    """The user's handler runs on the second Ctrl-C of a command; what it raises (an
    Exception, yet no failure of a rank) stops the workers at once, as a second Ctrl-C does
    (before: the engine was only marked broken, the workers left in a collective). The
    engine's step then fails as any failed step does: its retry of each sequence alone meets
    the stopped engine."""

    def handler(signum, frame):
        raise Stop("user asked to stop")

    previous = signal.signal(signal.SIGINT, handler)
    llm = tp_llm(tiny_model_dir)
    procs = llm.engine.runner.model._workers
    patch_layer(llm, two_ctrl_cs)
    try:
        with pytest.raises((Stop, DistributedError)):
            llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert not any(p.is_alive() for p in procs)
        assert not dist.is_initialized()
        assert signal.getsignal(signal.SIGINT) is handler
    finally:
        llm.shutdown()
        signal.signal(signal.SIGINT, previous)
