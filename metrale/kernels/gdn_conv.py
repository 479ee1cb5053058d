"""The causal depthwise conv of a Gated DeltaNet layer (kernel width 4), as one Triton kernel that
reads and writes the conv windows in the state pool in place: one launch where the torch path
(`gdn.causal_conv1d` plus the window gather and scatter) takes about ten, most of a decode step's
GDN glue.

One program per (sequence, block of channels) holds the three-input window in registers, then per
row t < lengths[b]: out = SiLU(w0 x[t-3] + w1 x[t-2] + w2 x[t-1] + w3 x[t]), shifts x[t] in, and
stores the window after that row into entry rows[b, t] where asked (per-row-slot verify). At the
end it stores the window into entry final[b] where asked (`final = read`: prefill chunks, decode,
write-on-accept commits). Rows past a sequence's length get zeros (padding; the delta rule leaves
the state alone for them). `gdn.causal_conv1d` is the reference. A forward's conv takes the packed
offsets (`query_start_loc`) instead of lengths and reads lengths[b] = starts[b+1] - starts[b]
itself: no launch per step to make them.
"""

from __future__ import annotations

import torch

from metrale.kernels import pdl
from metrale.kernels.gdn_recurrent import triton

if triton is not None:
    import triton.language as tl

    from metrale.kernels.pdl import pdl_prologue

    @triton.jit
    def _conv_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        pool_ptr,
        read_ptr,
        final_ptr,
        rows_ptr,
        lens_ptr,
        T,
        D,
        stride_xb,
        stride_xt,
        BD: tl.constexpr,
        WRITE_FINAL: tl.constexpr,
        WRITE_ROWS: tl.constexpr,
        STORE_OUT: tl.constexpr,
        LENS_FROM_STARTS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        b = tl.program_id(0).to(tl.int64)  # row offsets of big batches pass 2**31
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        ok = d < D
        entry = tl.load(read_ptr + b).to(tl.int64)
        win = pool_ptr + entry * D * 3 + d * 3  # [D, 3] per entry, oldest first
        x0 = tl.load(win, mask=ok, other=0.0).to(tl.float32)
        x1 = tl.load(win + 1, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(win + 2, mask=ok, other=0.0).to(tl.float32)
        if STORE_OUT:
            w0 = tl.load(w_ptr + d * 4, mask=ok, other=0.0).to(tl.float32)
            w1 = tl.load(w_ptr + d * 4 + 1, mask=ok, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + d * 4 + 2, mask=ok, other=0.0).to(tl.float32)
            w3 = tl.load(w_ptr + d * 4 + 3, mask=ok, other=0.0).to(tl.float32)
        if LENS_FROM_STARTS:  # lens_ptr: the packed offsets [B+1]; the rows their difference
            n = tl.minimum((tl.load(lens_ptr + b + 1) - tl.load(lens_ptr + b)).to(tl.int32), T)
        else:
            n = tl.minimum(tl.load(lens_ptr + b).to(tl.int32), T)
        for t in range(n):
            x3 = tl.load(x_ptr + b * stride_xb + t * stride_xt + d, mask=ok, other=0.0)
            x3 = x3.to(tl.float32)
            if STORE_OUT:
                y = w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3
                y = y * tl.sigmoid(y)
                tl.store(out_ptr + (b * T + t) * D + d, y.to(out_ptr.dtype.element_ty), mask=ok)
            x0, x1, x2 = x1, x2, x3
            if WRITE_ROWS:
                dst = pool_ptr + tl.load(rows_ptr + b * T + t).to(tl.int64) * D * 3 + d * 3
                tl.store(dst, x0.to(pool_ptr.dtype.element_ty), mask=ok)
                tl.store(dst + 1, x1.to(pool_ptr.dtype.element_ty), mask=ok)
                tl.store(dst + 2, x2.to(pool_ptr.dtype.element_ty), mask=ok)
        if STORE_OUT:
            zero = tl.zeros([BD], tl.float32).to(out_ptr.dtype.element_ty)
            for t in range(n, T):  # padding rows
                tl.store(out_ptr + (b * T + t) * D + d, zero, mask=ok)
        if WRITE_FINAL:
            dst = pool_ptr + tl.load(final_ptr + b).to(tl.int64) * D * 3 + d * 3
            tl.store(dst, x0.to(pool_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + 1, x1.to(pool_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + 2, x2.to(pool_ptr.dtype.element_ty), mask=ok)


def conv_in_pool(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    pool: torch.Tensor,
    read: torch.Tensor,
    lengths: torch.Tensor | None,
    *,
    final: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """x [B, T, D] (padded rows; any row strides, unit channel stride); weight [D, 4] (None: only
    advance the windows, no output); pool [S, D, 3]. Sequence b's window comes from entry
    read[b] and its first lengths[b] rows shift in; with lengths None, starts [B+1] (the packed
    offsets, `query_start_loc`) give them as starts[b+1] - starts[b], read in the kernel (no
    launch to make lengths). Returns SiLU(conv) [B, T, D] in x's dtype (into `out` if given, a
    contiguous tensor of that shape), or None without a weight."""
    if (lengths is None) == (starts is None):
        raise ValueError("conv_in_pool takes lengths or starts, one of them")
    bsz, seq, dim = x.shape
    if pool.shape[1:] != (dim, 3) or not pool.is_contiguous():
        raise ValueError(f"conv pool of shape {tuple(pool.shape)}: want contiguous [S, {dim}, 3]")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight is None:
        out = None
    elif out is None:
        out = torch.empty(bsz, seq, dim, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(dim), 256)
    _conv_kernel[(bsz, triton.cdiv(dim, block))](
        x,
        pool if weight is None else weight.contiguous(),
        pool if out is None else out,
        pool,
        read,
        pool if final is None else final,
        pool if rows is None else rows.contiguous(),
        starts if lengths is None else lengths,
        seq,
        dim,
        x.stride(0),
        x.stride(1),
        BD=block,
        WRITE_FINAL=final is not None,
        WRITE_ROWS=rows is not None,
        STORE_OUT=weight is not None,
        LENS_FROM_STARTS=lengths is None,
        num_warps=4,
        **pdl.launch(x),
    )
    return out
