"""The gated delta rule, chunked (WY) form, as one Triton kernel: a hybrid target's prefill chunks
with matmuls instead of one dependent step per row.

One program per (sequence, value head, block of BV value columns) keeps its [dk, BV] slice of the
float32 state in registers and walks the sequence BT = 16 rows at a time. Per chunk, with G the
cumulative log-decay, Gamma_ij = exp(G_i - G_j) (i >= j) and L = strict_lower(diag(beta) K K^T o
Gamma) (the derivation is in `gdn.chunk_gated_delta_rule`, the torch reference):

    T     = (I + L)^-1                    forward substitution, 16 rows
    U_all = T diag(beta) V - T diag(beta exp(G)) K S
    O     = diag(exp(G)) Q S + ((Q K^T) o Gamma o causal) U_all
    S    <- exp(G_last) S + (diag(exp(G_last - G)) K)^T U_all

The inverse is built row by row, not by repeated squaring: with correlated keys the Neumann
product (I - L)(I + L^2)(I + L^4)... loses everything to cancellation from 32 rows on (measured
against a float64 solve: errors of 4 at 32 rows, 1e9 at 64, for an inverse of norm 1), and 16
exact rows keep every product on the tensor cores. Sixteen is also `tl.dot`'s smallest size.

Reads each sequence's state from pool entry read[b] and writes the state after its last row to
entry final[b], like `gdn_recurrent.delta_rule_in_pool`.
"""

from __future__ import annotations

import torch

from metrale.kernels.gdn_recurrent import L2NORM_EPS, GateInputs, check_pool_shapes, triton

if triton is not None:
    import triton.language as tl

    from metrale.kernels.gdn_fused import _softplus

    @triton.jit
    def _chunk_delta_rule_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        beta_ptr,
        out_ptr,
        pool_ptr,
        read_ptr,
        final_ptr,
        T,
        stride_gb,
        stride_gt,
        stride_betab,
        stride_betat,
        a_log_ptr,
        dt_bias_ptr,
        scale,
        eps,
        HK: tl.constexpr,
        HV: tl.constexpr,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        BT: tl.constexpr,
        HAS_STATE: tl.constexpr,
        PRECISION: tl.constexpr,
        RAW_GATES: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)  # row offsets of big batches pass 2**31
        h = tl.program_id(1)
        hk = h // (HV // HK)
        kk = tl.arange(0, BK)
        vv = tl.program_id(2) * BV + tl.arange(0, BV)
        tt = tl.arange(0, BT)
        k_ok, v_ok = kk < DK, vv < DV
        tile = h * DK * DV + kk[:, None] * DV + vv[None, :]
        tile_ok = k_ok[:, None] & v_ok[None, :]
        entry_size = HV * DK * DV
        s = tl.zeros([BK, BV], tl.float32)
        if HAS_STATE:
            entry = tl.load(read_ptr + b).to(tl.int64)
            s = tl.load(pool_ptr + entry * entry_size + tile, mask=tile_ok, other=0.0)
            s = s.to(tl.float32)
        causal = tt[:, None] >= tt[None, :]
        strict = tt[:, None] > tt[None, :]
        eye = tl.where(tt[:, None] == tt[None, :], 1.0, 0.0)
        for c in range(tl.cdiv(T, BT)):
            rows = c * BT + tt
            r_ok = rows < T
            qk_rows = (b * T + rows) * HK + hk
            qk_off = qk_rows[:, None] * DK + kk[None, :]
            qk_ok = r_ok[:, None] & k_ok[None, :]
            q = tl.load(q_ptr + qk_off, mask=qk_ok, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + qk_off, mask=qk_ok, other=0.0).to(tl.float32)
            q = q * tl.rsqrt(tl.sum(q * q, axis=1) + eps)[:, None] * scale
            k = k * tl.rsqrt(tl.sum(k * k, axis=1) + eps)[:, None]
            v_rows = (b * T + rows) * HV + h
            v = tl.load(
                v_ptr + v_rows[:, None] * DV + vv[None, :],
                mask=r_ok[:, None] & v_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            g_at = g_ptr + b * stride_gb + rows * stride_gt + h
            beta_at = beta_ptr + b * stride_betab + rows * stride_betat + h
            if RAW_GATES:  # a and b (`GateInputs`); -inf past the end gives g = beta = 0
                a = tl.load(g_at, mask=r_ok, other=float("-inf")).to(tl.float32)
                neg_a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
                g = neg_a * _softplus(a + tl.load(dt_bias_ptr + h).to(tl.float32))
                beta = tl.load(beta_at, mask=r_ok, other=float("-inf")).to(tl.float32)
                beta = tl.sigmoid(beta).to(beta_ptr.dtype.element_ty).to(tl.float32)
            else:
                g = tl.load(g_at, mask=r_ok, other=0.0).to(tl.float32)
                beta = tl.load(beta_at, mask=r_ok, other=0.0).to(tl.float32)
            cum = tl.cumsum(g, axis=0)  # G
            # masked before exp: above the diagonal G_i - G_j > 0 and may overflow
            diff = tl.where(causal, cum[:, None] - cum[None, :], 0.0)
            gamma = tl.where(causal, tl.exp(diff), 0.0)
            kk_t = tl.dot(k, tl.trans(k), input_precision=PRECISION)  # [BT, BT]
            lower = tl.where(strict, beta[:, None] * kk_t * gamma, 0.0)
            inv = eye
            for i in tl.static_range(1, BT):
                # row i of (I + L)^-1 = e_i - sum_j L_ij (row j), rows j < i final already
                l_i = tl.sum(tl.where(tt[:, None] == i, lower, 0.0), axis=0)  # L[i, :]
                row = tl.sum(l_i[:, None] * inv, axis=0)
                inv = tl.where(tt[:, None] == i, inv - row[None, :], inv)
            decay = tl.exp(cum)
            w = tl.dot(inv, k * (beta * decay)[:, None], input_precision=PRECISION)  # [BT, BK]
            u = tl.dot(inv, v * beta[:, None], input_precision=PRECISION)  # [BT, BV]
            u = u - tl.dot(w, s, input_precision=PRECISION)  # U_all
            attn = tl.dot(q, tl.trans(k), input_precision=PRECISION) * gamma
            o = tl.dot(q * decay[:, None], s, input_precision=PRECISION)
            o += tl.dot(attn, u, input_precision=PRECISION)
            tl.store(
                out_ptr + v_rows[:, None] * DV + vv[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=r_ok[:, None] & v_ok[None, :],
            )
            last = tl.sum(tl.where(tt == BT - 1, cum, 0.0), axis=0)  # padded rows add g = 0
            k_end = k * tl.exp(last - cum)[:, None]
            s = s * tl.exp(last) + tl.dot(tl.trans(k_end), u, input_precision=PRECISION)
        entry = tl.load(final_ptr + b).to(tl.int64)
        s = s.to(pool_ptr.dtype.element_ty)
        tl.store(pool_ptr + entry * entry_size + tile, s, mask=tile_ok)


def chunk_delta_rule_in_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    read: torch.Tensor | None,
    final: torch.Tensor,
    *,
    scale: float | None = None,
    gates: GateInputs | None = None,
) -> torch.Tensor:
    """q, k [B, T, Hk, dk] (l2-normalised here); v [B, T, Hv, dv]; g, beta [B, T, Hv]; pool
    [S, Hv, dk, dv] (`gdn_recurrent.STATE_DTYPES`: the chunk runs in float32 and the state is
    rounded to the pool's type once, at the end). Sequence b starts from entry read[b] (None:
    zeros) and ends in entry final[b]. Returns out [B, T, Hv, dv] in v's dtype. With `gates`, g
    and beta are computed in the kernel from the layer's gate inputs (g and beta are ignored)."""
    bsz, seq, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    check_pool_shapes(q, v, pool)
    if gates is not None:
        g, beta = gates.a, gates.b
    q, k, v = (x.contiguous() for x in (q, k, v))
    g, beta = (x if x.stride(2) == 1 else x.contiguous() for x in (g, beta))
    out = torch.empty_like(v)
    # tl.dot needs every dimension >= 16 on the GPU: small heads are padded (masked)
    block_v = max(min(triton.next_power_of_2(dv), 32), 16)
    # the interpreter's float32 dot is exact already; on the GPU tf32x3 keeps float32 accuracy
    # on the tensor cores
    precision = "ieee" if not v.is_cuda else "tf32x3"
    _chunk_delta_rule_kernel[(bsz, hv, triton.cdiv(dv, block_v))](
        q,
        k,
        v,
        g,
        beta,
        out,
        pool,
        pool if read is None else read.contiguous(),
        final.contiguous(),
        seq,
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        pool if gates is None else gates.a_log,
        pool if gates is None else gates.dt_bias,
        dk**-0.5 if scale is None else scale,
        L2NORM_EPS,
        HK=hk,
        HV=hv,
        DK=dk,
        DV=dv,
        BK=max(triton.next_power_of_2(dk), 16),
        BV=block_v,
        BT=16,
        HAS_STATE=read is not None,
        PRECISION=precision,
        RAW_GATES=gates is not None,
        num_warps=4,
    )
    return out
