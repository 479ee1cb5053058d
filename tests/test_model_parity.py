"""metrale's Qwen3 against transformers' own `Qwen3ForCausalLM` on the same saved random weights:
logits of every row (one-shot and chunked prefill over pages, decode rows) and greedy generation."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.config import EngineConfig, ModelConfig
from metrale.engine.llm import LLMEngine

transformers = pytest.importorskip("transformers")
TF_MAJOR = int(transformers.__version__.split(".")[0])


def rope(rope_type: str, **params) -> dict:
    """Rope settings in the layout of the installed transformers (4.x rope_scaling, 5.x
    rope_parameters); metrale reads both."""
    if TF_MAJOR >= 5:
        return {"rope_parameters": {"rope_type": rope_type, "rope_theta": 10000.0, **params}}
    return {"rope_scaling": {"rope_type": rope_type, **params}} if rope_type != "default" else {}


CONFIGS = {
    # GQA ratio 1, tied, head_dim == hidden / heads, plain rotary
    "mha_tied": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, **rope("default")),
    # GQA ratio 4, untied, head_dim != hidden / heads, linear rope scaling
    "gqa4_untied_linear": dict(
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        **rope("linear", factor=2.0),
    ),
    # GQA ratio 2, yarn scaling, attention bias, 3 layers
    "gqa2_yarn_bias": dict(
        num_hidden_layers=3,
        attention_bias=True,
        **rope("yarn", factor=4.0, original_max_position_embeddings=256),
    ),
    # multi-query (ratio 4 with one KV head), llama3 rope
    "mqa_llama3": dict(
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=24,
        **rope(
            "llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=128,
        ),
    ),
}


ROPE_TYPES = {
    "mha_tied": "default",
    "gqa4_untied_linear": "linear",
    "gqa2_yarn_bias": "yarn",
    "mqa_llama3": "llama3",
}


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def metrale_logits(model_dir, ids: list[int], chunks: list[int], page_size: int) -> torch.Tensor:
    """Run `ids` through the engine in prefill chunks of the given sizes (the last chunks may be
    1-row decode-like steps), returning every row's logits."""
    engine = LLMEngine(
        model_dir,
        EngineConfig(device="cpu", dtype="float32", page_size=page_size, max_num_seqs=4),
    )
    engine.add_request("r", ids, SamplingParams(max_tokens=1))
    seq = engine.requests["r"].seqs[0]
    out = []
    for chunk in chunks:
        engine.scheduler.max_num_batched_tokens = chunk
        batch = engine.scheduler.schedule()
        assert batch.entries[0].num_rows == chunk
        out.append(engine.runner.all_logits(batch))
        seq.num_computed_tokens += chunk
    assert seq.num_computed_tokens == len(ids)
    return torch.cat(out)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(hf_qwen3_factory, name):
    model_dir = hf_qwen3_factory(name, seed=1, **CONFIGS[name])
    assert ModelConfig.from_hf(model_dir).rope.rope_type == ROPE_TYPES[name]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (40,), generator=g).tolist()
    ref = hf_logits(model_dir, ids)
    # one-shot prefill, and chunked prefill over pages of 4 rows ending in 1-row steps
    for chunks, page in (([40], 16), ([7, 13, 16, 1, 1, 1, 1], 4)):
        got = metrale_logits(model_dir, ids, chunks, page)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_greedy_64_tokens_match_transformers_generate(hf_qwen3_factory):
    model_dir = hf_qwen3_factory("gqa4_untied_linear", seed=1, **CONFIGS["gqa4_untied_linear"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model_dir, device="cpu", dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = [[5, 17, 300, 42, 9], list(range(100, 133))]
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=64,
                min_new_tokens=64,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"
