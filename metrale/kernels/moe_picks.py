"""The routing's Triton pieces that the routing launch (`moe_routing`) and the split router
launch (`moe_router`) share: the router product over a run of hidden columns, each row's top-k
pick with its softmax weights, and the plan of one block of rows from registers.

Their arithmetic is the routing's definition (`moe_routing`'s docstring): the pick compares
float32 logits, equal ones go to the lower expert index, a NaN is never picked before a number.
Their torch reference is the routing's: `moe_routing.route_reference` for the picks and weights,
a stable sort of the pairs by expert for the plan (`tests/test_moe_kernels.py`).
"""

from __future__ import annotations

from metrale.kernels.fused import triton

if triton is not None:
    import triton.language as tl

    from metrale.kernels.moe_plan import _tile_map_of

    @triton.jit
    def _router_product(
        x_ptr,
        stride_x,
        router_ptr,
        rows,
        r_ok,
        experts,
        e_ok,
        h_lo,
        h_hi,
        H,
        BR: tl.constexpr,
        BN: tl.constexpr,
        BH: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """[BR, BN] float32: hidden rows `rows` times router rows `experts` over the hidden
        columns h_lo .. h_hi (a multiple of BH apart, or ending at H), in chunks of BH in order.
        IEEE (the interpreter, whose bf16 dot is wrong) or float32 inputs: a float32 product as
        torch's (no tf32; float32 operands hold bf16 ones exactly)."""
        hh = tl.arange(0, BH)
        acc = tl.zeros([BR, BN], tl.float32)
        for h0 in range(h_lo, h_hi, BH):
            h = h0 + hh
            x = tl.load(
                x_ptr + rows[:, None] * stride_x + h[None, :],
                mask=r_ok[:, None] & (h[None, :] < H),
                other=0.0,
            )
            # [BN, BH]: each expert's run of H contiguous (coalesced), transposed in the dot
            w = tl.load(
                router_ptr + experts[:, None] * H + h[None, :],
                mask=e_ok[:, None] & (h[None, :] < H),
                other=0.0,
            )
            if IEEE or x.dtype == tl.float32:
                acc = tl.dot(
                    x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee"
                )
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        return acc

    @triton.jit
    def _pick(
        logit,
        rows,
        r_ok,
        ids_ptr,
        w_ptr,
        E,
        K: tl.constexpr,
        BR: tl.constexpr,
        BE: tl.constexpr,
        BKK: tl.constexpr,
        NORM: tl.constexpr,
    ):
        """Router logits [BR, BE] (float32; columns from E on: anything) of `rows` -> each row's
        k experts and weights, stored; returns (picks [BR, BKK], picks of each expert in each
        row [BR, BE])."""
        cols = tl.arange(0, BE)
        slot = tl.arange(0, BKK)
        out_ok = r_ok[:, None] & (slot[None, :] < K)
        out_off = rows[:, None] * K + slot[None, :]
        logit = tl.where(cols[None, :] < E, logit, float("-inf"))
        top = tl.max(logit, axis=1)
        total = tl.sum(tl.exp(logit - top[:, None]), axis=1)
        taken = cols[None, :] >= E
        # A NaN logit is never picked before a number; its row's weights are NaN (total).
        pickable = tl.where(logit == logit, logit, float("-inf"))
        vals = tl.zeros([BR, BKK], tl.float32)
        picks = tl.zeros([BR, BKK], tl.int32)
        for j in tl.static_range(K):
            cur = tl.where(taken, float("-inf"), pickable)
            best = tl.max(cur, axis=1)
            # the lowest index among the largest not yet taken: the tie rule, and a row's
            # picks stay distinct when what is left is all -inf (the plan relies on it)
            at_best = (cur == best[:, None]) & ~taken
            idx = tl.min(tl.where(at_best, cols[None, :], BE), axis=1)
            taken = taken | (cols[None, :] == idx[:, None])
            val = tl.exp(best - top) / total  # its softmax probability, bit for bit
            vals = tl.where(slot[None, :] == j, val[:, None], vals)
            picks = tl.where(slot[None, :] == j, idx[:, None], picks)
        if NORM:
            vals = vals / tl.sum(vals, axis=1)[:, None]
        tl.store(ids_ptr + out_off, picks, mask=out_ok)
        tl.store(w_ptr + out_off, vals.to(w_ptr.dtype.element_ty), mask=out_ok)
        hits = (taken & (cols[None, :] < E) & r_ok[:, None]).to(tl.int32)
        return picks, hits

    @triton.jit
    def _plan_in_registers(
        picks,
        hits,
        order_ptr,
        tiles_ptr,
        N,
        E,
        MAX_TILES,
        K: tl.constexpr,
        BR: tl.constexpr,
        BE: tl.constexpr,
        BKK: tl.constexpr,
        BM: tl.constexpr,
        BT: tl.constexpr,
        SHARED: tl.constexpr,
    ):
        """The plan of one block of rows 0.. whose picks (distinct in a row) and per-row expert
        hits are in registers, as `_plan_block` and `_tile_map` make it from memory."""
        count = tl.sum(hits, axis=0)
        at = tl.cumsum(hits, axis=0) - hits + (tl.cumsum(count, axis=0) - count)[None, :]
        rows = tl.arange(0, BR)
        slot = tl.arange(0, BKK)
        ok = (rows[:, None] < N) & (slot[None, :] < K)
        pair = rows[:, None] * K + slot[None, :]
        tl.store(order_ptr + tl.gather(at, picks, axis=1), pair, mask=ok)
        if SHARED:
            tl.store(order_ptr + N * K + rows, N * K + rows, mask=rows < N)
        _tile_map_of(count, tiles_ptr, N, E, MAX_TILES, BE, BM, BT, SHARED)
