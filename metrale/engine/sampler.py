"""Token selection for a batch of logits rows: greedy argmax or a seeded exponential race, plus
logprobs of the raw logits.

Randomness comes from `seeded_uniform`, a counter-based hash of (request seed, output position,
stream, token id) built from integer tensor ops. A row's noise therefore depends only on its
request and position: the same seed gives the same tokens whatever the batch composition, on any
device, and after preemption and recompute. Nothing here syncs with the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from metrale.engine.logits_pipeline import (
    GREEDY_TEMPERATURE_EPS,
    SamplingBatch,
    SamplingRow,
    apply_logits_pipeline,
)

__all__ = [
    "GREEDY_TEMPERATURE_EPS",
    "SAMPLE_STREAM",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingRow",
    "apply_logits_pipeline",
    "sample",
    "seeded_uniform",
]

# Stream of the uniforms behind the token pick; other consumers (rejection sampling) use others.
SAMPLE_STREAM = 0

_M32 = 0xFFFFFFFF
# Initial states of the two 32-bit lanes that key a row; together they make a 64-bit row key, so
# two (seed, step, stream) triples share a noise vector with odds ~2**-64, not 2**-32.
_LANE_SEEDS = (0x243F6A88, 0x85A308D3)
# Below 2**30 so that `arange + salt` fits int32 index math if torch.compile fuses it.
_TOKEN_SALT = 0x3C6EF372


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) without int64 overflow.

    x * c could reach 2**64 when c >= 2**31. Writing c = c' + 2**31 (c' < 2**31):
    x * c = x * c' + (x << 31), and (x << 31) mod 2**32 only keeps x's low bit.
    """
    if c < 1 << 31:
        return (x * c) & _M32
    return (x * (c - (1 << 31)) + ((x & 1) << 31)) & _M32


def _rotl32(x: Tensor, r: int) -> Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _mix32_(h: Tensor) -> Tensor:
    """In-place 32-bit avalanche mixer (xorshift-multiply, Wellons' "lowbias32" constants): a
    bijection on [0, 2**32). Both multipliers are < 2**31, so each product stays below 2**63 and
    needs a single multiply; values stay non-negative, so the right shifts are logical."""
    h ^= h >> 16
    h.mul_(0x21F0AAAD).bitwise_and_(_M32)
    h ^= h >> 15
    h.mul_(0x735A2D97).bitwise_and_(_M32)
    h ^= h >> 15
    return h


def _murmur32(words: list[Tensor], lane_seed: int) -> Tensor:
    """MurmurHash3 (x86, 32-bit) of a fixed sequence of 32-bit words, elementwise over [N]."""
    h = torch.full_like(words[0], lane_seed)
    for k in words:
        k = _mul32(k, 0xCC9E2D51)
        k = _rotl32(k, 15)
        k = _mul32(k, 0x1B873593)
        h = _rotl32(h ^ k, 13)
        h = (_mul32(h, 5) + 0xE6546B64) & _M32
    return _mix32_(h ^ (4 * len(words)))


def seeded_uniform(seed: Tensor, step: Tensor, vocab_size: int, stream: int = 0) -> Tensor:
    """[N] int64 seed, [N] int64 step -> [N, V] float32 uniforms in the open interval (0, 1).

    Exact integer arithmetic (every intermediate below 2**63), so results are bit-identical on
    every device and need neither a torch.Generator nor a host sync.
    """
    seed = seed.to(torch.int64)
    step = step.to(torch.int64)
    # 32-bit words; `& _M32` after an arithmetic shift also gives the right two's-complement
    # high word for negative values.
    words = [
        seed & _M32,
        (seed >> 32) & _M32,
        step & _M32,
        (step >> 32) & _M32,
        torch.full_like(seed, stream & _M32),
    ]
    lane0 = _murmur32(words, _LANE_SEEDS[0])[:, None]  # [N, 1]
    lane1 = _murmur32(words, _LANE_SEEDS[1])[:, None]  # [N, 1]
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=seed.device)
    token_key = _mix32_((tokens + _TOKEN_SALT) & _M32)[None, :]  # [1, V], distinct per token
    # The mixer is a bijection, so within a row all V values are distinct; the second round folds
    # in the other lane. In-place ops: this is the [N, V] hot loop, memory-bound on GPU.
    h = _mix32_(lane0 ^ token_key)  # [N, V]
    h = _mix32_(h.add_(lane1).bitwise_and_(_M32))  # [N, V]
    # 23 bits: (m + 0.5) / 2**23 = (2m + 1) / 2**24 is exact in float32 and lies in
    # [2**-24, 1 - 2**-24]; with 24 bits the top values would round to exactly 1.0.
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


class SamplerOutput(NamedTuple):
    token_ids: Tensor  # [N] int64
    logprobs: Tensor | None  # [N] f32: log_softmax(raw logits)[token]; None when none asked
    ranks: Tensor | None  # [N] int64: 1 + number of tokens with a strictly higher raw logprob
    top_token_ids: Tensor | None  # [N, k] int64, k = max requested logprobs
    top_logprobs: Tensor | None  # [N, k] f32 (raw log_softmax)


def _exponential_race(processed: Tensor, batch: SamplingBatch) -> Tensor:
    """argmax(p / E) with E ~ Exp(1) i.i.d. per token picks token i with probability p_i
    (the smallest of the scaled exponentials E_i / p_i is token i's with odds p_i)."""
    probs = torch.softmax(processed, dim=-1)  # [N, V]; masked tokens have p = 0
    u = seeded_uniform(batch.seed, batch.step, processed.shape[-1], SAMPLE_STREAM)  # [N, V]
    exp_noise = u.log_().neg_()  # [N, V] E = -log(u) > 0 since u < 1
    return probs.div_(exp_noise).argmax(dim=-1)  # [N]


def sample(logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
    """RAW [N, V] float32 logits -> picked tokens (and raw-logit logprobs when any row asked)."""
    processed = apply_logits_pipeline(logits, batch)  # [N, V]
    if batch.all_greedy:
        token_ids = processed.argmax(dim=-1)  # ties -> lowest id
    else:
        token_ids = _exponential_race(processed, batch)
        if batch.any_greedy:
            token_ids = torch.where(batch.greedy, processed.argmax(dim=-1), token_ids)
    if batch.max_logprobs is None:
        return SamplerOutput(token_ids, None, None, None, None)
    raw_logp = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [N, V]
    token_logp = raw_logp.gather(1, token_ids[:, None])  # [N, 1]
    ranks = (raw_logp > token_logp).sum(dim=-1) + 1  # [N]
    top_logp, top_ids = raw_logp.topk(batch.max_logprobs, dim=-1)  # [N, k] each
    return SamplerOutput(token_ids, token_logp.squeeze(1), ranks, top_ids, top_logp)
