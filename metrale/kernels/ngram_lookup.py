"""Prompt-lookup drafting as one Triton kernel: every sequence's n-gram search in one launch.

One program per sequence scans the last `window` tokens of its row in a token table [slots,
capacity] (int32, absolute positions). For each end position e it counts how many of the tokens
ending at e equal the tokens ending at the sequence's last one (at most n_max, never reaching
before the window); the longest such match of at least n_min wins, the latest occurrence whose
continuation holds k tokens first, else the latest (what `speculative.ngram.lookup`, the
reference and test oracle, proposes). A match is scored `length * 2**32 + e`, so one max per
block keeps the longest, latest match, and a second max the longest, latest full one.

`ngram_commit_lookup`, for drafting ahead right after a verify (`speculative.ngram_device`):
each program first works out its sequence's accepted drafts from the target's picks, writes its
committed tokens into its row and scans the row as it then stands, in the same launch (a
barrier between the writes and the scan: the program's threads read what the others wrote).
Each row of the output holds the count of drafts, the sequence's token count and the drafts, so
one copy brings all of it back.
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
    # NOTE: every integer is a runtime value and the per-sequence arrays sit in one aligned
    # tensor: otherwise Triton would compile a variant per divisibility of each (a slice's
    # address, a batch size), seconds apiece inside running steps. Two variants in all
    # (COMMIT), both compiled when the table is made.
    @triton.jit(do_not_specialize=["bsz", "capacity", "window", "max_k"])
    def _ngram_kernel(
        table_ptr,
        meta_ptr,
        ids_ptr,
        picks_ptr,
        out_ptr,
        bsz,
        capacity,
        window,
        max_k,
        N_MIN: tl.constexpr,
        N_MAX: tl.constexpr,
        BK: tl.constexpr,
        BQ: tl.constexpr,
        BLOCK: tl.constexpr,
        COMMIT: tl.constexpr,
    ):
        b = tl.program_id(0)
        if COMMIT:
            slot = tl.load(meta_ptr + b).to(tl.int64)
            draft_row = tl.load(meta_ptr + bsz + b)
            pick_row = tl.load(meta_ptr + 2 * bsz + b)
            step_k = tl.load(meta_ptr + 3 * bsz + b)
            before = tl.load(meta_ptr + 4 * bsz + b).to(tl.int64)
            k = tl.load(meta_ptr + 5 * bsz + b).to(tl.int64)
            q = tl.arange(0, BQ).to(tl.int64)
            picked = tl.load(picks_ptr + pick_row + q, mask=q <= step_k, other=-1)
            drafted = tl.load(ids_ptr + draft_row + q, mask=q < step_k, other=-2)
            # the first draft the target did not pick, else k (row k has no draft: q = k)
            accepted = tl.min(tl.where((q < step_k) & (drafted == picked), BQ, q), axis=0)
            written = before + q
            keep = (q <= accepted) & (written < capacity)
            tl.store(table_ptr + slot * capacity + written, picked.to(tl.int32), mask=keep)
            tl.debug_barrier()  # the scan below reads these tokens, from other threads
            length = tl.minimum(before + accepted + 1, capacity)
        else:
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
        out = out_ptr + b * (2 + max_k)
        tl.store(out, count)
        tl.store(out + 1, length)
        tl.store(out + 2 + i, drafts.to(tl.int64), mask=i < max_k)


def _launch(table, meta, ids, picks, bsz, n_min, n_max, window, max_k, commit: bool):
    max_k = max(max_k, 1)
    out = torch.empty(bsz, 2 + max_k, dtype=torch.int64, device=table.device)
    if bsz:
        _ngram_kernel[(bsz,)](
            table,
            meta,
            ids,
            picks,
            out,
            bsz,
            table.shape[1],
            window,
            max_k,
            N_MIN=n_min,
            N_MAX=n_max,
            BK=triton.next_power_of_2(max_k),
            BQ=triton.next_power_of_2(max_k + 1),
            BLOCK=BLOCK,
            COMMIT=commit,
        )
    return out


def ngram_lookup(
    table: torch.Tensor,
    meta: torch.Tensor,
    n_min: int,
    n_max: int,
    window: int,
    max_k: int,
) -> torch.Tensor:
    """table [S, capacity] int32; meta [3 * B] int64: each sequence's row, then each one's
    token count, then each one's most drafts (at most `max_k`) -> [B, 2 + max_k] int64: per
    sequence its count of drafts, its token count, its drafts (zero past the count)."""
    return _launch(table, meta, meta, meta, meta.shape[0] // 3, n_min, n_max, window, max_k, False)


def ngram_commit_lookup(
    table: torch.Tensor,
    meta: torch.Tensor,
    input_ids: torch.Tensor,
    picks: torch.Tensor,
    n_min: int,
    n_max: int,
    window: int,
    max_k: int,
) -> torch.Tensor:
    """`ngram_lookup` after a step, each sequence's committed tokens first written into its row.

    meta [6 * B] int64, per sequence: its row; where its k drafts sit in the step's packed
    `input_ids`; where the target's picks of its sampled rows sit in `picks` (the token after
    its last token, then after each draft); k (at most `max_k`); its token count before the
    step; the most drafts to look up. The accepted drafts are the leading ones equal to the
    pick before them; the committed tokens are the picks up to the one after the last accepted
    (the bonus token). -> [B, 2 + max_k] as `ngram_lookup`, the token counts those after the
    step."""
    bsz = meta.shape[0] // 6
    return _launch(table, meta, input_ids, picks, bsz, n_min, n_max, window, max_k, True)
