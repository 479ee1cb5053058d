"""Speculation never changes the output: with the n-gram drafter and an oracle drafter at
acceptance alpha in {0, 0.5, 0.9, 1}, greedy output equals the non-speculative output token for
token, alone and in a batch of 16 with mixed depths, under both verify-key arms, with preemption;
per-request control; a failing drafter ends only its sequences."""

from __future__ import annotations

import random

import pytest

from metrale import LLM, SamplingParams
from metrale.speculative.drafter import Draft
from metrale.speculative.replay import ReplayDrafter

NUM_PROMPTS = 16


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(NUM_PROMPTS):
        # repetitive prompts give the n-gram drafter something to find
        motif = [rng.randrange(3, 500) for _ in range(rng.randrange(2, 6))]
        prompts.append(
            (motif * 8)[: rng.randrange(4, 40)]
            if i % 2
            else [rng.randrange(3, 500) for _ in range(rng.randrange(2, 30))]
        )
    return prompts


def params_for(i: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=10 + i % 9, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts):
    llm = LLM(tiny_model_dir, device="cpu")
    outs = llm.generate(prompts, [params_for(i) for i in range(NUM_PROMPTS)], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run(model_dir, prompts, drafter=None, spec=None, index=None, **engine):
    """Generate `prompts` (the test prompts at `index`, default all) with speculation."""
    index = index or list(range(len(prompts)))
    llm = LLM(model_dir, drafter=drafter, device="cpu", spec=spec or {"num_drafts": 4}, **engine)
    outs = llm.generate(prompts, [params_for(i) for i in index], use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable
    return [o.outputs[0].token_ids for o in outs], llm


def replay(prompts, reference, alpha: float) -> ReplayDrafter:
    return ReplayDrafter(dict(zip(map(tuple, prompts), reference, strict=True)), alpha, 512)


@pytest.mark.parametrize("canonical_arm", [True, False], indirect=True, ids=["canonical", "own"])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.9, 1.0])
def test_oracle_drafter_is_lossless_in_a_batch(
    tiny_model_dir, prompts, reference, alpha, canonical_arm
):
    got, llm = run(tiny_model_dir, prompts, replay(prompts, reference, alpha))
    assert got == reference
    spec = llm.engine.telemetry.spec
    assert spec.num_drafts > 0
    if alpha == 0.0:  # forced a = 0 at every step
        assert spec.num_accepted_tokens == 0
    if alpha == 1.0:  # forced a = K: every draft accepted
        assert spec.num_accepted_tokens == spec.num_draft_tokens
        assert spec.mean_acceptance_length > 2.5


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_forced_patterns_single_sequence_without_dcut(tiny_model_dir, prompts, reference, alpha):
    drafter = replay(prompts, reference, alpha)
    for i in (0, 5, 11):
        got, llm = run(
            tiny_model_dir, [prompts[i]], drafter, spec={"num_drafts": 3, "dcut": False}, index=[i]
        )
        assert got == [reference[i]]
        spec = llm.engine.telemetry.spec
        assert spec.num_accepted_tokens == (spec.num_draft_tokens if alpha else 0)
        # with no depth cut every verify used the full K (or what max_tokens left)
        assert len(spec.drafted_per_pos) == 3


@pytest.mark.parametrize("canonical_arm", [True, False], indirect=True, ids=["canonical", "own"])
def test_ngram_drafter_is_lossless_with_preemption(
    tiny_model_dir, prompts, reference, canonical_arm
):
    got, llm = run(tiny_model_dir, prompts, spec={"method": "ngram", "num_drafts": 4})
    assert got == reference
    assert llm.engine.telemetry.spec.num_drafts > 0
    got, llm = run(
        tiny_model_dir,
        prompts,
        spec={"method": "ngram", "num_drafts": 4},
        page_size=4,
        # (the lookahead stops at what a sequence can write: 40 pages no longer preempt)
        num_kv_pages=36,
        max_num_batched_tokens=48,
    )
    assert got == reference
    assert llm.engine.telemetry.preemptions > 0


def test_oracle_with_preemption_and_mixed_depths(tiny_model_dir, prompts, reference):
    got, llm = run(
        tiny_model_dir,
        prompts,
        replay(prompts, reference, 0.7),
        page_size=4,
        num_kv_pages=40,
        max_num_batched_tokens=40,
    )
    assert got == reference
    assert llm.engine.telemetry.preemptions > 0
    assert len(llm.engine.telemetry.spec.verify_keys) > 1


def test_per_request_speculation_control(tiny_model_dir, prompts, reference):
    llm = LLM(
        tiny_model_dir,
        drafter=replay(prompts, reference, 1.0),
        device="cpu",
        spec={"num_drafts": 4, "dcut": False},
    )
    params = [
        params_for(0, speculative=False),
        params_for(1, num_drafts=1),
        params_for(2, num_drafts=0),
        params_for(3),
    ]
    outs = llm.generate(prompts[:4], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        reference[i][: params[i].max_tokens] for i in range(4)
    ]
    spec = llm.engine.telemetry.spec
    # only prompts 1 (one draft per verify) and 3 (up to four) drafted
    assert spec.drafted_per_pos[0] > spec.drafted_per_pos[1]


class FlakyDrafter:
    """Proposes nonsense for everyone and raises for one request."""

    name, needs_hidden = "flaky", False

    def propose(self, seqs, max_drafts):
        if any(s.request_id == "req-3" for s in seqs):
            raise RuntimeError("drafter exploded")
        return [Draft([7] * k) for k in max_drafts]

    def observe(self, verdicts):
        pass

    def release(self, seq):
        pass


def test_failing_drafter_fails_only_its_sequence(tiny_model_dir, prompts, reference):
    llm = LLM(tiny_model_dir, drafter=FlakyDrafter(), device="cpu")
    outs = llm.generate(prompts[:6], [params_for(i) for i in range(6)], use_tqdm=False)
    assert outs[3].outputs[0].finish_reason == "error"
    assert "drafter exploded" in outs[3].outputs[0].error
    for i in (0, 1, 2, 4, 5):
        assert outs[i].outputs[0].token_ids == reference[i]
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable


class OutOfVocabDrafter(FlakyDrafter):
    """Proposes a token past the vocabulary for one request; `own_tokens` set as a drafter of
    the sequence's own tokens would set it, when `claims` is true."""

    name = "out-of-vocab"

    def __init__(self, claims: bool, bad=10**6) -> None:
        self.bad = bad
        if claims:
            self.own_tokens = "yes"  # not True: only `own_tokens is True` skips the check

    def propose(self, seqs, max_drafts):
        return [
            Draft([self.bad] * k if s.request_id == "req-2" else [7] * k)
            for s, k in zip(seqs, max_drafts, strict=True)
        ]


@pytest.mark.parametrize(
    "bad, says",
    # (a bool or a float passed as a token id: review)
    [
        (10**6, "outside the vocabulary"),
        (-1, "outside the vocabulary"),
        (3.0, "not an int"),
        (True, "not an int"),
    ],  # fmt: skip
)
@pytest.mark.parametrize("claims", [False, True])
def test_a_draft_outside_the_vocabulary_fails_only_its_sequence(
    tiny_model_dir, prompts, reference, claims, bad, says
):
    """A plugged-in drafter's draft token outside the vocabulary (or not an int) ends its
    sequence with an error naming it; the others are plain decoding's. Only the n-gram drafter,
    whose drafts are the sequence's own tokens, is exempt from the check (`own_tokens is
    True`)."""
    llm = LLM(tiny_model_dir, drafter=OutOfVocabDrafter(claims, bad), device="cpu")
    outs = llm.generate(prompts[:4], [params_for(i) for i in range(4)], use_tqdm=False)
    assert outs[2].outputs[0].finish_reason == "error"
    assert says in outs[2].outputs[0].error
    for i in (0, 1, 3):
        assert outs[i].outputs[0].token_ids == reference[i]
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable


@pytest.mark.parametrize(
    "token", ["numpy-int64", "torch-0d", "torch-0d-int32"], ids=lambda name: name
)
def test_integer_scalars_are_draft_token_ids(tiny_model_dir, prompts, reference, token):
    """Draft tokens that are numpy integers or 0-d torch integers (a drafter written with
    numpy, or `list(ids_tensor)`) are ids like ints: the check that refuses bools and floats
    takes them (it once refused the torch scalars, which worked before it; review)."""
    import numpy as np
    import torch

    seven = {
        "numpy-int64": np.int64(7),
        "torch-0d": torch.tensor(7),
        "torch-0d-int32": torch.tensor(7, dtype=torch.int32),
    }[token]
    llm = LLM(tiny_model_dir, drafter=OutOfVocabDrafter(False, seven), device="cpu")
    outs = llm.generate(prompts[:4], [params_for(i) for i in range(4)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference[:4]
