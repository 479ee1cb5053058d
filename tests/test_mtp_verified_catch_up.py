"""The MTP catch-up that follows the target's own verify program on the device, before the host
reads the verdicts (`MTPDrafter._catch_up_verified`), on CPU: the target's ragged programs and
the drafter's programs with their capture replaced by "run the captured function again on every
replay". The program works out each sequence's accepted drafts from the target's picks and
feeds the committed rows; the drafts it chains ahead must be the eager drafter's, step for step,
greedy and seeded, while sequences arrive and finish. Prompt chunks catch up in programs of the
target's prefill shapes (with 2 slots, beside other sequences' verify rows)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.engine import graphs
from metrale.speculative import mtp_graphs
from tests.test_hybrid_engine import hybrid_dir, hybrid_mtp_dir  # noqa: F401
from tests.test_hybrid_graphs import RerunGraph as TargetRerun
from tests.test_mtp_graphs import PROMPTS, RerunGraph, drafts_of


@pytest.fixture
def rerun_graphs(monkeypatch):
    def target_capture(fn, pool, device):
        graph = TargetRerun(fn, fn())
        return graph, graph.outputs

    def drafter_capture(fn, pool, device):
        graph = RerunGraph(fn, fn())
        return graph, graph.outputs

    monkeypatch.setattr(graphs, "capture", target_capture)
    monkeypatch.setattr(mtp_graphs, "capture", drafter_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


def graphed_mtp(kwargs: dict, max_rows: int | None = None) -> LLM:
    """An engine whose target steps replay ragged programs and whose MTP drafter runs its
    programs, as on the GPU (`max_rows`: `graph_max_rows`)."""
    llm = LLM(**kwargs)
    engine = llm.engine
    runner, drafter = engine.runner, engine.spec.drafter
    max_seqs = engine.config.max_num_seqs
    runner.graphs = graphs.GraphRunner(  # as the runner builds it on CUDA
        runner.model,
        max_rows,
        max(engine.max_model_len + engine.lookahead, runner.prefill_limit),
        runner.page_size,
        runner.device,
        paged_kernel=True,
        max_q=engine.config.spec.num_drafts + 1,
        max_seqs=max_seqs,
        prefill_rows=runner.prefill_limit,
    )
    drafter.chain_graphs = mtp_graphs.DraftChainGraphs(
        runner,
        drafter.heads,
        max_seqs,
        runner.graphs.max_model_len,
        max_seqs,
        (drafter._first, drafter._hidden),
    )
    runner.after_verify = drafter._catch_up_verified
    return llm


def count_verified(llm: LLM) -> list[int]:
    """[catch-ups the step programs ran]: wraps the drafter's hook."""
    drafter, seen = llm.engine.spec.drafter, [0]
    hook = drafter._catch_up_verified

    def counted(*args):
        seen[0] += 1
        return hook(*args)

    llm.engine.runner.after_verify = counted
    return seen


TIGHT = dict(page_size=4, num_kv_pages=24, max_num_batched_tokens=16)


@pytest.mark.parametrize(
    "num_drafts, max_num_seqs, temperature, pool",
    [(3, 8, 0.0, {}), (4, 8, 0.0, {}), (3, 2, 0.0, {}), (3, 8, 0.8, {}), (3, 4, 0.0, TIGHT)],
    ids=["k3", "k4", "arrivals", "seeded", "preempted"],
)
def test_catch_up_in_the_verify_program_drafts_what_the_eager_drafter_drafts(
    rerun_graphs, num_drafts, max_num_seqs, temperature, pool
):
    """`preempted`: a pool too small for the batch (sequences are preempted and recomputed)
    and a chunk budget that splits prompts across steps."""
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=24, ignore_eos=True)
    spec = {"method": "mtp", "num_drafts": num_drafts, "dcut": False}
    kwargs = dict(device="cpu", dtype="float32", spec=spec, max_num_seqs=max_num_seqs, **pool)
    want, want_drafts = drafts_of(LLM(**kwargs), params)
    plain = LLM(device="cpu", dtype="float32", max_num_seqs=max_num_seqs, **pool)
    outs = plain.generate(PROMPTS, dataclasses.replace(params, speculative=False), use_tqdm=False)
    assert want == [o.outputs[0].token_ids for o in outs]

    llm = graphed_mtp(kwargs)
    seen = count_verified(llm)
    drafter = llm.engine.spec.drafter
    eager = []  # prompt chunks catch up in prefill-shaped programs, never eagerly
    drafter._catch_up_eager = lambda *args: eager.append(args)
    got, got_drafts = drafts_of(llm, params)
    assert got == want
    assert got_drafts == want_drafts
    assert seen[0] > 10  # most steps caught up in the step's own program
    assert not eager
    chain = drafter.chain_graphs
    assert chain.verified_replays > 10
    # every step replayed a target program, and every catch-up followed it on the device
    # (prompt chunks too, in the prefill programs' steps): none waited for the verdicts
    assert chain.catch_up_replays == chain.verified_replays
    assert drafter.drafted_ahead > sum(1 for step in got_drafts for _, d in step if d) // 2
    assert llm.engine.telemetry.spec.num_accepted_tokens > 20
    assert (llm.engine.telemetry.preemptions > 0) == bool(pool)


@pytest.mark.parametrize("variant", ["write_on_accept", "per_row_slots"])
def test_hybrid_target_catch_up_in_its_verify_program(
    hybrid_mtp_dir,  # noqa: F811
    rerun_graphs,
    variant,
):
    """A Qwen3-Next target with its MTP head: verify steps (programs of width 1 + K) catch up
    in the step's program, decode steps (width 1) from the verdicts; the drafts equal the eager
    drafter's and the output plain decoding's."""
    from tests.test_hybrid_engine import PROMPTS as IDS
    from tests.test_hybrid_engine import greedy, llm_for

    opts = dict(
        spec={"method": "mtp", "num_drafts": 3, "dcut": False},
        hybrid_verify_state=variant,
        max_num_seqs=4,
    )
    plain = llm_for(hybrid_mtp_dir).generate(IDS, greedy(16), use_tqdm=False)
    eager = llm_for(hybrid_mtp_dir, **opts)
    want, want_drafts = drafts_of(eager, greedy(16), IDS)
    assert want == [o.outputs[0].token_ids for o in plain]
    llm = llm_for(hybrid_mtp_dir, **opts)
    engine = llm.engine
    runner, drafter = engine.runner, engine.spec.drafter
    runner.graphs = graphs.GraphRunner(
        runner.model,
        None,
        engine.max_model_len + engine.lookahead,
        runner.page_size,
        runner.device,
        paged_kernel=True,
        state_pool=runner.states.pool,
        max_q=4,
        max_seqs=4,
        verify_mode=runner.states.verify_mode,
    )
    drafter.chain_graphs = mtp_graphs.DraftChainGraphs(
        runner, drafter.heads, 4, runner.graphs.max_model_len, 4, (drafter._first, drafter._hidden)
    )
    runner.after_verify = drafter._catch_up_verified
    got, got_drafts = drafts_of(llm, greedy(16), IDS)
    assert got == want
    assert got_drafts == want_drafts
    assert drafter.chain_graphs.verified_replays > 3


@pytest.mark.parametrize("max_model_len", [38, 39])
def test_chain_ahead_near_the_model_length_stays_in_the_rotary_table(rerun_graphs, max_model_len):
    """A request that runs to `max_model_len`: the catch-up chains the next drafts ahead past
    the positions the rotary table holds (it chains K - 1 deep whatever the caps); those rows
    go to the dummy page and the request ends by length, as plain decoding's does (found by a
    review: an IndexError on CPU, an out-of-bounds gather on CUDA)."""
    kwargs = dict(
        device="cpu",
        dtype="float32",
        max_num_seqs=1,
        max_model_len=max_model_len,
        max_num_batched_tokens=16,
        spec={"method": "mtp", "num_drafts": 3, "dcut": False},
    )
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    want = LLM(**kwargs).generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    got = graphed_mtp(kwargs).generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "length"
    assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)


def test_sequences_that_do_not_draft_leave_their_pages_alone(rerun_graphs):
    """A request with `speculative=False` batched with one that speculates: the step's catch-up
    program writes no MTP K/V into its pages (the eager drafter never does), so a speculative
    request that reuses them through the prefix cache drafts what the eager drafter drafts
    (found by a review)."""
    kwargs = dict(
        device="cpu",
        dtype="float32",
        max_num_seqs=4,
        page_size=4,
        spec={"method": "mtp", "num_drafts": 3, "dcut": False},
    )

    def run(llm: LLM):
        plain = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, speculative=False)
        spec = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        first = llm.generate(PROMPTS[:2], [plain, spec], use_tqdm=False)[0]
        ids = list(first.prompt_token_ids) + list(first.outputs[0].token_ids)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        return drafts_of(llm, params, [ids])

    assert run(graphed_mtp(kwargs)) == run(LLM(**kwargs))


def test_a_workspace_narrower_than_the_catch_up_shapes(rerun_graphs):
    """`graph_max_rows` below the widest step: catch-up programs are captured only for the
    shapes the target's workspace holds; wider steps catch up eagerly (found by a review: the
    engine failed to start)."""
    kwargs = dict(device="cpu", dtype="float32", max_num_seqs=8, spec={"method": "mtp"})
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(**kwargs).generate(PROMPTS, params)]
    llm = graphed_mtp(kwargs, max_rows=16)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
    assert llm.engine.spec.drafter.chain_graphs.catch_up_replays > 0


def test_prompt_chunks_past_the_prefill_programs_catch_up_in_pieces(rerun_graphs):
    """Steps whose prompt chunks hold more rows than the widest prefill program run the target
    eagerly; their catch-up is cut into pieces of at most that many rows, replayed in order
    (a piece reads the K/V the pieces before it wrote), never eagerly: the drafts are the eager
    drafter's. Before, such a step's catch-up ran eagerly (up to 3 ms at 64 slots on the
    H200, beside a 5 ms step)."""
    long = [p * 6 for p in PROMPTS]  # 30 to 80 tokens
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = {"method": "mtp", "num_drafts": 3, "dcut": False}
    kwargs = dict(
        device="cpu",
        dtype="float32",
        spec=spec,
        max_num_seqs=4,
        max_num_batched_tokens=96,
        graph_prefill_rows=32,
    )
    want, want_drafts = drafts_of(LLM(**kwargs), params, long)
    llm = graphed_mtp(kwargs)
    drafter = llm.engine.spec.drafter
    eager = []
    drafter._catch_up_eager = lambda *args: eager.append(args)
    pieces = []
    real = drafter._catch_up_in_pieces
    drafter._catch_up_in_pieces = lambda *args: pieces.append(real(*args)) or pieces[-1]
    got, got_drafts = drafts_of(llm, params, long)
    assert got == want
    assert got_drafts == want_drafts
    assert pieces and all(pieces)
    assert not eager
