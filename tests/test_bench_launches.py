"""The bench's launch count and batch roofline on a tiny hybrid shape, on CPU: `step_launches`
counts a decode step's would-be kernels (fewer with the fused paths forced on under the
interpreter), and `batch_weight_bytes` counts the experts a batch reads."""

from __future__ import annotations

import os

import pytest
import torch

from metrale.api import LLM
from metrale.bench.profile_step import step_launches
from metrale.bench.shapes import batch_weight_bytes, experts_read, write_shape
from metrale.bench.timing import weight_bytes
from metrale.knobs import knobs


@pytest.fixture(scope="module")
def tiny_next(tmp_path_factory):
    path = write_shape("qwen3-next-tiny", tmp_path_factory.mktemp("shape") / "next")
    return LLM(path, load_format="dummy", device="cpu", dtype="float32", max_model_len=128)


def test_batch_roofline_counts_the_experts_read(tiny_next):
    model = tiny_next.engine.runner.model
    hybrid = model.config.hybrid
    e, k = hybrid.num_experts, hybrid.num_experts_per_tok
    assert experts_read(e, k, 1) == k
    assert experts_read(64, 10, 16) == pytest.approx(59.78, abs=0.01)
    one, many = batch_weight_bytes(model, 1), batch_weight_bytes(model, 64)
    assert abs(one - weight_bytes(model)) <= 8  # per-tensor rounding in weight_bytes
    expert_bytes = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n
    )
    assert many == pytest.approx(one + expert_bytes * (e - k) / e, rel=1e-3)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the interpreter")
def test_step_launches_fall_with_the_fused_paths(tiny_next, monkeypatch):
    plain = step_launches(tiny_next, 1, context=16)
    assert plain["kernels"] == sum(plain["by_name"].values()) > 0
    monkeypatch.setenv("METRALE_FORCE_FUSED_KERNELS", "1")
    knobs.cache_clear()
    try:
        fused = step_launches(tiny_next, 1, context=16)
    finally:
        monkeypatch.undo()
        knobs.cache_clear()
    # a decode step's routing: the split router launch (the product in it), no router GEMM
    assert fused["by_name"].get("triton._split_route_kernel", 0) > 0
    assert fused["by_name"].get("triton._route_plan_kernel", 0) == 0
    assert fused["kernels"] < plain["kernels"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the interpreter")
def test_decode_step_launches_nothing_for_its_metadata(tiny_next, monkeypatch):
    """With every fused path of the GPU (the attention kernel, the norms too) under the
    interpreter, a batch-1 decode step launches the embedding, the GEMVs and the head's GEMM,
    the logits' float copy and the per-layer kernels, and nothing else: no index derivation
    (aranges, repeat_interleave, the row layout's gathers) once per step. Per layer: 4 MoE
    launches (the router product with the routing, gate/up, down, combine with the next norm),
    5 per GDN layer, 6 per attention layer."""
    from metrale.kernels import fused
    from metrale.kernels.dispatch import interpreter_forced
    from metrale.kernels.paged_attention import TritonPagedAttention

    runner = tiny_next.engine.runner
    model = runner.model
    backend = TritonPagedAttention()
    monkeypatch.setattr(runner, "backend", backend)
    monkeypatch.setattr(model, "backend", backend)
    for layer in model.attention_layers:
        monkeypatch.setattr(layer, "_backend", backend)
    monkeypatch.setattr(fused, "fused_enabled", lambda x: x.is_cuda or interpreter_forced(x))
    monkeypatch.setenv("METRALE_FORCE_FUSED_KERNELS", "1")
    knobs.cache_clear()
    try:
        got = step_launches(tiny_next, 1, context=16)["by_name"]
    finally:
        monkeypatch.undo()
        knobs.cache_clear()
    aten = {name: n for name, n in got.items() if name.startswith("aten.")}
    gdn, attn = len(model.gdn_layers), len(model.attention_layers)
    layers = gdn + attn
    # GEMMs: 2 per GDN layer (in, out), 2 per attention layer (qkv, o), as the few-row GEMV
    # kernel, and the head (cuBLAS); the logits' float copy (none here: the model runs in float32)
    want = {"aten.embedding": 1, "aten.linear": 1}
    assert got["triton._gemv_kernel"] == 2 * layers
    if model.model.embed_tokens.weight.dtype != torch.float32:
        want["aten.to"] = 1
    assert aten == want
    assert got["triton._add_rmsnorm_kernel"] == layers + 1  # the first input norm, each post
    assert got["triton._conv_kernel"] == got["triton._gated_norm_kernel"] == gdn
    assert got["triton._combine_kernel"] == got["triton._split_route_kernel"] == layers
    per_layer = 4 * layers + 3 * gdn + 3 * attn + got.get("triton._combine_splits_kernel", 0)
    assert sum(got.values()) == sum(want.values()) + 2 * layers + layers + 1 + per_layer
