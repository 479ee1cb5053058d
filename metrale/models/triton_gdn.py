"""The gated delta rule, recurrent form, as one Triton kernel: decode and verify rows of a hybrid
(Qwen3-Next) target without a torch op per row.

One program per (sequence, value head, block of BV value columns) keeps its [dk, BV] slice of the
float32 state in registers across the sequence's rows (the columns of the state evolve
independently), and per row: decays it, writes the delta-rule correction, reads the output, and
optionally stores the state after that row (verify keeps every row's state for write-on-accept).
Same arguments and results as `gdn.recurrent_gated_delta_rule`, its reference and test oracle.

Off unless `METRALE_GDN_TRITON=1`: it runs under the Triton interpreter in the CPU tests, and is
switched on once the H200 run confirms it.
"""

from __future__ import annotations

import torch

from metrale.knobs import knobs

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

L2NORM_EPS = 1e-6  # as gdn.L2NORM_EPS (HF's l2norm)


def triton_gdn_enabled(x: torch.Tensor) -> bool:
    """Run the recurrent form as this kernel: CUDA, Triton, and `METRALE_GDN_TRITON=1`."""
    return triton is not None and x.is_cuda and knobs().gdn_triton


if triton is not None:

    @triton.jit
    def _recurrent_delta_rule_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        beta_ptr,
        state_ptr,
        out_ptr,
        final_ptr,
        states_ptr,
        T,
        scale,
        eps,
        HK: tl.constexpr,
        HV: tl.constexpr,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        L2NORM: tl.constexpr,
        HAS_STATE: tl.constexpr,
        ALL_STATES: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        hk = h // (HV // HK)  # value head h reads key head h // (HV / HK)
        kk = tl.arange(0, BK)
        vv = tl.program_id(2) * BV + tl.arange(0, BV)
        k_ok, v_ok = kk < DK, vv < DV
        tile = kk[:, None] * DV + vv[None, :]
        tile_ok = k_ok[:, None] & v_ok[None, :]
        s = tl.zeros([BK, BV], tl.float32)
        if HAS_STATE:
            s = tl.load(state_ptr + (b * HV + h) * DK * DV + tile, mask=tile_ok, other=0.0)
        for t in range(T):
            qk_row = (b * T + t) * HK + hk
            q = tl.load(q_ptr + qk_row * DK + kk, mask=k_ok, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + qk_row * DK + kk, mask=k_ok, other=0.0).to(tl.float32)
            if L2NORM:
                q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps)
                k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
            q = q * scale
            row = (b * T + t) * HV + h
            v = tl.load(v_ptr + row * DV + vv, mask=v_ok, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + row).to(tl.float32)
            beta = tl.load(beta_ptr + row).to(tl.float32)
            s = s * tl.exp(g)
            u = (v - tl.sum(k[:, None] * s, axis=0)) * beta  # the correction, [BV]
            s = s + k[:, None] * u[None, :]
            o = tl.sum(q[:, None] * s, axis=0)
            tl.store(out_ptr + row * DV + vv, o.to(out_ptr.dtype.element_ty), mask=v_ok)
            if ALL_STATES:
                tl.store(states_ptr + row * DK * DV + tile, s, mask=tile_ok)
        tl.store(final_ptr + (b * HV + h) * DK * DV + tile, s, mask=tile_ok)


def recurrent_gated_delta_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    l2norm_qk: bool = True,
    output_all_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g, beta [B, T, Hv]; state [B, Hv, dk, dv] or None
    -> (out [B, T, Hv, dv] in v's dtype, final state [B, Hv, dk, dv] float32, per-row states
    [B, T, Hv, dk, dv] float32 or None)."""
    bsz, seq, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if hv % hk:
        raise ValueError(f"{hv} value heads are not a multiple of {hk} key heads")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    out = torch.empty_like(v)
    final = torch.empty(bsz, hv, dk, dv, dtype=torch.float32, device=v.device)
    states = (
        torch.empty(bsz, seq, hv, dk, dv, dtype=torch.float32, device=v.device)
        if output_all_states
        else final
    )
    init = state.float().contiguous() if state is not None else final
    block_v = min(triton.next_power_of_2(dv), 32)
    _recurrent_delta_rule_kernel[(bsz, hv, triton.cdiv(dv, block_v))](
        q,
        k,
        v,
        g,
        beta,
        init,
        out,
        final,
        states,
        seq,
        dk**-0.5 if scale is None else scale,
        L2NORM_EPS,
        HK=hk,
        HV=hv,
        DK=dk,
        DV=dv,
        BK=triton.next_power_of_2(dk),
        BV=block_v,
        L2NORM=l2norm_qk,
        HAS_STATE=state is not None,
        ALL_STATES=output_all_states,
    )
    return out, final, states if output_all_states else None
