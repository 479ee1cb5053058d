"""Fused Triton kernels for the per-layer glue of a decode/verify step: residual add + RMSNorm
(plain, or zero-centred as Qwen3-Next's), QK-norm + rotary, SiLU(gate) * up, and the gated
RMSNorm of a Gated DeltaNet layer.

Why: at small batch a step is a chain of small kernels; the unfused torch ops cost ~60 launches
per layer (an RMSNorm alone is seven), each a few microseconds of fixed latency that CUDA graphs
do not remove. These kernels do each piece in one launch.

Rounding: each kernel rounds to the activation dtype where the torch reference does (after the
residual add, after normalising, after the weight, after each rotary product), so the fused and
reference paths agree to within reduction-order rounding. The torch references (`RMSNorm._reference`
and `MLP` in `models/layers.py`, the attention's QK-norm and rotary in `models/qwen3.py`,
`models/gdn.gated_rms_norm`) stay the CPU path and the oracle of the tests. Kernels also run
under `TRITON_INTERPRET=1` on CPU tensors, which is how CI tests them.
"""

from __future__ import annotations

import torch

from metrale.kernels import pdl
from metrale.knobs import knobs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines without Triton: the torch reference serves
    triton = None


def fused_enabled(x: torch.Tensor) -> bool:
    """Use the fused kernels for this activation: on CUDA with Triton, unless switched off."""
    return triton is not None and x.is_cuda and not knobs().no_fused_kernels


if triton is not None:
    from metrale.kernels.pdl import pdl_prologue

    @triton.jit
    def _round(x, DT: tl.constexpr):
        """x rounded to the activation dtype and back to float32 (what a torch op on DT does)."""
        return x.to(DT).to(tl.float32)

    @triton.jit
    def _add_rmsnorm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        res_out_ptr,
        stride_x,
        stride_r,
        n,
        eps,
        HAS_RES: tl.constexpr,
        ZERO_CENTRED: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        dt = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            x = _round(x + r, dt)
            tl.store(res_out_ptr + row * n + cols, x.to(dt), mask=mask)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if ZERO_CENTRED:  # (1 + w) * norm(x), all in float32 (Qwen3-Next)
            tl.store(out_ptr + row * n + cols, ((1.0 + w) * x * inv).to(dt), mask=mask)
        else:
            tl.store(out_ptr + row * n + cols, (w * _round(x * inv, dt)).to(dt), mask=mask)

    # One binary for both uses (with and without the KV write): the flag is a runtime argument
    # and the cache pointers are not specialised on alignment, so q and k come out of the same
    # machine code either way (on the H200 the two constexpr variants differed by one bf16 ulp).
    # Nor the positions (a view into the step's packed metadata, aligned or not): a new
    # alignment would compile the kernel again inside a running step.
    @triton.jit(do_not_specialize=["pos_ptr", "kc_ptr", "vc_ptr", "slots_ptr", "write_kv"])
    def _qk_norm_rope_kernel(
        qkv_ptr,
        qw_ptr,
        kw_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        q_ptr,
        k_ptr,
        kc_ptr,
        vc_ptr,
        slots_ptr,
        write_kv,
        stride_row,
        stride_cos,
        eps,
        NUM_Q: tl.constexpr,
        NUM_KV: tl.constexpr,
        D: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        row = tl.program_id(0)
        head = tl.program_id(1)  # q heads first, then k heads
        half = tl.arange(0, D // 2)
        dt = q_ptr.dtype.element_ty
        src = qkv_ptr + row * stride_row + head * D
        x1 = tl.load(src + half).to(tl.float32)
        x2 = tl.load(src + D // 2 + half).to(tl.float32)
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        if head < NUM_Q:
            w1 = tl.load(qw_ptr + half).to(tl.float32)
            w2 = tl.load(qw_ptr + D // 2 + half).to(tl.float32)
        else:
            w1 = tl.load(kw_ptr + half).to(tl.float32)
            w2 = tl.load(kw_ptr + D // 2 + half).to(tl.float32)
        y1 = _round(w1 * _round(x1 * inv, dt), dt)
        y2 = _round(w2 * _round(x2 * inv, dt), dt)
        pos = tl.load(pos_ptr + row)
        cos = _round(tl.load(cos_ptr + pos * stride_cos + half), dt)
        sin = _round(tl.load(sin_ptr + pos * stride_cos + half), dt)
        o1 = _round(_round(y1 * cos, dt) - _round(y2 * sin, dt), dt)
        o2 = _round(_round(y2 * cos, dt) + _round(y1 * sin, dt), dt)
        if head < NUM_Q:
            dst = q_ptr + (row * NUM_Q + head) * D
        else:
            dst = k_ptr + (row * NUM_KV + head - NUM_Q) * D
        tl.store(dst + half, o1.to(dt))
        tl.store(dst + D // 2 + half, o2.to(dt))
        if (write_kv != 0) & (head >= NUM_Q):  # this row's k and v head into its cache slot
            kv_head = head - NUM_Q
            at = tl.load(slots_ptr + row).to(tl.int64) * (NUM_KV * D) + kv_head * D
            cdt = kc_ptr.dtype.element_ty
            tl.store(kc_ptr + at + half, o1.to(dt).to(cdt))
            tl.store(kc_ptr + at + D // 2 + half, o2.to(dt).to(cdt))
            v_src = qkv_ptr + row * stride_row + (NUM_Q + NUM_KV + kv_head) * D
            tl.store(vc_ptr + at + half, tl.load(v_src + half).to(cdt))
            tl.store(vc_ptr + at + D // 2 + half, tl.load(v_src + D // 2 + half).to(cdt))

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_prologue(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        dt = out_ptr.dtype.element_ty
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
        act = _round(gate * tl.sigmoid(gate), dt)
        tl.store(out_ptr + row * n + cols, (act * up).to(dt), mask=mask)

    @triton.jit
    def _gated_rmsnorm_kernel(
        x_ptr, z_ptr, w_ptr, out_ptr, n, eps, BLOCK: tl.constexpr, PDL: tl.constexpr
    ):
        pdl_prologue(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        dt = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
        normed = _round(w * _round(x * inv, dt), dt)
        tl.store(out_ptr + row * n + cols, (normed * z * tl.sigmoid(z)).to(dt), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, n] with unit stride along n (a view when it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    zero_centred: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * norm(x + residual), x + residual); with residual None, (weight * norm(x), x).
    `zero_centred`: (1 + weight) * norm(.), scaled in float32 (Qwen3-Next's norms)."""
    x2 = _rows(x)
    rows, n = x2.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    res2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty_like(out) if residual is not None else out
    block = triton.next_power_of_2(n)
    _add_rmsnorm_kernel[(rows,)](
        x2,
        res2,
        weight,
        out,
        res_out,
        x2.stride(0),
        res2.stride(0),
        n,
        eps,
        HAS_RES=residual is not None,
        ZERO_CENTRED=zero_centred,
        BLOCK=block,
        num_warps=min(max(block // 512, 1), 16),
        **pdl.launch(x2),
    )
    new_residual = res_out.view(x.shape) if residual is not None else x
    return out.view(x.shape), new_residual


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
    """qkv [T, (num_q + 2 num_kv) D] -> (q [T, num_q, D], k [T, num_kv, D]): per-head RMSNorm
    with the q/k weights, then rotary (rotate-half) at each row's position. v is untouched.
    With `kv_cache` [2, pages, page_size, Hkv, D] and `slots` [T]: each row's k and v also go
    to its slot (`attention.write_kv`'s work, saving its two launches: then pass the backend
    `kv_written=True`)."""
    rows = qkv.shape[0]
    dim = q_weight.shape[0]
    q = torch.empty(rows, num_q, dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(rows, num_kv, dim, dtype=qkv.dtype, device=qkv.device)
    kc, vc, slots = kv_cache_halves(kv_cache, slots, q, positions)
    if rows:
        _qk_norm_rope_kernel[(rows, num_q + num_kv)](
            qkv,
            q_weight,
            k_weight,
            cos,
            sin,
            positions,
            q,
            k,
            kc,
            vc,
            slots,
            int(kv_cache is not None),
            qkv.stride(0),
            cos.stride(0),
            eps,
            NUM_Q=num_q,
            NUM_KV=num_kv,
            D=dim,
            num_warps=1,
            **pdl.launch(qkv),
        )
    return q, k


def kv_cache_halves(
    kv_cache: torch.Tensor | None,
    slots: torch.Tensor | None,
    dummy: torch.Tensor,
    index_dummy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k cache, v cache, slots) for a glue kernel that writes the KV rows itself, or unused
    stand-ins when it does not (`kv_cache` None): `dummy` of the activation dtype for the cache
    halves and `index_dummy` (int64) for the slots, so that both uses pass the same argument
    types and run the same compiled kernel."""
    if kv_cache is None:
        return dummy, dummy, index_dummy
    if slots is None or not kv_cache.is_contiguous():
        raise ValueError("writing KV in the kernel needs slots and a contiguous cache")
    return kv_cache[0], kv_cache[1], slots


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (gate then up) -> silu(gate) * up [..., I]."""
    x2 = _rows(x)
    rows, n = x2.shape[0], x2.shape[1] // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(n), 1024)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](
            x2, out, x2.stride(0), n, BLOCK=block, num_warps=4, **pdl.launch(x2)
        )
    return out.view(*x.shape[:-1], n)


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float):
    """weight * norm(x) * silu(gate) over the last dim (`gdn.gated_rms_norm`'s roundings)."""
    x2, z2 = x.reshape(-1, x.shape[-1]).contiguous(), gate.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(x2)
    if x2.shape[0]:
        _gated_rmsnorm_kernel[(x2.shape[0],)](
            x2,
            z2,
            weight,
            out,
            x2.shape[1],
            eps,
            BLOCK=triton.next_power_of_2(x2.shape[1]),
            **pdl.launch(x2),
        )
    return out.view(x.shape)
