"""A dense Qwen3 target split across a tensor-parallel group: the same modules as
`models/qwen3.py`, built at one rank's shapes (`parallel.local_config`), with the three places
where ranks meet: the row-parallel o and down projections all-reduce their partial sums, the
vocabulary-parallel embedding all-reduces the rows each rank looked up, and the head gathers
each rank's slice of the vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.config import ModelConfig
from metrale.distributed.parallel import TPGroup, local_config
from metrale.models.attention import AttentionBackend
from metrale.models.qwen3 import Qwen3ForCausalLM


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


class TPQwen3ForCausalLM(Qwen3ForCausalLM):
    """One rank's shard of a dense Qwen3 target; `compute_logits` returns every rank's vocabulary
    (float32 [R, V]), so the sampler on rank 0 sees whole rows."""

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int, tp: TPGroup
    ) -> None:
        local = local_config(cfg, tp.size)
        super().__init__(local, backend, max_positions)
        self.tp = tp
        inner = self.model
        inner.embed_tokens = VocabParallelEmbedding(local.vocab_size, cfg.hidden_size, tp)
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallelLinear(attn.q_size, cfg.hidden_size, cfg.attention_bias, tp)
            mlp.down_proj = RowParallelLinear(local.intermediate_size, cfg.hidden_size, False, tp)

    def compute_logits(self, hidden, rows=None, out=None) -> torch.Tensor:
        logits = self.tp.all_gather_last(super().compute_logits(hidden, rows))
        return logits if out is None else out.copy_(logits)
