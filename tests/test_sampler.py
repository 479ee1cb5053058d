"""Tests for the logits pipeline and sampler against straightforward per-row references."""

from __future__ import annotations

import math
import random

import pytest
import torch

from metrale.config import SamplingParams
from metrale.engine.sampler import (
    SamplingBatch,
    SamplingRow,
    apply_logits_pipeline,
    sample,
    seeded_uniform,
)

CPU = torch.device("cpu")
NEG_INF = float("-inf")


def build(rows: list[SamplingRow], vocab: int, device: torch.device = CPU) -> SamplingBatch:
    return SamplingBatch.build(rows, vocab, device)


def row(seed: int = 0, prompt=(), output=(), eos=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), seed, list(prompt), list(output), tuple(eos))


# ---------------------------------------------------------------------------------------------
# Reference pipeline: one row at a time, float64, plain Python loops.


def _softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    if m == NEG_INF:
        return [0.0] * len(xs)
    es = [math.exp(x - m) for x in xs]
    s = sum(es)
    return [e / s for e in es]


def reference_process(logits: list[float], r: SamplingRow) -> list[float]:
    p = r.params
    x = list(logits)
    v = len(x)
    seen = set(r.prompt_token_ids) | set(r.output_token_ids)
    for t in seen:
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(r.output_token_ids):
        count = list(r.output_token_ids).count(t)
        x[t] -= p.frequency_penalty * count + p.presence_penalty
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if len(r.output_token_ids) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
        for t in banned:
            x[t] = NEG_INF
    if p.temperature == 0.0:
        return x
    x = [xi / p.temperature for xi in x]
    if 0 < p.top_k < v:
        kth = sorted(x, reverse=True)[p.top_k - 1]
        x = [xi if xi >= kth else NEG_INF for xi in x]
    if p.top_p < 1.0:
        probs = _softmax(x)
        order = sorted(range(v), key=lambda t: (-probs[t], t))
        kept, mass = set(), 0.0
        for t in order:
            kept.add(t)
            mass += probs[t]
            if mass >= p.top_p:
                break
        x = [xi if t in kept else NEG_INF for t, xi in enumerate(x)]
    if p.min_p > 0.0:
        probs = _softmax(x)
        pmax = max(probs)
        x = [NEG_INF if pr < p.min_p * pmax else xi for xi, pr in zip(x, probs, strict=True)]
    return x


def assert_matches_reference(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    batch = build(rows, logits.shape[1])
    before = logits.clone()
    got = apply_logits_pipeline(logits, batch)
    assert torch.equal(logits, before), "pipeline mutated its input"
    assert got.dtype == torch.float32 and got.shape == logits.shape
    for i, r in enumerate(rows):
        want = torch.tensor(reference_process(logits[i].double().tolist(), r), dtype=torch.float64)
        g = got[i].double()
        assert torch.equal(torch.isneginf(g), torch.isneginf(want)), f"row {i}: mask differs"
        finite = ~torch.isneginf(want)
        torch.testing.assert_close(g[finite], want[finite], rtol=1e-5, atol=1e-5)
    return got


def random_row(rng: random.Random, vocab: int, greedy_ok: bool = True) -> SamplingRow:
    choices = {
        "temperature": [0.0, 0.5, 1.0, 1.7] if greedy_ok else [0.5, 1.0, 1.7],
        "top_k": [-1, 0, 1, 3, 10, vocab + 5],
        "top_p": [1.0, 0.3, 0.8, 0.95],
        "min_p": [0.0, 0.0, 0.05, 0.3],
        "repetition_penalty": [1.0, 0.8, 1.3],
        "presence_penalty": [0.0, 0.5, -0.7],
        "frequency_penalty": [0.0, 0.4, -0.3],
        "min_tokens": [0, 3, 6],
        "stop_token_ids": [None, [7], [7, 8]],
        "ignore_eos": [False, False, True],
    }
    params = {name: rng.choice(options) for name, options in choices.items()}
    if rng.random() < 0.4:
        bias = {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(rng.randint(1, 4))}
        params["logit_bias"] = bias
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 10))]
    output = [rng.randrange(12) for _ in range(rng.randint(0, 8))]
    return row(rng.randrange(1 << 40), prompt, output, (5, 6), max_tokens=32, **params)


# ---------------------------------------------------------------------------------------------
# Logits pipeline


@pytest.mark.parametrize("trial", range(12))
def test_pipeline_matches_reference_mixed_rows(trial: int) -> None:
    rng = random.Random(trial)
    vocab = rng.choice([16, 40, 64])
    rows = [random_row(rng, vocab) for _ in range(rng.randint(1, 10))]
    gen = torch.Generator().manual_seed(trial)
    logits = torch.randn(len(rows), vocab, generator=gen) * 3
    assert_matches_reference(logits, rows)


def test_pipeline_top_k_only_path() -> None:
    # No row uses top-p, so top-k runs through torch.topk rather than the sort.
    vocab = 50
    rows = [row(top_k=k, temperature=t) for k, t in [(1, 1.0), (4, 0.7), (-1, 1.0), (49, 2.0)]]
    rows.append(row(top_k=3, temperature=0.0))  # greedy: top-k not applied
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(1))
    batch = build(rows, vocab)
    assert batch.any_top_k and not batch.any_top_p and batch.max_top_k == 49
    got = assert_matches_reference(logits, rows)
    assert (~torch.isneginf(got)).sum(-1).tolist() == [1, 4, vocab, 49, vocab]


def test_pipeline_top_k_keeps_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    got = apply_logits_pipeline(logits, build([row(top_k=2)], 5))
    assert torch.isneginf(got[0]).tolist() == [True, False, False, False, True]


def test_pipeline_no_penalties_skips_optional_tensors() -> None:
    rows = [row(temperature=0.8, top_p=0.9), row(temperature=0.0), row(min_p=0.1)]
    batch = build(rows, 32)
    assert batch.prompt_mask is None and batch.output_counts is None
    assert batch.bias_index is None and batch.ban_index is None
    assert not batch.any_penalty and batch.max_logprobs is None
    assert batch.any_greedy and not batch.all_greedy and batch.any_top_p and batch.any_min_p
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(2))
    assert_matches_reference(logits, rows)


def test_pipeline_all_greedy_is_untouched_without_penalties() -> None:
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(3))
    batch = build([row(temperature=0.0, top_k=2), row(temperature=0.0, top_p=0.1)], 20)
    assert batch.all_greedy and not batch.any_top_k and not batch.any_top_p
    got = apply_logits_pipeline(logits, batch)
    assert torch.equal(got, logits) and got.data_ptr() != logits.data_ptr()


def test_pipeline_penalties_explicit() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -2.0, 0.0]])
    r = row(
        prompt=[0, 1],
        output=[2, 2, 3],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logit_bias={5: 3.0, 4: -1.0},
        temperature=0.0,
    )
    got = apply_logits_pipeline(logits, build([r], 6))[0]
    # 0: 2/2; 1: -1*2; 2: 0.5/2 - 0.5*2 - 0.25; 3: 1/2 - 0.5 - 0.25; 4: -2 - 1; 5: 0 + 3
    want = torch.tensor([1.0, -2.0, -1.0, -0.25, -3.0, 3.0])
    torch.testing.assert_close(got, want)


def test_pipeline_min_tokens_bans() -> None:
    vocab = 10
    logits = torch.zeros(4, vocab)
    rows = [
        row(output=[1], min_tokens=3, eos=(9,), stop_token_ids=[4]),  # banned: 4, 9
        row(output=[1], min_tokens=3, eos=(9,), stop_token_ids=[4], ignore_eos=True),  # 4
        row(output=[1, 2, 3], min_tokens=3, eos=(9,), stop_token_ids=[4]),  # reached: none
        row(output=[], min_tokens=1, eos=(8, 9)),  # 8, 9
    ]
    got = apply_logits_pipeline(logits, build(rows, vocab))
    banned = [torch.isneginf(g).nonzero().flatten().tolist() for g in got]
    assert banned == [[4, 9], [4], [], [8, 9]]
    assert_matches_reference(logits, rows)


def test_pipeline_temperature_and_min_p() -> None:
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]] * 2)
    rows = [row(temperature=2.0), row(min_p=0.2)]
    got = assert_matches_reference(logits, rows)
    torch.testing.assert_close(got[0], logits[0] / 2)
    # 0.05 < 0.2 * 0.5 is dropped, 0.15 >= 0.1 kept.
    assert torch.isneginf(got[1]).tolist() == [False, False, False, True]


def test_build_rejects_out_of_vocab_ids() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        build([row(logit_bias={10: 1.0})], 10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        build([row(min_tokens=1, stop_token_ids=[12])], 10)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        build([row(prompt=[3, 10], repetition_penalty=1.1)], 10)


def test_build_resolves_huge_and_negative_seeds() -> None:
    batch = build([row(seed=-1), row(seed=(1 << 64) + 5), row(seed=(1 << 63) + 1)], 8)
    assert batch.seed.tolist() == [-1, 5, -(1 << 63) + 1]


# ---------------------------------------------------------------------------------------------
# seeded_uniform


def _py_mix(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x21F0AAAD) % (1 << 32)
    h ^= h >> 15
    h = (h * 0x735A2D97) % (1 << 32)
    return h ^ (h >> 15)


def py_uniform(seed: int, step: int, stream: int, token: int) -> float:
    """The documented hash with unbounded Python ints: any int64 overflow would show up here."""
    s, t = seed % (1 << 64), step % (1 << 64)
    words = [s & 0xFFFFFFFF, s >> 32, t & 0xFFFFFFFF, t >> 32, stream]
    lanes = []
    for lane in range(2):
        total = 0
        for j, w in enumerate(words):
            salt = _py_mix(lane * 5 + j + 0x2545F491)
            mult = (salt >> 1) | 1
            total += mult * _py_mix(w ^ salt)
        lanes.append(_py_mix(total % (1 << 32)))
    h = _py_mix(lanes[0] ^ _py_mix(token + 0x3C6EF372))
    h = _py_mix((h + lanes[1]) % (1 << 32))
    return ((h >> 9) + 0.5) / (1 << 23)


def test_seeded_uniform_exact_against_python_ints() -> None:
    seeds = [0, 1, -1, (1 << 63) - 1, -(1 << 63), 123456789012345, -98765]
    steps = [0, 1, 7, 1 << 33, 5, 1000, 2]
    for stream in (0, 3):
        u = seeded_uniform(torch.tensor(seeds), torch.tensor(steps), 37, stream)
        for i, (s, t) in enumerate(zip(seeds, steps, strict=True)):
            for tok in (0, 1, 17, 36):
                assert u[i, tok].item() == py_uniform(s, t, stream, tok)


def test_seeded_uniform_range_mean_and_determinism() -> None:
    seeds = torch.arange(64) * 7919 - 100
    steps = torch.arange(64) % 5
    u = seeded_uniform(seeds, steps, 4096)
    assert u.shape == (64, 4096) and u.dtype == torch.float32
    assert u.min() > 0.0 and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.003  # std of the mean ~ 0.29 / 512 = 0.0006
    assert abs(u.var().item() - 1 / 12) < 0.002
    assert torch.equal(u, seeded_uniform(seeds, steps, 4096))
    # A row does not depend on the batch it is computed in.
    assert torch.equal(u[10:11], seeded_uniform(seeds[10:11], steps[10:11], 4096))
    # Every bit of the 23-bit mantissa source is balanced.
    m = ((u * (1 << 23)) - 0.5).round().long()
    for bit in range(23):
        assert abs(((m >> bit) & 1).float().mean().item() - 0.5) < 0.005


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    return torch.corrcoef(torch.stack([a, b]))[0, 1].item()


def test_seeded_uniform_neighbours_uncorrelated() -> None:
    n, v = 256, 1024  # 262k pairs: correlation std ~ 0.002
    base = torch.arange(n)
    u = seeded_uniform(base, torch.zeros(n, dtype=torch.long), v)
    assert abs(_corr(u[:, :-1], u[:, 1:])) < 0.01  # neighbouring token ids
    assert abs(_corr(u[:-1], u[1:])) < 0.01  # neighbouring seeds
    u_next_step = seeded_uniform(base, torch.ones(n, dtype=torch.long), v)
    assert abs(_corr(u, u_next_step)) < 0.01  # neighbouring steps
    u_stream = seeded_uniform(base, torch.zeros(n, dtype=torch.long), v, stream=1)
    assert abs(_corr(u, u_stream)) < 0.01  # other stream
    # Seeds differing only in the high word must differ too.
    u_hi = seeded_uniform(base + (1 << 32), torch.zeros(n, dtype=torch.long), v)
    assert abs(_corr(u, u_hi)) < 0.01
    assert (u == u_hi).float().mean() < 0.001


# ---------------------------------------------------------------------------------------------
# Sampling


def test_same_row_same_token_in_any_batch() -> None:
    vocab = 200
    gen = torch.Generator().manual_seed(5)
    target_logits = torch.randn(1, vocab, generator=gen)
    target = row(seed=42, prompt=[1, 2, 3], output=[4, 5], temperature=1.0, top_p=0.95)
    alone = sample(target_logits, build([target], vocab)).token_ids[0].item()
    rng = random.Random(0)
    for pos in range(5):
        others = [random_row(rng, vocab) for _ in range(6)]
        rows = others[:pos] + [target] + others[pos:]
        logits = torch.randn(len(rows), vocab, generator=gen)
        logits[pos] = target_logits[0]
        out = sample(logits, build(rows, vocab))
        assert out.token_ids[pos].item() == alone


def test_different_seeds_and_steps_give_different_tokens() -> None:
    vocab = 100_000
    n = 40
    # Uniform logits: some two of the 40 picks agree with odds ~ 780 / 100k, so a repeat means
    # the noise did not change with the seed (or step).
    logits = torch.zeros(n, vocab)
    by_seed = sample(logits, build([row(seed=s) for s in range(n)], vocab)).token_ids
    assert len(set(by_seed.tolist())) >= n - 1
    by_step = sample(logits, build([row(seed=7, output=[0] * s) for s in range(n)], vocab))
    assert len(set(by_step.token_ids.tolist())) >= n - 1
    again = sample(logits, build([row(seed=s) for s in range(n)], vocab)).token_ids
    assert torch.equal(by_seed, again)


# Upper 0.1% points of the chi-square distribution, by degrees of freedom (standard tables).
CHI2_CRIT_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def chi_square_ok(counts: list[int], probs: list[float]) -> bool:
    total = sum(counts)
    stat = sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))
    dof = len(counts) - 1
    try:
        from scipy.stats import chi2

        return chi2.sf(stat, dof) > 0.001
    except ImportError:
        return stat < CHI2_CRIT_P001[dof]


@pytest.mark.parametrize("vary", ["seed", "step"])
def test_sampling_distribution_chi_square(vary: str) -> None:
    vocab = 8
    logits = torch.tensor([2.0, 1.5, 1.0, 0.8, 0.3, -0.5, -1.0, -3.0])
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=None)
    n = 20000
    if vary == "seed":
        rows = [SamplingRow(params, s, [], []) for s in range(n)]
    else:  # one request, many output positions (a range is a cheap Sequence of that length)
        rows = [SamplingRow(params, 1234, [], range(s)) for s in range(n)]
    out = sample(logits.expand(n, vocab), build(rows, vocab))
    counts = torch.bincount(out.token_ids, minlength=vocab).tolist()
    ref = reference_process(logits.double().tolist(), rows[0])
    probs = _softmax(ref)
    kept = [t for t in range(vocab) if probs[t] > 0]
    assert 1 < len(kept) < vocab  # the test really exercises top-p
    assert all(counts[t] == 0 for t in range(vocab) if t not in kept), counts
    assert chi_square_ok([counts[t] for t in kept], [probs[t] for t in kept]), counts


def test_top_k_masked_tokens_never_sampled() -> None:
    vocab = 30
    n = 3000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(9)).expand(n, vocab)
    rows = [row(seed=s, top_k=3, temperature=1.5) for s in range(n)]
    got = set(sample(logits, build(rows, vocab)).token_ids.tolist())
    assert got == set(logits[0].topk(3).indices.tolist())


def test_logprobs_use_raw_logits() -> None:
    vocab = 64
    rng = random.Random(3)
    rows = [random_row(rng, vocab) for _ in range(9)]
    rows[0] = row(seed=1, output=[3, 3], repetition_penalty=1.3, temperature=0.5, logprobs=5)
    rows[1] = row(temperature=0.0, frequency_penalty=1.0, output=[1], logprobs=0)
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(4)) * 2
    out = sample(logits, build(rows, vocab))
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.ranks is not None
    assert out.top_token_ids is not None and out.top_logprobs is not None
    for i, tok in enumerate(out.token_ids.tolist()):
        assert out.logprobs[i].item() == pytest.approx(raw[i, tok].item(), abs=1e-6)
        higher = sum(1 for t in range(vocab) if raw[i, t] > raw[i, tok])
        assert out.ranks[i].item() == 1 + higher
    top_vals, top_ids = torch.topk(raw, 5, dim=-1)
    assert out.top_token_ids.shape == (len(rows), 5)
    assert torch.equal(out.top_token_ids, top_ids)
    torch.testing.assert_close(out.top_logprobs, top_vals)


def test_logprobs_zero_and_none() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(6))
    out = sample(logits, build([row(logprobs=0), row()], 10))
    assert out.top_token_ids is not None and out.top_token_ids.shape == (2, 0)
    assert out.logprobs is not None and out.logprobs.shape == (2,)
    out = sample(logits, build([row(), row(temperature=0.0)], 10))
    assert out.logprobs is None and out.ranks is None and out.top_logprobs is None


def test_greedy_rows_take_argmax_of_processed_logits() -> None:
    vocab = 40
    rng = random.Random(11)
    rows = [random_row(rng, vocab) for _ in range(10)]
    rows += [row(temperature=0.0, top_k=1), row(temperature=1e-7, top_p=0.5)]  # tiny T: greedy
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(12))
    batch = build(rows, vocab)
    out = sample(logits, batch)
    processed = apply_logits_pipeline(logits, batch)
    for i, r in enumerate(rows):
        if r.params.temperature < 1e-5:
            want = max(range(vocab), key=lambda t: (processed[i, t].item(), -t))
            assert out.token_ids[i].item() == want
        else:
            assert not torch.isneginf(processed[i, out.token_ids[i]])


def test_greedy_repetition_penalty_changes_pick() -> None:
    logits = torch.tensor([[2.0, 1.8, 0.0, -3.0], [-1.0, -1.2, -5.0, -1.0]])
    plain = [row(temperature=0.0), row(temperature=0.0)]
    assert sample(logits, build(plain, 4)).token_ids.tolist() == [0, 0]  # ties -> lowest id
    penalised = [
        row(temperature=0.0, prompt=[0], repetition_penalty=1.5),  # 2.0 -> 1.33 < 1.8
        row(temperature=0.0, output=[0, 3], repetition_penalty=1.5),  # -1.0 -> -1.5 < -1.2
    ]
    assert sample(logits, build(penalised, 4)).token_ids.tolist() == [1, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_agree() -> None:
    cuda = torch.device("cuda")
    seeds = torch.tensor([0, -1, 1 << 40, 77])
    steps = torch.tensor([0, 3, 9, 1 << 35])
    for stream in (0, 5):
        u_cpu = seeded_uniform(seeds, steps, 50000, stream)
        u_gpu = seeded_uniform(seeds.to(cuda), steps.to(cuda), 50000, stream)
        assert torch.equal(u_cpu, u_gpu.cpu())
    vocab = 500
    rng = random.Random(21)
    rows = [random_row(rng, vocab, greedy_ok=False) for _ in range(16)]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(22))
    tok_cpu = sample(logits, build(rows, vocab)).token_ids
    tok_gpu = sample(logits.to(cuda), build(rows, vocab, cuda)).token_ids
    assert torch.equal(tok_cpu, tok_gpu.cpu())


def test_a_row_with_drafts_builds_as_its_expanded_rows():
    """One SamplingRow with k drafts describes k + 1 logits rows, row j after drafts[:j]: the
    batch equals the one built from k + 1 single rows, penalties, bias and bans included."""
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, frequency_penalty=0.5, logit_bias={3: 2.0}, min_tokens=4),
    ]
    outputs, drafts = [[1, 2], [4], [5, 6]], [[7, 8, 9], [], [2, 3]]
    compact = [
        SamplingRow(p, 11 + i, [9, 9, 3], out, (0,), tuple(d))
        for i, (p, out, d) in enumerate(zip(params, outputs, drafts, strict=True))
    ]
    expanded = [
        SamplingRow(p, 11 + i, [9, 9, 3], out + d[:j], (0,))
        for i, (p, out, d) in enumerate(zip(params, outputs, drafts, strict=True))
        for j in range(len(d) + 1)
    ]
    a = SamplingBatch.build(compact, 16, torch.device("cpu"))
    b = SamplingBatch.build(expanded, 16, torch.device("cpu"))
    assert a.num_rows == b.num_rows == 8
    for name, value in vars(a).items():
        other = getattr(b, name)
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other), name
        else:
            assert value == other, name
