"""The bench's launch count and batch roofline on a tiny hybrid shape, on CPU: `step_launches`
counts a decode step's would-be kernels (fewer with the fused paths forced on under the
interpreter), and `batch_weight_bytes` counts the experts a batch reads."""

from __future__ import annotations

import os

import pytest

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
    assert fused["by_name"].get("triton._route_plan_kernel", 0) > 0
    assert fused["kernels"] < plain["kernels"]
