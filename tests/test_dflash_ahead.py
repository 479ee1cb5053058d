"""DFlash drafting ahead (`DFlashDrafter._draft_ahead`): right after a verify program, before the
host reads the verdicts, the next drafts are made on the device from the accepted count and the
bonus token the target's picks imply. On CPU, with the target's ragged programs and the
drafter's programs replaced by stand-ins that run their function: `accepted_blocks` against a
Python reference; output equal to plain decoding (greedy, seeded sampling, preemption, async
scheduling) with most drafts taken from ahead, and the acceptance of the drafter without it."""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.speculative import dflash as dflash_mod
from metrale.speculative.dflash import accepted_blocks
from tests.ahead_helpers import ahead_case
from tests.test_spec_dflash import PROMPTS, EagerProgram, plain, ragged_programs, write_dflash


def test_accepted_blocks_equal_a_python_reference():
    """Sequences' rows among other rows (a prompt chunk's: rows without picks, or its last row
    sampled), their picks among other sequences' picks."""
    rng = random.Random(0)
    for _ in range(50):
        seqs = rng.randint(1, 6)
        ks = [rng.randint(0, 4) for _ in range(seqs)]
        depth = max(max(ks), 1)
        ids, picks, first_rows, first_picks, counts = [], [], [], [], []
        want_ids, want_lens = [], []
        for k in ks:
            chunk = rng.randint(0, 3)  # a prompt chunk's rows first, its last sampled or not
            ids += [rng.randint(0, 3) for _ in range(chunk)]
            picks += [rng.randint(0, 3) for _ in range(chunk and rng.randint(0, 1))]
            first_rows.append(len(ids))
            first_picks.append(len(picks))
            rows = [rng.randint(0, 3) for _ in range(1 + k)]  # last token, then k drafts
            chosen = [rng.randint(0, 3) for _ in range(1 + k)]  # the target's pick after each
            ids += rows
            picks += chosen
            n = rng.randint(2, 50)
            counts.append(n)
            accepted = 0
            while accepted < k and rows[1 + accepted] == chosen[accepted]:
                accepted += 1
            want_ids.append([chosen[accepted]] + [9] * 3)
            want_lens.append(n + accepted)
        ids.append(7)  # a padding row of the program, and its pick
        picks.append(5)
        got_ids, got_lens = accepted_blocks(
            torch.tensor(ids),
            torch.tensor(picks),
            torch.tensor(first_rows),
            torch.tensor(first_picks),
            torch.tensor(ks),
            torch.tensor(counts),
            depth,
            9,
            4,
        )
        assert got_ids.tolist() == want_ids and got_lens.tolist() == want_lens


@pytest.fixture(scope="module")
def echo(tiny_model_dir, tmp_path_factory):
    """A drafter whose drafts the target accepts at times (see `write_dflash`)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = plain(tiny_model_dir, PROMPTS[:1], params)[0]
    repeated = max(set(want), key=want.count)
    return write_dflash(tiny_model_dir, tmp_path_factory.mktemp("ahead") / "d", echo_mask=repeated)


def fake_capture(fn, pool, device):
    program = EagerProgram(fn)
    program.out = fn().clone()
    return program, program.out


def graphed(
    model_dir, drafter_dir, monkeypatch, ahead: bool = True, prefill_rows: int = 0, **kw
) -> LLM:
    """An engine whose target steps replay ragged programs (and steps with prompt chunks of up
    to `prefill_rows` rows prefill programs) and whose drafter replays its draft programs
    (stand-ins that run the function), as on the GPU; with `ahead`, drafting ahead."""
    monkeypatch.setattr(dflash_mod, "capture", fake_capture)
    monkeypatch.setattr(dflash_mod, "STARTUP_CONTEXT_ROWS", 512)
    spec = {"method": "dflash", "model": str(drafter_dir), "num_drafts": 3, "dcut": False}
    llm = LLM(model_dir, device="cpu", dtype="float32", spec=spec, max_num_seqs=6, **kw)
    engine = llm.engine
    ragged_programs(engine, prefill_rows)
    drafter = engine.spec.drafter
    drafter.graphs = dflash_mod.DraftGraphs(drafter, 6, 256, None)
    llm.ahead_shapes = []  # the programs after which it drafted ahead

    def draft_ahead(entries, shape, tokens):
        drafter._draft_ahead(entries, shape, tokens)
        if drafter._ahead is not None:
            llm.ahead_shapes.append(type(shape).__name__)

    if ahead:
        engine.runner.after_verify = draft_ahead
        engine.runner.after_verify_drafts_only = True
    return llm


def tokens_of(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def random_drafter(tiny_model_dir, tmp_path_factory):
    """A random drafter: its drafts depend on the block's first token and on the context."""
    return write_dflash(tiny_model_dir, tmp_path_factory.mktemp("ahead") / "r")


def verified_drafts(llm: LLM) -> tuple[list, list]:
    """Records (request, tokens so far, drafts) of every sequence each step verifies, and the
    number of them that also verified in the step before (the drafts made ahead, where every
    step is a program)."""
    runner, seen, again, last = llm.engine.runner, [], [0], [set()]
    execute = runner.execute

    def recording(batch, **kw):
        out = execute(batch, **kw)
        now = [
            (e.seq.request_id, e.seq.num_tokens, tuple(e.drafts)) for e in batch.entries if e.drafts
        ]
        seen.extend(now)
        again[0] += sum(r in last[0] for r, _, _ in now)
        replayed = runner.replayed_shape is not None  # a program: its hook drafted ahead
        last[0] = {r for r, _, _ in now} if replayed else set()
        return out

    runner.execute = recording
    return seen, again


@pytest.mark.parametrize(
    ("drafter", "prefill_rows"), [("echo", 0), ("random_drafter", 0), ("random_drafter", 256)]
)
def test_drafts_made_ahead_are_the_drafters_own(
    request, tiny_model_dir, monkeypatch, drafter, prefill_rows
):
    """Greedy output is plain decoding's, most drafts come from ahead, and every verified draft
    is the one the drafter makes without drafting ahead (so is the acceptance). With prefill
    programs, steps that verify beside a prompt chunk draft ahead too."""
    path = request.getfixturevalue(drafter)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12 + 4 * i, ignore_eos=True) for i in range(8)
    ]
    want = plain(tiny_model_dir, PROMPTS[:8], params)
    drafts, accepted = [], []
    for ahead in (False, True):
        llm = graphed(tiny_model_dir, path, monkeypatch, ahead, prefill_rows)
        seen, again = verified_drafts(llm)
        drafts.append(seen)
        assert tokens_of(llm, PROMPTS[:8], params) == want
        accepted.append(llm.engine.telemetry.spec.num_accepted_tokens)
    assert drafts[0] == drafts[1] and len(drafts[0]) > 20
    assert accepted[0] == accepted[1]
    # every verify of a sequence that verified in the step before took its drafts from ahead
    assert llm.engine.spec.drafter.drafted_ahead == again[0] > 0.5 * len(drafts[1])
    assert ("PrefillShape" in llm.ahead_shapes) == (prefill_rows > 0)


@pytest.mark.parametrize("case", ["seeded", "preemption", "async", "mixed"])
def test_output_equals_plain_decoding(tiny_model_dir, echo, monkeypatch, case):
    """Seeded sampling, preemption (a preempted sequence's drafts made ahead are dropped),
    async scheduling, and a batch where some requests do not speculate."""
    n = 8
    params, kw = ahead_case(case, n, max_tokens=10, kv_pages=9)
    want = plain(tiny_model_dir, PROMPTS[:n], params)
    llm = graphed(tiny_model_dir, echo, monkeypatch, **kw)
    assert tokens_of(llm, PROMPTS[:n], params) == want
    assert llm.engine.spec.drafter.drafted_ahead > 0
    if case == "preemption":
        assert llm.engine.telemetry.preemptions > 0
        assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable


def test_drafting_ahead_that_fails_fails_no_sequence(tiny_model_dir, echo, monkeypatch):
    """Drafting ahead is a speed-up only: if it raises (say, out of memory capturing a new draft
    program), `propose` drafts as usual and every sequence goes on (found by review: the verify
    step failed, and each sequence, run alone, ended with an error)."""
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True) for _ in range(4)]
    want = plain(tiny_model_dir, PROMPTS[:4], params)
    llm = graphed(tiny_model_dir, echo, monkeypatch)
    graphs = llm.engine.spec.drafter.graphs
    run = graphs.run

    def fails_ahead(*args):
        if any(f.function in ("_draft_ahead", "_drafted_ahead") for f in inspect.stack()):
            raise RuntimeError("CUDA out of memory")
        return run(*args)

    graphs.run = fails_ahead
    out = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == want
    assert {o.outputs[0].finish_reason for o in out} == {"length"}
    assert llm.engine.retried_batches == 0 and llm.engine.telemetry.spec.verify_steps > 3
