"""The sparse MoE block of Qwen3-Next (HF `Qwen3NextSparseMoeBlock`): a softmax router picks the
top-k experts of each row (their weights renormalised to sum 1 when `norm_topk_prob`), each a
SwiGLU MLP, plus one shared SwiGLU expert scaled by a sigmoid gate of its own.

The experts are stacked as HF 5.x keeps them (`experts.gate_up_proj` [E, 2I, H] with gate rows
first, `experts.down_proj` [E, H, I]); the loader fills them from per-expert checkpoint tensors
(`experts.{e}.gate_proj.weight`, ...) as well.

On CUDA (and on CPU under the forced interpreter, `kernels/dispatch.py`) a block is five launches:
the router GEMM (cuBLAS), routing + plan (`kernels/moe_routing.py`), and the grouped gate/up,
down and combine kernels (`kernels/moe.py`) with the shared expert as one more group, the combine
optionally ending in the next layer's residual add + norm. Up to a block of rows it is four: the
routing kernel's programs split the router GEMM (`SPLIT_ROUTER`). Equal router logits
pick the lower expert index in both paths (`moe_routing.route_reference`). Elsewhere (CPU, or the
kernels off), `torch._grouped_mm` where it runs without a host sync (bf16 on sm90/sm100 GPUs, any
float dtype on CPU, 16-byte aligned dims); else small batches gather each row's experts and run
batched matmuls, still sync-free, and larger ones loop over the experts (`_looped`: the
reference).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from metrale.config import ModelConfig
from metrale.kernels.batch_invariant import InvariantLinear
from metrale.kernels.dispatch import hybrid_kernels_enabled
from metrale.kernels.moe import BLOCK_M, SharedExpert, grouped_experts
from metrale.kernels.moe_routing import makes_logits, route, route_block_rows, route_reference
from metrale.models.activations import sigmoid, silu
from metrale.models.layers import SwiGLUMLP

# Without the grouped GEMM: up to this many (row, expert) pairs, the experts' weights are gathered
# per row (sync-free, but each pair copies its expert's weights); above it, the loop reads each
# expert once but syncs once per expert.
GATHER_MAX_PAIRS = 64

# The routing kernel can compute the router product itself (`route(..., hidden=, router=)`, one
# launch fewer per layer), but on the H200 that was slower than cuBLAS + route at every batch size
# (`scripts/moe_route_timing.py`, 64 experts, H 2048: 24.1 vs 17.3 us at 1 row, 30.1 vs 22.9 at 16,
# 32.5 vs 26.4 at 64): one program per row block reads the whole router alone. Off by default.
ROUTER_IN_KERNEL = False
# Up to one block of rows (decode and short verify steps), programs split the router product and
# the last routes (`kernels/moe_router.py`): one launch instead of cuBLAS's and the routing's.
# Not in the deterministic mode (its invariant router product is the one every batch size uses).
SPLIT_ROUTER = True


@functools.cache
def _grouped_mm_syncless(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs on this device and dtype without a host sync. On CUDA only
    its CUTLASS kernel does (bf16 on sm90/sm100): any other GPU or dtype falls back to one matmul
    per group after copying `offs` to the host. On CPU that fallback is all there is, and costs
    no sync (torch >= 2.9; 2.8 had no CPU kernel)."""
    try:
        if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(
            "aten::_grouped_mm", device.type.upper()
        ):
            return False
    except RuntimeError:  # torch < 2.8: no such operator
        return False
    if device.type == "cuda":
        return (
            dtype == torch.bfloat16
            and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] in (9, 10)
        )
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)


class Qwen3NextExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # the deterministic mode (`make_batch_invariant`): on the CPU, each row's experts in
        # float64 (`_wide`); on the GPU the Triton kernels compute each row alone already
        self.row_invariant = False

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [N, H]; experts, weights [N, k] (expert ids and their routing weights) -> [N, H].
        An id of `num_experts` is a pick this module does not hold (another expert-parallel
        rank's): it adds nothing, and every path but the small-batch gather skips its work."""
        if self.row_invariant and not x.is_cuda and not hybrid_kernels_enabled(x):
            return self._wide(x, experts, weights)
        return self._path(x, experts)(x, experts, weights)

    def _wide(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor):
        """`_looped` in float64, rounded once: the CPU's products block by the number of rows
        (the grouped GEMM by the rows each expert gets), so a float32 row rounds by what shares
        its step; in float64 it is within about 1e-16 of exact either way. One expert at a
        time, so the float64 copies are one expert's weights, whatever the batch."""
        return self._looped(x.double(), experts, weights.double()).to(x.dtype)

    def _path(self, x: torch.Tensor, experts: torch.Tensor):
        """The grouped Triton kernels where they run (`_triton`). Else the grouped GEMM wherever
        it runs sync-free: it reads each touched expert's weights once at any batch size and
        keeps decode/verify steps graph-capturable. Otherwise the gather for small batches (no
        sync, but a weight copy per pair) and the loop for the rest.
        """
        w, down = self.gate_up_proj, self.down_proj
        if hybrid_kernels_enabled(x) and w.is_contiguous() and down.is_contiguous():
            return self._triton
        # `_grouped_mm` wants every stride a multiple of 16 bytes (TMA on CUDA; checked on CPU
        # too): H for x and the transposed gate_up, I for the activations and transposed down.
        # The CUTLASS kernel takes at most 1023 groups.
        align = 16 // x.element_size()
        if (
            x.dtype == w.dtype == down.dtype
            and _grouped_mm_syncless(x.device, x.dtype)
            and w.is_contiguous()
            and down.is_contiguous()
            and w.shape[2] % align == 0
            and down.shape[2] % align == 0
            and self.num_experts < 1024
        ):
            return self._grouped
        # NOTE: a CUDA-graph capture cannot sync, so it gathers at any size.
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if experts.numel() <= GATHER_MAX_PAIRS or capturing:
            return self._gathered
        return self._looped

    def _triton(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Given picks (an expert-parallel rank's, masked): the plan, then the grouped kernels."""
        plan = route(
            None, experts.shape[1], num_experts=self.num_experts, ids=experts, weights=weights,
            dtype=x.dtype, block_m=BLOCK_M,
        )  # fmt: skip
        return grouped_experts(x, plan, self.gate_up_proj, self.down_proj)

    def _grouped(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The (row, expert) pairs sorted by expert, so that each expert's rows make one group of
        two grouped GEMMs (gate_up, then down); no host sync: the group sizes stay on the device.
        """
        n, k = experts.shape
        ids, order = experts.reshape(-1).sort(stable=True)  # pair p = row p // k, slot p % k
        # offs[e]: where expert e's group ends = pairs routed to experts <= e (bincount, nonzero
        # and friends would sync to size their output)
        expert_ids = torch.arange(self.num_experts, device=ids.device, dtype=ids.dtype)
        offs = torch.searchsorted(ids, expert_ids, right=True, out_int32=True)
        gate_up = torch._grouped_mm(x[order // k], self.gate_up_proj.transpose(1, 2), offs=offs)
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch._grouped_mm(silu(gate) * up, self.down_proj.transpose(1, 2), offs=offs)
        # Skipped picks (id E) sort last, past every group: no GEMM wrote their rows.
        y = y.masked_fill((ids >= self.num_experts)[:, None], 0.0)
        weights = weights.masked_fill(experts >= self.num_experts, 0)  # (0 x NaN: NaN)
        # Back to (row, slot) order, then each row's weighted sum as one small matmul: accumulated
        # in float32 and rounded once, and deterministic (index_add_ on CUDA adds in atomic order).
        y = torch.empty_like(y).index_copy_(0, order, y).view(n, k, y.shape[1])
        return torch.einsum("nk,nkh->nh", weights.to(y.dtype), y)

    def _gathered(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Each row's k experts gathered and applied as batched matmuls: no host sync, so decode
        and verify steps keep their one sync per step (and can be graph-captured)."""
        # (a skipped pick is computed on the last expert and weighted 0: a gather cannot drop a
        # pair without a sync to size its output)
        skip = experts >= self.num_experts
        experts = experts.masked_fill(skip, self.num_experts - 1)
        gate_up = torch.einsum("nh,nkoh->nko", x, self.gate_up_proj[experts])  # [N, k, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch.einsum("nki,nkhi->nkh", silu(gate) * up, self.down_proj[experts])
        return (y * weights.masked_fill(skip, 0)[..., None]).sum(dim=1).to(x.dtype)

    def _looped(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """One pass per expert over the rows routed to it: the reference path, and the one for
        larger batches where the grouped GEMM cannot run."""
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            rows, pick = torch.where(experts == e)  # NOTE: a host sync; reference path
            if rows.numel() == 0:
                continue
            # (in x's dtype: `_wide` runs this in float64)
            gate_up, down = self.gate_up_proj[e].to(x.dtype), self.down_proj[e].to(x.dtype)
            gate, up = F.linear(x[rows], gate_up).chunk(2, dim=-1)
            y = F.linear(silu(gate) * up, down) * weights[rows, pick, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


class Qwen3NextSparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hybrid = cfg.hybrid
        assert hybrid is not None
        self.top_k = hybrid.num_experts_per_tok
        self.norm_topk_prob = hybrid.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, hybrid.num_experts, bias=False)  # the router
        self.experts = Qwen3NextExperts(
            hybrid.num_experts, cfg.hidden_size, hybrid.moe_intermediate_size
        )
        self.shared_expert = SwiGLUMLP(cfg.hidden_size, hybrid.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        # the split router launch's arrival counter (`kernels/moe_router.py`): this block's own
        self.register_buffer("router_arrivals", torch.zeros(1, dtype=torch.int32), persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (expert ids [N, k], routing weights [N, k] in x's dtype); equal logits
        pick the lower expert index (the routing kernel's rule)."""
        return route_reference(self.gate(x), self.top_k, self.norm_topk_prob)

    def fused(self, x: torch.Tensor) -> bool:
        """Whether `forward` runs the routing and grouped kernels for this activation."""
        return (
            hybrid_kernels_enabled(x)
            and self.experts.gate_up_proj.is_contiguous()
            and self.experts.down_proj.is_contiguous()
        )

    def _splits_router(self, x: torch.Tensor) -> bool:
        """Whether the fused path routes x with the split router launch (`SPLIT_ROUTER`)."""
        gate = self.gate
        experts = gate.weight.shape[0]
        return (
            SPLIT_ROUTER
            and not isinstance(gate, InvariantLinear)  # (the deterministic mode's product)
            and gate.weight.dtype == x.dtype
            and makes_logits(experts)
            and x.shape[0] <= route_block_rows(experts)
            and self.router_arrivals.device == x.device
        )

    def folds_next_norm(self, x: torch.Tensor) -> bool:
        """Whether `forward(x, residual, next_norm)` may fuse the next norm: the kernels' path of
        this class (not a subclass with its own forward: the tensor-parallel block all-reduces
        its partial sums before any norm)."""
        return type(self).forward is Qwen3NextSparseMoeBlock.forward and self.fused(x)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        next_norm: nn.Module | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> the block's output [N, H]. With `residual` and `next_norm` (a zero-centred
        RMSNorm; only where `fused(x)`): next_norm.forward_residual(output, residual), fused
        into the block's last launch."""
        if not self.fused(x):
            if residual is not None:
                raise ValueError("the residual add + norm is fused only into the kernels' path")
            experts, weights = self.route(x)
            shared = sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            return self.experts(x, experts, weights) + shared
        gate = self.gate.weight
        if self._splits_router(x):
            plan = route(
                None, self.top_k, norm_topk_prob=self.norm_topk_prob, shared=True,
                block_m=BLOCK_M, hidden=x, router=gate, arrivals=self.router_arrivals,
            )  # fmt: skip
        elif ROUTER_IN_KERNEL and makes_logits(gate.shape[0]) and gate.dtype == x.dtype:
            plan = route(
                None, self.top_k, norm_topk_prob=self.norm_topk_prob, shared=True,
                block_m=BLOCK_M, hidden=x, router=gate,
            )  # fmt: skip
        else:
            plan = route(
                self.gate(x), self.top_k, norm_topk_prob=self.norm_topk_prob, shared=True,
                block_m=BLOCK_M,
            )  # fmt: skip
        se = self.shared_expert
        shared = SharedExpert(
            se.gate_up_proj.weight, se.down_proj.weight, self.shared_expert_gate.weight[0]
        )
        experts = self.experts
        if residual is None:
            return grouped_experts(x, plan, experts.gate_up_proj, experts.down_proj, shared)
        return grouped_experts(
            x, plan, experts.gate_up_proj, experts.down_proj, shared,
            residual=residual, norm_weight=next_norm.weight, eps=next_norm.eps,
        )  # fmt: skip
