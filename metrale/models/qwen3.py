"""The dense Qwen3 target (HF `Qwen3ForCausalLM`): GQA attention with QK-norm and rotary, SwiGLU.

`forward(input_ids, positions, meta) -> hidden` runs the packed rows of one step over the paged KV
cache; `compute_logits(hidden, rows)` projects only the rows that need logits, so a long prefill
chunk costs one vocab projection, not one per token.

Parameter names follow HF's except for two fused weights (q/k/v -> `qkv_proj`, gate/up ->
`gate_up_proj`); `PACKED_MODULES` tells the loader how to fill them.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.config import ModelConfig
from metrale.kernels import fused
from metrale.models.attention import AttentionBackend, AttentionMetadata
from metrale.models.layers import HiddenTaps, RMSNorm, RotaryEmbedding, SwiGLUMLP

# fused parameter suffix -> [(HF suffix, shard index)]; shards are concatenated along dim 0.
PACKED_MODULES = {
    "qkv_proj": [("q_proj", 0), ("k_proj", 1), ("v_proj", 2)],
    "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
}


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        # Shared, not owned: registering them as submodules would duplicate buffers per layer.
        self._rotary = (rotary,)
        self._backend = backend
        self.kv_cache: torch.Tensor | None = None  # [2, pages, page_size, Hkv, D], bound by runner

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        rows = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = v.view(rows, self.num_kv_heads, self.head_dim)
        rotary = self._rotary[0]
        if self.kv_cache is None:
            raise RuntimeError("attention layer has no KV cache bound; the runner binds it")
        written = fused.fused_enabled(qkv) and self.head_dim & (self.head_dim - 1) == 0
        if written:  # the glue kernel writes k and v into the cache too
            q, k = fused.qk_norm_rope(
                qkv,
                self.q_norm.weight,
                self.k_norm.weight,
                rotary.cos,
                rotary.sin,
                positions,
                self.num_heads,
                self.num_kv_heads,
                self.q_norm.eps,
                self.kv_cache,
                meta.slot_mapping,
            )
        else:
            q = self.q_norm(q.view(rows, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(rows, self.num_kv_heads, self.head_dim))
            q, k = rotary(positions, q, k)
        out = self._backend.forward(q, k, v, self.kv_cache, meta, self.scale, kv_written=written)
        return self.o_proj(out.reshape(rows, self.q_size))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, rotary, backend)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_residual(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm.forward_residual(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(cfg, self.rotary, backend) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.taps: HiddenTaps | None = None  # set by a runner whose drafter reads them

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        taps = self.taps
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, meta)
            if taps is not None:
                taps.write(i, hidden, residual)
        if taps is not None:
            taps.finish(positions, meta.slot_mapping)
        hidden, _ = self.norm.forward_residual(hidden, residual)
        return hidden


class Qwen3ForCausalLM(nn.Module):
    """The target. `forward` returns final-normed hidden states [T, H] of every packed row."""

    packed_modules = PACKED_MODULES
    # the head's product; `make_batch_invariant` swaps in the batch-invariant kernel
    head_linear = staticmethod(torch.nn.functional.linear)

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.config = cfg
        self.backend = backend
        self.model = Qwen3Model(cfg, backend, max_positions)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def attention_layers(self) -> list[Qwen3Attention]:
        return [layer.self_attn for layer in self.model.layers]

    @property
    def head_weight(self) -> torch.Tensor:
        """[V, H] output projection (the embedding when tied); drafters share it."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        meta = self.backend.prepare(meta)
        return self.model(input_ids, positions, meta)

    def compute_logits(
        self,
        hidden: torch.Tensor,
        rows: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden [T, H], rows [R] (None = all) -> float32 logits [R, V], into `out` if given
        (a graph's shared logits buffer: the float32 conversion writes it directly)."""
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        logits = self.head_linear(hidden, self.head_weight)
        return logits.float() if out is None else out.copy_(logits)
