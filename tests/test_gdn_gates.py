"""The GDN gates folded into the delta-rule kernels (`gdn_recurrent.GateInputs`: g and beta made
in registers from the layer's raw a and b): the recurrent and chunked kernels fed gate inputs
equal them fed g and beta; `GDNState.delta_rule` fed gate inputs equals each sequence run alone
through the torch reference, on the Triton and the torch path, in every state mode (WRITE through
both kernels, ROWS, DEFER and its commit), over ragged sequences padded to T whose padding rows
leave the state unchanged; and the fused layer passes the gate inputs only where the Triton delta
rule runs (five launches at decode), equal to its torch path.

The paths are chosen as in the engine, through the knobs: `METRALE_FORCE_FUSED_KERNELS=1` (the
interpreter on CPU), `METRALE_NO_FUSED_KERNELS` (the layer's glue) and `METRALE_NO_GDN_TRITON`
(the state's delta rule).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from metrale.bench.profile_step import count_launches  # noqa: E402
from metrale.kernels.gdn_chunk import chunk_delta_rule_in_pool  # noqa: E402
from metrale.kernels.gdn_recurrent import GateInputs, delta_rule_in_pool  # noqa: E402
from metrale.knobs import knobs  # noqa: E402
from metrale.models.gdn import recurrent_gated_delta_rule  # noqa: E402
from metrale.models.gdn_state import CHUNK_MIN_ROWS, GDNState, StateMode  # noqa: E402
from tests.test_gdn_fused import DEVICE, LAYOUTS, _gdn_layer, _layout, _state  # noqa: E402

HK, HV, DK, DV = 2, 4, 8, 12


@pytest.fixture
def paths(monkeypatch):
    """paths(glue, triton): the layer's fused glue and the state's Triton delta rule on or off
    (on CPU under the interpreter), by the knobs the engine reads."""

    def select(glue: bool, triton: bool) -> None:
        monkeypatch.setenv("METRALE_FORCE_FUSED_KERNELS", "1")
        for env, on in (("METRALE_NO_FUSED_KERNELS", glue), ("METRALE_NO_GDN_TRITON", triton)):
            if on:
                monkeypatch.delenv(env, raising=False)
            else:
                monkeypatch.setenv(env, "1")
        knobs.cache_clear()

    yield select
    monkeypatch.undo()
    knobs.cache_clear()


def _inputs(bsz, t, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    q, k, v = r(bsz, t, HK, DK), r(bsz, t, HK, DK), r(bsz, t, HV, DV)
    gates = GateInputs(r(bsz, t, HV, scale=3), r(bsz, t, HV, scale=3), r(HV), r(HV, scale=4))
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
    pool0 = torch.randn(1 + bsz + bsz * t, HV, DK, DV, device=DEVICE) * 0.1
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


# ragged sequences padded to T; "chunked" passes CHUNK_MIN_ROWS (the WRITE forward's WY kernel)
RAGGED = {"verify": [3, 1, 4], "chunked": [CHUNK_MIN_ROWS + 4, 7]}


@pytest.mark.parametrize("triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("mode", list(StateMode), ids=lambda m: m.value)
@pytest.mark.parametrize("shape", sorted(RAGGED))
def test_state_with_gate_inputs_equals_each_sequence_alone(shape, mode, triton, paths):
    """`GDNState.delta_rule(gates=...)` over ragged rows padded to T (padding a = b = -inf, as
    `gdn_fused.prepare` pads them, and garbage q, k, v) against each sequence's real rows alone
    through the torch reference: outputs, the states each mode writes (WRITE: the final one;
    ROWS: one per row, padding rows repeating the last real one; DEFER: none until `commit`
    advances each sequence over its accepted rows), and no other entry touched."""
    if mode is not StateMode.WRITE and shape == "chunked":
        pytest.skip("verify rows only")
    paths(glue=True, triton=triton)
    lengths = RAGGED[shape]
    bsz, t = len(lengths), max(lengths)
    q, k, v, gates = _inputs(bsz, t, seed=11)
    real = torch.arange(t, device=DEVICE)[None, :] < torch.tensor(lengths, device=DEVICE)[:, None]
    pad = ~real[..., None].expand(-1, -1, HV)
    padded = GateInputs(
        gates.a.masked_fill(pad, float("-inf")),
        gates.b.masked_fill(pad, float("-inf")),
        gates.a_log,
        gates.dt_bias,
    )
    g, beta = gates.materialize()
    # entries: 2 bsz + 1 (sequence b reads 2 (bsz - b) - 1; the even ones nobody addresses), then
    # bsz t per-row slots
    entries = 2 * bsz + 1 + bsz * t
    state = GDNState.zeros(1, entries, (5, 3), (HV, DK, DV), torch.float32, DEVICE)
    gen = torch.Generator().manual_seed(13)
    state.ssm[0].copy_(torch.randn(entries, HV, DK, DV, generator=gen) * 0.1)
    pool0 = state.ssm[0].clone()
    read = torch.arange(bsz, device=DEVICE).flip(0) * 2 + 1
    rows = None
    if mode is StateMode.ROWS:
        rows = torch.arange(2 * bsz + 1, entries, device=DEVICE).view(bsz, t)
    view = state.view(read, mode, rows)
    conv_in = torch.randn(bsz, t, 5, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    with torch.no_grad():
        # the conv runs only because a commit advances the windows too (not under test here)
        view.causal_conv(0, conv_in, torch.ones(5, 4, device=DEVICE), real.sum(1))
        out = view.delta_rule(0, q, k, v, gates=padded)
        if mode is StateMode.DEFER:
            kept = view.pending[0]
            assert (kept.gates is not None) == triton and (kept.g is None) == triton
            torch.testing.assert_close(state.ssm[0], pool0, rtol=0, atol=0)  # nothing written
            accepted = torch.tensor([min(2, n) for n in lengths], device=DEVICE)
            view.commit(accepted)
    want_pool = pool0.clone()
    for b, n in enumerate(lengths):
        alone = recurrent_gated_delta_rule(
            q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n],
            g[b : b + 1, :n], beta[b : b + 1, :n], pool0[read[b]][None], output_all_states=True,
        )  # fmt: skip
        torch.testing.assert_close(out[b, :n], alone.out[0], rtol=1e-5, atol=1e-5)
        assert alone.states is not None
        if mode is StateMode.WRITE:
            want_pool[read[b]] = alone.state[0]
        elif mode is StateMode.ROWS:
            assert rows is not None
            want_pool[rows[b, :n]] = alone.states[0]
            want_pool[rows[b, n:]] = alone.state[0]  # padding rows change nothing
        else:
            want_pool[read[b]] = alone.states[0, int(accepted[b]) - 1]
    torch.testing.assert_close(state.ssm[0], want_pool, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", list(StateMode), ids=lambda m: m.value)
@pytest.mark.parametrize("shape", sorted(LAYOUTS))
def test_layer_passes_gate_inputs_only_to_the_triton_delta_rule(shape, mode, paths):
    """The fused layer with the Triton delta rule (gate inputs), with the torch one (g and beta
    from `prepare`) and the torch path agree: outputs, the states written, the commit's."""
    if mode is not StateMode.WRITE and shape == "prefill":
        pytest.skip("verify rows only")
    layout = _layout(LAYOUTS[shape])
    bsz, t = layout.index.shape
    hidden = torch.randn(layout.row_seq.shape[0], 48, generator=torch.Generator().manual_seed(3))
    layer = _gdn_layer()
    results = []
    for glue, triton in ((False, False), (True, True), (True, False)):
        paths(glue=glue, triton=triton)
        state = _state(mode, bsz, t, seed=4)
        with torch.no_grad():
            out = layer(hidden.to(DEVICE), layout, state)
            if mode is StateMode.DEFER:
                assert (state.pending[0].gates is not None) == (glue and triton)
                state.commit(torch.tensor([1, 2, 3][:bsz], device=DEVICE).minimum(layout.lengths))
        conv, ssm = state.conv[0].clone(), state.ssm[0].clone()
        if state.rows is not None:
            # NOTE: the entries of padding rows are never read (the engine points them at its
            # dummy entry): the conv kernel leaves them as they were, the torch conv writes them
            pad = state.rows[~layout.valid]
            conv[pad], ssm[pad] = 0, 0
        results.append((out, conv, ssm))
    for other in results[1:]:
        for got, want in zip(other, results[0], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_decode_layer_is_five_launches(paths):
    """At decode the fused layer launches the in-projection, the conv, the delta rule (making
    the gates), the gated norm and out_proj: nothing for g and beta."""
    paths(glue=True, triton=True)
    layout = _layout(LAYOUTS["decode"])
    layer = _gdn_layer()
    hidden = torch.randn(3, 48, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    state = _state(StateMode.WRITE, 3, 1, seed=6)
    with torch.no_grad():
        layer(hidden, layout, state)  # the first fused forward reorders the in-projections
        counts = count_launches(lambda: layer(hidden, layout, state))
    assert sum(counts.values()) == 5, counts
    assert (
        counts["triton._recurrent_delta_rule_kernel"] == 1 and not counts["triton._prepare_kernel"]
    )
