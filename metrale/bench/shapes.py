"""Model shapes for `metrale bench`: published Qwen3 / Qwen3-Next config numbers (run with random
weights, `load_format="dummy"`) and tiny shapes for CPU runs; and the roofline of a batch of a
sparse MoE target, which reads more experts than one token does (`batch_weight_bytes`)."""

from __future__ import annotations

import json
from pathlib import Path

from metrale.default_model import write_tokenizer

# Published config numbers of the Qwen3 family (HF config.json), and a tiny shape for CPU runs.
SHAPES = {
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "qwen3-1.7b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    # Qwen3-Next-80B-A3B's published layout with 64 of its 512 experts (the same experts per
    # token, so the same bytes per token at small batch; 19 GB of bf16 weights instead of 160).
    "qwen3-next-a3b-64e": dict(
        architectures=["Qwen3NextForCausalLM"],
        model_type="qwen3_next",
        hidden_size=2048,
        intermediate_size=5120,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        num_experts=64,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        partial_rotary_factor=0.25,
        rope_theta=10000000.0,
        tie_word_embeddings=False,
    ),
    "qwen3-next-tiny": dict(
        architectures=["Qwen3NextForCausalLM"],
        model_type="qwen3_next",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
}
_COMMON = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=151936,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    torch_dtype="bfloat16",
    eos_token_id=151645,
)


def write_shape(name: str, path: Path) -> Path:
    """A weightless checkpoint directory of a named shape (run with load_format="dummy")."""
    if name not in SHAPES:
        raise ValueError(f"--shape {name!r}: expected one of {sorted(SHAPES)}")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**_COMMON, **SHAPES[name]}, indent=2))
    write_tokenizer(path)
    return path


def experts_read(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a batch of `batch` rows reads in one MoE layer, expected when each row
    picks top_k of num_experts at random: E (1 - (1 - k/E)^B). Batch 1 reads k; at
    qwen3-next-a3b-64e's 10 of 64, batch 16 reads 59.8 and batch 64 all but 0.001."""
    if num_experts <= 0 or batch <= 0:
        return float(min(top_k, num_experts))
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def batch_weight_bytes(model, batch: int) -> int:
    """Weight bytes one decode step of `batch` rows reads: `timing.weight_bytes` (every weight
    once, a token's k of E routed experts) with the routed experts counted at
    `experts_read(batch)` of E instead."""
    from metrale.bench.timing import weight_bytes

    total = weight_bytes(model)
    hybrid = getattr(getattr(model, "config", None), "hybrid", None)
    if hybrid is None or not hybrid.num_experts:
        return total
    e, k = hybrid.num_experts, hybrid.num_experts_per_tok
    seen, experts = set(), 0
    for name, p in model.named_parameters():
        if ".experts." in name + "." and p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            experts += p.numel() * p.element_size()
    # weight_bytes counted experts * k / E (rounded down per tensor); add the rest of the batch's
    return total + int(experts * (experts_read(e, k, batch) - k) / e)
