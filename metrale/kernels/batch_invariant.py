"""Batch-invariant matrix products for the deterministic mode (`EngineConfig.deterministic`).

cuBLAS picks its kernel (split-K, reduction order) by the number of rows M, so the same token's
row rounds differently alone, in a batch of 64, or as a verify row beside its drafts; that is why
speculative greedy output drifts from plain greedy output in bf16. This kernel computes every
output element the same way for any M: each program reduces over K in one fixed order
(BLOCK_K chunks, first to last, float32 accumulation, one rounding at the end), there is no
split-K and no atomics, and rows beyond M are masked loads that contribute nothing to the rows
that are there. The tile shape may follow M (`config_for`): it changes which program computes
an element, not how. A row's result is then a function of that row and the weight alone (the
GPU tests check it bitwise for M = 1, 3, 17, 64, 256 at any position).

`invariant_linear` has F.linear's signature; `make_batch_invariant(module)` points every
nn.Linear of a model, and its head, at it. Its torch reference is F.linear; on the CPU the
engine runs that reference in float64 and rounds once (`_wide_linear`), which makes it
batch-invariant there too.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines without Triton: F.linear serves
    triton = None

# Under the Triton interpreter the kernel runs on CPU tensors (the CPU tests use it).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if triton is not None:
    # Not specialised on M (the step's rows): Triton would compile one variant for M == 1, one
    # for M a multiple of 16 and one for any other M, so the first eager step with a row count
    # of a new kind compiled the kernel again inside a running step (seconds). One binary per
    # tile configuration serves every M (M only masks rows), and the programs captured at
    # start-up compile every configuration a step meets.
    @triton.jit(do_not_specialize=["M"])
    def _invariant_matmul_kernel(
        a_ptr,
        w_ptr,
        bias_ptr,
        c_ptr,
        M,
        N,
        K,
        stride_am,
        stride_wn,
        stride_cm,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_F32: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """C[M, N] = A[M, K] @ W[N, K]^T (+ bias): one [BLOCK_M, BLOCK_N] tile per program."""
        pid = tl.program_id(0)
        # M fastest: the row tiles that read one block of weight columns run side by side, so
        # the weight block is read from memory once and from L2 by the rest.
        num_m = tl.cdiv(M, BLOCK_M)
        pid_m = pid % num_m
        pid_n = pid // num_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
        w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_ok = rk < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if DOT_F32:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int) -> dict:
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


def config_for(m: int, n: int, k: int) -> dict:
    """The tile configuration for M rows of a weight [N, K].

    Choosing it by M keeps the invariance: every configuration reduces each element over K in
    the same order (16-wide matrix-instruction steps, first to last, into one float32
    accumulator), and on the H200 all fourteen measured configurations, mma.sync and wgmma,
    BLOCK_K 32 to 256, gave bitwise equal outputs (`scripts/invariant_gemm_cross.py`; the GPU
    test checks the chosen ones across M). The choices are the fastest measured on the qwen3-8b
    weights (`scripts/invariant_gemm_sweep.py`, `invariant_gemm_tune.py`); per decode step,
    against cuBLAS: 0.96x at M <= 16, 1.04x at 64, 1.34x at 256, about 1.4x for long prefills.
    """
    head = n > 65536  # a vocabulary projection
    wide = n > 8192  # gate_up: enough column blocks even with wide tiles
    if m <= 16:  # decode at small batch: memory-bound, narrow tiles spread over the GPU
        return _cfg(16, 32, 256, 4, 4) if wide else _cfg(16, 16, 256, 2, 4)
    if m <= 64:
        if head:
            return _cfg(64, 128, 128, 4, 4)
        if wide:
            return _cfg(64, 64, 64, 4, 4)
        return _cfg(64, 64 if n > 4096 else 32, 128, 4, 5)
    if m <= 128:
        return _cfg(128, 128, 64, 8, 3) if wide else _cfg(64, 64, 128, 4, 4)
    if m <= 256 and not head:
        if k > 4096:  # down
            return _cfg(64, 128, 128, 4, 4)
        if n <= 4096:  # o
            return _cfg(128, 64, 128, 8, 4)
        return _cfg(128, 128, 64, 8, 5)
    return _cfg(128, 128, 64, 8, 3)


# Output features per float64 product of `_wide_linear`.
WIDE_BLOCK = 8192


def _wide_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The CPU's batch-invariant product: F.linear in float64, rounded once to x's dtype.

    CPU BLAS picks its kernel and blocking by M too (a one-row product takes a GEMV), so a
    float32 row rounds differently alone and in a batch. In float64 a row's product is within
    about 1e-16 of the exact one whatever the order, and rounding that to float32 gives the same
    bits unless the exact value lies that close to a rounding boundary."""
    if x.dtype == torch.float64:
        return F.linear(x, weight, bias)
    x64 = x.double()
    parts = []
    # a block of output features at a time: a vocabulary head's float64 copy would be gigabytes
    for i in range(0, weight.shape[0], WIDE_BLOCK):
        b = None if bias is None else bias[i : i + WIDE_BLOCK].double()
        parts.append(F.linear(x64, weight[i : i + WIDE_BLOCK].double(), b).to(x.dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


# Shared memory a program may use where the device does not say (consumer GPUs: about 99 KiB).
DEFAULT_SHARED_BYTES = 99 * 1024


@functools.cache
def shared_bytes(device: torch.device) -> int:
    """The shared memory one program may opt in to on `device` (227 KiB on the H200)."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or DEFAULT_SHARED_BYTES)


def pipeline_bytes(block_m: int, block_n: int, block_k: int, elem_bytes: int, stages: int) -> int:
    """Shared memory a pipelined GEMM tile's operand buffers may take: (BLOCK_M + BLOCK_N) x
    BLOCK_K elements a stage, every stage counted (Triton keeps one fewer: this errs toward
    the smaller tile)."""
    return (block_m + block_n) * block_k * elem_bytes * stages


def fit_shared(cfg: dict, elem_bytes: int, budget: int) -> dict:
    """`cfg` with fewer pipeline stages, then a shorter BLOCK_K, until its operand buffers
    ((BLOCK_M + BLOCK_N) x BLOCK_K elements a stage) fit in `budget` bytes.

    The tuned tiles are for 2-byte operands on the H200; float32 doubles their buffers (a
    float32 target in the deterministic mode failed at start-up asking 288 KiB), and smaller
    GPUs have less. Neither change touches the invariance: the stages only overlap the loads,
    and every BLOCK_K reduces in the same order (the module's docstring); the shape of a step
    still picks the same configuration on one device."""
    cfg = dict(cfg)

    def need() -> int:
        return pipeline_bytes(
            cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], elem_bytes, cfg["num_stages"]
        )

    while need() > budget and cfg["num_stages"] > 2:
        cfg["num_stages"] -= 1
    while need() > budget and cfg["BLOCK_K"] > 16:
        cfg["BLOCK_K"] //= 2
    return cfg


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config=None
) -> torch.Tensor:
    """F.linear(x, weight, bias) with every row computed independently of the others."""
    if not x.is_cuda and not INTERPRETED:
        return _wide_linear(x, weight, bias)
    if triton is None:
        return F.linear(x, weight, bias)
    n, k = weight.shape
    lead = x.shape[:-1]
    if k == 0 or lead.numel() == 0:  # nothing to reduce, or no rows: F.linear's result
        return F.linear(x, weight, bias)
    a = x.reshape(lead.numel(), k)
    if a.stride(-1) != 1:
        a = a.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if bias is not None:
        bias = bias.contiguous()  # the kernel reads it as one contiguous row
    m = a.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    # The interpreter rounds each BLOCK_K chunk's product before accumulating it (the GPU's
    # matrix steps do not), so under it one configuration serves every M.
    if config is not None:
        cfg = dict(config)
    elif INTERPRETED:
        cfg = _cfg(16, 32, 64, 4, 1)
    else:
        cfg = fit_shared(config_for(m, n, k), x.element_size(), shared_bytes(x.device))
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _invariant_matmul_kernel[grid](
        a,
        weight,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        a.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        DOT_F32=INTERPRETED,
        # float32 products in full float32, as torch's own (tf32 is off by default)
        PRECISION="ieee" if x.dtype == torch.float32 or INTERPRETED else "tf32",
        **cfg,
    )
    return out.reshape(*lead, n)


class InvariantLinear(nn.Linear):
    """An nn.Linear whose forward is `invariant_linear` (same parameters, same state dict)."""

    product = staticmethod(invariant_linear)  # (for a layer that multiplies by a fused weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)  # the kernel has no backward
        return invariant_linear(x, self.weight, self.bias)


def make_batch_invariant(module: nn.Module) -> int:
    """Point every nn.Linear under `module`, and a target's head product (`head_linear`), at the
    invariant kernel (in place: the class changes, the parameters stay). Returns how many
    products were changed."""
    changed = 0
    for sub in module.modules():
        if type(sub) is nn.Linear:
            sub.__class__ = InvariantLinear
            changed += 1
        if hasattr(type(sub), "head_linear"):
            sub.head_linear = invariant_linear
            changed += 1
        if getattr(sub, "row_invariant", None) is False:  # a MoE's experts
            sub.row_invariant = True
            changed += 1
    return changed


def check_invariant_support(model_cfg, cfg, paged_kernel: bool) -> None:
    """Refuse a deterministic engine on CUDA that would fall back to a batch-variant kernel."""
    if triton is None:
        raise ValueError("deterministic: needs Triton on CUDA (the invariant kernels are Triton)")
    page = cfg.page_size
    if not paged_kernel or page < 16 or page & (page - 1):
        raise ValueError(
            "deterministic: the batch-invariant paged attention needs page_size a power of two "
            f">= 16 and head_dim a power of two >= 16 (got page_size {page}, "
            f"head_dim {model_cfg.head_dim})"
        )
