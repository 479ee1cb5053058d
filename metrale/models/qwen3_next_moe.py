"""The sparse MoE block of Qwen3-Next (HF `Qwen3NextSparseMoeBlock`): a softmax router picks the
top-k experts of each row (their weights renormalised to sum 1 when `norm_topk_prob`), each a
SwiGLU MLP, plus one shared SwiGLU expert scaled by a sigmoid gate of its own.

The experts are stacked as HF 5.x keeps them (`experts.gate_up_proj` [E, 2I, H] with gate rows
first, `experts.down_proj` [E, H, I]); the loader fills them from per-expert checkpoint tensors
(`experts.{e}.gate_proj.weight`, ...) as well. Small batches (decode, verify) gather each row's
experts and run batched matmuls without a host sync; larger ones loop over the experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.config import ModelConfig
from metrale.models.layers import SwiGLUMLP

# Up to this many (row, expert) pairs, the experts' weights are gathered per row (sync-free,
# but each pair copies its expert's weights); above it, the loop reads each expert once.
GATHER_MAX_PAIRS = 64


class Qwen3NextExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [N, H]; experts, weights [N, k] (expert ids and their routing weights) -> [N, H]."""
        if experts.numel() <= GATHER_MAX_PAIRS:
            return self._gathered(x, experts, weights)
        return self._looped(x, experts, weights)

    def _gathered(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Each row's k experts gathered and applied as batched matmuls: no host sync, so decode
        and verify steps keep their one sync per step (and can be graph-captured)."""
        gate_up = torch.einsum("nh,nkoh->nko", x, self.gate_up_proj[experts])  # [N, k, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch.einsum("nki,nkhi->nkh", F.silu(gate) * up, self.down_proj[experts])
        return (y * weights[..., None]).sum(dim=1).to(x.dtype)

    def _looped(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """One pass per expert over the rows routed to it (prefill-sized batches)."""
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            rows, pick = torch.where(experts == e)  # NOTE: a host sync; reference path
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[rows, pick, None]
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

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (expert ids [N, k], routing weights [N, k] in x's dtype)."""
        logits = self.gate(x)  # [N, E]
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, experts, weights) + shared
