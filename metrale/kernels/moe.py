"""Routed experts (and the shared expert) of a sparse MoE block as three Triton launches over a
`moe_plan.MoEPlan`: grouped gate/up with SiLU(gate) * up in its epilogue, grouped down, and
the per-row combine (routing-weighted sum, the shared expert's sigmoid gate, optionally the next
norm's residual add + RMSNorm).

Grouped: program (tile t, column block) takes tile t's run of up to BM sorted pairs, all of one
expert, gathers their rows and multiplies them by that expert's weights, so each expert's
weights are read once per tile at any batch size (batch 1 included: one tile per picked expert).
The shared expert is "expert E" with a pair per row and its own intermediate size.

Batch invariance: a row's output never depends on the other rows of the batch or on its place
among them. Every launch uses one block shape whatever the batch, reduces over K in one fixed
BK loop (no split-K), and the routed sum runs per row over its slots in slot order; nothing is
accumulated across programs. `tests/test_moe_grouped.py` checks rows bitwise across batches.

Rounding follows the torch reference paths (`qwen3_next_moe.Qwen3NextExperts._looped` and
`Qwen3NextSparseMoeBlock.forward`): each GEMM result rounded to the activation dtype, SiLU
rounded before the product and the product once more, each expert's output rounded, the routed
sum rounded once, the shared expert's gate (logit, then sigmoid) and its product rounded, and the
sum of both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from metrale.kernels import pdl
from metrale.kernels.fused import triton
from metrale.kernels.moe_plan import MoEPlan

# (BN, BK, num_warps, num_stages) per kernel; BM is the plan's block_m. Fixed per process: a
# row's rounding must not depend on the batch (see the module docstring). The best of
# `benchmarks/moe_kernels.py --sweep` on the H200 over 1, 16, 64 and 256 rows (gate/up: 29.4 /
# 102.6 / 114.0 / 200.5 us for the three launches against 31.4 / 105.5 / 123.3 / 245.4 with the
# (32, 128, 8) before it; down: (64, 128, 4) 1-4% faster than (64, 64, 8)). Pipeline stages 2-5
# and wider tiles near these were within 1% (Triton's default 3 kept).
GATE_UP_BLOCKS = (32, 128, 4, 3)
DOWN_BLOCKS = (64, 128, 4, 3)
COMBINE_BLOCK = 1024
BLOCK_M = 16  # tl.dot's smallest M on the GPU


class SharedExpert(NamedTuple):
    """The shared expert's weights as the kernels read them (one SwiGLU expert)."""

    gate_up: torch.Tensor  # [2 I_s, H], gate rows first
    down: torch.Tensor  # [H, I_s]
    gate: torch.Tensor  # [H] the sigmoid gate's weight row


if triton is not None:
    import triton.language as tl

    from metrale.kernels.pdl import pdl_prologue

    @triton.jit
    def _r(x, DT: tl.constexpr):
        """x rounded to the activation dtype and back to float32 (what a torch op on DT does)."""
        return x.to(DT).to(tl.float32)

    @triton.jit(do_not_specialize=["NK", "N", "MAX_TILES"])
    def _gate_up_kernel(
        x_ptr,
        stride_x,
        w_ptr,
        ws_ptr,
        order_ptr,
        tiles_ptr,
        h_ptr,
        NK,
        N,
        MAX_TILES,
        E,
        H,
        INTER,
        INTER_S,
        IW,
        K: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        t = tl.program_id(0)
        expert = tl.load(tiles_ptr + t)
        if expert < 0:
            return
        if expert < E:  # a routed expert: gate rows, then up rows, of [E, 2I, H]
            w = w_ptr + expert.to(tl.int64) * 2 * INTER * H
            up = INTER * H
            inter = INTER
        else:  # the shared expert [2 I_s, H]
            w = ws_ptr
            up = INTER_S * H
            inter = INTER_S
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        if tl.program_id(1) * BN >= inter:
            return
        pos = tl.load(tiles_ptr + MAX_TILES + t) + tl.arange(0, BM)
        ok = pos < tl.load(tiles_ptr + 2 * MAX_TILES + t)
        pair = tl.load(order_ptr + pos, mask=ok, other=0)
        row = tl.where(pair < NK, pair // K, pair - NK).to(tl.int64)
        n_ok = n < inter
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, H, BK):
            k = k0 + tl.arange(0, BK)
            k_ok = k < H
            x_ok = ok[:, None] & k_ok[None, :]
            xk = tl.load(x_ptr + row[:, None] * stride_x + k[None, :], mask=x_ok, other=0.0)
            w_ok = k_ok[:, None] & n_ok[None, :]
            wg = tl.load(w + n[None, :] * H + k[:, None], mask=w_ok, other=0.0)
            wu = tl.load(w + up + n[None, :] * H + k[:, None], mask=w_ok, other=0.0)
            if UPCAST:
                xk, wg, wu = xk.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            acc_g = tl.dot(xk, wg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(xk, wu, acc_u, input_precision=PRECISION)
        dt = h_ptr.dtype.element_ty
        gate = _r(acc_g, dt)
        act = _r(gate * tl.sigmoid(gate), dt)
        h = act * _r(acc_u, dt)
        dst = h_ptr + pos[:, None].to(tl.int64) * IW + n[None, :]
        tl.store(dst, h.to(dt), mask=ok[:, None] & n_ok[None, :])

    @triton.jit(do_not_specialize=["N", "MAX_TILES"])
    def _down_kernel(
        h_ptr,
        w_ptr,
        ws_ptr,
        order_ptr,
        tiles_ptr,
        y_ptr,
        N,
        MAX_TILES,
        E,
        H,
        INTER,
        INTER_S,
        IW,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        t = tl.program_id(0)
        expert = tl.load(tiles_ptr + t)
        if expert < 0:
            return
        if expert < E:  # [E, H, I]
            w = w_ptr + expert.to(tl.int64) * H * INTER
            inter = INTER
        else:  # [H, I_s]
            w = ws_ptr
            inter = INTER_S
        pos = tl.load(tiles_ptr + MAX_TILES + t) + tl.arange(0, BM)
        ok = pos < tl.load(tiles_ptr + 2 * MAX_TILES + t)
        pair = tl.load(order_ptr + pos, mask=ok, other=0).to(tl.int64)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_ok = n < H
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, inter, BK):
            k = k0 + tl.arange(0, BK)
            k_ok = k < inter
            hk = tl.load(
                h_ptr + pos[:, None].to(tl.int64) * IW + k[None, :],
                mask=ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            wt = tl.load(w + n[None, :] * inter + k[:, None], k_ok[:, None] & n_ok[None, :], 0.0)
            if UPCAST:
                hk, wt = hk.to(tl.float32), wt.to(tl.float32)
            acc = tl.dot(hk, wt, acc, input_precision=PRECISION)
        dst = y_ptr + pair[:, None] * H + n[None, :]
        tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])

    @triton.jit(do_not_specialize=["NK"])
    def _combine_kernel(
        y_ptr,
        w_ptr,
        ids_ptr,
        E,
        x_ptr,
        stride_x,
        sg_ptr,
        res_ptr,
        norm_ptr,
        out_ptr,
        res_out_ptr,
        NK,
        H,
        eps,
        K: tl.constexpr,
        BH: tl.constexpr,
        BX: tl.constexpr,
        SHARED: tl.constexpr,
        ADD_NORM: tl.constexpr,
        SKIPS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        n = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BH + tl.arange(0, BH)
        c_ok = cols < H
        dt = out_ptr.dtype.element_ty
        acc = tl.zeros([BH], tl.float32)
        for j in tl.static_range(K):  # slot order: the routed sum's fixed order
            w = tl.load(w_ptr + n * K + j).to(tl.float32)
            if SKIPS:  # a skipped pick's row of y was never written: it adds 0
                here = tl.load(ids_ptr + n * K + j + cols * 0) < E  # (as a block: a mask)
                w = tl.where(here, w, 0.0)
                y = tl.load(y_ptr + (n * K + j) * H + cols, mask=c_ok & here, other=0.0)
            else:
                y = tl.load(y_ptr + (n * K + j) * H + cols, mask=c_ok, other=0.0)
            acc += w * y.to(tl.float32)
        out = _r(acc, dt)
        if SHARED:  # + sigmoid(x . w_gate) * shared(x)
            dot = tl.zeros([BX], tl.float32)
            for k0 in range(0, H, BX):
                k = k0 + tl.arange(0, BX)
                xk = tl.load(x_ptr + n * stride_x + k, mask=k < H, other=0.0).to(tl.float32)
                dot += xk * tl.load(sg_ptr + k, mask=k < H, other=0.0).to(tl.float32)
            gate = _r(tl.sigmoid(_r(tl.sum(dot, axis=0), dt)), dt)
            ys = tl.load(y_ptr + (NK + n) * H + cols, mask=c_ok, other=0.0).to(tl.float32)
            out = _r(out + _r(gate * ys, dt), dt)
        if ADD_NORM:  # the next (1 + w) RMSNorm with its residual add (`fused.add_rmsnorm`)
            res = tl.load(res_ptr + n * H + cols, mask=c_ok, other=0.0).to(tl.float32)
            out = _r(out + res, dt)
            tl.store(res_out_ptr + n * H + cols, out.to(dt), mask=c_ok)
            inv = tl.rsqrt(tl.sum(out * out, axis=0) / H + eps)
            wn = tl.load(norm_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
            out = (1.0 + wn) * out * inv
        tl.store(out_ptr + n * H + cols, out.to(dt), mask=c_ok)


def _dot_args(x: torch.Tensor) -> dict:
    """float32 activations keep float32 products (tf32 would round them). The interpreter's
    dot mishandles bf16 operands: there they are widened first (bf16 products are exact in
    float32, so only the accumulation order can differ from the GPU's)."""
    return dict(PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=not x.is_cuda)


def grouped_experts(
    x: torch.Tensor,
    plan: MoEPlan,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    shared: SharedExpert | None = None,
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] (unit column stride); gate_up_proj [E, 2I, H], down_proj [E, H, I] (both
    contiguous) -> sum_j weights[:, j] * expert_j(x) (+ the shared expert when the plan has it)
    [N, H] in x's dtype; a pick of expert E (`MoEPlan.skips`) adds nothing. With `residual`
    and `norm_weight`: (the (1 + w) RMSNorm of out + residual, out + residual), as the next
    layer's `forward_residual` would return."""
    n, hidden = x.shape
    num_experts, inter = down_proj.shape[0], down_proj.shape[2]
    if plan.shared != (shared is not None):
        raise ValueError("the plan and the shared expert disagree")
    inter_s = shared.down.shape[1] if shared is not None else 0
    iw = max(inter, inter_s)
    pairs = plan.order.shape[0]
    h = torch.empty(pairs, iw, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    add_norm = residual is not None
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if add_norm else out
    if n == 0:
        return (out, res_out) if add_norm else out
    if x.stride(1) != 1:
        x = x.contiguous()
    tiles = plan.tiles.shape[1]
    nk = n * plan.top_k
    dots = _dot_args(x)
    ws_up = gate_up_proj if shared is None else shared.gate_up
    ws_down = down_proj if shared is None else shared.down
    bn, bk, warps, stages = GATE_UP_BLOCKS
    _gate_up_kernel[(tiles, triton.cdiv(iw, bn))](
        x, x.stride(0), gate_up_proj, ws_up, plan.order, plan.tiles, h,
        nk, n, tiles, num_experts, hidden, inter, inter_s, iw,
        K=plan.top_k, BM=plan.block_m, BN=bn, BK=bk, **dots, num_warps=warps, num_stages=stages,
        **pdl.launch(x),
    )  # fmt: skip
    bn, bk, warps, stages = DOWN_BLOCKS
    _down_kernel[(tiles, triton.cdiv(hidden, bn))](
        h, down_proj, ws_down, plan.order, plan.tiles, y,
        n, tiles, num_experts, hidden, inter, inter_s, iw,
        BM=plan.block_m, BN=bn, BK=bk, **dots, num_warps=warps, num_stages=stages,
        **pdl.launch(x),
    )  # fmt: skip
    # the norm needs a whole row per program
    block_h = triton.next_power_of_2(hidden) if add_norm else min(COMBINE_BLOCK, hidden)
    block_h = triton.next_power_of_2(block_h)
    _combine_kernel[(n, triton.cdiv(hidden, block_h))](
        y, plan.weights, plan.ids, num_experts, x, x.stride(0),
        shared.gate if shared is not None else x,
        residual.contiguous() if add_norm else x,
        norm_weight if add_norm else x,
        out, res_out, nk, hidden, eps,
        K=plan.top_k, BH=block_h, BX=min(1024, triton.next_power_of_2(hidden)),
        SHARED=shared is not None, ADD_NORM=add_norm, SKIPS=plan.skips,
        num_warps=min(max(block_h // 512, 1), 16), **pdl.launch(x),
    )  # fmt: skip
    return (out, res_out) if add_norm else out
