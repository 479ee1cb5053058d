"""Triton kernels against their torch references: paged attention (one program per head, and
split over the KV pages), residual add + RMSNorm, QK-norm + rotary, SiLU * up.

On CUDA they run on the GPU; without it, under the Triton interpreter on CPU tensors (conftest
sets TRITON_INTERPRET=1), so CI checks the kernels' logic too. Skipped when Triton is missing.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from metrale.config import RopeConfig  # noqa: E402
from metrale.kernels import fused, paged_attention  # noqa: E402
from metrale.models.attention import AttentionMetadata, TorchPagedAttention, write_kv  # noqa: E402
from metrale.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not paged_attention.INTERPRETED:
    pytest.skip("no CUDA and TRITON_INTERPRET is not set", allow_module_level=True)
DTYPES = [torch.float32, torch.bfloat16]


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal up to rounding: float32 tightly; bf16 by the relative error of the whole tensor
    (element-wise, a difference of rounded products can cancel to a large relative error). The
    interpreter truncates to bf16 instead of rounding to nearest, which about doubles and biases
    the error of a chain of roundings, hence its looser bound."""
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < (8e-3 if DEVICE == "cuda" else 2e-2), err


@pytest.fixture
def reference_ops(monkeypatch):
    """Force the torch path (what CPU runs) for building references on CUDA too."""

    def use_reference():
        monkeypatch.setattr(fused, "fused_enabled", lambda x: False)

    return use_reference


def _against_reference(dtype, heads, kv_heads, dim, page, pages, q_lens, seq_lens):
    """Run the kernel and the torch reference over one batch of sequences with `q_lens` rows
    ending at `seq_lens` keys (pages shuffled, never the dummy): both must write the same K/V.
    Returns (the kernel's prepared metadata, the output's relative error)."""
    width = -(-max(seq_lens) // page)
    tables = torch.randperm(pages - 1)[: len(q_lens) * width].view(len(q_lens), width) + 1
    rows = sum(q_lens)
    positions, slots, starts = [], [], [0]
    for b, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        for p in range(sl - ql, sl):
            positions.append(p)
            slots.append(int(tables[b, p // page]) * page + p % page)
        starts.append(starts[-1] + ql)

    def meta():
        def t(x):
            return torch.as_tensor(x, dtype=torch.long, device=DEVICE)

        lens = t(seq_lens)
        return AttentionMetadata(
            t(slots), t(positions), t(starts), lens, t(tables), max(q_lens), max(seq_lens), page
        )

    cache = torch.randn(2, pages, page, kv_heads, dim, device=DEVICE, dtype=dtype)
    q = torch.randn(rows, heads, dim, device=DEVICE, dtype=dtype)
    k = torch.randn(rows, kv_heads, dim, device=DEVICE, dtype=dtype)
    v = torch.randn(rows, kv_heads, dim, device=DEVICE, dtype=dtype)
    ref_cache, kernel_cache = cache.clone(), cache.clone()
    ref_backend, kernel_backend = TorchPagedAttention(), paged_attention.TritonPagedAttention()
    ref = ref_backend.forward(q, k, v, ref_cache, ref_backend.prepare(meta()), dim**-0.5)
    kernel_meta = kernel_backend.prepare(meta())
    out = kernel_backend.forward(q, k, v, kernel_cache, kernel_meta, dim**-0.5)
    torch.testing.assert_close(kernel_cache, ref_cache)  # the same rows written
    return kernel_meta, ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (32, 8), (16, 2), (12, 4)])
@pytest.mark.parametrize("splits", [1, 4])
def test_paged_attention_matches_reference(dtype, heads, kv_heads, splits, monkeypatch):
    monkeypatch.setattr(paged_attention, "num_splits", lambda *args: splits)
    torch.manual_seed(0)
    q_lens, seq_lens = [1, 4, 16, 3, 1, 7], [1, 37, 100, 16, 250, 64]
    _, err = _against_reference(dtype, heads, kv_heads, 64, 16, 128, q_lens, seq_lens)
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (32, 8), (12, 4)])
def test_paged_attention_tiles_prefill_chunks(dtype, heads, kv_heads):
    """Prefill chunks (more than MAX_KERNEL_ROWS rows) in one batch with decode and verify rows:
    a whole prompt, a later chunk of a longer sequence (its rows see the earlier pages), a chunk
    whose rows straddle tiles unevenly. The kernel tiles the query rows; the reference agrees."""
    torch.manual_seed(1)
    q_lens, seq_lens = [70, 1, 40, 4, 17], [70, 30, 120, 50, 17]
    assert max(q_lens) > paged_attention.MAX_KERNEL_ROWS
    kernel_meta, err = _against_reference(dtype, heads, kv_heads, 32, 16, 64, q_lens, seq_lens)
    assert kernel_meta.mask is None  # the kernel's own path, not the padded reference
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (32, 8)])
def test_prefill_tiles_are_numbered_across_the_step(heads, kv_heads):
    """A prefill program's layout: many short verify sequences beside a prompt, sequences with
    no rows (a program's spare ones), rows straddling tile boundaries at every offset. The
    tiles are numbered across the step (`_tile_of`), so each row must be computed by exactly
    the tile of its own sequence: the output equals the reference on every row."""
    torch.manual_seed(2)
    q_lens = [4, 0, 4, 3, 33, 0, 1, 4, 16, 17, 4, 0, 2, 4, 4, 0]
    seq_lens = [50, 1, 20, 9, 33, 5, 90, 36, 16, 40, 4, 1, 70, 64, 8, 1]
    assert max(q_lens) > paged_attention.MAX_KERNEL_ROWS
    dtype = torch.float32
    _, err = _against_reference(dtype, heads, kv_heads, 32, 16, 128, q_lens, seq_lens)
    assert err < 1e-5, err


def test_num_splits_fills_the_gpu_and_ignores_decode_padding():
    cpu = torch.device("cpu")  # counted as 132 multiprocessors
    assert paged_attention.num_splits(1, 8, cpu) == paged_attention.MAX_SPLITS
    assert paged_attention.num_splits(64, 8, cpu) == 1
    assert paged_attention.num_splits(16, 8, cpu) == 4
    # A decode of 5 sequences is replayed padded to 8: both must split alike.
    assert paged_attention.num_splits(5, 8, cpu) == paged_attention.num_splits(8, 8, cpu)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [64, 96])
def test_add_rmsnorm_matches_reference(dtype, with_residual, hidden, reference_ops):
    torch.manual_seed(1)
    norm = RMSNorm(hidden, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    x = torch.randn(5, hidden, device=DEVICE, dtype=dtype) * 3
    res = torch.randn(5, hidden, device=DEVICE, dtype=dtype) if with_residual else None
    out, new_res = fused.add_rmsnorm(x, res, norm.weight, norm.eps)
    reference_ops()
    if with_residual:
        ref, ref_res = norm.forward_residual(x, res)
        if DEVICE == "cuda":  # one rounding of the sum: exact (the interpreter truncates bf16)
            torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)
        _close(new_res, ref_res, dtype)
    else:
        ref = norm(x)
        assert new_res is x
    _close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope_type", ["default", "yarn"])
def test_qk_norm_rope_matches_reference(dtype, rope_type, reference_ops):
    torch.manual_seed(2)
    rows, num_q, num_kv, dim = 7, 4, 2, 32
    rope = RopeConfig(rope_type, 10000.0, 4.0, original_max_position_embeddings=128)
    rotary = RotaryEmbedding(rope, dim, 512).to(DEVICE)
    q_norm, k_norm = RMSNorm(dim, 1e-6).to(DEVICE, dtype), RMSNorm(dim, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        q_norm.weight.normal_(1.0, 0.1)
        k_norm.weight.normal_(1.0, 0.1)
    qkv = torch.randn(rows, (num_q + 2 * num_kv) * dim, device=DEVICE, dtype=dtype)
    positions = torch.tensor([0, 1, 5, 100, 101, 300, 511], device=DEVICE)
    args = (rotary.cos, rotary.sin, positions, num_q, num_kv, 1e-6)
    q, k = fused.qk_norm_rope(qkv, q_norm.weight, k_norm.weight, *args)
    reference_ops()
    q_ref, k_ref, _ = qkv.split([num_q * dim, num_kv * dim, num_kv * dim], dim=-1)
    q_ref = q_norm(q_ref.reshape(rows, num_q, dim))
    k_ref = k_norm(k_ref.reshape(rows, num_kv, dim))
    q_ref, k_ref = rotary(positions, q_ref, k_ref)
    _close(q, q_ref, dtype)
    _close(k, k_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_writes_the_rows_kv_into_their_slots(dtype):
    """Given a cache and slots, the kernel stores each row's k and v at its slot: the cache
    equals `write_kv` of the same k and v, bit for bit; other slots keep their values."""
    torch.manual_seed(4)
    rows, num_q, num_kv, dim, pages, page = 6, 4, 2, 32, 4, 4
    rotary = RotaryEmbedding(RopeConfig("default", 10000.0), dim, 64).to(DEVICE)
    weight = torch.randn(dim, device=DEVICE, dtype=dtype)
    qkv = torch.randn(rows, (num_q + 2 * num_kv) * dim, device=DEVICE, dtype=dtype)
    positions = torch.tensor([0, 1, 5, 30, 31, 63], device=DEVICE)
    slots = torch.tensor([15, 3, 4, 0, 9, 12], device=DEVICE)
    cache = torch.randn(2, pages, page, num_kv, dim, device=DEVICE, dtype=dtype)
    want = cache.clone()
    args = (qkv, weight, weight, rotary.cos, rotary.sin, positions, num_q, num_kv, 1e-6)
    q, k = fused.qk_norm_rope(*args, cache, slots)
    assert [torch.equal(a, b) for a, b in zip((q, k), fused.qk_norm_rope(*args))] == [True] * 2
    write_kv(want, k, qkv[:, (num_q + num_kv) * dim :].reshape(rows, num_kv, dim), slots)
    assert torch.equal(cache, want)
    with pytest.raises(ValueError, match="slots"):
        fused.qk_norm_rope(*args, cache, None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(dtype, reference_ops):
    torch.manual_seed(3)
    mlp = SwiGLUMLP(32, 48).to(DEVICE, dtype)
    gate_up = torch.randn(6, 96, device=DEVICE, dtype=dtype) * 4
    out = fused.silu_mul(gate_up)
    reference_ops()
    gate, up = gate_up.split(48, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    _close(out, ref, dtype)
    assert mlp.down_proj(out).shape == (6, 32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_zero_centred_add_rmsnorm_matches_reference(dtype, with_residual, reference_ops):
    """Qwen3-Next's (1 + w) norm: the fused kernel against `ZeroCentredRMSNorm`'s torch path."""
    from metrale.models.qwen3_next import ZeroCentredRMSNorm

    torch.manual_seed(8)
    norm = ZeroCentredRMSNorm(96, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.1)
    x = torch.randn(5, 96, device=DEVICE, dtype=dtype) * 3
    res = torch.randn(5, 96, device=DEVICE, dtype=dtype) if with_residual else None
    out, new_res = fused.add_rmsnorm(x, res, norm.weight, norm.eps, zero_centred=True)
    reference_ops()
    ref, ref_res = norm.forward_residual(x, res) if with_residual else (norm(x), x)
    _close(out, ref, dtype)
    _close(new_res, ref_res, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rmsnorm_matches_reference(dtype):
    from metrale.models.gdn import gated_rms_norm

    torch.manual_seed(9)
    x = torch.randn(7, 4, 24, device=DEVICE, dtype=dtype) * 2  # [rows, heads, dv]
    z = torch.randn(7, 4, 24, device=DEVICE, dtype=dtype) * 3
    w = (torch.randn(24, device=DEVICE) * 0.1 + 1).to(dtype)
    _close(fused.gated_rmsnorm(x, z, w, 1e-6), gated_rms_norm(x, z, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("all_states", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_delta_rule_kernel_matches_reference(dtype, all_states, with_state):
    """The Triton recurrent gated delta rule against `gdn.recurrent_gated_delta_rule`: outputs,
    final state and per-row states (verify), with grouped key heads, value dims that are not a
    power of two, and padded rows (g = beta = 0) that must leave the state alone."""
    from metrale.kernels.gdn_recurrent import recurrent_gated_delta_rule_triton
    from metrale.models.gdn import recurrent_gated_delta_rule

    torch.manual_seed(4)
    b, t, hk, hv, dk, dv = 2, 5, 2, 4, 16, 24
    q = torch.randn(b, t, hk, dk, device=DEVICE).to(dtype)
    k = torch.randn(b, t, hk, dk, device=DEVICE).to(dtype)
    v = torch.randn(b, t, hv, dv, device=DEVICE).to(dtype)
    g = -torch.rand(b, t, hv, device=DEVICE)  # log-decays <= 0
    beta = torch.rand(b, t, hv, device=DEVICE)
    g[1, 3:], beta[1, 3:] = 0.0, 0.0  # sequence 1 has 3 real rows, then padding
    state = torch.randn(b, hv, dk, dv, device=DEVICE) if with_state else None
    ref = recurrent_gated_delta_rule(q, k, v, g, beta, state, output_all_states=all_states)
    out, final, states = recurrent_gated_delta_rule_triton(
        q, k, v, g, beta, state, output_all_states=all_states
    )
    _close(out, ref.out, dtype)
    torch.testing.assert_close(final, ref.state, rtol=1e-4, atol=1e-4)
    if all_states:
        torch.testing.assert_close(states, ref.states, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(states[1, 3:], states[1, 2:3].expand(2, -1, -1, -1))
    else:
        assert states is None


def test_one_binary_delta_rule_computes_every_mode_as_the_sequential_decodes(monkeypatch):
    """The deterministic mode's delta-rule kernel (`invariant=True`: one binary, its mode a
    runtime value) against the same token's decode rows, one step each: a verify's outputs
    (the state left alone), its write-on-accept commit of each accepted count, per-row slots
    and a prompt of 4 rows. Bitwise: one binary runs the same arithmetic in every mode (on
    CPU the interpreter; the GPU check of the same is `det_units.py` in the session 67
    results)."""
    from metrale.kernels import gdn_recurrent
    from metrale.kernels.gdn_recurrent import GateInputs, delta_rule_in_pool

    # each launch's argument types: a pointer's element type is part of the compiled signature
    # (unused pointers once took the pool's, so each mode compiled its own binary)
    signatures, real = set(), gdn_recurrent._invariant_delta_rule_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                kinds = [a.dtype if torch.is_tensor(a) else type(a) for a in args]
                signatures.add((*kinds, *sorted((k, type(v)) for k, v in kwargs.items())))
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(gdn_recurrent, "_invariant_delta_rule_kernel", Spy())
    torch.manual_seed(5)
    b, t, hk, hv, dk, dv = 2, 4, 2, 4, 16, 32
    q, k = (torch.randn(b, t, hk, dk, device=DEVICE) for _ in range(2))
    v = torch.randn(b, t, hv, dv, device=DEVICE)
    a, beta_in = (torch.randn(b, t, hv, device=DEVICE) for _ in range(2))
    a_log, dt_bias = torch.randn(hv, device=DEVICE) * 0.5, torch.randn(hv, device=DEVICE) * 0.5
    init = torch.randn(12, hv, dk, dv, device=DEVICE) * 0.1
    read = torch.tensor([3, 1], device=DEVICE)

    def run(pool, at=slice(0, t), **kw):
        gates = GateInputs(a[:, at], beta_in[:, at], a_log, dt_bias)
        return delta_rule_in_pool(
            q[:, at], k[:, at], v[:, at], None, None, pool, read, gates=gates,
            block_v=16, invariant=True, **kw,
        )  # fmt: skip

    pool, outs, states = init.clone(), [], []
    for row in range(t):  # a decode step per row
        outs.append(run(pool, slice(row, row + 1), final=read)[:, 0])
        states.append(pool[read].clone())
    verify = run(init.clone())  # a write-on-accept verify: outputs, the state left alone
    assert all(torch.equal(verify[:, row], outs[row]) for row in range(t))
    for accepted in range(1, t + 1):
        committed = init.clone()
        lengths = torch.full((b,), accepted, device=DEVICE, dtype=torch.int32)
        assert run(committed, final=read, lengths=lengths) is None
        assert torch.equal(committed[read], states[accepted - 1])
    slots, per_row = init.clone(), torch.arange(4, 12, device=DEVICE).view(b, t)
    per_row_out = run(slots, rows=per_row)
    assert all(torch.equal(slots[per_row[:, r]], states[r]) for r in range(t))
    assert torch.equal(per_row_out, verify)
    prompt = init.clone()
    assert torch.equal(run(prompt, final=read), verify)
    assert torch.equal(prompt[read], states[-1])
    assert len(signatures) == 1  # every mode, one binary's arguments


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("correlated", [False, True])
@pytest.mark.parametrize("dk, dv", [(16, 24), (8, 8)])  # 8: below tl.dot's 16, padded
def test_chunk_delta_rule_kernel_matches_reference(with_state, correlated, dk, dv):
    """The Triton chunked (WY) delta rule against the recurrent reference: several 16-row chunks
    and a partial one, a sequence with padded rows (g = beta = 0), grouped key heads, value dims
    that are not a power of two; with nearly parallel keys too, where an inverse by repeated
    squaring would fall apart."""
    from metrale.kernels.gdn_chunk import chunk_delta_rule_in_pool
    from metrale.models.gdn import recurrent_gated_delta_rule

    torch.manual_seed(7)
    b, t, hk, hv = 2, 37, 2, 4
    q = torch.randn(b, t, hk, dk, device=DEVICE)
    k = torch.randn(b, t, hk, dk, device=DEVICE)
    if correlated:
        k = k * 0.2 + torch.randn(1, 1, hk, dk, device=DEVICE)
    v = torch.randn(b, t, hv, dv, device=DEVICE)
    g = -torch.rand(b, t, hv, device=DEVICE) * 0.1
    beta = torch.rand(b, t, hv, device=DEVICE)
    g[1, 30:], beta[1, 30:] = 0.0, 0.0  # sequence 1: 30 rows, then padding
    pool = torch.randn(5, hv, dk, dv, device=DEVICE)
    read = torch.tensor([3, 1], device=DEVICE)
    init = pool[read].clone() if with_state else None
    ref = recurrent_gated_delta_rule(q, k, v, g, beta, init)
    final = torch.tensor([4, 0], device=DEVICE)
    out = chunk_delta_rule_in_pool(q, k, v, g, beta, pool, read if with_state else None, final)
    torch.testing.assert_close(out, ref.out, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(pool[final], ref.state, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["final", "rows", "advance"])
def test_conv_kernel_matches_reference(dtype, mode):
    """The Triton causal conv on a window pool against `gdn.causal_conv1d`: outputs (zeros on
    padding rows), the final window written back where it was read, per-row windows into their
    entries, or (no weight) only the windows advanced by each sequence's rows."""
    from metrale.kernels.gdn_conv import conv_in_pool
    from metrale.models.gdn import causal_conv1d

    torch.manual_seed(10)
    b, t, d = 3, 5, 40
    x = torch.randn(b, t, d, device=DEVICE).to(dtype)
    weight = torch.randn(d, 4, device=DEVICE).to(dtype)
    pool = torch.randn(12, d, 3, device=DEVICE).to(dtype)
    before = pool.clone()
    read = torch.tensor([7, 2, 4], device=DEVICE)
    lengths = torch.tensor([5, 2, 1], device=DEVICE)
    rows = torch.tensor([[7, 8, 9, 10, 11], [2, 3, 0, 0, 0], [4, 0, 0, 0, 0]], device=DEVICE)
    ref = causal_conv1d(x, weight, before[read], lengths=lengths, output_all_windows=True)
    out = conv_in_pool(
        x,
        None if mode == "advance" else weight,
        pool,
        read,
        lengths,
        final=read if mode in ("final", "advance") else None,
        rows=rows if mode == "rows" else None,
    )
    if mode == "advance":
        assert out is None
    else:
        valid = (torch.arange(t, device=DEVICE)[None, :] < lengths[:, None])[..., None]
        _close(out, torch.where(valid, ref.out, 0), dtype)
        assert not out[~valid.expand_as(out)].any()
    if mode == "rows":
        for i in range(b):
            for j in range(int(lengths[i])):
                assert torch.equal(pool[rows[i, j]], ref.windows[i, j])
    else:
        assert torch.equal(pool[read], ref.window)
    untouched = [5, 6, 1] if mode == "rows" else [0, 1, 3, 5, 6, 8, 9, 10, 11]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("width", [1, 5])
def test_conv_kernel_reads_lengths_from_the_packed_offsets(width):
    """`conv_in_pool(..., starts=query_start_loc)` (a forward's conv: no lengths tensor made)
    equals the call with lengths = the offsets' differences, bit for bit: outputs and windows,
    zero-row sequences included (T = 1: the trailing ones of a padded decode program)."""
    from metrale.kernels.gdn_conv import conv_in_pool

    torch.manual_seed(11)
    lens = [1, 1, 0, 0] if width == 1 else [5, 2, 0, 1]
    b, d = len(lens), 40
    x = torch.randn(b, width, d, device=DEVICE)
    weight = torch.randn(d, 4, device=DEVICE)
    pool = torch.randn(9, d, 3, device=DEVICE)
    read = torch.tensor([7, 2, 4, 0], device=DEVICE)
    lengths = torch.tensor(lens, device=DEVICE)
    starts = torch.tensor([0, *lens], device=DEVICE).cumsum(0)
    results = []
    for kw in ({"lengths": lengths}, {"lengths": None, "starts": starts}):
        store = pool.clone()
        out = conv_in_pool(x, weight, store, read, final=read, **kw)
        results.append((out, store))
    for got, want in zip(results[1], results[0], strict=True):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="lengths or starts"):
        conv_in_pool(x, weight, pool, read, lengths, starts=starts)


@pytest.mark.parametrize("mode", ["final", "rows", "read_only", "commit"])
def test_delta_rule_kernel_addresses_the_pool_in_place(mode):
    """The kernel on a state pool: sequences read non-adjacent entries; `final` writes the state
    after the last row back into the entry read, `rows` the state after row t into its own entry
    (row 0 over the entry read; padding rows to the dummy entry 0), `read_only` writes nothing,
    `commit` (lengths) writes the state after each sequence's first lengths[b] rows only.
    Every other entry is left alone."""
    from metrale.kernels.gdn_recurrent import delta_rule_in_pool
    from metrale.models.gdn import recurrent_gated_delta_rule

    torch.manual_seed(6)
    b, t, hk, hv, dk, dv = 2, 3, 1, 2, 16, 8
    # q, k, v as the layer makes them: row-strided slices of one conv output
    mixed = torch.randn(b, t, 2 * hk * dk + hv * dv, device=DEVICE)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(b, t, hk, dk), k.view(b, t, hk, dk), v.view(b, t, hv, dv)
    g, beta = -torch.rand(b, t, hv, device=DEVICE), torch.rand(b, t, hv, device=DEVICE)
    g[1, 2], beta[1, 2] = 0.0, 0.0  # sequence 1: two rows, then padding
    pool = torch.randn(9, hv, dk, dv, device=DEVICE)
    before = pool.clone()
    read = torch.tensor([6, 2], device=DEVICE)
    rows = torch.tensor([[6, 7, 8], [2, 4, 0]], device=DEVICE)
    ref = recurrent_gated_delta_rule(q, k, v, g, beta, before[read], output_all_states=True)
    out = delta_rule_in_pool(
        q,
        k,
        v,
        g,
        beta,
        pool,
        read,
        final=read if mode in ("final", "commit") else None,
        rows=rows if mode == "rows" else None,
        lengths=torch.tensor([2, 1], device=DEVICE) if mode == "commit" else None,
    )
    touched: list[int] = []
    if mode == "commit":
        assert out is None
        torch.testing.assert_close(pool[6], ref.states[0, 1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[2], ref.states[1, 0], rtol=1e-4, atol=1e-4)
        touched = [6, 2]
    else:
        torch.testing.assert_close(out, ref.out, rtol=1e-4, atol=1e-4)
    if mode == "final":
        torch.testing.assert_close(pool[read], ref.state, rtol=1e-4, atol=1e-4)
        touched = [6, 2]
    elif mode == "rows":
        torch.testing.assert_close(pool[[6, 7, 8]], ref.states[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[[2, 4]], ref.states[1, :2], rtol=1e-4, atol=1e-4)
        touched = [0, 2, 4, 6, 7, 8]
    rest = [i for i in range(9) if i not in touched]
    assert torch.equal(pool[rest], before[rest])


@pytest.mark.parametrize("splits", [1, 4])
def test_attention_ignores_nan_past_the_sequence_and_rows_without_keys(splits, monkeypatch):
    """Both backends with NaN parked past every sequence's end (a stale page, the dummy page):
    the output stays finite and equals a clean cache's; a row that sees no key at all (only a
    capture-time dummy row can) gets 0, not 0 / 0, whatever the number of splits."""
    monkeypatch.setattr(paged_attention, "num_splits", lambda *args: splits)
    torch.manual_seed(5)
    page, pages, heads, kv_heads, dim = 16, 8, 4, 2, 16
    seq_lens, q_lens = [20, 5], [2, 1]
    tables = [[1, 2], [3, 0]]  # the second sequence's padding entry is the dummy page
    positions, slots, starts = [], [], [0]
    for b, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        for p in range(sl - ql, sl):
            positions.append(p)
            slots.append(tables[b][p // page] * page + p % page)
        starts.append(starts[-1] + ql)

    def meta(lens=seq_lens):
        def t(x):
            return torch.as_tensor(x, dtype=torch.long, device=DEVICE)

        return AttentionMetadata(
            t(slots), t(positions), t(starts), t(lens), t(tables), max(q_lens), max(lens), page
        )

    clean = torch.randn(2, pages, page, kv_heads, dim, device=DEVICE)
    dirty = clean.clone()
    dirty[:, 0] = float("nan")  # the dummy page
    dirty[:, 2, 4:] = float("nan")  # sequence 0 ends at position 19: page 2, offset 3
    dirty[:, 3, 5:] = float("nan")  # sequence 1 ends at position 4: page 3, offset 4
    q = torch.randn(3, heads, dim, device=DEVICE)
    k, v = (
        torch.randn(3, kv_heads, dim, device=DEVICE),
        torch.randn(3, kv_heads, dim, device=DEVICE),
    )
    for backend in (TorchPagedAttention(), paged_attention.TritonPagedAttention()):
        want = backend.forward(q, k, v, clean.clone(), backend.prepare(meta()), dim**-0.5)
        got = backend.forward(q, k, v, dirty.clone(), backend.prepare(meta()), dim**-0.5)
        assert torch.isfinite(got).all(), type(backend).__name__
        torch.testing.assert_close(got, want)
    # Rows whose positions precede every key (seq_len 1 for 2 rows: the first sees nothing).
    kernel = paged_attention.TritonPagedAttention()
    out = kernel.forward(q, k, v, clean.clone(), kernel.prepare(meta([1, 5])), dim**-0.5)
    assert torch.isfinite(out).all()
    assert out[0].abs().max() == 0


def test_attention_tiles_fit_shared_memory_and_divide_the_split():
    """Tiles of keys: as wide as asked where the program fits the device's shared memory,
    halved where it would not (a wide GQA group with D = 256, a consumer GPU's 99 KiB), and a
    divisor of the invariant kernel's split."""
    from metrale.kernels.kv_tiles import tile_pages

    h200, consumer = 227 * 1024, 99 * 1024
    qwen3_8b = dict(rows=64, dim=128, elem_bytes=2)
    assert tile_pages(16, 128, **qwen3_8b, shared=h200, split_pages=8) == 8
    assert tile_pages(16, 64, **qwen3_8b, shared=h200) == 4
    assert tile_pages(16, 128, rows=128, dim=256, elem_bytes=2, shared=h200) == 8
    assert tile_pages(16, 128, rows=256, dim=256, elem_bytes=2, shared=h200) == 4
    assert tile_pages(16, 128, rows=128, dim=256, elem_bytes=2, shared=consumer) == 1
    assert tile_pages(16, 128, **qwen3_8b, shared=h200, split_pages=6) == 2
    assert tile_pages(16, 128, **qwen3_8b, shared=h200, split_pages=3) == 1
    assert tile_pages(256, 64, **qwen3_8b, shared=h200) == 1  # a page wider than the tile
