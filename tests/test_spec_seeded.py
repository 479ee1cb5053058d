"""Seeded sampling with speculation: a one-hot draft is judged against the target's own seeded
sample at its position, so a seeded request emits exactly the tokens plain seeded decoding emits,
alone or in a batch, with any drafter, at any depth D-Cut picks, run after run; and no drafter can
bias the output, not even one that re-proposes what a rejection revealed (`Verdict.picks`).
CPU, float32, dense and hybrid targets."""

from __future__ import annotations

import random

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.speculative.drafter import Draft
from metrale.speculative.replay import ReplayDrafter
from tests.test_hybrid_engine import hybrid_dir  # noqa: F401 (a module fixture)
from tests.test_spec_lossless import make_prompts
from tests.test_spec_sampling import (  # noqa: F401 (module fixtures)
    PROMPT,
    SAMPLES,
    SIGNIFICANCE,
    TEMP,
    TOP_K,
    chi_square_pvalue,
    exact,
    model_dir,
)


def seeded(i: int, n: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=n, ignore_eos=True)


def _target(request, name):
    return request.getfixturevalue("tiny_model_dir" if name == "dense" else "hybrid_dir")


@pytest.mark.parametrize("target", ["dense", "hybrid"])
@pytest.mark.parametrize("drafter", ["ngram", "replay"])
def test_seeded_sampling_with_speculation_equals_plain(request, target, drafter):
    path = _target(request, target)
    prompts = [[t % 300 for t in prompt] for prompt in make_prompts(seed=5)[:10]]
    params = [seeded(i) for i in range(len(prompts))]
    plain = LLM(path, device="cpu").generate(prompts, params, use_tqdm=False)
    ref = [o.outputs[0].token_ids for o in plain]
    if drafter == "ngram":
        llm = LLM(path, device="cpu", spec={"method": "ngram", "num_drafts": 3})
    else:  # drafts right at 70%: the sampled continuation, corrupted
        replay = ReplayDrafter(dict(zip(map(tuple, prompts), ref, strict=True)), 0.7, 200)
        llm = LLM(path, device="cpu", drafter=replay, spec={"num_drafts": 3})
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert batch == ref
    alone = [
        llm.generate([p], [q], use_tqdm=False)[0].outputs[0].token_ids
        for p, q in zip(prompts[:3], params[:3], strict=True)
    ]
    assert alone == ref[:3]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert again == ref  # D-Cut's estimates have moved since: the output has not
    tel = llm.engine.telemetry.spec
    assert tel.num_draft_tokens > 0
    if drafter == "replay":  # both outcomes of the judgement ran
        assert 0 < tel.num_accepted_tokens < tel.num_draft_tokens


class PicksAdversary:
    """Re-proposes what the verifier revealed: the target's picks from rows past the first
    rejection of the previous verify (drafts that would win reused uniforms). With `with_probs`
    it is an honest q-drafter that puts 0.9 of q on the revealed token and draws from q."""

    name, needs_hidden = "adversary", False

    def __init__(self, with_probs: bool = False, vocab: int = 6) -> None:
        self.revealed: dict[int, list[int]] = {}
        self.with_probs, self.vocab = with_probs, vocab

    def propose(self, seqs, caps):
        out = []
        for seq, k in zip(seqs, caps, strict=True):
            tokens = (self.revealed.pop(seq.seq_id, []) + [1] * k)[:k]
            if not self.with_probs:
                out.append(Draft(tokens))
                continue
            q = torch.full((k, self.vocab), 0.1 / (self.vocab - 1))
            q[range(k), tokens] = 0.9
            rng = random.Random(f"{seq.seed}:{seq.num_tokens}:{seq.num_verifies}")
            drawn = [rng.choices(range(self.vocab), weights=row.tolist())[0] for row in q]
            out.append(Draft(drawn, q))
        return out

    def observe(self, verdicts):
        for v in verdicts:
            if v.drafts and v.num_accepted < len(v.drafts):
                self.revealed[v.seq.seq_id] = v.picks[v.num_accepted + 1 :]

    def release(self, seq):
        self.revealed.pop(seq.seq_id, None)


@pytest.mark.parametrize("with_probs", [False, True], ids=["one-hot", "with-q"])
def test_an_adversarial_drafter_cannot_bias_sampling(model_dir, exact, with_probs):  # noqa: F811
    llm = LLM(
        model_dir,
        drafter=PicksAdversary(with_probs),
        device="cpu",
        max_num_seqs=512,
        max_num_batched_tokens=4096,
        spec={"num_drafts": 3, "dcut": False},
    )
    params = [
        SamplingParams(temperature=TEMP, top_k=TOP_K, seed=s, max_tokens=5, ignore_eos=True)
        for s in range(SAMPLES)
    ]
    outs = llm.generate([PROMPT] * SAMPLES, params, use_tqdm=False)
    counts: dict = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_pvalue(counts, exact, SAMPLES) > SIGNIFICANCE
    if not with_probs:  # one-hot: exactly plain seeded decoding, sample by sample
        plain = LLM(model_dir, device="cpu", max_num_seqs=512, max_num_batched_tokens=4096)
        ref = plain.generate([PROMPT] * 300, params[:300], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs[:300]] == [o.outputs[0].token_ids for o in ref]
