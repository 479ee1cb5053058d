"""Projections of a few rows (a decode or small verify step) as Triton kernels launched with PDL,
with `F.linear` as the torch reference (`tests/test_gemv.py`).

Why. At batch 1 a decode step's dense projections are cuBLAS GEMMs of one row against a large
weight (on the qwen3-next-a3b-64e shape: 97 a step, 1.35 ms of 4.45 on an H100 against 0.91 at
the weight roofline). cuBLAS's kernels cannot take part in programmatic dependent launch
(`kernels/pdl.py`), so each of them waits, unlaunched, for the kernel before it to finish, and
the kernel after it for it; and its one-row tiles read the 4096 -> 2048 projections as a split-K
GEMM plus a reduce at about half the bandwidth. These kernels are launched with PDL like the
step's other kernels, and stream their weight near the bandwidth (`benchmarks/gemv_chain.py`).

The kernels. The strip GEMV (one or two rows): each program holds a BN-row strip of the weight
whole in registers (K up to `MAX_K`) and takes every row of x against it, reduced over K in
float32. The tensor-core kernel (up to `MAX_ROWS` rows, padded to 16): a BN-row strip of
the weight per program, K in pipelined BK steps, as a GEMM would with a 16-row tile. Both
accumulate in float32 as cuBLAS does (the sums are ordered differently, so the bits may differ
from cuBLAS's in the last place, as one cuBLAS kernel's do from another's).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from metrale.kernels import pdl
from metrale.kernels.batch_invariant import pipeline_bytes
from metrale.kernels.dispatch import interpreter_forced
from metrale.kernels.kv_tiles import shared_budget
from metrale.knobs import knobs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines without Triton
    triton = None

# Where each kernel beats cuBLAS on an H100 (`benchmarks/gemv_chain.py`, session 74). The strip
# GEMV: one row of x up to K = MAX_K, two up to K = MAX_K_TWO_ROWS (each row's product widens the
# registers a program holds by a strip; at 4 rows cuBLAS is faster). The tensor-core kernel with
# TILES for the rest up to MAX_ROWS (4 and 8 rows: 2-12% faster than cuBLAS on every shape tried;
# more rows are not measured yet).
MAX_ROWS = 8
MAX_K = 16384
MAX_K_TWO_ROWS = 4096
# weight elements a strip GEMV program holds for each row of x (8 KiB of bf16): BN = rows * STRIP
# // next_pow2(K) (two rows of K 4096 at half that were up to 15% slower than cuBLAS)
STRIP = 4096
TILES = (32, 128, 4, 5)  # BN, BK, warps, stages
# Long or wide weights stream faster with wider tiles (session 76, 4 rows on an H100: the
# qwen3-8b down projection 39.0 against 40.4 us, gate/up 69.1 against 70.2, q/k/v 20.7 against
# 21.2; at K 2048 or N 4096 and below TILES stays the best or within 1%), where the device's
# shared memory holds them (160 and 120 KiB: not sm86/89/120's 99 KiB; review).
TILES_LONG_K = (64, 256, 4, 5)  # K >= 8192
TILES_WIDE_N = (64, 256, 4, 4)  # K >= 4096 and N >= 6144

if triton is not None:
    from metrale.kernels.pdl import pdl_prologue

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """out[M, N] = x[M, K] @ w[N, K]^T (+ b): a BN-row strip of w per program, all of K, and
        all M (<= BM) rows of x, reduced over K in one pass."""
        pdl_prologue(PDL)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        m = tl.arange(0, BM)
        k = tl.arange(0, BK)
        w_ok = (n[:, None] < N) & (k[None, :] < K)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=w_ok, other=0.0)
        x_ok = (m[:, None] < M) & (k[None, :] < K)
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_x + k[None, :], mask=x_ok, other=0.0)
        acc = tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        out_ok = (m[:, None] < M) & (n[None, :] < N)
        out = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + m[:, None] * stride_o + n[None, :], out, mask=out_ok)

    @triton.jit
    def _skinny_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
        DOT_F32: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """out[M, N] = x[M, K] @ w[N, K]^T (+ b) on the tensor cores, M <= BM (>= 16, the
        product's least), a BN-row strip of w per program, K in BK steps (pipelined).
        `DOT_F32`: the operands in float32 (the interpreter's product takes no bf16); float32
        products in full precision (`PRECISION` "ieee", not tf32)."""
        pdl_prologue(PDL)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        m = tl.arange(0, BM)
        kk = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + kk
            x_ok = (m[:, None] < M) & (k[None, :] < K)
            x = tl.load(
                x_ptr + m[:, None].to(tl.int64) * stride_x + k[None, :], mask=x_ok, other=0.0
            )
            w_ok = (n[:, None] < N) & (k[None, :] < K)
            w = tl.load(
                w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=w_ok, other=0.0
            )
            if DOT_F32:
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        out_ok = (m[:, None] < M) & (n[None, :] < N)
        out = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + m[:, None] * stride_o + n[None, :], out, mask=out_ok)


def launch_tiles(
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    bn: int,
    bk: int,
    warps: int,
    stages: int,
) -> None:
    """out [M, N] = rows [M, K] @ weight^T (+ bias) on the tensor cores (M <= 64; `gemv`'s
    tiles or a benchmark's)."""
    m, k = rows.shape
    n = weight.shape[0]
    _skinny_kernel[(triton.cdiv(n, bn),)](
        rows, weight, bias if bias is not None else weight, out,
        m, n, k, rows.stride(0), weight.stride(0), out.stride(0),
        BM=max(16, triton.next_power_of_2(m)), BN=bn, BK=bk, HAS_BIAS=bias is not None,
        DOT_F32=not rows.is_cuda,
        PRECISION="ieee" if rows.dtype == torch.float32 or not rows.is_cuda else "tf32",
        num_warps=warps, num_stages=stages, **pdl.launch(rows),
    )  # fmt: skip


def _strip_fits(rows: int, k: int) -> bool:
    """Whether the strip GEMV serves `rows` rows of width k (else the tensor-core kernel)."""
    return (rows <= 1 and k <= MAX_K) or (rows == 2 and k <= MAX_K_TWO_ROWS)


def _tensor_cores(x: torch.Tensor) -> bool:
    """Whether the tensor-core kernel takes x: bf16 or fp16, on an sm80 or later GPU (Triton's
    bf16 products need Ampere) or under the interpreter."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return False
    return not x.is_cuda or pdl.cuda_major(x) >= 8


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear` takes x @ weight^T (+ bias) through a kernel here: CUDA (or the CPU
    where a test forces the fused paths, `kernels/dispatch.py`), the weight (and bias) in x's
    dtype (bf16, fp16 or fp32) and on its device (no negated views), the bias of shape [N], the
    weight row-major, K > 0, at most MAX_ROWS rows (past the strip GEMV's reach, the tensor-core
    kernel's `_tensor_cores`), nothing that autograd would follow, the knob off."""
    k = weight.shape[-1]
    rows = x.numel() // max(k, 1)
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (
        triton is not None
        and (x.is_cuda or interpreter_forced(x))
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and all(t.dtype == x.dtype and t.device == x.device and not t.is_neg() for t in tensors)
        and x.dim() >= 1
        and weight.dim() == 2
        and (bias is None or bias.shape == weight.shape[:1])
        and weight.stride(1) == 1
        and x.shape[-1] == k > 0
        and rows <= MAX_ROWS
        and (_strip_fits(rows, k) or _tensor_cores(x))
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        and not knobs().no_gemv
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] through the strip GEMV or the
    tensor-core kernel, any device Triton runs on (its interpreter on the CPU). The caller
    checks the shape (`gemv_applies`)."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if bias is not None:
        bias = bias.contiguous()  # (the kernels read it as b[n])
    out = torch.empty(rows.shape[0], n, device=x.device, dtype=x.dtype)
    if rows.shape[0] and n:
        if _strip_fits(rows.shape[0], k):
            launch_strip(rows, weight, bias, out, *strip_of(n, k, STRIP * rows.shape[0]))
        else:
            launch_tiles(rows, weight, bias, out, *tiles_of(n, k, rows))
    return out.view(*x.shape[:-1], n)


def tiles_of(n: int, k: int, x: torch.Tensor) -> tuple[int, int, int, int]:
    """The tensor-core kernel's (BN, BK, warps, stages) for an [n, k] weight and rows `x`: a
    wider tile for long or wide weights where the device's shared memory holds it."""
    budget = shared_budget(x.device)
    for tiles, applies in ((TILES_LONG_K, k >= 8192), (TILES_WIDE_N, k >= 4096 and n >= 6144)):
        if applies and shared_need(tiles, x.element_size()) <= budget:
            return tiles
    return TILES


def shared_need(tiles: tuple[int, int, int, int], elem_bytes: int) -> int:
    """Bytes of shared memory a tile's pipeline may take: x's 16 rows and BN weight rows a
    stage (`batch_invariant.pipeline_bytes`)."""
    bn, bk, _, stages = tiles
    return pipeline_bytes(16, bn, bk, elem_bytes, stages)


def strip_of(n: int, k: int, strip: int = STRIP) -> tuple[int, int]:
    """(weight rows a program holds, warps) for an [n, k] weight: about `strip` elements."""
    bk = triton.next_power_of_2(k)
    bn = max(1, min(64, strip // bk, triton.next_power_of_2(n)))
    return bn, 4 if bn * bk <= 8192 else 8


def launch_strip(
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    bn: int,
    warps: int,
) -> None:
    """out [M, N] = rows [M, K] @ weight^T (+ bias), BN weight rows a program (`gemv`'s tiles
    or a benchmark's)."""
    m, k = rows.shape
    n = weight.shape[0]
    _gemv_kernel[(triton.cdiv(n, bn),)](
        rows, weight, bias if bias is not None else weight, out,
        m, n, k, rows.stride(0), weight.stride(0), out.stride(0),
        BM=triton.next_power_of_2(m), BN=bn, BK=triton.next_power_of_2(k),
        HAS_BIAS=bias is not None, num_warps=warps, **pdl.launch(rows),
    )  # fmt: skip


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the few-row kernels where they apply (`gemv_applies`)."""
    if gemv_applies(x, weight, bias):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


class StreamedLinear(nn.Linear):
    """An nn.Linear whose forward is `linear` (same parameters, same state dict)."""

    product = staticmethod(linear)  # (for a layer that multiplies by a fused weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def stream_projections(module: nn.Module) -> int:
    """Point every plain nn.Linear under `module` at `linear`, in place (the class changes, the
    parameters stay; the deterministic mode's invariant products are not plain). Returns how
    many were changed."""
    changed = 0
    for sub in module.modules():
        if type(sub) is nn.Linear:
            sub.__class__ = StreamedLinear
            changed += 1
    return changed
