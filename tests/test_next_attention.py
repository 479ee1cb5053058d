"""Qwen3-Next attention glue kernels (`kernels/next_attention.py`) against the torch path of
`Qwen3NextAttention`: (1 + w) QK-norm and partial rotary read from the interleaved q/gate
projection, and the output gate. Under Triton's interpreter on CPU."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from metrale.config import RopeConfig  # noqa: E402
from metrale.kernels import next_attention  # noqa: E402
from metrale.models.attention import write_kv  # noqa: E402
from metrale.models.layers import RotaryEmbedding  # noqa: E402
from metrale.models.qwen3_next import ZeroCentredRMSNorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not set", allow_module_level=True)


def _tol(dtype):
    # bf16: two ulps (the interpreter truncates instead of rounding, over a chain of roundings)
    return dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-6, atol=2**-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_fraction", [0.25, 0.5, 1.0])
def test_qk_norm_rope_equals_the_torch_path(dtype, rotary_fraction):
    heads, kv_heads, dim, rows = 4, 2, 16, 5
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(rows, 2 * heads * dim + 2 * kv_heads * dim + 3, generator=gen)
    qkv = qkv.to(DEVICE, dtype)[:, :-3]  # a row-strided view, as a slice would be
    q_norm = ZeroCentredRMSNorm(dim, 1e-6).to(DEVICE, dtype)
    k_norm = ZeroCentredRMSNorm(dim, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        q_norm.weight.normal_(0, 0.2)
        k_norm.weight.normal_(0, 0.2)
    rope = RopeConfig(rope_type="default", theta=10000.0)
    rotary = RotaryEmbedding(rope, int(dim * rotary_fraction), 64).to(DEVICE)
    positions = torch.tensor([0, 3, 17, 63, 5], device=DEVICE)
    q, k = next_attention.qk_norm_rope(
        qkv, q_norm.weight, k_norm.weight, rotary.cos, rotary.sin, positions, heads, kv_heads, 1e-6
    )
    # the torch path of Qwen3NextAttention.forward
    q_size = 2 * heads * dim
    qg, k_ref, _ = qkv.split([q_size, kv_heads * dim, kv_heads * dim], -1)
    q_ref, _ = qg.reshape(rows, heads, 2 * dim).chunk(2, dim=-1)
    q_ref = q_norm._reference(q_ref)
    k_ref = k_norm._reference(k_ref.reshape(rows, kv_heads, dim))
    rot = 2 * rotary.cos.shape[-1]
    q_rot, k_rot = rotary(positions, q_ref[..., :rot], k_ref[..., :rot])
    q_ref = torch.cat([q_rot, q_ref[..., rot:]], -1)
    k_ref = torch.cat([k_rot, k_ref[..., rot:]], -1)
    torch.testing.assert_close(q, q_ref, **_tol(dtype))
    torch.testing.assert_close(k, k_ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_gate_equals_the_torch_path(dtype):
    heads, dim, rows = 4, 16, 3
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(rows, 2 * heads * dim + 64, generator=gen).to(DEVICE, dtype)
    attn = torch.randn(rows, heads, dim, generator=gen).to(DEVICE, dtype)
    out = next_attention.output_gate(attn, qkv, heads)
    gate = qkv[:, : 2 * heads * dim].reshape(rows, heads, 2 * dim)[..., dim:]
    ref = attn.reshape(rows, -1) * torch.sigmoid(gate.reshape(rows, -1))
    torch.testing.assert_close(out, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_writes_the_rows_kv_into_their_slots(dtype):
    """With a cache and slots the kernel also stores each row's k and v at its slot: the cache
    equals `write_kv` of the same k and v (bit for bit), and no other slot changes."""
    heads, kv_heads, dim, rows, pages, page = 4, 2, 16, 5, 3, 4
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(rows, 2 * heads * dim + 2 * kv_heads * dim + 3, generator=gen)
    qkv = qkv.to(DEVICE, dtype)[:, :-3]
    weight = (torch.randn(dim, generator=gen) * 0.2).to(DEVICE, dtype)
    rotary = RotaryEmbedding(RopeConfig(rope_type="default", theta=10000.0), dim // 4, 64)
    rotary = rotary.to(DEVICE)
    positions = torch.tensor([0, 3, 17, 63, 5], device=DEVICE)
    slots = torch.tensor([9, 0, 4, 11, 2], device=DEVICE)  # scattered over the pages
    cache = torch.randn(2, pages, page, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    want = cache.clone()
    args = (qkv, weight, weight, rotary.cos, rotary.sin, positions, heads, kv_heads, 1e-6)
    q, k = next_attention.qk_norm_rope(*args, cache, slots)
    q_alone, k_alone = next_attention.qk_norm_rope(*args)
    assert torch.equal(q, q_alone) and torch.equal(k, k_alone)
    v = qkv[:, 2 * heads * dim + kv_heads * dim :].reshape(rows, kv_heads, dim)
    write_kv(want, k, v, slots)
    assert torch.equal(cache, want)
