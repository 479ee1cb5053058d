"""The hybrid target's fused kernels on CUDA at qwen3-next-a3b-64e's shapes (H 2048, 64 experts,
top-10, I 512, GDN 16/32 heads of 128, attention 16/2 heads of 256, bf16): equal to their torch
references, each row bitwise the same whatever the batch around it (1, 3, 17, 64 rows, the row
at several places), and the MoE block captured in a CUDA graph without a sync.

    python -m pytest -q tests/test_hybrid_kernels_gpu.py   (skipped without CUDA)
"""

from __future__ import annotations

import math

import pytest
import torch

from metrale.config import ModelConfig, RopeConfig
from metrale.kernels import gdn_fused, moe, moe_routing, next_attention
from metrale.models import qwen3_next_moe
from metrale.models.gdn import RowLayout, gated_rms_norm
from metrale.models.layers import RotaryEmbedding
from metrale.models.qwen3_next import ZeroCentredRMSNorm
from metrale.models.qwen3_next_moe import Qwen3NextSparseMoeBlock

pytestmark = pytest.mark.gpu
H, E, K, INTER = 2048, 64, 10, 512
BATCHES = ((1, 0), (3, 1), (3, 2), (17, 0), (17, 9), (17, 16), (64, 0), (64, 63), (256, 200))


def _block() -> Qwen3NextSparseMoeBlock:
    raw = dict(
        architectures=["Qwen3NextForCausalLM"], hidden_size=H, intermediate_size=5120,
        num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, num_experts=E, num_experts_per_tok=K,
        moe_intermediate_size=INTER, shared_expert_intermediate_size=INTER, vocab_size=64,
    )  # fmt: skip
    block = Qwen3NextSparseMoeBlock(ModelConfig.from_dict(raw))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return block.cuda().bfloat16()


def _rows_with(row: torch.Tensor, n: int, at: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, *row.shape[1:], generator=torch.Generator().manual_seed(seed))
    x = x.to(row.device, row.dtype)
    x[at] = row[0]
    return x


def test_routing_matches_the_reference_with_bf16_ties():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(256, E, generator=gen) * 2).cuda().bfloat16()  # bf16 logits tie often
    plan = moe_routing.route(logits, K, shared=True)
    ids, weights = moe_routing.route_reference(logits, K, True)
    assert torch.equal(plan.ids.long(), ids)
    torch.testing.assert_close(plan.weights, weights, rtol=0, atol=2**-8)


@pytest.mark.parametrize("n", [1, 16, 64, 256])
def test_moe_block_matches_the_reference(n, monkeypatch):
    block = _block()
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(n)).cuda().bfloat16()
    with torch.no_grad():
        monkeypatch.setattr(qwen3_next_moe, "hybrid_kernels_enabled", lambda x: False)
        ref = block(x)
        exact = block.float()(x.float())  # the same bf16 weights, float32 math
        block.bfloat16()
        monkeypatch.setattr(qwen3_next_moe, "hybrid_kernels_enabled", lambda x: True)
        out = block(x)
    err = ((out.float() - exact).norm() / exact.norm()).item()
    err_ref = ((ref.float() - exact).norm() / exact.norm()).item()
    assert err < max(2 * err_ref, 4e-3), (err, err_ref)


def test_moe_rows_are_batch_invariant(monkeypatch):
    monkeypatch.setattr(qwen3_next_moe, "hybrid_kernels_enabled", lambda x: True)
    block = _block()
    norm = ZeroCentredRMSNorm(H, 1e-6).cuda().bfloat16()
    row = torch.randn(1, H, generator=torch.Generator().manual_seed(2)).cuda().bfloat16()
    res_row = torch.randn(1, H, generator=torch.Generator().manual_seed(3)).cuda().bfloat16()
    outs = []
    with torch.no_grad():
        single = moe_routing.SINGLE_MAX_BLOCKS
        for i, (n, at) in enumerate(BATCHES):
            # 256 rows: the routing's two-launch form (a program per block)
            monkeypatch.setattr(moe_routing, "SINGLE_MAX_BLOCKS", 0 if n == 256 else single)
            x, residual = _rows_with(row, n, at, 10 + i), _rows_with(res_row, n, at, 50 + i)
            # the router product made in the routing kernel: the row's logits are its own too
            gate = block.gate.weight
            plan = moe_routing.route(
                None, K, shared=True, block_m=moe.BLOCK_M, hidden=x, router=gate
            )
            se = block.shared_expert
            shared = moe.SharedExpert(
                se.gate_up_proj.weight, se.down_proj.weight, block.shared_expert_gate.weight[0]
            )
            exp = block.experts
            normed, res = moe.grouped_experts(
                x, plan, exp.gate_up_proj, exp.down_proj, shared,
                residual=residual, norm_weight=norm.weight, eps=1e-6,
            )  # fmt: skip
            out = moe.grouped_experts(x, plan, exp.gate_up_proj, exp.down_proj, shared)
            outs.append((out[at], normed[at], res[at], plan.ids[at], plan.weights[at]))
    for (n, at), other in zip(BATCHES[1:], outs[1:], strict=True):
        for a, b in zip(outs[0], other, strict=True):
            assert torch.equal(a, b), (n, at)


def test_gdn_and_attention_glue_rows_are_batch_invariant():
    hv, dv, channels = 32, 128, 2 * 2048 + 4096
    gen = torch.Generator().manual_seed(4)
    proj_row = torch.randn(1, channels + 4096 + 2 * hv, generator=gen).cuda().bfloat16()
    out_row = torch.randn(1, 1, hv, dv, generator=gen).cuda().bfloat16()
    a_log, dt_bias = torch.randn(hv).cuda(), torch.randn(hv).cuda()
    weight = torch.ones(dv).cuda().bfloat16()
    heads, kv, d = 16, 2, 256
    qkv_row = torch.randn(1, 2 * heads * d + 2 * kv * d, generator=gen).cuda().bfloat16()
    rotary = RotaryEmbedding(RopeConfig(theta=1e7), 64, 4096).cuda()
    outs = []
    for i, (n, at) in enumerate(BATCHES):
        proj = _rows_with(proj_row, n, at, 100 + i)
        starts = torch.arange(n + 1).cuda()
        layout = RowLayout.build(starts, 1, n)
        mixed, z, ba = proj.split([channels, 4096, 2 * hv], -1)
        _, g, beta = gdn_fused.prepare(mixed, ba, a_log, dt_bias, layout.index, layout.lengths)
        out = _rows_with(out_row.view(1, -1), n, at, 200 + i).view(n, 1, hv, dv)
        normed = gdn_fused.gated_norm(out, z, weight, 1e-6, layout.row_seq, layout.row_offset)
        qkv = _rows_with(qkv_row, n, at, 300 + i)
        positions = torch.full((n,), 1234).cuda()
        q, k = next_attention.qk_norm_rope(
            qkv, weight[:1].expand(d), weight[:1].expand(d), rotary.cos, rotary.sin, positions,
            heads, kv, 1e-6,
        )  # fmt: skip
        gated = next_attention.output_gate(q.contiguous(), qkv, heads)
        outs.append((g[at], beta[at], normed[at], q[at], k[at], gated[at]))
        if i == 0:  # and equal to the references
            ref = gated_rms_norm(out.view(n, hv, dv), z.reshape(n, hv, dv), weight, 1e-6)
            torch.testing.assert_close(normed, ref.view(n, -1), rtol=2e-2, atol=2e-2)
    for (n, at), other in zip(BATCHES[1:], outs[1:], strict=True):
        for a, b in zip(outs[0], other, strict=True):
            assert torch.equal(a, b), (n, at)


def test_moe_block_is_graph_capturable(monkeypatch):
    """The fused block has no host sync: captured once, replayed over new inputs."""
    monkeypatch.setattr(qwen3_next_moe, "hybrid_kernels_enabled", lambda x: True)
    block = _block()
    x = torch.randn(16, H).cuda().bfloat16()
    stream = torch.cuda.Stream()
    with torch.no_grad():
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            block(x)  # warm-up: compiles
            torch.cuda.set_sync_debug_mode("error")
            try:
                block(x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = block(x)
        x.copy_(torch.randn(16, H).cuda().bfloat16())
        graph.replay()
        torch.testing.assert_close(out, block(x), rtol=0, atol=0)
