"""Training-time modules: a plain causal Qwen3 and a Qwen3-Next-layout MTP head, under HF names.

The engine's modules (`metrale.models`) run packed rows over a paged KV cache with fused q/k/v
and gate/up weights; training wants dense [batch, seq] tensors, autograd and
`scaled_dot_product_attention(is_causal=True)`. These modules compute the same function with
unfused weights whose `state_dict` names are exactly the checkpoint's:

- `CausalLM`: `model.embed_tokens`, `model.layers.N.{self_attn.{q,k,v,o}_proj, self_attn.q_norm,
  self_attn.k_norm, mlp.{gate,up,down}_proj, input_layernorm, post_attention_layernorm}`,
  `model.norm`, and `lm_head` when the embeddings are untied (HF `Qwen3ForCausalLM`);
- `MTPHead`: `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc`, `norm`, `layers.N.*` (the
  Qwen3-Next `mtp.*` tensors without the prefix).

Norms and rotary are the engine's own (`RMSNorm`, minus its inference-only fused kernels, and
`RotaryEmbedding`), so numerics agree with `metrale.models` and with transformers to float32
rounding.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from metrale.config import ModelConfig
from metrale.models.layers import RMSNorm as _EngineRMSNorm
from metrale.models.layers import RotaryEmbedding
from metrale.models.loader import checkpoint_files

INIT_STD = 0.02


def dense_target_config(target_dir: Path, stage: str) -> ModelConfig:
    """The target's config, or a ValueError for a target these trainers cannot run: they
    train drafters over a dense Qwen3 (a Qwen3-Next target failed later with a weight-shape
    error, after its copy was written; found in review)."""
    cfg = ModelConfig.from_hf(target_dir)
    if cfg.hybrid is not None:
        raise ValueError(
            f"target: {target_dir} is a hybrid (Qwen3-Next) model; `metrale train {stage}` "
            "trains drafters for a dense Qwen3 target"
        )
    return cfg


class RMSNorm(_EngineRMSNorm):
    """The engine's RMSNorm (same parameter, same float32 reduction), always as plain torch ops:
    the engine's CUDA fast path calls inference-only fused kernels that autograd cannot see."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """GQA self-attention with per-head QK RMSNorm and rotary, causal over its input rows."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        q, kv = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, q, bias=bias)
        self.k_proj = nn.Linear(h, kv, bias=bias)
        self.v_proj = nn.Linear(h, kv, bias=bias)
        self.o_proj = nn.Linear(q, h, bias=bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding
    ) -> torch.Tensor:
        """x [B, T, H], positions [T] -> [B, T, H]."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        # The engine's rotary takes rows [T, heads, D]; its cos/sin [T, 1, D/2] broadcast over B.
        q, k = rotary(positions, q, k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [B, heads, T, D]
        out = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), is_causal=True, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block; returns the residual stream after attention and MLP (no final norm)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's `Qwen3Model` (the `model.` prefix): embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """A dense Qwen3 for training. `forward(ids)` returns the final-normed hidden states, the
    same quantity the engine's `Qwen3Model.forward` returns (and MTP heads consume)."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        # No parameters, non-persistent buffers: the state_dict keeps HF's names only.
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] (positions 0..T-1) -> final-normed hidden [B, T, H]."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, self.rotary)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> float32 logits [..., V] (the loss wants float32 whatever autocast
        computed the projection in)."""
        return F.linear(hidden, self.head_weight).float()

    def init_weights(self, gen: torch.Generator) -> None:
        init_weights(self, gen, self.config.num_hidden_layers)

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, max_positions: int) -> CausalLM:
        """The target in `model_dir` in float32 (other tensors in the files, MTP heads say, are
        skipped); every parameter must be present with its shape."""
        model = cls(ModelConfig.from_hf(model_dir), max_positions)
        state = model.state_dict()
        loaded: set[str] = set()
        for path in checkpoint_files(model_dir):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    if name not in state:
                        continue
                    tensor = f.get_tensor(name)
                    if tensor.shape != state[name].shape:
                        raise ValueError(
                            f"{path.name}: tensor {name} has shape {tuple(tensor.shape)}, "
                            f"expected {tuple(state[name].shape)}"
                        )
                    state[name].copy_(tensor.float())
                    loaded.add(name)
        missing = sorted(set(state) - loaded)
        if missing:
            raise ValueError(
                f"{model_dir}: checkpoint lacks {missing[:5]} ({len(missing)} missing)"
            )
        return model


class MTPHead(nn.Module):
    """Qwen3-Next-layout MTP modules: shared fc and norms, one decoder layer per module.

    `forward` is `metrale.models.mtp.MTPModule.forward` for dense rows: (tokens at p+1, hidden at
    p, rotary positions) -> post-norm `out`, which the target head projects and which the next
    chained step consumes (the Qwen3-Next convention). Module `step % num_layers` serves draft
    step `step`, as `MTPHeads.for_step` does.
    """

    def __init__(self, cfg: ModelConfig, num_layers: int = 1) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"the MTP head needs >= 1 layer, got {num_layers}")
        self.config = cfg
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(h, eps)
        self.pre_fc_norm_hidden = RMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(num_layers))
        self.norm = RMSNorm(h, eps)

    def forward(
        self,
        step: int,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        embed: nn.Embedding,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        """tokens [B, T] (at p+1), hidden [B, T, H] (at p), positions [T] -> out [B, T, H]."""
        emb = self.pre_fc_norm_embedding(embed(tokens))
        u = self.fc(torch.cat([emb, self.pre_fc_norm_hidden(hidden)], dim=-1))  # [B, T, 2H] -> H
        x = self.layers[step % len(self.layers)](u, positions, rotary)
        return self.norm(x)

    def init_weights(self, gen: torch.Generator) -> None:
        init_weights(self, gen, len(self.layers))


@torch.no_grad()
def init_weights(module: nn.Module, gen: torch.Generator, num_layers: int) -> None:
    """N(0, 0.02) matrices and embeddings, zero biases, all-ones norms; the residual-stream
    writers (o_proj, down_proj) are scaled by 1/sqrt(2 * layers) so the stream's variance does
    not grow with depth (GPT-2's init). Drawn on CPU from `gen` in parameter order, so one seed
    gives the same weights on every device."""
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            std = INIT_STD
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std /= math.sqrt(2 * num_layers)
            p.copy_(torch.randn(p.shape, generator=gen) * std)
