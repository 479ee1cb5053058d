"""The acceptance function and the verify step on their own: logprobs with speculation equal
plain decoding's, sequences' KV and positions stay consistent under forced acceptance patterns,
raw-argmax judging, and the CLI's speculative mode."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.engine.sampler import SamplingBatch, SamplingRow
from metrale.speculative.verify import accept, build_layout
from tests.test_spec_lossless import make_prompts, params_for, replay


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(seed=7)[:6]


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_logprobs_with_speculation_equal_plain_decoding(tiny_model_dir, prompts, alpha):
    params = [params_for(i, logprobs=3, repetition_penalty=1.2) for i in range(len(prompts))]
    plain = LLM(tiny_model_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    ref = [o.outputs[0].token_ids for o in plain]
    llm = LLM(
        tiny_model_dir,
        drafter=replay(prompts, ref, alpha),
        device="cpu",
        spec={"num_drafts": 3},
    )
    spec = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        assert len(a.logprobs) == len(b.logprobs)
        for pa, pb in zip(a.logprobs, b.logprobs, strict=True):
            assert list(pa) == list(pb)  # same tokens, same order
            for tok in pa:
                assert pa[tok].rank == pb[tok].rank
                assert pa[tok].logprob == pytest.approx(pb[tok].logprob, abs=1e-5)
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_positions_and_pages_stay_consistent(tiny_model_dir, prompts, alpha):
    """After every step of a forced pattern, each running sequence has computed exactly its
    tokens but the last, its pages cover them, and its KV rows equal a fresh prefill's."""
    params = [params_for(i) for i in range(len(prompts))]
    ref = [
        o.outputs[0].token_ids
        for o in LLM(tiny_model_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    ]
    llm = LLM(
        tiny_model_dir,
        drafter=replay(prompts, ref, alpha),
        device="cpu",
        spec={"num_drafts": 4, "dcut": False},
    )
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            if seq.is_prefilling:
                continue
            assert seq.num_computed_tokens == seq.num_tokens - 1
            # (the tokens of a held verify may end it at its length, `engine/held_verify.py`:
            # that last token is never a row)
            rows = seq.num_tokens - (len(seq.output_token_ids) >= seq.params.max_tokens)
            assert len(seq.block_table) * engine.config.page_size >= rows
            checked += 1
            if checked == 8:  # mid-generation: the cached rows are exactly a prefill's
                assert_kv_equals_fresh_prefill(tiny_model_dir, engine, seq)
    assert checked > 8
    assert engine.allocator.num_free == engine.allocator.num_usable


def kv_rows(engine, seq, n: int) -> torch.Tensor:
    """[layers, 2, n, Hkv, D] the KV rows of seq's first n positions."""
    page = engine.config.page_size
    slots = torch.tensor([seq.block_table[p // page] * page + p % page for p in range(n)])
    cache = engine.runner.kv_cache
    return cache.view(*cache.shape[:2], -1, *cache.shape[-2:])[:, :, slots]


def assert_kv_equals_fresh_prefill(model_dir, engine, seq) -> None:
    n = seq.num_computed_tokens
    fresh = LLM(model_dir, device="cpu").engine
    fresh.add_request("x", seq.tokens(0, n), SamplingParams(max_tokens=1))
    batch = fresh.scheduler.schedule()
    fresh.runner.all_logits(batch)
    other = fresh.requests["x"].seqs[0]
    torch.testing.assert_close(
        kv_rows(engine, seq, n), kv_rows(fresh, other, n), atol=1e-5, rtol=1e-5
    )


def test_raw_argmax_ignores_the_pipeline_on_draft_rows():
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 2.0, 1.0]])
    # a bias that makes token 2 the processed argmax on both rows
    sp = SamplingParams(temperature=0.0, logit_bias={2: 5.0})
    rows = [SamplingRow(sp, 0, [0], out) for out in ([], [2])]
    sb = SamplingBatch.build(rows, 3, torch.device("cpu"))
    layout = build_layout([1], [[1]], torch.device("cpu"))
    piped = accept(logits, sb, layout)
    raw = accept(logits, sb, layout, raw_argmax=True)
    assert piped.num_accepted.tolist() == [0] and piped.emitted.tolist() == [2, 2]
    # the draft row judges on the raw argmax (1, accepted); the bonus row keeps the pipeline
    assert raw.num_accepted.tolist() == [1] and raw.emitted.tolist() == [1, 2]


def test_greedy_fast_path_equals_the_pipeline_and_accept():
    """`greedy_verdicts` (the runner's path for plain greedy rows) gives exactly the verdicts of
    the full pipeline + `accept`, on random logits with ties and drafts that match in part."""
    from metrale.engine.sequence import ScheduledSeq, Sequence
    from metrale.engine.step_output import greedy_verdicts, verdicts_of

    gen = torch.Generator().manual_seed(0)
    vocab, sp = 11, SamplingParams(temperature=0.0, max_tokens=64)
    for trial in range(20):
        depths = [int(d) for d in torch.randint(0, 5, (6,), generator=gen)]
        rows = sum(depths) + len(depths)
        # few distinct values: many ties, where the first maximal id must win on both paths
        logits = torch.randint(0, 4, (rows, vocab), generator=gen).float()
        picks = logits.argmax(dim=-1).tolist()
        entries, start = [], 0
        for s, k in enumerate(depths):
            # drafts equal to the row's argmax until a random cut, then random tokens
            cut = int(torch.randint(0, k + 1, (1,), generator=gen))
            drafts = picks[start : start + cut] + [
                int(t) for t in torch.randint(0, vocab, (k - cut,), generator=gen)
            ]
            seq = Sequence(s, f"r{s}", [1, 2, 3], sp, seed=s, eos_token_ids=(0,), arrival=s)
            seq.num_computed_tokens = 2
            entries.append(ScheduledSeq(seq, 1 + k, drafts))
            start += k + 1
        sb = SamplingBatch.build(
            [SamplingRow(sp, 0, [1, 2, 3], [], drafts=e.drafts) for e in entries],
            vocab,
            torch.device("cpu"),
        )
        layout = build_layout(depths, [e.drafts for e in entries], torch.device("cpu"))
        slow = verdicts_of(entries, accept(logits, sb, layout))
        fast = greedy_verdicts(entries, logits.argmax(dim=-1))
        for a, b in zip(slow, fast, strict=True):
            assert (a.num_accepted, a.matches, a.picks) == (b.num_accepted, b.matches, b.picks)
            assert [t.token_id for t in a.tokens] == [t.token_id for t in b.tokens], trial


def test_plain_greedy_covers_every_pipeline_stage_that_touches_greedy_rows():
    from metrale.engine.logits_pipeline import is_plain_greedy

    assert is_plain_greedy(SamplingParams(temperature=0.0), 0)
    assert is_plain_greedy(SamplingParams(temperature=0.0, top_p=0.5, top_k=3), 0)
    for changed in (
        dict(temperature=0.7),
        dict(repetition_penalty=1.1),
        dict(presence_penalty=0.5),
        dict(frequency_penalty=0.5),
        dict(logit_bias={3: 1.0}),
        dict(logprobs=0),
        dict(min_tokens=2),
    ):
        assert not is_plain_greedy(SamplingParams(**{"temperature": 0.0, **changed}), 1), changed
    assert is_plain_greedy(SamplingParams(temperature=0.0, min_tokens=2), 2)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_device_acceptance_from_tokens_equals_accept(temperature):
    """`accepted_from_tokens` (what the MTP catch-up program computes on the device, from the
    emitted tokens and the step's input ids alone) gives `accept`'s accepted counts on random
    steps: greedy rows with ties, seeded sampled rows with one-hot drafts, sequences of 0..K
    drafts, and trailing padding sequences with and without rows."""
    from metrale.speculative.verify import accepted_from_tokens

    gen = torch.Generator().manual_seed(1)
    vocab, k_max, accepted = 9, 4, 0
    for trial in range(30):
        depths = [int(d) for d in torch.randint(0, k_max + 1, (7,), generator=gen)]
        rows = sum(depths) + len(depths)
        logits = torch.randint(0, 3, (rows, vocab), generator=gen).float()
        picks = logits.argmax(dim=-1).tolist()
        drafts, inputs, starts = [], [], [0]
        for k in depths:
            start = starts[-1]
            cut = int(torch.randint(0, k + 1, (1,), generator=gen))
            own = picks[start : start + cut]
            rest = [int(t) for t in torch.randint(0, vocab, (k - cut,), generator=gen)]
            drafts.append(own + rest)
            inputs += [int(torch.randint(0, vocab, (1,), generator=gen))] + own + rest
            starts.append(start + k + 1)
        params = [
            SamplingParams(temperature=temperature, seed=trial * 10 + s, max_tokens=64)
            for s in range(len(depths))
        ]
        sb = SamplingBatch.build(
            [SamplingRow(p, p.seed or 0, [1, 2], [], drafts=d) for p, d in zip(params, drafts)],
            vocab,
            torch.device("cpu"),
        )
        acc = accept(logits, sb, build_layout(depths, drafts, torch.device("cpu")))
        # a padding sequence of 2 rows and one of none, as the programs lay them out
        padded_starts = torch.tensor(starts + [rows + 2, rows + 2])
        tokens = torch.cat([acc.emitted, torch.zeros(2, dtype=torch.long)])
        padded_inputs = torch.tensor(inputs + [0, 0])
        got = accepted_from_tokens(padded_starts, tokens, padded_inputs, k_max + 1)
        assert got[: len(depths)].tolist() == acc.num_accepted.tolist(), trial
        assert got[len(depths) :].tolist() == [1, 0]  # padding rows of equal tokens "match"
        accepted += sum(acc.num_accepted.tolist())
    assert accepted > 20  # drafts were accepted, in part


GREEDY_REVIEW = dict(temperature=0, ignore_eos=True)


@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_device_drafts_left_no_row_by_the_budget(method):
    """Three non-speculative requests decode ahead of a speculative one under a 4-row budget:
    the last is left 1 row, so it verifies no draft (found in review: its device drafts were
    cut to a 0-length row, and packing the step raised IndexError, failing the request)."""
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:", "x = "]
    params = [SamplingParams(**GREEDY_REVIEW, max_tokens=40, speculative=False)] * 3 + [
        SamplingParams(**GREEDY_REVIEW, max_tokens=12)
    ]
    want = LLM(device="cpu").generate(prompts, params, use_tqdm=False)
    llm = LLM(device="cpu", spec={"method": method, "num_drafts": 3}, max_num_batched_tokens=4)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in got] == ["length"] * 4, got[3].outputs[0].error
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_the_shadow_line_logs_each_verify_s_base_picks_and_drafts(tiny_model_dir, knob_env, caplog):
    """`METRALE_MTP_SHADOW_TOPK` (seed 002): every verify logs `SHADOW_TGT base=<the sequence's
    length before the verify> v=[the target's pick at each row] drafts=[the drafts]`, the join
    key and the target side of the drafter's top-k probe; with the knob unset, nothing."""
    import logging
    import re

    from metrale import LLM, SamplingParams

    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = {"method": "ngram", "num_drafts": 3, "dcut": False}
    line = re.compile(r"SHADOW_TGT base=(\d+) v=\[([\d, ]*)\] drafts=\[([\d, ]*)\]")
    caplog.set_level(logging.INFO, logger="metrale.speculative.observing")
    LLM(tiny_model_dir, device="cpu", spec=spec).generate([prompt], params, use_tqdm=False)
    assert not [r for r in caplog.records if "SHADOW_TGT" in r.getMessage()]
    knob_env(METRALE_MTP_SHADOW_TOPK="3")
    out = LLM(tiny_model_dir, device="cpu", spec=spec).generate([prompt], params, use_tqdm=False)
    tokens = prompt + out[0].outputs[0].token_ids
    messages = [r.getMessage() for r in caplog.records]
    seen = [line.fullmatch(m) for m in messages if "SHADOW_TGT" in m]
    assert seen and all(seen)
    # the first verify follows the prefill's token; each later one, the tokens the one before
    # committed (every step verifies: the drafter always finds the prompt's period)
    expected = len(prompt) + 1
    for match in seen:
        base = int(match[1])
        picks = [int(t) for t in match[2].split(",")]
        drafts = [int(t) for t in match[3].split(",")]
        assert base == expected and len(picks) == len(drafts) + 1 >= 2
        # the picks up to the first miss, and the one after, are the tokens that followed
        accepted = next((i for i, (d, p) in enumerate(zip(drafts, picks)) if d != p), len(drafts))
        assert tokens[base : base + accepted + 1] == picks[: accepted + 1]
        expected = base + accepted + 1


def test_the_verify_shapes_remembered_stay_bounded(tiny_model_dir):
    """ARCHITECTURE: everything the engine keeps per shape is bounded. The verify steps' shapes
    (slots and depths) whose telemetry `_record_verify` worked out are forgotten past
    `SHAPES_REMEMBERED`, and a shape seen again is recorded as the first time."""
    from types import SimpleNamespace

    from metrale import LLM
    from metrale.speculative.controller import SHAPES_REMEMBERED

    spec = LLM(tiny_model_dir, device="cpu", spec={"method": "ngram", "num_drafts": 3}).engine.spec

    def entries(n: int):
        # a distinct shape for each n: slots 0..7, depths from n's digits in base 3, plus one
        depths = [1 + (n // 3**i) % 3 for i in range(8)]
        return [
            SimpleNamespace(seq=SimpleNamespace(slot=s), drafts=[0] * d)
            for s, d in enumerate(depths)
        ]

    first = None
    for n in range(SHAPES_REMEMBERED + 50):
        spec._record_verify(entries(n))
        assert len(spec._shapes) <= SHAPES_REMEMBERED
        if n == 0:
            first = dict(spec._shapes)
    spec._shapes.clear()
    spec._record_verify(entries(0))
    assert spec._shapes == first and spec.telemetry.verify_steps == SHAPES_REMEMBERED + 51
