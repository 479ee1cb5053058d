"""The glue of Qwen3-Next's gated attention as two Triton launches: `qk_norm_rope` (the (1 + w)
RMSNorm of every q and k head, then rotary on the heads' leading dims, read straight from the
fused qkv projection where q and the output gate interleave per head) before the attention, and
`output_gate` (attention output * sigmoid(gate)) after it. The torch path
(`qwen3_next.Qwen3NextAttention`, the reference) spends about twenty launches per layer here: two
norms with their copies, the rotary's products, differences and concatenations, the gate's copy
and sigmoid.

Rounding follows the torch path: the norm in float32 rounded once (`ZeroCentredRMSNorm`), cos and
sin rounded to the activation dtype, each rotary product and the sum or difference rounded
(`layers._rotate`), the sigmoid rounded and the gated product. One program per (row, head):
batch invariant.
"""

from __future__ import annotations

import torch

from metrale.kernels import pdl
from metrale.kernels.fused import kv_cache_halves, triton

if triton is not None:
    import triton.language as tl

    from metrale.kernels.pdl import pdl_prologue

    @triton.jit
    def _r(x, DT: tl.constexpr):
        return x.to(DT).to(tl.float32)

    # One binary for both uses (with and without the KV write): the flag is a runtime argument
    # and the cache pointers are not specialised on alignment, so q and k come out of the same
    # machine code either way (on the H200 the two constexpr variants differed by one bf16 ulp).
    # Nor the positions (a view into the step's packed metadata, aligned or not): a new
    # alignment would compile the kernel again inside a running step.
    @triton.jit(do_not_specialize=["pos_ptr", "kc_ptr", "vc_ptr", "slots_ptr", "write_kv"])
    def _qk_norm_rope_kernel(
        qkv_ptr,
        stride_row,
        qw_ptr,
        kw_ptr,
        cos_ptr,
        sin_ptr,
        stride_cos,
        pos_ptr,
        q_ptr,
        k_ptr,
        kc_ptr,
        vc_ptr,
        slots_ptr,
        write_kv,
        eps,
        NUM_Q: tl.constexpr,
        NUM_KV: tl.constexpr,
        D: tl.constexpr,
        ROT: tl.constexpr,
        BD: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)  # q heads first, then k heads
        d = tl.arange(0, BD)
        ok = d < D
        half = ROT // 2
        # the partner of a rotated dim: d + half in the first half, d - half in the second
        partner = tl.where(d < half, d + half, tl.where(d < ROT, d - half, d))
        dt = q_ptr.dtype.element_ty
        if head < NUM_Q:  # q_proj gives [q (D), gate (D)] per head
            src = qkv_ptr + row * stride_row + head * 2 * D
            w_ptr = qw_ptr
        else:
            src = qkv_ptr + row * stride_row + NUM_Q * 2 * D + (head - NUM_Q) * D
            w_ptr = kw_ptr
        x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
        xp = tl.load(src + partner, mask=ok, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        y = _r(x * inv * (1.0 + tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)), dt)
        yp = _r(xp * inv * (1.0 + tl.load(w_ptr + partner, mask=ok, other=0.0).to(tl.float32)), dt)
        pos = tl.load(pos_ptr + row).to(tl.int64)
        rot = d < ROT
        c = _r(tl.load(cos_ptr + pos * stride_cos + d % half, mask=rot, other=0.0), dt)
        s = _r(tl.load(sin_ptr + pos * stride_cos + d % half, mask=rot, other=0.0), dt)
        first = _r(_r(y * c, dt) - _r(yp * s, dt), dt)  # x1 cos - x2 sin
        second = _r(_r(y * c, dt) + _r(yp * s, dt), dt)  # x2 cos + x1 sin
        out = tl.where(d < half, first, tl.where(rot, second, y))
        if head < NUM_Q:
            dst = q_ptr + (row * NUM_Q + head) * D
        else:
            dst = k_ptr + (row * NUM_KV + head - NUM_Q) * D
        tl.store(dst + d, out.to(dt), mask=ok)
        if (write_kv != 0) & (head >= NUM_Q):  # this row's k and v head into its cache slot
            kv_head = head - NUM_Q
            at = tl.load(slots_ptr + row).to(tl.int64) * (NUM_KV * D) + kv_head * D
            cdt = kc_ptr.dtype.element_ty
            tl.store(kc_ptr + at + d, out.to(dt).to(cdt), mask=ok)
            v_src = qkv_ptr + row * stride_row + NUM_Q * 2 * D + (NUM_KV + kv_head) * D
            tl.store(vc_ptr + at + d, tl.load(v_src + d, mask=ok, other=0.0).to(cdt), mask=ok)

    @triton.jit
    def _output_gate_kernel(
        attn_ptr,
        qkv_ptr,
        stride_row,
        out_ptr,
        NUM_Q: tl.constexpr,
        D: tl.constexpr,
        BD: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        d = tl.arange(0, BD)
        ok = d < D
        dt = out_ptr.dtype.element_ty
        a = tl.load(attn_ptr + (row * NUM_Q + head) * D + d, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(qkv_ptr + row * stride_row + head * 2 * D + D + d, mask=ok, other=0.0)
        gate = _r(tl.sigmoid(g.to(tl.float32)), dt)
        tl.store(out_ptr + (row * NUM_Q + head) * D + d, (a * gate).to(dt), mask=ok)


def qk_norm_rope(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    num_q: int,
    num_kv: int,
    eps: float,
    kv_cache: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, num_q * 2D + 2 num_kv D] (per q head its query then its gate; then k, then v) ->
    (q [T, num_q, D], k [T, num_kv, D]) normalised with (1 + w) and rotated on the leading
    2 cos.shape[-1] dims of each head at each row's position. With `kv_cache` and `slots`, each
    row's k and v also go to its slot (as `fused.qk_norm_rope`: two launches fewer a layer)."""
    rows, dim = qkv.shape[0], q_weight.shape[0]
    q = torch.empty(rows, num_q, dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(rows, num_kv, dim, dtype=qkv.dtype, device=qkv.device)
    kc, vc, slots = kv_cache_halves(kv_cache, slots, q, positions)
    if rows:
        _qk_norm_rope_kernel[(rows, num_q + num_kv)](
            qkv, qkv.stride(0), q_weight, k_weight, cos, sin, cos.stride(0), positions, q, k,
            kc, vc, slots, int(kv_cache is not None), eps, NUM_Q=num_q, NUM_KV=num_kv, D=dim,
            ROT=2 * cos.shape[-1], BD=triton.next_power_of_2(dim), num_warps=1,
            **pdl.launch(qkv),
        )  # fmt: skip
    return q, k


def output_gate(attn: torch.Tensor, qkv: torch.Tensor, num_q: int) -> torch.Tensor:
    """attn [T, num_q, D] (contiguous) * sigmoid(the gates in qkv) -> [T, num_q * D]."""
    rows, _, dim = attn.shape
    out = torch.empty(rows, num_q * dim, dtype=attn.dtype, device=attn.device)
    if rows:
        _output_gate_kernel[(rows, num_q)](
            attn.contiguous(), qkv, qkv.stride(0), out, NUM_Q=num_q, D=dim,
            BD=triton.next_power_of_2(dim), num_warps=1, **pdl.launch(qkv),
        )  # fmt: skip
    return out
