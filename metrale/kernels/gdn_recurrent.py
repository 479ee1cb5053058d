"""The gated delta rule, recurrent form, as one Triton kernel that addresses the state pool in
place: decode, verify and write-on-accept commits of a hybrid (Qwen3-Next) target without a torch
op per row and without gathering or scattering states.

One program per (sequence, value head, block of BV value columns) loads its [dk, BV] slice of the
state from pool entry `read[b]`, keeps it in registers (float32) across the sequence's rows (the
columns of the state evolve independently), and per row decays it, writes the delta-rule
correction and reads the output. It then stores, as asked:
  - the state after the last row into entry `final[b]` (prefill, decode, commits: `final = read`);
  - the state after row t into entry `rows[b, t]` (per-row-slot verify);
  - nothing (write-on-accept verify: the state is written later, for the accepted rows only).
A program reads and writes only its own tile, so writing back into the entry it read is safe.

`gdn.recurrent_gated_delta_rule` is its reference and test oracle. On by default on CUDA;
`METRALE_NO_GDN_TRITON=1` runs the torch reference instead (A/B runs).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from metrale.kernels import pdl
from metrale.kernels.dispatch import interpreter_forced
from metrale.knobs import knobs

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

L2NORM_EPS = 1e-6  # as gdn.L2NORM_EPS (HF's l2norm)
# The delta-rule state's storage types (`EngineConfig.mamba_ssm_cache_dtype`); the arithmetic is
# float32 whatever the pool holds.
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class GateInputs(NamedTuple):
    """A GDN layer's gate inputs, which the delta-rule kernels turn into its gates in registers
    (no g and beta tensors, no launch to make them): g = -exp(a_log) * softplus(a + dt_bias) in
    float32 and beta = sigmoid(b) rounded to b's dtype, as `Qwen3NextGatedDeltaNet` computes
    them. a and b are [B, T, Hv] with unit head stride (row-strided views of the in-projection's
    output will do); a padding row holds a = b = -inf, which gives g = beta = 0."""

    a: torch.Tensor
    b: torch.Tensor
    a_log: torch.Tensor  # [Hv]
    dt_bias: torch.Tensor  # [Hv]

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, beta) as torch ops: the reference, and the torch path's inputs."""
        g = -self.a_log.float().exp() * F.softplus(self.a.float() + self.dt_bias)
        return g, self.b.sigmoid()


def triton_gdn_enabled(x: torch.Tensor) -> bool:
    """Run the recurrent form as this kernel: CUDA, Triton, and not `METRALE_NO_GDN_TRITON=1`
    (or CPU tensors under the interpreter when forced: `dispatch.interpreter_forced`)."""
    if triton is None or knobs().no_gdn_triton:
        return False
    return x.is_cuda or interpreter_forced(x)


# `_invariant_delta_rule_kernel`'s arguments Triton must not specialise on: the mode switches,
# the row count (a 1 would be a constant) and every pointer and stride (their alignment) but
# the state pool's, one allocation, aligned in every mode (its tile loads stay vectorised).
_ONE_BINARY = [
    "q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "out_ptr", "read_ptr",
    "final_ptr", "rows_ptr", "lens_ptr", "T", "stride_qb", "stride_qt", "stride_kb",
    "stride_kt", "stride_vb", "stride_vt", "stride_gb", "stride_gt", "stride_betab",
    "stride_betat", "a_log_ptr", "dt_bias_ptr", "WRITE_FINAL", "WRITE_ROWS", "HAS_LENS",
    "STORE_OUT",
]  # fmt: skip

if triton is not None:
    from metrale.kernels.gdn_fused import _softplus
    from metrale.kernels.pdl import pdl_prologue

    # The kernel's arguments, in order: pointers and strides, then the launch shape, then the
    # variant's switches (a program's mode: which of the states and outputs it writes).
    @triton.jit
    def _delta_rule_program(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, pool_ptr, read_ptr, final_ptr, rows_ptr,
        lens_ptr, T, stride_qb, stride_qt, stride_kb, stride_kt, stride_vb, stride_vt,
        stride_gb, stride_gt, stride_betab, stride_betat, a_log_ptr, dt_bias_ptr, scale, eps,
        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, HAS_STATE: tl.constexpr,
        RAW_GATES: tl.constexpr, ROUND_STATE: tl.constexpr,
        WRITE_FINAL, WRITE_ROWS, HAS_LENS, STORE_OUT,
    ):  # fmt: skip
        """One program's rows (see the module docstring). The four mode switches are compile-time
        constants in `_recurrent_delta_rule_kernel` and runtime values in
        `_invariant_delta_rule_kernel`."""
        b = tl.program_id(0).to(tl.int64)  # row offsets of big batches pass 2**31
        h = tl.program_id(1)
        hk = h // (HV // HK)  # value head h reads key head h // (HV / HK)
        state_ty = pool_ptr.dtype.element_ty
        if RAW_GATES:
            neg_a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
            dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        kk = tl.arange(0, BK)
        vv = tl.program_id(2) * BV + tl.arange(0, BV)
        k_ok, v_ok = kk < DK, vv < DV
        tile = h * DK * DV + kk[:, None] * DV + vv[None, :]
        tile_ok = k_ok[:, None] & v_ok[None, :]
        entry_size = HV * DK * DV
        s = tl.zeros([BK, BV], tl.float32)
        if HAS_STATE:
            entry = tl.load(read_ptr + b).to(tl.int64)
            s = tl.load(pool_ptr + entry * entry_size + tile, mask=tile_ok, other=0.0)
            s = s.to(tl.float32)
        n = T
        if HAS_LENS:  # a commit: only the sequence's accepted rows
            n = tl.minimum(tl.load(lens_ptr + b).to(tl.int32), T)
        for t in range(n):
            q_row = q_ptr + b * stride_qb + t * stride_qt + hk * DK
            k_row = k_ptr + b * stride_kb + t * stride_kt + hk * DK
            q = tl.load(q_row + kk, mask=k_ok, other=0.0).to(tl.float32)
            k = tl.load(k_row + kk, mask=k_ok, other=0.0).to(tl.float32)
            if L2NORM:
                q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps)
                k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
            q = q * scale
            row = (b * T + t) * HV + h
            v_row = v_ptr + b * stride_vb + t * stride_vt + h * DV
            v = tl.load(v_row + vv, mask=v_ok, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + b * stride_gb + t * stride_gt + h).to(tl.float32)
            beta = tl.load(beta_ptr + b * stride_betab + t * stride_betat + h)
            if RAW_GATES:  # g, beta hold a, b: the layer's gates (`GateInputs`)
                g = neg_a * _softplus(g + dt_bias)
                beta = tl.sigmoid(beta.to(tl.float32)).to(beta_ptr.dtype.element_ty)
            beta = beta.to(tl.float32)
            s = s * tl.exp(g)
            u = (v - tl.sum(k[:, None] * s, axis=0)) * beta  # the correction, [BV]
            s = s + k[:, None] * u[None, :]
            if STORE_OUT:
                o = tl.sum(q[:, None] * s, axis=0)
                tl.store(out_ptr + row * DV + vv, o.to(out_ptr.dtype.element_ty), mask=v_ok)
            if ROUND_STATE:
                # a pool below float32: each row goes on from the state as a step ending at
                # it would have stored it, so T rows in one call give the bits of T decodes
                s = s.to(state_ty).to(tl.float32)
            if WRITE_ROWS:
                row_entry = tl.load(rows_ptr + b * T + t).to(tl.int64)
                tl.store(pool_ptr + row_entry * entry_size + tile, s.to(state_ty), mask=tile_ok)
        if WRITE_FINAL:
            entry = tl.load(final_ptr + b).to(tl.int64)
            tl.store(pool_ptr + entry * entry_size + tile, s.to(state_ty), mask=tile_ok)

    @triton.jit
    def _recurrent_delta_rule_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, pool_ptr, read_ptr, final_ptr, rows_ptr,
        lens_ptr, T, stride_qb, stride_qt, stride_kb, stride_kt, stride_vb, stride_vt,
        stride_gb, stride_gt, stride_betab, stride_betat, a_log_ptr, dt_bias_ptr, scale, eps,
        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, HAS_STATE: tl.constexpr,
        RAW_GATES: tl.constexpr, ROUND_STATE: tl.constexpr,
        WRITE_FINAL: tl.constexpr, WRITE_ROWS: tl.constexpr, HAS_LENS: tl.constexpr,
        STORE_OUT: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_prologue(PDL)
        _delta_rule_program(
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, pool_ptr, read_ptr, final_ptr,
            rows_ptr, lens_ptr, T, stride_qb, stride_qt, stride_kb, stride_kt, stride_vb,
            stride_vt, stride_gb, stride_gt, stride_betab, stride_betat, a_log_ptr, dt_bias_ptr,
            scale, eps, HK, HV, DK, DV, BK, BV, L2NORM, HAS_STATE, RAW_GATES, ROUND_STATE,
            WRITE_FINAL, WRITE_ROWS, HAS_LENS, STORE_OUT,
        )  # fmt: skip

    # The deterministic mode's kernel: one binary for a decode, a verify, its commit and a
    # prompt (the mode switches, the row count and the row strides are runtime values). Two
    # variants of the same arithmetic can round differently (the per-row-slot variant's states
    # differed from a decode's at Qwen3-Next's shape on an H100, as `fused.qk_norm_rope`'s two
    # variants did on the H200), and a verify row must carry a decode row's bits.
    @triton.jit(do_not_specialize=_ONE_BINARY)
    def _invariant_delta_rule_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, pool_ptr, read_ptr, final_ptr, rows_ptr,
        lens_ptr, T, stride_qb, stride_qt, stride_kb, stride_kt, stride_vb, stride_vt,
        stride_gb, stride_gt, stride_betab, stride_betat, a_log_ptr, dt_bias_ptr, scale, eps,
        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, HAS_STATE: tl.constexpr,
        RAW_GATES: tl.constexpr, ROUND_STATE: tl.constexpr,
        WRITE_FINAL, WRITE_ROWS, HAS_LENS, STORE_OUT,
        PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_prologue(PDL)
        _delta_rule_program(
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, pool_ptr, read_ptr, final_ptr,
            rows_ptr, lens_ptr, T, stride_qb, stride_qt, stride_kb, stride_kt, stride_vb,
            stride_vt, stride_gb, stride_gt, stride_betab, stride_betat, a_log_ptr, dt_bias_ptr,
            scale, eps, HK, HV, DK, DV, BK, BV, L2NORM, HAS_STATE, RAW_GATES, ROUND_STATE,
            WRITE_FINAL, WRITE_ROWS, HAS_LENS, STORE_OUT,
        )  # fmt: skip


def delta_rule_in_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    read: torch.Tensor | None,
    *,
    final: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    scale: float | None = None,
    l2norm_qk: bool = True,
    lengths: torch.Tensor | None = None,
    gates: GateInputs | None = None,
    block_v: int | None = None,
    num_warps: int = 4,
    invariant: bool = False,
) -> torch.Tensor | None:
    """q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g, beta [B, T, Hv]; pool [S, Hv, dk, dv] (float32,
    or a 16-bit type: `STATE_DTYPES`; the state is rounded to it after every row, as a decode
    step stores it, and computed in float32 in between). Sequence b starts from entry read[b]
    (None: zeros); writes the state after its last row into entry final[b] and the state after
    row t into entry rows[b, t] where those are given.
    Returns out [B, T, Hv, dv] in v's dtype; with `lengths` [B] (a write-on-accept commit) only
    each sequence's first lengths[b] rows run, and nothing but the states is written (None).
    With `gates`, g and beta are computed in the kernel from the layer's gate inputs (g and
    beta are ignored). `block_v`, `num_warps`: the launch shape (value columns per program;
    default `_block_v`). `invariant` (the deterministic mode, with a fixed `block_v`): every
    call runs one binary, `_invariant_delta_rule_kernel`."""
    bsz, seq, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    check_pool_shapes(q, v, pool)
    # q, k, v may be row-strided views (slices of the conv output): no copy
    q, k, v = (_heads_contiguous(x) for x in (q, k, v))
    if gates is not None:
        g, beta = gates.a, gates.b
    g, beta = (x if x.stride(2) == 1 else x.contiguous() for x in (g, beta))
    out = None if lengths is not None else torch.empty(v.shape, dtype=v.dtype, device=v.device)
    block_v = block_v or _block_v(bsz * hv, dv, v.device)
    dummy = pool  # an unread pointer for the arguments a variant does not use
    out_dummy = index_dummy = dummy
    if invariant:
        # one binary for every mode: an unused pointer has the element type a used one has (a
        # pointer's type is part of the compiled signature, not specialised or not; found in
        # review), and the index tensors are int64 whoever made them
        read, final, rows, lengths = (
            None if x is None else x.to(torch.int64) for x in (read, final, rows, lengths)
        )
        out_dummy = v
        index_dummy = (
            read if read is not None else torch.zeros(1, dtype=torch.int64, device=v.device)
        )
    kernel = _invariant_delta_rule_kernel if invariant else _recurrent_delta_rule_kernel
    # (runtime switches in the invariant kernel: ints, whose value Triton does not fold)
    mode = int if invariant else bool
    kernel[(bsz, hv, triton.cdiv(dv, block_v))](
        q,
        k,
        v,
        g,
        beta,
        out_dummy if out is None else out,
        pool,
        index_dummy if read is None else read.contiguous(),
        index_dummy if final is None else final.contiguous(),
        index_dummy if rows is None else rows.contiguous(),
        index_dummy if lengths is None else lengths.contiguous(),
        seq,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        dummy if gates is None else gates.a_log,
        dummy if gates is None else gates.dt_bias,
        dk**-0.5 if scale is None else scale,
        L2NORM_EPS,
        HK=hk,
        HV=hv,
        DK=dk,
        DV=dv,
        BK=triton.next_power_of_2(dk),
        BV=block_v,
        L2NORM=l2norm_qk,
        HAS_STATE=read is not None,
        WRITE_FINAL=mode(final is not None),
        WRITE_ROWS=mode(rows is not None),
        HAS_LENS=mode(lengths is not None),
        STORE_OUT=mode(lengths is None),
        RAW_GATES=gates is not None,
        ROUND_STATE=pool.dtype != torch.float32,
        num_warps=num_warps,
        **pdl.launch(q),
    )
    return out


def check_pool_shapes(q: torch.Tensor, v: torch.Tensor, pool: torch.Tensor) -> None:
    """What every pool kernel needs: whole groups of value heads per key head, and a contiguous
    state pool (`STATE_DTYPES`) of matching heads and dims."""
    hk, dk, hv, dv = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
    if hv % hk:
        raise ValueError(f"{hv} value heads are not a multiple of {hk} key heads")
    if pool.dtype not in STATE_DTYPES or not pool.is_contiguous():
        raise ValueError(f"the state pool must be contiguous, of {STATE_DTYPES}: {pool.dtype}")
    if tuple(pool.shape[1:]) != (hv, dk, dv):
        raise ValueError(f"state pool of shape {tuple(pool.shape)}: want [S, {hv}, {dk}, {dv}]")


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, d] with each row's heads packed (the rows themselves may be strided)."""
    if x.stride(3) == 1 and x.stride(2) == x.shape[3]:
        return x
    return x.contiguous()


@functools.cache
def _programs_wanted(device: torch.device) -> int:
    """Two programs per SM (one per SM on the interpreter) keep the state's streams busy."""
    if device.type != "cuda":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


# Value columns per program in the deterministic mode, whatever the batch. A program's sums over
# dk (the correction, the output) reduce in an order that follows its tile's shape, so
# `_block_v`'s choice by the batch gave a row other bits alone than in a batch (Qwen3-Next's
# shape on an H100: 16 columns at 1-2 sequences, 32 at 3-4, 64 from 5). 32 cost 14% / 11% of
# the kernel's time against the best choice in the H200 sweep below (0.154 vs 0.135 ms at
# batch 1, 3.49 vs 3.14 ms at batch 64, 36 layers).
INVARIANT_BLOCK_V = 32


def invariant_block_v(dv: int) -> int:
    """The deterministic mode's value columns per program for value heads of `dv` columns."""
    return min(INVARIANT_BLOCK_V, 1 << max(dv - 1, 0).bit_length())


def _block_v(heads: int, dv: int, device: torch.device) -> int:
    """Value columns per program: the widest of 64, 32, 16 that still launches enough programs
    (`benchmarks/gdn_verify_variants.py --sweep`, H200, 36 layers: decode at batch 64 takes
    3.14 ms with 64, 3.49 with 32; at batch 1, 0.135 ms with 16, 0.154 with 32)."""
    for block in (64, 32):
        if heads * triton.cdiv(dv, block) >= _programs_wanted(device):
            return min(block, triton.next_power_of_2(dv))
    return min(16, triton.next_power_of_2(dv))


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
    """The functional form of `delta_rule_in_pool`, with `gdn.recurrent_gated_delta_rule`'s
    arguments and results (the tests' entry point): (out, final state [B, Hv, dk, dv], per-row
    states [B, T, Hv, dk, dv] or None); `state` is never modified."""
    bsz, seq = q.shape[:2]
    hv, dk, dv = v.shape[2], q.shape[3], v.shape[3]
    # pool: [initial states | final states | per-row states]
    pool = torch.empty(bsz * (2 + seq), hv, dk, dv, dtype=torch.float32, device=v.device)
    if state is not None:
        pool[:bsz] = state
    index = torch.arange(bsz * (2 + seq), device=v.device)
    out = delta_rule_in_pool(
        q,
        k,
        v,
        g,
        beta,
        pool,
        index[:bsz] if state is not None else None,
        final=index[bsz : 2 * bsz],
        rows=index[2 * bsz :].view(bsz, seq) if output_all_states else None,
        scale=scale,
        l2norm_qk=l2norm_qk,
    )
    states = pool[2 * bsz :].view(bsz, seq, hv, dk, dv) if output_all_states else None
    return out, pool[bsz : 2 * bsz], states
