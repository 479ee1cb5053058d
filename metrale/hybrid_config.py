"""The Qwen3-Next (hybrid Gated DeltaNet) part of a model's configuration, read from its HF
config.json with `transformers.Qwen3NextConfig`'s defaults; `config.ModelConfig.hybrid` holds
it (None for dense Qwen3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class HybridConfig:
    """What a Qwen3-Next (`Qwen3NextForCausalLM`) target adds to the dense shape: Gated DeltaNet
    ("linear_attention") layers between gated full-attention layers, sparse MoE with a shared
    expert, and rotary on the first `partial_rotary_factor` of each attention head."""

    layer_types: tuple[str, ...]  # per layer: "linear_attention" (GDN) | "full_attention"
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int  # 0: every layer has a dense MLP of `intermediate_size`
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    partial_rotary_factor: float

    def is_moe_layer(self, layer: int) -> bool:
        """HF's rule: a sparse MoE block unless listed dense or off the `decoder_sparse_step`."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def gdn_layers(self) -> list[int]:
        """Indices of the GDN layers; the i-th one owns entry i of the recurrent state."""
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv (q, k and v of every head)."""
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * key_dim + self.linear_num_value_heads * self.linear_value_head_dim


def hybrid_from_hf(
    cfg: dict[str, Any], source: str, num_layers: int, head_dim: int, positive_int: Any
) -> HybridConfig:
    """Read the Qwen3-Next fields, defaulting as `transformers.Qwen3NextConfig` does."""

    def pos(key: str, default: int) -> int:
        return positive_int(key, cfg.get(key, default))

    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = pos("full_attention_interval", 4)
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(num_layers)
        ]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ValueError(f"{source}: field 'layer_types' must list {num_layers} layer types")
    if any(t not in LAYER_TYPES for t in layer_types):
        raise ValueError(
            f"{source}: field 'layer_types' holds {sorted(set(layer_types) - set(LAYER_TYPES))}; "
            f"expected {LAYER_TYPES}"
        )
    key_heads, value_heads = pos("linear_num_key_heads", 16), pos("linear_num_value_heads", 32)
    if value_heads % key_heads:
        raise ValueError(
            f"{source}: linear_num_value_heads {value_heads} is not a multiple of "
            f"linear_num_key_heads {key_heads}"
        )
    kernel = pos("linear_conv_kernel_dim", 4)
    if kernel < 2:
        raise ValueError(f"{source}: field 'linear_conv_kernel_dim' must be >= 2, got {kernel}")
    num_experts = cfg.get("num_experts", 512)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 0:
        raise ValueError(f"{source}: field 'num_experts' must be an integer >= 0")
    top_k = pos("num_experts_per_tok", 10)
    if num_experts and top_k > num_experts:
        raise ValueError(f"{source}: num_experts_per_tok {top_k} exceeds num_experts {num_experts}")
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(not isinstance(i, int) for i in dense):
        raise ValueError(f"{source}: field 'mlp_only_layers' must list layer indices")
    rope = cfg.get("rope_parameters") or {}
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    rotary_dim = int(head_dim * partial)
    if not 0 < partial <= 1 or rotary_dim == 0 or rotary_dim % 2:
        raise ValueError(
            f"{source}: partial_rotary_factor {partial} gives rotary dim {rotary_dim} of "
            f"head_dim {head_dim}; it must be even and > 0"
        )
    return HybridConfig(
        layer_types=tuple(layer_types),
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=pos("linear_key_head_dim", 128),
        linear_value_head_dim=pos("linear_value_head_dim", 128),
        linear_conv_kernel_dim=kernel,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=pos("moe_intermediate_size", 512),
        shared_expert_intermediate_size=pos("shared_expert_intermediate_size", 512),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        decoder_sparse_step=pos("decoder_sparse_step", 1),
        mlp_only_layers=tuple(dense),
        partial_rotary_factor=partial,
    )
