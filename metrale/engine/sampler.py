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
    "exponential_race",
    "sample",
    "seeded_uniform",
]

# Stream of the uniforms behind the token pick; other consumers (rejection sampling) use others.
SAMPLE_STREAM = 0

_M32 = 0xFFFFFFFF
# A row is keyed by two 32-bit lanes (64 bits together), so two (seed, step, stream) triples
# share a noise vector with odds ~2**-64, not 2**-32.
_NUM_LANES = 2
# Offsets added to small aranges before mixing them into per-slot and per-token salts. Both are
# below 2**30 so that, should torch.compile fold `arange + offset` into its int32 index math,
# nothing overflows there.
_SLOT_OFFSET = 0x2545F491
_TOKEN_OFFSET = 0x3C6EF372


def _mix32_(h: Tensor) -> Tensor:
    """In-place 32-bit avalanche mixer (xorshift-multiply; constants from C. Wellons'
    hash-prospector search), a bijection on [0, 2**32). Both multipliers are < 2**31, so on
    values < 2**32 each product stays below 2**63 (no int64 overflow); values stay non-negative,
    so the right shifts are logical although the tensors are signed."""
    h ^= h >> 16
    h.mul_(0x21F0AAAD).bitwise_and_(_M32)
    h ^= h >> 15
    h.mul_(0x735A2D97).bitwise_and_(_M32)
    h ^= h >> 15
    return h


def _row_keys(seed: Tensor, step: Tensor, stream: int) -> Tensor:
    """[N] seed, [N] step -> [N, 2] lane keys in [0, 2**32).

    key[lane] = mix(sum_j mult[lane, j] * mix(word_j ^ salt[lane, j]) mod 2**32). The per-slot
    salt and odd multiplier keep slots apart (a plain sum of one mixer over all words would
    collide when two words trade values); a change in any single word always changes the key.
    All lanes and words go through the same few [N, 2, 5] ops: this part is tiny, so its cost is
    kernel launches.
    """
    # `& _M32` after an arithmetic shift also gives the two's-complement high word of negatives.
    words = torch.stack(
        [
            seed & _M32,
            (seed >> 32) & _M32,
            step & _M32,
            (step >> 32) & _M32,
            torch.full_like(seed, stream & _M32),
        ],
        dim=-1,
    )  # [N, 5]
    slots = torch.arange(_NUM_LANES * words.shape[1], dtype=torch.int64, device=seed.device)
    salt = _mix32_(slots + _SLOT_OFFSET).view(1, _NUM_LANES, -1)  # [1, 2, 5]
    mult = (salt >> 1) | 1  # [1, 2, 5] odd and < 2**31, so products stay below 2**63
    mixed = _mix32_(words[:, None, :] ^ salt)  # [N, 2, 5]
    return _mix32_((mixed * mult & _M32).sum(dim=-1) & _M32)  # [N, 2]


def seeded_uniform(seed: Tensor, step: Tensor, vocab_size: int, stream: int = 0) -> Tensor:
    """[N] int64 seed, [N] int64 step -> [N, V] float32 uniforms in the open interval (0, 1).

    Exact integer arithmetic (every intermediate below 2**63), so results are bit-identical on
    every device and need neither a torch.Generator nor a host sync.
    """
    keys = _row_keys(seed.to(torch.int64), step.to(torch.int64), stream)  # [N, 2]
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=seed.device)
    token_key = _mix32_(tokens + _TOKEN_OFFSET)[None, :]  # [1, V], distinct per token
    # The mixer is a bijection, so within a row all V values are distinct; the second round folds
    # in the other lane. In-place ops: this is the [N, V] part, memory-bound on GPU.
    h = _mix32_(keys[:, :1] ^ token_key)  # [N, V]
    h = _mix32_(h.add_(keys[:, 1:]).bitwise_and_(_M32))  # [N, V]
    # 23 bits: (m + 0.5) / 2**23 = (2m + 1) / 2**24 is exact in float32 and lies in
    # [2**-24, 1 - 2**-24]; with 24 bits the top values would round to exactly 1.0.
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


class SamplerOutput(NamedTuple):
    token_ids: Tensor  # [N] int64
    logprobs: Tensor | None  # [N] f32: log_softmax(raw logits)[token]; None when none asked
    ranks: Tensor | None  # [N] int64: 1 + number of tokens with a strictly higher raw logprob
    top_token_ids: Tensor | None  # [N, k] int64, k = max requested logprobs
    top_logprobs: Tensor | None  # [N, k] f32 (raw log_softmax)


def exponential_race(probs: Tensor, seed: Tensor, step: Tensor, stream: int) -> Tensor:
    """[N, V] probabilities -> [N] argmax(p / E) with E ~ Exp(1) i.i.d. per token, seeded per
    (request seed, step, stream): picks token i with probability p_i (the smallest of the
    scaled exponentials E_i / p_i is token i's with odds p_i). `probs` is left as it is (the
    quotient goes into the noise's buffer). The sampler, the verify's own sample and residual,
    and the engine's draw of a draft from a drafter's q all race this one way."""
    noise = seeded_uniform(seed, step, probs.shape[-1], stream).log_().neg_()  # E = -log(u) > 0
    return torch.div(probs, noise, out=noise).argmax(dim=-1)


def _exponential_race(processed: Tensor, batch: SamplingBatch) -> Tensor:
    probs = torch.softmax(processed, dim=-1)  # [N, V]; masked tokens have p = 0
    return exponential_race(probs, batch.seed, batch.step, SAMPLE_STREAM)


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
