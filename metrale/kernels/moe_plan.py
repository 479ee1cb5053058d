"""The grouped expert GEMMs' plan (`MoEPlan`): each (row, expert) pair's place in expert order
and the tiles of rows the grouped kernels (`kernels/moe.py`) walk, as the routing launch
(`kernels/moe_routing.py`) ends by computing them from the per-block expert counts.

  - `order[pos]`: the pair at position pos when pairs are sorted by expert, stably (a row's pairs
    of one expert keep row order), the shared expert's pairs last (as "expert" E);
  - `tiles[:, t]` = (expert, first position, end position) of tile t: each expert's positions cut
    into runs of `block_m`, expert -1 past the last tile. Tiles are at most `max_tiles`: a
    static grid, no host sync.

Per-expert counts are integer sums: the plan is deterministic. Its torch reference is a stable
sort of the pairs by expert and their per-expert counts (`tests/test_moe_kernels.py`,
`_plan_reference`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from metrale.kernels.fused import triton


class MoEPlan(NamedTuple):
    """What `route` hands the grouped expert kernels (see the module docstring)."""

    ids: torch.Tensor  # [N, k] int32 expert of each (row, slot)
    weights: torch.Tensor  # [N, k] routing weights, activation dtype
    order: torch.Tensor  # [N k (+ N)] int32 pair at each sorted position
    tiles: torch.Tensor  # [3, max_tiles] int32 (expert or -1, first position, end position)
    num_rows: int
    top_k: int
    shared: bool  # pairs N k .. N k + N - 1 are the shared expert's ("expert" E)
    block_m: int
    # given ids may name "expert" E: a pick no kernel computes (another expert-parallel rank's),
    # left out of the tiles and of the combine
    skips: bool = False


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _totals(counts_ptr, blk, NB, BE: tl.constexpr):
        """(pairs per expert over all blocks, pairs per expert in the blocks before blk)."""
        cols = tl.arange(0, BE)
        total = tl.zeros([BE], tl.int32)
        before = tl.zeros([BE], tl.int32)
        for b in range(NB):
            c = tl.load(counts_ptr + b * BE + cols)
            total += c
            before += tl.where(b < blk, c, 0)
        return total, before

    @triton.jit
    def _plan_block(
        blk,
        ids_ptr,
        counts_ptr,
        order_ptr,
        N,
        NB,
        K: tl.constexpr,
        BR: tl.constexpr,
        BE: tl.constexpr,
        BKK: tl.constexpr,
        SHARED: tl.constexpr,
        DISTINCT: tl.constexpr,
    ):
        """Scatter block blk's pairs to their sorted positions: pair (r, j) of expert e goes to
        the start of e's group + e's pairs in earlier rows + e's picks in row r before slot j
        (an expert-parallel rank's masked picks repeat an expert within a row). DISTINCT: no
        row picks an expert twice (picks made here), so each pair's place is one gather."""
        cols = tl.arange(0, BE)
        rows = blk * BR + tl.arange(0, BR)
        r_ok = rows < N
        total, before = _totals(counts_ptr, blk, NB, BE)
        base = tl.cumsum(total, axis=0) - total + before  # where this block's pairs of e start
        count = tl.zeros([BR, BE], tl.int32)  # picks of e in row r
        for j in tl.static_range(K):
            idx = tl.load(ids_ptr + rows * K + j, mask=r_ok, other=0)
            count += ((cols[None, :] == idx[:, None]) & r_ok[:, None]).to(tl.int32)
        at = tl.cumsum(count, axis=0) - count + base[None, :]
        if DISTINCT:
            slot = tl.arange(0, BKK)
            ok = r_ok[:, None] & (slot[None, :] < K)
            pair = rows[:, None] * K + slot[None, :]
            idx = tl.load(ids_ptr + pair, mask=ok, other=0)
            tl.store(order_ptr + tl.gather(at, idx, axis=1), pair, mask=ok)
        else:
            for j in tl.static_range(K):
                idx = tl.load(ids_ptr + rows * K + j, mask=r_ok, other=0)
                hit = cols[None, :] == idx[:, None]
                pos = tl.sum(tl.where(hit, at, 0), axis=1)
                tl.store(order_ptr + pos, rows * K + j, mask=r_ok)
                at += hit.to(tl.int32)  # a repeat of e in this row goes after this one
        if SHARED:
            tl.store(order_ptr + N * K + rows, N * K + rows, mask=r_ok)

    @triton.jit
    def _tile_map(
        counts_ptr,
        tiles_ptr,
        N,
        E,
        NB,
        MAX_TILES,
        K: tl.constexpr,
        BE: tl.constexpr,
        BM: tl.constexpr,
        BT: tl.constexpr,
        SHARED: tl.constexpr,
    ):
        """tiles[:, t] = (expert, first, end position) of tile t; expert -1 past the last."""
        count, _ = _totals(counts_ptr, 0, NB, BE)
        _tile_map_of(count, tiles_ptr, N, E, MAX_TILES, BE, BM, BT, SHARED)

    @triton.jit
    def _tile_map_of(
        count,
        tiles_ptr,
        N,
        E,
        MAX_TILES,
        BE: tl.constexpr,
        BM: tl.constexpr,
        BT: tl.constexpr,
        SHARED: tl.constexpr,
    ):
        """`_tile_map` from the per-expert pair counts [BE] in registers."""
        cols = tl.arange(0, BE)
        # column E: the shared expert's pairs, or the skipped picks (sorted last, in no tile)
        if SHARED:  # noqa: SIM108 (a branch on a constexpr)
            count = tl.where(cols == E, N, count)
        else:
            count = tl.where(cols == E, 0, count)
        start = tl.cumsum(count, axis=0) - count
        tiles = (count + BM - 1) // BM
        first = tl.cumsum(tiles, axis=0) - tiles
        for t0 in range(0, MAX_TILES, BT):
            t = t0 + tl.arange(0, BT)
            inside = (t[:, None] >= first[None, :]) & (t[:, None] < (first + tiles)[None, :])
            found = tl.sum(inside.to(tl.int32), axis=1) > 0
            expert = tl.sum(tl.where(inside, cols[None, :], 0), axis=1)
            begin = tl.sum(tl.where(inside, start + (t[:, None] - first) * BM, 0), axis=1)
            end = tl.minimum(begin + BM, tl.sum(tl.where(inside, start + count, 0), axis=1))
            t_ok = t < MAX_TILES
            tl.store(tiles_ptr + t, tl.where(found, expert, -1), mask=t_ok)
            tl.store(tiles_ptr + MAX_TILES + t, begin, mask=t_ok)
            tl.store(tiles_ptr + 2 * MAX_TILES + t, end, mask=t_ok)


def max_tiles(num_rows: int, top_k: int, num_experts: int, shared: bool, block_m: int) -> int:
    """The most tiles a plan can have (each expert's last tile may be partial)."""
    pairs = num_rows * top_k
    tiles = -(-pairs // block_m) + min(num_experts, pairs)
    return tiles + (-(-num_rows // block_m) if shared else 0)
