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
            rng = random.Random(f"{seq.seed}:{seq.num_tokens}:{seq.noise_epoch}")
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


def _choosy_adversary_hits(fresh: bool, adversarial: bool, n: int = 4000) -> float:
    """P(x2 = 0) under a q-drafter that learns the sample at position 2 from a bonus-row pick,
    then leaves position 2 to the target's own sample when it is token 0 and otherwise judges it
    with an honest q draft (p is the same at every position, so the pick stays informative).
    The n sequences (seeds) run as one batch per step."""
    from metrale.engine.logits_pipeline import SamplingBatch, SamplingRow
    from metrale.speculative.verify import accept, build_layout

    vocab, logp = 4, torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=10)
    cpu = torch.device("cpu")

    def verify(seqs):  # seqs: [(seed, out, epoch, drafts, q or None)] -> [(tokens, picks)]
        rows = [
            SamplingRow(params, sd, [1], list(o), (), tuple(d), e, fresh) for sd, o, e, d, _ in seqs
        ]
        batch = SamplingBatch.build(rows, vocab, cpu)
        layout = build_layout([len(d) for *_, d, _ in seqs], [d for *_, d, _ in seqs], cpu)
        q_all = torch.cat(
            [
                torch.cat(
                    [q if q is not None else torch.zeros(len(d), vocab), torch.zeros(1, vocab)]
                )
                for *_, d, q in seqs
            ]
        )
        q_rows = torch.tensor([f for *_, d, q in seqs for f in [q is not None] * len(d) + [False]])
        acc = accept(
            logp.expand(batch.num_rows, vocab).clone(), batch, layout, q_all, q_rows=q_rows
        )
        emitted, accepted, out, row = acc.emitted.tolist(), acc.num_accepted.tolist(), [], 0
        for (*_, d, _), a in zip(seqs, accepted, strict=True):
            picks = emitted[row : row + len(d) + 1]
            out.append((list(d[:a]) + [picks[a]], picks))
            row += len(d) + 1
        return out

    first_q = torch.zeros(2, vocab)
    first_q[:, 3] = 1.0
    state = {}  # seed -> [out, epoch, revealed]
    for seed, (toks, picks) in zip(
        range(n), verify([(s, [], 0, [3, 3], first_q) for s in range(n)]), strict=True
    ):
        state[seed] = [toks, 1, picks[2]]  # the bonus row's pick: the sample at position 2
    while any(len(v[0]) < 3 for v in state.values()):
        todo = [s for s, v in state.items() if len(v[0]) < 3]
        seqs = []
        for s in todo:
            out, epoch, revealed = state[s]
            if len(out) == 2 and adversarial and revealed != 0:
                draft = random.Random(s).randrange(vocab)  # honest: drawn from q, uniform
                seqs.append((s, out, epoch, [draft], torch.full((1, vocab), 0.25)))
            else:
                seqs.append((s, out, epoch, [], None))
        for s, (toks, _) in zip(todo, verify(seqs), strict=True):
            state[s][0] = state[s][0] + toks
            state[s][1] += 1
    return sum(v[0][2] == 0 for v in state.values()) / n


def test_a_drafter_choosing_which_positions_get_judged_cannot_bias_them():
    """Noise keyed by the sampling step once q-drafts appear: the choice gains nothing. (Keyed
    by position alone, the same adversary lifts P(x2 = 0) from 0.40 to about 0.64.)"""
    assert abs(_choosy_adversary_hits(fresh=True, adversarial=True) - 0.4) < 0.035
    assert abs(_choosy_adversary_hits(fresh=True, adversarial=False) - 0.4) < 0.035
    assert _choosy_adversary_hits(fresh=False, adversarial=True) > 0.55  # the test has power
