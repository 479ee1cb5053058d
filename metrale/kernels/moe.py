"""Routed experts for a handful of (row, expert) pairs as two Triton GEMV kernels: decode and short
verify steps of a sparse MoE target, where a grouped GEMM is mostly empty tiles.

The (row, expert) pairs stay in routing order (no sort): program (p, n-block) reads pair p's row
of x and its expert's weight rows directly, so each pair reads its expert's weights once and
nothing else. `gate_up_silu` computes SiLU(x W_gate^T) * (x W_up^T) for its block of the
intermediate dimension (both halves in one program), `down` the expert's output block; the
routing-weighted sum over a row's k experts is one small batched matmul in the caller.

Rounding follows the torch paths: each GEMM result is rounded to the activation dtype, SiLU is
rounded before the product, the product once more. Used when the pairs are few (at most
`GEMV_MAX_PAIRS`): beyond that, experts shared by several pairs would be read several times and
the grouped GEMM wins. `qwen3_next_moe.Qwen3NextExperts._looped` is the reference.
"""

from __future__ import annotations

import torch

from metrale.kernels.fused import triton

# At or below this many (row, expert) pairs the GEMV kernels run (H200: a decode step of one
# sequence with top-10 routing is 10 pairs; the grouped GEMM spent 22 us per call there).
GEMV_MAX_PAIRS = 64

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _gate_up_silu_kernel(
        x_ptr, w_ptr, ids_ptr, out_ptr, TOPK, HID, INTER, BN: tl.constexpr, BK: tl.constexpr
    ):
        p = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_ok = n < INTER
        expert = tl.load(ids_ptr + p).to(tl.int64)
        x_row = x_ptr + (p // TOPK) * HID
        w = w_ptr + expert * 2 * INTER * HID
        gate = tl.zeros([BN], tl.float32)
        up = tl.zeros([BN], tl.float32)
        for k0 in range(0, HID, BK):
            k = k0 + tl.arange(0, BK)
            k_ok = k < HID
            xk = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
            tile_ok = n_ok[:, None] & k_ok[None, :]
            wg = tl.load(w + n[:, None] * HID + k[None, :], mask=tile_ok, other=0.0)
            wu = tl.load(w + (INTER + n[:, None]) * HID + k[None, :], mask=tile_ok, other=0.0)
            gate += tl.sum(wg.to(tl.float32) * xk[None, :], axis=1)
            up += tl.sum(wu.to(tl.float32) * xk[None, :], axis=1)
        dt = out_ptr.dtype.element_ty
        gate = gate.to(dt).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)
        tl.store(out_ptr + p * INTER + n, (act * up.to(dt).to(tl.float32)).to(dt), mask=n_ok)

    @triton.jit
    def _down_kernel(
        h_ptr, w_ptr, ids_ptr, out_ptr, HID, INTER, BN: tl.constexpr, BK: tl.constexpr
    ):
        p = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_ok = n < HID
        expert = tl.load(ids_ptr + p).to(tl.int64)
        w = w_ptr + expert * HID * INTER
        acc = tl.zeros([BN], tl.float32)
        for k0 in range(0, INTER, BK):
            k = k0 + tl.arange(0, BK)
            k_ok = k < INTER
            hk = tl.load(h_ptr + p * INTER + k, mask=k_ok, other=0.0).to(tl.float32)
            tile_ok = n_ok[:, None] & k_ok[None, :]
            wt = tl.load(w + n[:, None] * INTER + k[None, :], mask=tile_ok, other=0.0)
            acc += tl.sum(wt.to(tl.float32) * hk[None, :], axis=1)
        tl.store(out_ptr + p * HID + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def experts_gemv(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    # H200, one row, top-10 of 64 experts at Qwen3-Next's H and I: gate_up with 16 rows per
    # program ran in 101 us per call against 154 us with 32 (more programs in flight; eager, so
    # launch costs included); down was best at 32.
    gate_up_blocks: tuple[int, int] = (16, 128),
    down_blocks: tuple[int, int] = (32, 128),
) -> torch.Tensor:
    """x [N, H]; experts, weights [N, k]; gate_up_proj [E, 2I, H]; down_proj [E, H, I] (both
    contiguous) -> sum_j weights[:, j] * expert_j(x) [N, H] in x's dtype. `*_blocks`: (output
    rows, reduction columns) per program of each kernel."""
    n, topk = experts.shape
    hidden, inter = x.shape[1], down_proj.shape[2]
    pairs = n * topk
    ids = experts.reshape(-1).contiguous()
    x = x.contiguous()
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    if pairs:
        (bn, bk), (dn, dk) = gate_up_blocks, down_blocks
        _gate_up_silu_kernel[(pairs, triton.cdiv(inter, bn))](
            x, gate_up_proj, ids, h, topk, hidden, inter, BN=bn, BK=bk, num_warps=4
        )
        _down_kernel[(pairs, triton.cdiv(hidden, dn))](
            h, down_proj, ids, y, hidden, inter, BN=dn, BK=dk, num_warps=4
        )
    return torch.einsum("nk,nkh->nh", weights.to(y.dtype), y.view(n, topk, hidden))
