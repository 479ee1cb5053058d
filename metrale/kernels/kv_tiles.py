"""Tiles of a sequence's paged keys and values, shared by the paged attention kernels.

A page holds PAGE rows of one layer's cache ([pages, PAGE, KV heads, D]); a tile is TILE_PAGES
consecutive pages of one sequence and one KV head, gathered through the block table into one
[TILE_PAGES * PAGE, D] block. Reading several pages per step of the attention loop keeps more
bytes in flight per program and makes the matrix products wider than one 16-row page (with
one page per step the H200's decode attention read the cache at about 60% of its bandwidth).

`tile_scores` is the online softmax's step over one tile (load, scores, causal mask, new max,
weights), which both kernels take on with their own row sums. `tile_pages` picks how many pages
a tile spans: a number of keys (TILE_KEYS for the default
kernel), halved until a program's shared memory fits the device (the query tile plus a K and a
V tile), and for the invariant kernel a divisor of its split, so its tiles start at positions
fixed by the sequence alone. `models/attention.TorchPagedAttention` is the reference of the
kernels that use these tiles.
"""

from __future__ import annotations

import torch

from metrale.kernels.batch_invariant import shared_bytes

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the attention kernels are not built
    triton = None

# Keys gathered per step of the default kernel's loop (a power of two; the H200's best of
# 16-128 at batch 1-64, `scripts/attention_kernel_bench.py`).
TILE_KEYS = 64
# Launch options of the attention kernels (Triton's defaults; kept here so a sweep can set them).
NUM_WARPS = 4
NUM_STAGES = 3


# Shared memory a program needs beyond its query, key and value tiles (measured with ptxas:
# 0-8 KiB on sm_80-sm_90), with room to spare.
SHARED_MARGIN = 16 * 1024
# What interpreted runs (CPU tests) plan their tiles for: an H100/H200's 227 KiB.
INTERPRETED_SHARED = 227 * 1024


def shared_budget(device: torch.device) -> int:
    """The shared memory one program may use on `device`."""
    return shared_bytes(device) if device.type == "cuda" else INTERPRETED_SHARED


def tile_pages(
    page: int, keys: int, *, rows: int, dim: int, elem_bytes: int, shared: int,
    split_pages: int | None = None,
) -> int:  # fmt: skip
    """Pages per tile for pages of `page` rows: `keys` keys (one page when a page holds more),
    a power of two, halved while a program of `rows` tile rows would not fit `shared` bytes or
    (invariant kernel) the tile does not divide a split of `split_pages` pages."""
    pages = max(1, keys // page)
    pages = 1 << (pages.bit_length() - 1)

    def fits(n: int) -> bool:
        return (rows + 2 * n * page) * dim * elem_bytes + SHARED_MARGIN <= shared

    while pages > 1 and (not fits(pages) or (split_pages is not None and split_pages % pages)):
        pages //= 2
    return pages


# Pages a tile, as compiled: (kernel family, its fixed configuration) -> pages (`fitted_pages`).
_FITTED: dict[tuple, int] = {}


def fitted_pages(key: tuple, planned: int, shared_of, budget: int) -> int:
    """`planned` pages a tile (`tile_pages`' estimate), halved while the kernels compiled with
    it would ask more shared memory than `budget`: `shared_of(pages)` compiles them (no launch)
    and returns the most any asks. The estimate leaves out the pipeline's extra K/V buffers
    and the scores, so a 256-wide head with 8 query heads a KV head (Qwen3-Next) asked 333 KB
    of the H100's 232 KB and its first launch failed. Decided once per `key` before any launch
    with it, so every row of that configuration is computed with the same tile (the invariant
    kernel's bits follow its tile)."""
    pages = _FITTED.get(key)
    if pages is None:
        pages = planned
        while pages > 1 and shared_of(pages) > budget:
            pages //= 2
        _FITTED[key] = pages
    return pages


tile_scores = None  # the kernel helpers below, where Triton is installed
if triton is not None:

    @triton.jit
    def _load_kv_tile(
        k_ptr, v_ptr, tables_ptr, seq, kvh, p0, end, seq_len,
        stride_cp, stride_co, stride_ch, stride_bt,
        D: tl.constexpr, PAGE: tl.constexpr, TILE_PAGES: tl.constexpr,
    ):  # fmt: skip
        """Pages p0 .. p0 + TILE_PAGES - 1 of the sequence's KV head, those before `end`:
        (keys, values, each key's position, whether it is one of the sequence's keys). Values
        that are not are zeroed: a stale NaN there (an old occupant's page, the dummy page)
        would otherwise reach the output through 0 * NaN. Their keys are the caller's to mask."""
        j = tl.arange(0, TILE_PAGES * PAGE)
        page_idx = p0 + j // PAGE
        in_range = page_idx < end
        page = tl.load(tables_ptr + seq * stride_bt + page_idx, mask=in_range, other=0)
        key_pos = page_idx * PAGE + j % PAGE
        real = in_range & (key_pos < seq_len)
        row = page.to(tl.int64) * stride_cp + kvh * stride_ch + (j % PAGE) * stride_co
        d = tl.arange(0, D)
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=in_range[:, None], other=0.0)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=real[:, None], other=0.0)
        return k, v, key_pos, real

    @triton.jit
    def tile_scores(
        q, m_i, k_ptr, v_ptr, tables_ptr, seq, kvh, p, end, pos, row_ok, seq_len, scale,
        stride_cp, stride_co, stride_ch, stride_bt,
        D: tl.constexpr, PAGE: tl.constexpr, TILE_PAGES: tl.constexpr,
        PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        """The online softmax's step over the tile of pages p .. p + TILE_PAGES - 1 (those
        before `end`) for rows at positions `pos` with running max m_i: (the tile's values,
        each row's float32 weights of its visible keys against the new max, the rescale of
        what came before, the new max). Summing the weights and weighting the values is the
        caller's: the kernels sum them differently."""
        k, v, key_pos, real = _load_kv_tile(
            k_ptr, v_ptr, tables_ptr, seq, kvh, p, end, seq_len,
            stride_cp, stride_co, stride_ch, stride_bt, D, PAGE, TILE_PAGES,
        )  # fmt: skip
        if DOT_F32:  # the interpreter's bf16 dot is wrong; float32 operands are exact
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        visible = (key_pos[None, :] <= pos[:, None]) & real[None, :] & row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        return v, tl.exp(s - m_safe[:, None]), tl.exp(m_i - m_safe), m_new
