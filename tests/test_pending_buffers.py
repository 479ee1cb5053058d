"""Write-on-accept programs share one set of pending rows (`gdn_state.PendingBuffers`): every
CUDA-graph program of a hybrid target leaves its verify rows' delta-rule and conv inputs in the
pool's buffers, which its commit reads right after it, instead of keeping its own (some GiB at 64
sequences, summed over the programs).

CPU, float32, the fused Triton paths forced under the interpreter (`METRALE_FORCE_FUSED_KERNELS`,
as on CUDA: raw gates), with the fake capture of `test_hybrid_prefill_graphs`: output equals
plain eager decoding, and every program's pending rows are views of the shared buffers."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from metrale.engine.program_shapes import GDNMixedShape, max_ragged_seqs  # noqa: E402
from metrale.knobs import knobs  # noqa: E402
from metrale.models.gdn_pending import PendingBuffers
from metrale.models.gdn_state import GDNState, SplitState, StateMode  # noqa: E402
from metrale.speculative.replay import ReplayDrafter  # noqa: E402
from tests.test_hybrid_engine import hybrid_dir, llm_for  # noqa: E402, F401
from tests.test_hybrid_prefill_graphs import (  # noqa: E402
    fake_graphs,  # noqa: F401
    graphed,
    ids,
    params_of,
    prompts_of,
)


@pytest.fixture
def fused(monkeypatch):
    """force() -> the fused paths on from then on (the reference runs the torch path first)."""

    def force():
        monkeypatch.setenv("METRALE_FORCE_FUSED_KERNELS", "1")
        knobs.cache_clear()

    yield force
    monkeypatch.undo()
    knobs.cache_clear()


def in_buffers(t: torch.Tensor, buffers: PendingBuffers) -> bool:
    storages = {
        b.untyped_storage().data_ptr()
        for b in (buffers.conv_in, buffers.conv, buffers.a, buffers.b)
    }
    return t.untyped_storage().data_ptr() in storages


def test_views_fit_or_decline():
    pool = GDNState.zeros(3, 4, (12, 3), (2, 4, 4), torch.float32)
    buffers = PendingBuffers.for_pool(pool, rows=10)
    conv_in, a, b, conv = buffers.views(2, 3, 3)
    assert conv_in.shape == conv.shape == (3, 3, 12) and a.shape == b.shape == (3, 3, 2)
    assert conv_in.is_contiguous() and in_buffers(conv_in, buffers)
    assert buffers.views(0, 2, 5) is not None and buffers.views(0, 3, 4) is None  # 12 > 10 rows
    assert buffers.nbytes() == 3 * 10 * (2 * 12 + 2 * 2) * 4
    view = pool.view(None, StateMode.DEFER)
    assert view.pending_outputs(0, 2, 3) is None  # no buffers: allocate
    pool.pending_out = buffers
    deferred = pool.view(None, StateMode.DEFER)
    assert deferred.pending_outputs(1, 2, 3) is not None
    assert deferred.pending_outputs(1, 2, 1) is None  # one row a sequence: views of the step
    assert pool.view(None, StateMode.WRITE).pending_outputs(1, 2, 3) is None


def test_write_on_accept_programs_share_the_pending_rows(hybrid_dir, fake_graphs, fused):  # noqa: F811
    """A replay drafter and prompts arriving mid-run (verify programs and mixed ones): the
    output is plain decoding's, and the pending rows of every write-on-accept program, mixed
    programs' verify rows included, live in the pool's one `PendingBuffers`."""
    prompts = prompts_of([5, 22], seed=5)  # the second's chunks run beside the first's verifies
    params = params_of(len(prompts), seed=5, lo=6, hi=8)
    want = ids(llm_for(hybrid_dir).generate(prompts, params, use_tqdm=False))
    truth = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    fused()
    llm = graphed(
        llm_for(
            hybrid_dir,
            drafter=ReplayDrafter(truth, 0.7, vocab_size=320, seed=3),
            spec={"num_drafts": 3, "dcut": False},
            hybrid_verify_state="write_on_accept",
            max_num_batched_tokens=16,
            max_num_seqs=2,
        ),
        capture=False,  # each program on first use: the interpreter's forwards are slow
    )
    runner = llm.engine.runner
    buffers = runner.states.pool.pending_out
    # sized for the widest verify of 2 sequences of 1 + K = 4 rows, padding sequences included
    assert buffers is not None and buffers.rows == max_ragged_seqs(2, 4) * 4
    assert ids(llm.generate(prompts, params, use_tqdm=False)) == want
    assert runner.watch.eager == [] and llm.engine.retried_batches == 0
    programs = list(runner.graphs.cache._programs.items())
    programs += list(runner.graphs.mixed._programs.items())
    deferred = 0
    for (table, (_, mode)), (_, _, _, state) in programs:
        if mode is not StateMode.DEFER:
            continue
        if isinstance(state, SplitState):
            assert isinstance(table, GDNMixedShape)
            state = state.tail
        assert state.pending and state.pending.keys() == state.pending_conv.keys()
        for layer, rows in state.pending.items():
            assert rows.gates is not None  # raw gates: the Triton delta rule's inputs
            for t in (rows.q, rows.k, rows.v, rows.gates.a, rows.gates.b):
                assert in_buffers(t, buffers), (table, layer)
            assert in_buffers(state.pending_conv[layer], buffers)
        deferred += 1
    assert deferred >= 2 and any(isinstance(t, GDNMixedShape) for (t, _), _ in programs)
