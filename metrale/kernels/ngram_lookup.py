"""Prompt-lookup drafting as one Triton kernel: every sequence's n-gram search in one launch.

One program per sequence scans the last `window` tokens of its row in a token table [slots,
capacity] (int32, absolute positions). For each end position e it counts how many of the tokens
ending at e equal the tokens ending at the sequence's last one (at most n_max, never reaching
before the window); the longest such match of at least n_min wins, the latest occurrence whose
continuation holds k tokens first, else the latest (what `speculative.ngram.lookup`, the
reference and test oracle, proposes). A match is scored `length * 2**32 + e`, so one max per
block keeps the longest, latest match, and a second max the longest, latest full one.
"""

from __future__ import annotations

import torch

from metrale.kernels.dispatch import interpreter_forced
from metrale.kernels.fused import triton

if triton is not None:
    import triton.language as tl

BLOCK = 1024  # end positions per iteration


def device_lookup_supported(device: torch.device) -> bool:
    """The kernel can run for tensors on `device`: CUDA, or CPU under a forced interpreter."""
    if triton is None:
        return False
    return device.type == "cuda" or interpreter_forced(torch.empty(0, device=device))


if triton is not None:
    # NOTE: every integer is a runtime value and the three per-sequence arrays sit in one
    # aligned tensor: otherwise Triton would compile a variant per divisibility of each (a
    # slice's address, a batch size), seconds apiece inside running steps.
    @triton.jit(do_not_specialize=["bsz", "capacity", "window", "max_k"])
    def _ngram_kernel(
        table_ptr,
        meta_ptr,
        out_ptr,
        count_ptr,
        bsz,
        capacity,
        window,
        max_k,
        N_MIN: tl.constexpr,
        N_MAX: tl.constexpr,
        BK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        slot = tl.load(meta_ptr + b).to(tl.int64)
        length = tl.load(meta_ptr + bsz + b).to(tl.int64)
        k = tl.load(meta_ptr + 2 * bsz + b).to(tl.int64)
        row = table_ptr + slot * capacity
        first = tl.maximum(length - window, 0)
        best_any = tl.full([], -1, tl.int64)
        best_full = tl.full([], -1, tl.int64)
        # an n-gram ending at e is followed by a token: e <= length - 2
        for start in range(first, length - 1, BLOCK):
            e = start + tl.arange(0, BLOCK).to(tl.int64)
            alive = e <= length - 2
            matched = tl.zeros([BLOCK], tl.int64)
            for j in tl.static_range(N_MAX):
                at = length - 1 - j
                tail = tl.load(row + at, mask=at >= 0, other=-1)
                pos = e - j
                inside = alive & (pos >= first)
                tok = tl.load(row + pos, mask=inside, other=-2)
                alive = inside & (tok == tail)
                matched += alive.to(tl.int64)
            hit = (e <= length - 2) & (matched >= N_MIN)
            score = matched * 4294967296 + e
            best_any = tl.maximum(best_any, tl.max(tl.where(hit, score, -1), axis=0))
            full = hit & (e + 1 + k <= length)
            best_full = tl.maximum(best_full, tl.max(tl.where(full, score, -1), axis=0))
        best = best_any // 4294967296
        use_full = (best_full >= 0) & (best_full // 4294967296 == best)
        end = tl.where(use_full, best_full % 4294967296, best_any % 4294967296)
        count = tl.where(best_any >= 0, tl.minimum(k, length - 1 - end), 0)
        count = tl.maximum(count, 0)
        i = tl.arange(0, BK)
        drafts = tl.load(row + end + 1 + i, mask=i < count, other=0)
        tl.store(out_ptr + b * max_k + i, drafts.to(tl.int64), mask=i < max_k)
        tl.store(count_ptr + b, count)


def ngram_lookup(
    table: torch.Tensor,
    meta: torch.Tensor,
    n_min: int,
    n_max: int,
    window: int,
    max_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """table [S, capacity] int32; meta [3 * B] int64: each sequence's row, then each one's
    token count, then each one's most drafts (at most `max_k`) -> (drafts [B, max_k] int64,
    zero past each count; counts [B] int64)."""
    bsz = meta.shape[0] // 3
    max_k = max(max_k, 1)
    out = torch.empty(bsz, max_k, dtype=torch.int64, device=table.device)
    counts = torch.empty(bsz, dtype=torch.int64, device=table.device)
    if bsz:
        _ngram_kernel[(bsz,)](
            table,
            meta,
            out,
            counts,
            bsz,
            table.shape[1],
            window,
            max_k,
            N_MIN=n_min,
            N_MAX=n_max,
            BK=triton.next_power_of_2(max_k),
            BLOCK=BLOCK,
        )
    return out, counts
