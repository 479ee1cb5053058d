"""A target split across a tensor-parallel group: the same modules as `models/qwen3.py` and
`models/qwen3_next.py`, built at one rank's shapes (`parallel.local_config`), with the places
where ranks meet: the row-parallel o, down and GDN out projections all-reduce their partial sums,
the vocabulary-parallel embedding all-reduces the rows each rank looked up, the head gathers each
rank's slice of the vocabulary, and a hybrid's MoE block all-reduces once the partial sums of its
experts (whole ones with expert parallelism, a slice of each without) and of its share of the
shared expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.config import ModelConfig
from metrale.distributed.parallel import TPGroup, experts_of, local_config
from metrale.models.attention import AttentionBackend
from metrale.models.layers import SwiGLUMLP
from metrale.models.qwen3 import Qwen3ForCausalLM
from metrale.models.qwen3_next import Qwen3NextForCausalLM
from metrale.models.qwen3_next_moe import Qwen3NextExperts, Qwen3NextSparseMoeBlock


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_shard @ W_shard^T) + b: the bias (whole on every rank) is added once,
    after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce_(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [rank * n, (rank + 1) * n) of the vocabulary; a token outside them looks up zeros,
    and the all-reduce gives every rank every token's row."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.tp = tp
        self.first = tp.rank * num_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce_(rows.masked_fill(outside[:, None], 0.0))


class ParallelSparseMoeBlock(Qwen3NextSparseMoeBlock):
    """The router whole on every rank (same rows in, same picks out). With expert parallelism
    this rank's experts, the other ranks' picks skipped; without, a slice of every expert's
    intermediate rows. Either way this rank's share of the shared expert (scaled by its gate,
    which is linear in that share), and one all-reduce of the sum."""

    def __init__(self, cfg: ModelConfig, local: ModelConfig, tp: TPGroup) -> None:
        super().__init__(local)  # the router: `local.hybrid.num_experts` is the whole count
        self.tp = tp
        self.first, count = experts_of(cfg, tp)
        h = cfg.hidden_size
        self.experts = Qwen3NextExperts(count, h, local.hybrid.moe_intermediate_size)
        self.shared_expert = SwiGLUMLP(h, local.hybrid.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        if self.tp.expert_parallel:
            local = experts - self.first
            count = self.experts.num_experts
            mine = (local >= 0) & (local < count)
            # Another rank's pick is id `count`: `Qwen3NextExperts` skips it, so each rank
            # computes its own experts' pairs alone. Each rank still takes every row (no
            # all-to-all): the rows are few in a decode step, and replicated already.
            experts, weights = local.masked_fill(~mine, count), weights.masked_fill(~mine, 0)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce_(self.experts(x, experts, weights) + shared)


def _row_parallel(linear: nn.Linear, tp: TPGroup) -> RowParallelLinear:
    return RowParallelLinear(linear.in_features, linear.out_features, linear.bias is not None, tp)


class _VocabParallel:
    """What both sharded targets share: the model built from this rank's config
    (`self.config`), the embedding split by vocabulary rows, and logits gathered from every
    rank's slice (float32 [R, V], so the sampler on rank 0 sees whole rows)."""

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int, tp: TPGroup
    ) -> None:
        local = local_config(cfg, tp)
        super().__init__(local, backend, max_positions)
        self.tp = tp
        self.model.embed_tokens = VocabParallelEmbedding(local.vocab_size, cfg.hidden_size, tp)

    def compute_logits(self, hidden, rows=None, out=None) -> torch.Tensor:
        logits = self.tp.all_gather_last(super().compute_logits(hidden, rows))
        return logits if out is None else out.copy_(logits)


class TPQwen3ForCausalLM(_VocabParallel, Qwen3ForCausalLM):
    """One rank's shard of a dense Qwen3 target."""

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int, tp: TPGroup
    ) -> None:
        super().__init__(cfg, backend, max_positions, tp)
        for layer in self.model.layers:
            layer.self_attn.o_proj = _row_parallel(layer.self_attn.o_proj, tp)
            layer.mlp.down_proj = _row_parallel(layer.mlp.down_proj, tp)


class TPQwen3NextForCausalLM(_VocabParallel, Qwen3NextForCausalLM):
    """One rank's shard of a hybrid Qwen3-Next target: gated attention split by heads as the
    dense one, GDN layers by key heads (each with its value heads, conv channels and recurrent
    state: `make_state` gives this rank's), experts as `ParallelSparseMoeBlock` says."""

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int, tp: TPGroup
    ) -> None:
        super().__init__(cfg, backend, max_positions, tp)
        local = self.config  # this rank's
        for layer in self.model.layers:
            if layer.layer_type == "linear_attention":
                layer.linear_attn.out_proj = _row_parallel(layer.linear_attn.out_proj, tp)
            else:
                layer.self_attn.o_proj = _row_parallel(layer.self_attn.o_proj, tp)
            if isinstance(layer.mlp, Qwen3NextSparseMoeBlock):
                layer.mlp = ParallelSparseMoeBlock(cfg, local, tp)
            else:
                layer.mlp.down_proj = _row_parallel(layer.mlp.down_proj, tp)
