"""The glue of a Gated DeltaNet layer around its conv and delta-rule kernels, as two Triton
launches: `prepare` (the gates g and beta, and the conv input padded to [B, T, C]) before them,
`gated_norm` (the gated RMSNorm, reading the delta rule's padded output and the gate z straight
from the in-projection's output) after them. The torch path spends about a dozen launches here
(the gate's exp, softplus and products, the sigmoid, the padding gathers, the unpad, the copies
of z).

`prepare`, per padded position (b, t) of a layout with `index` [B, T] (the packed row of each
position) and `lengths` [B]: g = -exp(A_log) * softplus(a + dt_bias) in float32 and beta =
sigmoid(b) rounded to the activation dtype (as `Qwen3NextGatedDeltaNet` computes them), both 0 on
padding positions (a row with g = beta = 0 leaves the state alone); and, when T > 1, the conv
input row (zeros on padding). `gated_norm` computes `gdn.gated_rms_norm` (the reference) for the
packed rows, finding each one's padded position from the layout.

Each program computes one position's or one row's values from that row alone: batch invariant.
"""

from __future__ import annotations

import torch

from metrale.kernels import pdl
from metrale.kernels.fused import triton

if triton is not None:
    import triton.language as tl

    from metrale.kernels.pdl import pdl_prologue

    @triton.jit
    def _softplus(x):
        """torch's softplus (beta 1, threshold 20), log1p done accurately (Goldberg's trick)."""
        u = 1.0 + tl.exp(x)
        log1p = tl.where(u == 1.0, tl.exp(x), tl.log(u) * (tl.exp(x) / (u - 1.0)))
        return tl.where(x > 20.0, x, log1p)

    @triton.jit
    def _prepare_kernel(
        mixed_ptr,
        stride_m,
        ba_ptr,
        stride_ba,
        a_log_ptr,
        dt_bias_ptr,
        index_ptr,
        lens_ptr,
        conv_ptr,
        g_ptr,
        beta_ptr,
        T,
        C,
        HV: tl.constexpr,
        BH: tl.constexpr,
        BC: tl.constexpr,
        PAD_CONV: tl.constexpr,
        RAW: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        p = tl.program_id(0).to(tl.int64)  # padded position b * T + t
        b = p // T
        valid = (p % T) < tl.load(lens_ptr + b)
        src = tl.load(index_ptr + p).to(tl.int64)
        if tl.program_id(1) == 0:
            h = tl.arange(0, BH)
            h_ok = tl.where(valid, h < HV, False)  # (`&` with a scalar: the interpreter balks)
            bb = tl.load(ba_ptr + src * stride_ba + h, mask=h_ok, other=0.0)
            a = tl.load(ba_ptr + src * stride_ba + HV + h, mask=h_ok, other=0.0).to(tl.float32)
            a_log = tl.load(a_log_ptr + h, mask=h < HV, other=0.0).to(tl.float32)
            dt_bias = tl.load(dt_bias_ptr + h, mask=h < HV, other=0.0).to(tl.float32)
            if RAW:  # the gate inputs, for the delta-rule kernel (-inf: a padding row)
                tl.store(g_ptr + p * HV + h, tl.where(h_ok, a, float("-inf")), mask=h < HV)
                tl.store(beta_ptr + p * HV + h, tl.where(h_ok, bb, float("-inf")), mask=h < HV)
            else:
                g = -tl.exp(a_log) * _softplus(a + dt_bias)
                beta = tl.sigmoid(bb.to(tl.float32)).to(beta_ptr.dtype.element_ty)
                tl.store(g_ptr + p * HV + h, tl.where(h_ok, g, 0.0), mask=h < HV)
                tl.store(beta_ptr + p * HV + h, tl.where(h_ok, beta, 0.0), mask=h < HV)
        if PAD_CONV:
            c = tl.program_id(1) * BC + tl.arange(0, BC)
            x = tl.load(
                mixed_ptr + src * stride_m + c, mask=tl.where(valid, c < C, False), other=0.0
            )
            tl.store(conv_ptr + p * C + c, x, mask=c < C)

    @triton.jit
    def _gated_norm_kernel(
        o_ptr,
        z_ptr,
        stride_z,
        w_ptr,
        seq_ptr,
        offset_ptr,
        out_ptr,
        T,
        eps,
        HV: tl.constexpr,
        DV: tl.constexpr,
        BD: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        r = tl.program_id(0).to(tl.int64)  # packed row
        h = tl.program_id(1)
        src = r
        if T > 1:  # the row's padded position
            src = tl.load(seq_ptr + r).to(tl.int64) * T + tl.load(offset_ptr + r)
        d = tl.arange(0, BD)
        ok = d < DV
        dt = out_ptr.dtype.element_ty
        x = tl.load(o_ptr + (src * HV + h) * DV + d, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + r * stride_z + h * DV + d, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / DV + eps)
        normed = (w * (x * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(out_ptr + (r * HV + h) * DV + d, (normed * (z * tl.sigmoid(z))).to(dt), mask=ok)


def prepare(
    mixed: torch.Tensor,
    ba: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    index: torch.Tensor | None,
    lengths: torch.Tensor | None,
    *,
    raw: bool = False,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixed [N, C] (the conv input, unit column stride), ba [N, 2 Hv] (b then a, unit column
    stride), the layout's index [B, T] and lengths [B] -> (conv input [B, T, C]: a view of mixed
    when T == 1, g [B, T, Hv] float32, beta [B, T, Hv] in ba's dtype). `raw`: (conv input, a, b)
    instead, the gate inputs padded with -inf for the delta-rule kernel to turn into g and beta
    (`gdn_recurrent.GateInputs`); when T == 1 all three are views and nothing runs, and index
    and lengths may be None (one row per sequence: a decode step's layout need not make them).
    `out`: contiguous tensors of those shapes and dtypes to write the three into (T > 1)."""
    hv = a_log.shape[0]
    if index is None or lengths is None:
        if not raw:
            raise ValueError("prepare without index and lengths: only the raw gates at T == 1")
        bsz, t = mixed.shape[0], 1
    else:
        bsz, t = index.shape
    channels = mixed.shape[1]
    pad = t > 1
    if raw and not pad:  # decode: one row per sequence, nothing to pad
        return mixed.unsqueeze(1), ba[:, hv:].unsqueeze(1), ba[:, :hv].unsqueeze(1)
    assert index is not None and lengths is not None
    if out is not None and pad:
        conv, g, beta = out
    else:
        g = torch.empty(bsz, t, hv, dtype=ba.dtype if raw else torch.float32, device=ba.device)
        beta = torch.empty(bsz, t, hv, dtype=ba.dtype, device=ba.device)
        conv = (
            torch.empty(bsz, t, channels, dtype=mixed.dtype, device=mixed.device) if pad else None
        )
    block_c = min(triton.next_power_of_2(channels), 1024)
    if bsz:
        _prepare_kernel[(bsz * t, triton.cdiv(channels, block_c) if pad else 1)](
            mixed, mixed.stride(0), ba, ba.stride(0), a_log, dt_bias, index.contiguous(), lengths,
            conv if pad else g, g, beta, t, channels,
            HV=hv, BH=triton.next_power_of_2(hv), BC=block_c, PAD_CONV=pad, RAW=raw, num_warps=4,
            **pdl.launch(mixed),
        )  # fmt: skip
    return (conv if pad else mixed.unsqueeze(1)), g, beta


def gated_norm(
    out: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    row_seq: torch.Tensor | None,
    row_offset: torch.Tensor | None,
) -> torch.Tensor:
    """out [B, T, Hv, dv] (the delta rule's padded output, contiguous), z [N, Hv * dv] (unit
    column stride), the layout's row_seq and row_offset [N] -> weight * norm(out) * silu(z) of the
    N packed rows, [N, Hv * dv]. When T == 1 (row r is sequence r's) the kernel reads neither:
    they may be None."""
    bsz, t, hv, dv = out.shape
    rows = z.shape[0]
    res = torch.empty(rows, hv * dv, dtype=out.dtype, device=out.device)
    if t > 1 and (row_seq is None or row_offset is None):
        raise ValueError("gated_norm over more than one row per sequence needs row_seq, row_offset")
    if rows:
        if row_seq is None or row_offset is None:  # unread (T == 1): any pointer
            row_seq = row_offset = res
        _gated_norm_kernel[(rows, hv)](
            out.contiguous(), z, z.stride(0), weight, row_seq, row_offset, res, t, eps,
            HV=hv, DV=dv, BD=triton.next_power_of_2(dv), num_warps=1, **pdl.launch(z),
        )  # fmt: skip
    return res
