"""The GDN gates folded into the delta-rule kernels (`gdn_recurrent.GateInputs`): the recurrent
and chunked kernels fed the layer's gate inputs equal them fed g and beta, and a GDN layer whose
state takes the gate inputs equals the torch path in every mode.

`gdn_state.GDNState` does not take gate inputs yet. `GATED_DELTA_RULE` and `GATED_COMMIT` below
are the change it needs (a `gates` argument passed through to the kernels and kept for the
commit); the tests install them on the class for their duration.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

pytest.importorskip("triton")

from metrale.kernels.gdn_chunk import chunk_delta_rule_in_pool  # noqa: E402
from metrale.kernels.gdn_conv import conv_in_pool  # noqa: E402
from metrale.kernels.gdn_recurrent import GateInputs, delta_rule_in_pool  # noqa: E402
from metrale.models import gdn_state, qwen3_next_gdn  # noqa: E402
from metrale.models.gdn import recurrent_gated_delta_rule, window_after  # noqa: E402
from metrale.models.gdn_state import GDNState, StateMode  # noqa: E402
from tests.test_gdn_fused import DEVICE, LAYOUTS, _gdn_layer, _layout, _state  # noqa: E402


class PendingGated(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor | None
    beta: torch.Tensor | None
    gates: GateInputs | None


def GATED_DELTA_RULE(self, layer, q, k, v, g, beta, gates=None):  # noqa: N802
    """`GDNState.delta_rule` with a `gates` argument: the change gdn_state.py needs."""
    if gates is not None and not gdn_state.triton_gdn_enabled(v):
        g, beta = gates.materialize()  # the torch path makes g and beta itself
        gates = None
    if gates is None:
        out = GDNState._plain_delta_rule(self, layer, q, k, v, g, beta)
        if self.mode is StateMode.DEFER:
            self.pending[layer] = PendingGated(q, k, v, g, beta, None)
        return out
    pool, mode, t = self.ssm[layer], self.mode, q.shape[1]
    read = self._read(q.shape[0], pool.device)
    if mode is StateMode.DEFER:
        self.pending[layer] = PendingGated(q, k, v, None, None, gates)
    if mode is StateMode.WRITE and t > self.chunk_min_rows:
        return chunk_delta_rule_in_pool(q, k, v, None, None, pool, read, read, gates=gates)
    return delta_rule_in_pool(
        q, k, v, None, None, pool, read,
        final=read if mode is StateMode.WRITE else None,
        rows=self.rows if mode is StateMode.ROWS else None,
        gates=gates,
    )  # fmt: skip


def GATED_COMMIT(self, num_rows):  # noqa: N802
    """`GDNState.commit` reading the kept gate inputs: only the delta-rule step changes."""
    if self.mode is not StateMode.DEFER:
        raise RuntimeError(f"commit after a {self.mode.value} forward")
    for layer, p in self.pending.items():
        bsz, t = p.q.shape[:2]
        pool, store = self.ssm[layer], self.conv[layer]
        read = self._read(bsz, pool.device)
        if gdn_state.triton_gdn_enabled(p.v):
            delta_rule_in_pool(
                p.q, p.k, p.v, p.g, p.beta, pool, read, final=read, lengths=num_rows,
                gates=p.gates,
            )  # fmt: skip
        else:  # as before (gate inputs were materialised for the torch path)
            keep = torch.arange(t, device=pool.device)[None, :] < num_rows[:, None]
            g, beta = p.g * keep[..., None], p.beta * keep[..., None]
            res = recurrent_gated_delta_rule(p.q, p.k, p.v, g, beta, pool[read])
            pool.index_copy_(0, read, res.state)
        conv_in = self.pending_conv[layer]
        if gdn_state._conv_kernel_runs(conv_in, store):
            conv_in_pool(conv_in, None, store, read, num_rows, final=read)
        else:
            store.index_copy_(0, read, window_after(store[read], conv_in, num_rows).to(store.dtype))


@pytest.fixture
def gated_state(monkeypatch):
    monkeypatch.setattr(GDNState, "_plain_delta_rule", GDNState.delta_rule, raising=False)
    monkeypatch.setattr(GDNState, "delta_rule", GATED_DELTA_RULE)
    monkeypatch.setattr(GDNState, "commit", GATED_COMMIT)
    monkeypatch.setattr(GDNState, "accepts_gate_inputs", True, raising=False)


def _inputs(bsz, t, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    q, k, v = r(bsz, t, 2, 8), r(bsz, t, 2, 8), r(bsz, t, 4, 12)
    gates = GateInputs(r(bsz, t, 4, scale=3), r(bsz, t, 4, scale=3), r(4), r(4, scale=4))
    return q, k, v, gates


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3, 20])
def test_kernels_make_the_gates_from_their_inputs(t, dtype):
    """Recurrent (with per-row states and a partial commit) and chunked kernels, gate inputs
    against the materialised g and beta; -inf inputs (padding) leave the state alone."""
    bsz = 2
    q, k, v, gates = _inputs(bsz, t, seed=t, dtype=dtype)
    gates.a[1, -1], gates.b[1, -1] = float("-inf"), float("-inf")
    g, beta = gates.materialize()
    assert (g[1, -1] == 0).all() and (beta[1, -1] == 0).all()
    pool0 = torch.randn(1 + bsz + bsz * t, 4, 8, 12, device=DEVICE) * 0.1
    read = torch.tensor([1, 2], device=DEVICE)
    rows = torch.arange(3, 3 + bsz * t, device=DEVICE).view(bsz, t)
    results = []
    for kwargs in (dict(g=g, beta=beta), dict(g=None, beta=None, gates=gates)):
        pool = pool0.clone()
        out = delta_rule_in_pool(q, k, v, pool=pool, read=read, final=read, rows=rows, **kwargs)
        commit = pool0.clone()
        lens = torch.tensor([t, max(t - 1, 1)], device=DEVICE)
        delta_rule_in_pool(q, k, v, pool=commit, read=read, final=read, lengths=lens, **kwargs)
        chunk = pool0.clone()
        out_c = chunk_delta_rule_in_pool(q, k, v, pool=chunk, read=read, final=read, **kwargs)
        results.append((out, pool, commit, out_c, chunk))
    # bf16: beta is rounded to bf16 in both, but the interpreter truncates (an ulp apart)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", list(StateMode), ids=lambda m: m.value)
@pytest.mark.parametrize("shape", sorted(LAYOUTS))
def test_layer_with_gate_inputs_equals_the_torch_path(shape, mode, monkeypatch, gated_state):
    if mode is not StateMode.WRITE and shape == "prefill":
        pytest.skip("verify rows only")
    layout = _layout(LAYOUTS[shape])
    bsz, t = layout.index.shape
    hidden = torch.randn(layout.row_seq.shape[0], 48, generator=torch.Generator().manual_seed(3))
    layer = _gdn_layer()
    monkeypatch.setattr(gdn_state, "triton_gdn_enabled", lambda x: True)
    results = []
    for fused in (False, True):
        monkeypatch.setattr(qwen3_next_gdn, "hybrid_kernels_enabled", lambda x, f=fused: f)
        state = _state(mode, bsz, t, seed=4)
        with torch.no_grad():
            out = layer(hidden.to(DEVICE), layout, state)
            kept = [p.gates is not None for p in state.pending.values()]
            assert kept == ([fused] if mode is StateMode.DEFER else [])
            if mode is StateMode.DEFER:
                state.commit(torch.tensor([1, 2, 3][:bsz], device=DEVICE).minimum(layout.lengths))
        results.append((out, state.conv[0].clone(), state.ssm[0].clone()))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
