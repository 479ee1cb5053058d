"""The GDN layer's fused glue against its torch path: `gdn_fused.prepare` (gates and padding) and
`gdn_fused.gated_norm` against the ops they replace, and the whole `Qwen3NextGatedDeltaNet` fused
(one in-projection GEMM over reordered rows) against its torch path, over decode rows, ragged
verify-like rows and prefill chunks, in every state mode. Under Triton's interpreter on CPU.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from metrale.config import ModelConfig  # noqa: E402
from metrale.kernels import gdn_fused  # noqa: E402
from metrale.models import gdn_state, qwen3_next_gdn  # noqa: E402
from metrale.models.gdn import RowLayout, gated_rms_norm  # noqa: E402
from metrale.models.gdn_state import GDNState, StateMode  # noqa: E402
from metrale.models.qwen3_next_gdn import Qwen3NextGatedDeltaNet  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not set", allow_module_level=True)

LAYOUTS = {"decode": [1, 1, 1], "ragged": [3, 1, 4], "prefill": [7, 20]}


def _layout(lengths: list[int]) -> RowLayout:
    starts = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
    return RowLayout.build(starts, max(lengths), sum(lengths))


def _eager_layout(starts: torch.Tensor, max_q: int, num_rows: int) -> dict[str, torch.Tensor]:
    """Every index of a layout, derived at once as `RowLayout.build` did before it derived
    them on use: the reference."""
    device = starts.device
    lengths = starts[1:] - starts[:-1]
    offs = torch.arange(max(max_q, 1), device=device)
    valid = offs[None, :] < lengths[:, None]
    index = torch.where(valid, starts[:-1, None] + offs[None, :], 0)
    row_seq = torch.repeat_interleave(
        torch.arange(lengths.shape[0], device=device), lengths, output_size=num_rows
    )
    row_offset = torch.arange(num_rows, device=device) - starts[:-1][row_seq]
    return dict(index=index, valid=valid, lengths=lengths, row_seq=row_seq, row_offset=row_offset)


@pytest.mark.parametrize(
    "lengths", [*LAYOUTS.values(), [1, 1, 0, 0], [2, 0, 3, 0]], ids=str
)  # the last two: padding sequences of no rows, as a graph program has them
def test_row_layout_derives_each_index_on_use(lengths):
    """Building a layout launches nothing; each index, derived on first use (and kept), equals
    the eager derivation; `pad` and `unpad` round-trip."""
    from metrale.bench.profile_step import count_launches

    starts = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
    n, max_q = sum(lengths), max(lengths)
    built = []
    assert not sum(count_launches(lambda: built.append(RowLayout.build(starts, max_q, n))).values())
    layout = built[0]
    assert (layout.num_seqs, layout.width, layout.num_rows) == (len(lengths), max_q, n)
    for name, want in _eager_layout(starts, max_q, n).items():
        got = getattr(layout, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
        assert getattr(layout, name) is got  # derived once
    rows = torch.randn(n, 3, device=DEVICE)
    padded = layout.pad(rows)  # [B, T, 3]; one row per sequence: the rows as they are
    assert padded.shape[:2] == ((len(lengths), max_q) if max_q > 1 else (n, 1))
    assert torch.equal(layout.unpad(padded), rows)


def test_fused_decode_layer_derives_no_layout_index(monkeypatch):
    """A fused decode forward (one row per sequence, the gates made in the delta-rule kernel)
    reads no index of its layout, so a decode step launches nothing for the layout: the conv
    kernel reads the rows per sequence from query_start_loc. Equal to the torch path."""
    monkeypatch.setattr(gdn_state, "triton_gdn_enabled", lambda x: True)
    hidden = torch.randn(3, 48, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    layer = _gdn_layer()
    results = []
    for fused in (False, True):
        monkeypatch.setattr(qwen3_next_gdn, "hybrid_kernels_enabled", lambda x, f=fused: f)
        layout = _layout(LAYOUTS["decode"])
        state = _state(StateMode.WRITE, 3, 1, seed=6)
        with torch.no_grad():
            out = layer(hidden, layout, state)
        results.append((out, state.conv[0].clone(), state.ssm[0].clone()))
    derived = {"_arange", "lengths", "valid", "index", "row_seq", "row_offset"}
    assert not derived & set(vars(layout)), vars(layout).keys()
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the glue's entry points without the layout's indices: only where they read none
    mixed, ba = torch.randn(3, 40, device=DEVICE), torch.randn(3, 8, device=DEVICE)
    a_log, dt_bias = torch.randn(4, device=DEVICE), torch.randn(4, device=DEVICE)
    with pytest.raises(ValueError, match="raw gates"):
        gdn_fused.prepare(mixed, ba, a_log, dt_bias, None, None)
    out, z = torch.randn(1, 3, 4, 12, device=DEVICE), torch.randn(3, 48, device=DEVICE)
    with pytest.raises(ValueError, match="row_seq"):
        gdn_fused.gated_norm(out, z, torch.ones(12, device=DEVICE), 1e-6, None, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", sorted(LAYOUTS))
def test_prepare_equals_the_torch_gates_and_padding(shape, dtype):
    layout = _layout(LAYOUTS[shape])
    n, hv, channels = layout.row_seq.shape[0], 4, 40
    gen = torch.Generator().manual_seed(0)
    proj = (torch.randn(n, channels + 7 + 2 * hv, generator=gen) * 4).to(DEVICE, dtype)
    mixed, ba = proj[:, :channels], proj[:, channels + 7 :]  # row-strided views, as in the layer
    a_log = torch.randn(hv, generator=gen).to(DEVICE, dtype)
    dt_bias = (torch.randn(hv, generator=gen) * 8).to(DEVICE, dtype)  # softplus past 20 too
    conv, g, beta = gdn_fused.prepare(mixed, ba, a_log, dt_bias, layout.index, layout.lengths)
    b, a = ba[:, :hv], ba[:, hv:]
    torch.testing.assert_close(conv, layout.pad(mixed), rtol=0, atol=0)
    # one ulp: exp's implementations differ; the interpreter truncates to bf16
    ulp = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=0, atol=2**-8)
    torch.testing.assert_close(beta, layout.pad(b.sigmoid()), **ulp)
    want_g = layout.pad(-a_log.float().exp() * F.softplus(a.float() + dt_bias))
    torch.testing.assert_close(g, want_g, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", sorted(LAYOUTS))
def test_gated_norm_reads_padded_rows_and_strided_z(shape, dtype):
    layout = _layout(LAYOUTS[shape])
    n, (bsz, t), hv, dv = layout.row_seq.shape[0], layout.index.shape, 4, 12
    gen = torch.Generator().manual_seed(1)
    out = torch.randn(bsz, t, hv, dv, generator=gen).to(DEVICE, dtype)
    z = torch.randn(n, hv * dv + 5, generator=gen).to(DEVICE, dtype)[:, 3 : 3 + hv * dv]
    weight = (1 + 0.1 * torch.randn(dv, generator=gen)).to(DEVICE, dtype)
    got = gdn_fused.gated_norm(out, z, weight, 1e-6, layout.row_seq, layout.row_offset)
    want = gated_rms_norm(layout.unpad(out), z.reshape(n, hv, dv), weight, 1e-6)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want.reshape(n, hv * dv), **tol)


def _gdn_layer(seed: int = 2) -> Qwen3NextGatedDeltaNet:
    raw = dict(
        architectures=["Qwen3NextForCausalLM"], hidden_size=48, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_conv_kernel_dim=4, num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        vocab_size=64, layer_types=["linear_attention"],
    )  # fmt: skip
    layer = Qwen3NextGatedDeltaNet(ModelConfig.from_dict(raw), 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.rand(p.shape, generator=gen) * 3 - 2.5)
            elif name == "norm.weight":
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return layer.to(DEVICE)


def _state(mode: StateMode, bsz: int, t: int, seed: int) -> GDNState:
    """A pool of 1 + bsz (+ bsz t) random entries; sequence b reads entry 1 + b."""
    pool = GDNState.zeros(1, 1 + bsz + bsz * t, (80, 3), (4, 8, 12), torch.float32, DEVICE)
    gen = torch.Generator().manual_seed(seed)
    pool.conv[0].copy_(torch.randn(pool.conv[0].shape, generator=gen))
    pool.ssm[0].copy_(torch.randn(pool.ssm[0].shape, generator=gen) * 0.1)
    read = torch.arange(1, 1 + bsz, device=DEVICE)
    rows = None
    if mode is StateMode.ROWS:
        rows = torch.arange(1 + bsz, 1 + bsz + bsz * t, device=DEVICE).view(bsz, t)
    return pool.view(read, mode, rows)


@pytest.mark.parametrize("mode", list(StateMode), ids=lambda m: m.value)
@pytest.mark.parametrize("shape", sorted(LAYOUTS))
def test_fused_layer_equals_the_torch_path(shape, mode, monkeypatch):
    """Outputs and every state the forward writes (and, in DEFER, the commit's) agree; the
    torch path still reads the reordered in-projections after the fused one ran."""
    if mode is not StateMode.WRITE and shape == "prefill":
        pytest.skip("verify rows only")
    layout = _layout(LAYOUTS[shape])
    bsz, t = layout.index.shape
    hidden = torch.randn(layout.row_seq.shape[0], 48, generator=torch.Generator().manual_seed(3))
    hidden = hidden.to(DEVICE)
    layer = _gdn_layer()
    monkeypatch.setattr(gdn_state, "triton_gdn_enabled", lambda x: True)
    results = []
    for fused in (False, True, False):
        monkeypatch.setattr(qwen3_next_gdn, "hybrid_kernels_enabled", lambda x, f=fused: f)
        state = _state(mode, bsz, t, seed=4)
        with torch.no_grad():
            out = layer(hidden, layout, state)
            if mode is StateMode.DEFER:
                state.commit(torch.tensor([1, 2, 3][:bsz], device=DEVICE).minimum(layout.lengths))
        results.append((out, state.conv[0].clone(), state.ssm[0].clone()))
    assert layer._in_proj is not None  # the fused run reordered the rows
    for other in results[1:]:
        for got, want in zip(other, results[0], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_layer_keeps_the_deterministic_product(monkeypatch):
    """Under `make_batch_invariant` (the deterministic mode) the packed in-projection runs the
    batch-invariant product too, not F.linear."""
    from metrale.kernels.batch_invariant import (
        InvariantLinear,
        invariant_linear,
        make_batch_invariant,
    )

    layer = _gdn_layer()
    make_batch_invariant(layer)
    calls = []

    def spy(x, w, bias=None):
        calls.append(tuple(w.shape))
        return invariant_linear(x, w, bias)

    # (the class's own product, which the layer takes for its packed weight)
    monkeypatch.setattr(InvariantLinear, "product", staticmethod(spy))
    monkeypatch.setattr(qwen3_next_gdn, "hybrid_kernels_enabled", lambda x: True)
    monkeypatch.setattr(gdn_state, "triton_gdn_enabled", lambda x: True)
    layout = _layout(LAYOUTS["decode"])
    hidden = torch.randn(3, 48, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with torch.no_grad():
        layer(hidden, layout, _state(StateMode.WRITE, 3, 1, seed=6))
    assert calls and calls[0] == (80 + 48 + 8, 48)  # q, k, v | z | b, a rows
