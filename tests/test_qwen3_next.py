"""The hybrid Qwen3-Next target against transformers' own `Qwen3NextForCausalLM` (its torch
fallback path) on random tiny checkpoints: logits of packed prefill, chunked prefill mixed with
decode rows, step-by-step decode, and verify rows with write-on-accept; the GDN kernels against
each other and against HF's; config reading and loading."""

from __future__ import annotations

import importlib.util
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from metrale.config import ModelConfig
from metrale.models.attention import AttentionMetadata, TorchPagedAttention
from metrale.models.gdn import (
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_rms_norm,
    recurrent_gated_delta_rule,
    window_after,
)
from metrale.models.gdn_state import GDNState, StateMode
from metrale.models.loader import CheckpointError, load_weights
from metrale.models.qwen3_next import Qwen3NextForCausalLM

transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("fla") or importlib.util.find_spec("causal_conv1d"):
    pytest.skip(
        "flash-linear-attention / causal-conv1d installed: transformers would use them instead "
        "of its torch reference",
        allow_module_level=True,
    )
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next  # noqa: E402

ATOL = 1e-4
PAGE = 4

TINY_NEXT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,  # 3 GDN layers, then full attention (full_attention_interval 4)
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # 2 value heads per key head
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
CONFIGS = {
    # HF defaults: partial rotary 0.25, normalised top-k, MoE in every layer, untied head
    "moe": {},
    # tied head, raw top-k weights, a dense MLP layer, attention first, attention bias, rotary 1/2
    "mixed": dict(
        tie_word_embeddings=True,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        layer_types=["full_attention", "linear_attention", "linear_attention", "linear_attention"],
        attention_bias=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    ),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights that make every piece matter: O(1) logits, norm weights away from their init,
    decays from weak to strong."""
    gen = torch.Generator().manual_seed(seed)

    def normal(p: torch.Tensor, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(p.shape, generator=gen) * std + mean

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                # A in [0.08, 1.6]: per-row decays exp(g) from ~0.97 to ~0.2. Much stronger decay
                # forgets the state every row, and a head whose q and k are then near-orthogonal
                # outputs ~0, which the gated RMSNorm blows up to float32 noise (in HF too).
                p.copy_(torch.rand(p.shape, generator=gen) * 3 - 2.5)
            elif name.endswith("dt_bias"):
                p.copy_(normal(p, 0.5))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(normal(p, 0.1, 1.0))  # gated norm: plain weight
            elif "norm" in name:
                p.copy_(normal(p, 0.1))  # zero-centred: (1 + w)
            elif p.dim() == 1:
                p.copy_(normal(p, 0.1))  # biases
            else:
                p.copy_(normal(p, 1.0 / math.sqrt(p.shape[-1])))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def next_ckpt(request, tmp_path_factory):
    """(model dir, the HF model in float32) for a random tiny Qwen3-Next checkpoint."""
    cfg = transformers.Qwen3NextConfig(**{**TINY_NEXT, **CONFIGS[request.param]})
    torch.manual_seed(0)
    hf = transformers.Qwen3NextForCausalLM(cfg).eval()
    randomize(hf, seed=1)
    path = tmp_path_factory.mktemp(f"qwen3next-{request.param}")
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


class Harness:
    """metrale's model over a paged KV cache and a GDN state, run the way the runner will: each
    step packs rows of several sequences. Sequence i owns KV pages scattered over the pool and
    state entry `num_seqs - i` (entry 0 stays unused, like a dummy slot)."""

    def __init__(self, model_dir, num_seqs: int = 2, max_len: int = 128) -> None:
        cfg = ModelConfig.from_hf(model_dir)
        self.model = Qwen3NextForCausalLM(cfg, TorchPagedAttention(), max_positions=256)
        load_weights(self.model, model_dir)
        self.model.eval()
        pages = max_len // PAGE
        num_pages = 1 + num_seqs * pages
        layers = self.model.attention_layers
        self.kv = torch.zeros(
            len(layers), 2, num_pages, PAGE, cfg.num_key_value_heads, cfg.head_dim
        )
        for layer, cache in zip(layers, self.kv, strict=True):
            layer.kv_cache = cache
        perm = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(0)) + 1
        self.tables = perm.view(num_seqs, pages)  # page 0 is the dummy
        self.state = self.model.make_state(num_seqs + 1)
        self.num_seqs = num_seqs

    def entry(self, seq: int) -> int:
        return self.num_seqs - seq

    def step(
        self,
        rows: list[tuple[int, list[int], int]],
        mode: StateMode = StateMode.WRITE,
        row_entries: list[list[int]] | None = None,
    ):
        """rows: (sequence, its tokens this step, position of the first) -> logits [N, V];
        `mode` / `row_entries` ([B, T] entries, ROWS only): how the state is written."""
        ids, pos, qsl, lens = [], [], [0], []
        for _, tokens, start in rows:
            ids += tokens
            pos += range(start, start + len(tokens))
            qsl.append(len(ids))
            lens.append(start + len(tokens))
        positions = torch.tensor(pos)
        seqs = torch.tensor([s for s, _, _ in rows])
        row_seq = torch.repeat_interleave(seqs, torch.tensor([len(t) for _, t, _ in rows]))
        tables = self.tables[seqs]
        meta = AttentionMetadata(
            slot_mapping=self.tables[row_seq, positions // PAGE] * PAGE + positions % PAGE,
            positions=positions,
            query_start_loc=torch.tensor(qsl),
            seq_lens=torch.tensor(lens),
            block_tables=tables,
            max_query_len=max(len(t) for _, t, _ in rows),
            max_seq_len=max(lens),
            page_size=PAGE,
        )
        read = torch.tensor([self.entry(s) for s, _, _ in rows])
        row_t = None if row_entries is None else torch.tensor(row_entries)
        self.bound = self.state.view(read, mode, row_t)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), positions, meta, self.bound)
            return self.model.compute_logits(hidden)


def prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, TINY_NEXT["vocab_size"], (ln,), generator=gen).tolist() for ln in lengths
    ]


def test_packed_prefill_matches_transformers(next_ckpt):
    model_dir, hf = next_ckpt
    a, b = prompts(2, [70, 37])  # 70 rows: two WY chunks, the second partial
    h = Harness(model_dir)
    got = h.step([(0, a, 0), (1, b, 0)])
    torch.testing.assert_close(got[:70], hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(got[70:], hf_logits(hf, b), atol=ATOL, rtol=0)
    # each sequence wrote its own entries only
    for t in h.state.conv + h.state.ssm:
        assert not t[0].any() and t[1].any() and t[2].any()


def test_chunked_prefill_mixed_with_decode_matches_transformers(next_ckpt):
    model_dir, hf = next_ckpt
    a, b = prompts(2, [96, 12], seed=1)
    h = Harness(model_dir)
    # A prefills in chunks (one crossing a WY chunk boundary), B decodes beside it.
    plan = [((0, 23), (0, 5)), ((23, 88), (5, 6)), ((88, 91), (6, 7))]
    plan += [((i, i + 1), (i - 84, i - 83)) for i in range(91, 96)]
    got_a, got_b = [], []
    for (a0, a1), (b0, b1) in plan:
        out = h.step([(1, b[b0:b1], b0), (0, a[a0:a1], a0)])
        got_b.append(out[: b1 - b0])
        got_a.append(out[b1 - b0 :])
    torch.testing.assert_close(torch.cat(got_a), hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got_b), hf_logits(hf, b), atol=ATOL, rtol=0)


def test_step_by_step_decode_matches_transformers(next_ckpt):
    model_dir, hf = next_ckpt
    a, b = prompts(2, [40, 33], seed=2)
    h = Harness(model_dir)
    first = h.step([(0, a[:30], 0), (1, b[:25], 0)])
    got_a, got_b = [first[:30]], [first[30:]]
    for i in range(8):  # one row per sequence: the recurrent path
        out = h.step([(0, a[30 + i : 31 + i], 30 + i), (1, b[25 + i : 26 + i], 25 + i)])
        got_a.append(out[:1])
        got_b.append(out[1:])
    torch.testing.assert_close(torch.cat(got_a), hf_logits(hf, a[:38]), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got_b), hf_logits(hf, b[:33]), atol=ATOL, rtol=0)


def test_write_on_accept_verify_then_commit_matches_transformers(next_ckpt):
    """A DEFER (write-on-accept) forward of K+1 rows leaves the state entries alone; committing
    a + 1 rows continues exactly as if only rows 0..a had run."""
    model_dir, hf = next_ckpt
    a, b = prompts(2, [30, 30], seed=3)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    h = Harness(model_dir)
    h.step([(0, a[:20], 0), (1, b[:20], 0)])
    before = [t.clone() for t in h.state.conv + h.state.ssm]
    out = h.step([(0, a[20:24], 20), (1, b[20:22], 20)], StateMode.DEFER)  # depths 3 and 1
    torch.testing.assert_close(out[:4], ref_a[20:24], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[4:], ref_b[20:22], atol=ATOL, rtol=0)
    for x, y in zip(before, h.state.conv + h.state.ssm, strict=True):
        assert torch.equal(x, y)
    h.bound.commit(torch.tensor([2, 2]))  # A accepts one draft (rows 0..1), B all of its rows
    # A graph capture runs the commit twice (warm-up, capture): it must not consume its rows.
    after = [t.clone() for t in h.state.conv + h.state.ssm]
    for t, x in zip(h.state.conv + h.state.ssm, before, strict=True):
        t.copy_(x)
    h.bound.commit(torch.tensor([2, 2]))
    for x, y in zip(after, h.state.conv + h.state.ssm, strict=True):
        assert torch.equal(x, y)
    out = h.step([(0, a[22:25], 22), (1, b[22:25], 22)])
    torch.testing.assert_close(out[:3], ref_a[22:25], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[3:], ref_b[22:25], atol=ATOL, rtol=0)


def test_per_row_slot_verify_matches_transformers(next_ckpt):
    """A ROWS forward writes the state after each row into its own entry; continuing from the
    entry of the last accepted row equals transformers, and rows past a sequence's end write only
    the dummy entry."""
    model_dir, hf = next_ckpt
    a, b = prompts(2, [30, 30], seed=4)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    h = Harness(model_dir)
    h.step([(0, a[:20], 0), (1, b[:20], 0)])  # A on entry 2, B on entry 1
    h.state = h.model.make_state(12)
    h.step([(0, a[:20], 0), (1, b[:20], 0)])
    # A: rows 0..3 into entries 2, 5, 6, 7 (entry 2 is where it read from); B: rows into 1, 8
    out = h.step(
        [(0, a[20:24], 20), (1, b[20:22], 20)],
        StateMode.ROWS,
        row_entries=[[2, 5, 6, 7], [1, 8, 0, 0]],
    )
    torch.testing.assert_close(out[:4], ref_a[20:24], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[4:], ref_b[20:22], atol=ATOL, rtol=0)
    for t in h.state.conv + h.state.ssm:
        assert not t[9:].any()  # no other entry was touched
    # A accepted one draft (state after row 1: entry 5), B all (after row 1: entry 8)
    h.entry = {0: 5, 1: 8}.__getitem__
    out = h.step([(0, a[22:25], 22), (1, b[22:25], 22)])
    torch.testing.assert_close(out[:3], ref_a[22:25], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[3:], ref_b[22:25], atol=ATOL, rtol=0)


def test_window_after_takes_the_last_inputs():
    window = torch.arange(6.0).view(1, 2, 3)  # D = 2, K - 1 = 3
    x = torch.tensor([[[10.0, 20.0], [11.0, 21.0]]])  # two rows
    torch.testing.assert_close(window_after(window, x, torch.tensor([0])), window)
    got = window_after(window, x, torch.tensor([1]))
    torch.testing.assert_close(got, torch.tensor([[[1.0, 2.0, 10.0], [4.0, 5.0, 20.0]]]))


# ------------------------------------------------------------------------------------------ kernels


def delta_inputs(b: int, t: int, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hk, dk, generator=gen)
    k = torch.randn(b, t, hk, dk, generator=gen)
    v = torch.randn(b, t, hv, dv, generator=gen)
    g = -torch.rand(b, t, hv, generator=gen) * 2  # log-decay in [-2, 0]
    beta = torch.rand(b, t, hv, generator=gen)
    state = torch.randn(b, hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("t", [1, 5, 63, 64, 65, 130])
def test_chunk_form_equals_recurrent_form(t):
    q, k, v, g, beta, state = delta_inputs(2, t)
    rec = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    chunk = chunk_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(chunk.out, rec.out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunk.state, rec.state, atol=1e-5, rtol=1e-5)
    small = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    torch.testing.assert_close(small.out, rec.out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t", [7, 70])
def test_kernels_match_transformers_torch_reference(t):
    q, k, v, g, beta, state = delta_inputs(2, t, seed=1)
    args = dict(g=g, beta=beta, initial_state=state, output_final_state=True)
    for ours, theirs in (
        (recurrent_gated_delta_rule, hf_next.torch_recurrent_gated_delta_rule),
        (chunk_gated_delta_rule, hf_next.torch_chunk_gated_delta_rule),
    ):
        ref_out, ref_state = theirs(q, k, v, use_qk_l2norm_in_kernel=True, **args)
        got = ours(q, k, v, g, beta, state)
        torch.testing.assert_close(got.out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.state, ref_state, atol=1e-5, rtol=1e-5)


def test_per_row_states_equal_row_by_row_runs():
    q, k, v, g, beta, state = delta_inputs(3, 6, seed=2)
    full = recurrent_gated_delta_rule(q, k, v, g, beta, state, output_all_states=True)
    assert full.states.shape == (3, 6, 4, 8, 12)
    s = state
    for t in range(6):
        row = slice(t, t + 1)
        one = recurrent_gated_delta_rule(
            q[:, row], k[:, row], v[:, row], g[:, row], beta[:, row], s
        )
        torch.testing.assert_close(one.out, full.out[:, row], atol=1e-6, rtol=0)
        torch.testing.assert_close(full.states[:, t], one.state, atol=1e-6, rtol=0)
        s = one.state
    assert torch.equal(full.states[:, -1], full.state)


def test_identity_rows_leave_the_state_alone():
    """g = beta = 0 rows (the padding of shorter sequences) change neither form's state."""
    q, k, v, g, beta, state = delta_inputs(1, 70, seed=3)
    g[:, 50:], beta[:, 50:] = 0, 0
    ref = recurrent_gated_delta_rule(
        q[:, :50], k[:, :50], v[:, :50], g[:, :50], beta[:, :50], state
    )
    for run in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        got = run(q, k, v, g, beta, state)
        torch.testing.assert_close(got.state, ref.state, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.out[:, :50], ref.out, atol=1e-5, rtol=1e-5)


def test_conv_prefill_then_updates_equals_one_pass():
    gen = torch.Generator().manual_seed(4)
    b, t, d, kernel = 2, 11, 6, 4
    x = torch.randn(b, t, d, generator=gen)
    weight = torch.randn(d, kernel, generator=gen)
    window = torch.randn(b, d, kernel - 1, generator=gen)
    whole = causal_conv1d(x, weight, window, output_all_windows=True)
    # HF's reference over [window, x], the window as earlier inputs
    seq = torch.cat([window.transpose(1, 2), x], 1).transpose(1, 2)
    ref = hf_next.causal_conv1d_fn(seq, weight, activation="silu")[..., kernel - 1 :]
    torch.testing.assert_close(whole.out, ref.transpose(1, 2), atol=1e-6, rtol=0)
    assert torch.equal(whole.window, x[:, -3:].transpose(1, 2))
    # prefill 5 rows, then 2 rows, then single rows
    part = causal_conv1d(x[:, :5], weight, window)
    outs, w = [part.out], part.window
    for lo, hi in [(5, 7)] + [(i, i + 1) for i in range(7, t)]:
        step = causal_conv1d(x[:, lo:hi], weight, w)
        outs.append(step.out)
        w = step.window
        assert torch.equal(whole.windows[:, hi - 1], w)
    torch.testing.assert_close(torch.cat(outs, 1), whole.out, atol=1e-6, rtol=0)
    assert torch.equal(w, whole.window)
    # ragged lengths: each sequence's window ends at its own last real row
    ragged = causal_conv1d(x, weight, window, lengths=torch.tensor([4, 11]))
    assert torch.equal(ragged.window[0], causal_conv1d(x[:1, :4], weight, window[:1]).window[0])
    assert torch.equal(ragged.window[1], whole.window[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_transformers(dtype):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 12, generator=gen).to(dtype)
    z = torch.randn(9, 12, generator=gen).to(dtype)
    norm = hf_next.Qwen3NextRMSNormGated(12, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(12, generator=gen) * 0.1 + 1)
    norm = norm.to(dtype)
    with torch.no_grad():
        ours, theirs = gated_rms_norm(x, z, norm.weight, 1e-6), norm(x, z)
    # within an ulp in float32: our SiLU is written over exp on the CPU (`models/activations`:
    # torch's rounds an element by where it falls in the call); bf16 rounds that away
    if dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=3e-7, atol=1e-7)
    else:
        assert torch.equal(ours, theirs)


# ------------------------------------------------------------------------------ config and load


def test_config_reads_the_hybrid_fields(next_ckpt):
    model_dir, hf = next_ckpt
    cfg = ModelConfig.from_hf(model_dir)
    hybrid = cfg.hybrid
    assert cfg.architecture == "Qwen3NextForCausalLM"
    assert list(hybrid.layer_types) == hf.config.layer_types
    assert hybrid.gdn_layers == [i for i, t in enumerate(hf.config.layer_types) if t[0] == "l"]
    assert hybrid.partial_rotary_factor == hf.config.rope_parameters["partial_rotary_factor"]
    assert (hybrid.num_experts, hybrid.num_experts_per_tok) == (4, 2)
    assert hybrid.norm_topk_prob == hf.config.norm_topk_prob
    assert hybrid.conv_dim == 2 * 2 * 8 + 4 * 12
    for i, layer in enumerate(hf.model.layers):
        assert hybrid.is_moe_layer(i) == isinstance(layer.mlp, hf_next.Qwen3NextSparseMoeBlock)


def test_config_interval_and_errors():
    raw = {"architectures": ["Qwen3NextForCausalLM"], **TINY_NEXT, "num_hidden_layers": 8}
    raw["full_attention_interval"] = 3
    hybrid = ModelConfig.from_dict(raw).hybrid
    assert [i for i, t in enumerate(hybrid.layer_types) if t == "full_attention"] == [2, 5]
    assert hybrid.partial_rotary_factor == 0.25  # HF's default
    for bad, match in (
        ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
        ({"layer_types": ["mamba"] * 8}, "layer_types"),
        ({"linear_num_value_heads": 3}, "multiple"),
        ({"num_experts_per_tok": 5}, "exceeds"),
        ({"partial_rotary_factor": 0.1}, "rotary"),
    ):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_dict({**raw, **bad})
    dense = {**raw, "architectures": ["Qwen3ForCausalLM"]}
    assert ModelConfig.from_dict(dense).hybrid is None


def test_loader_ignores_mtp_and_names_a_missing_expert(next_ckpt, tmp_path):
    model_dir, _ = next_ckpt
    tensors = load_file(str(model_dir / "model.safetensors"))
    cfg = ModelConfig.from_hf(model_dir)
    shutil.copy(model_dir / "config.json", tmp_path / "config.json")
    layer = next(i for i in range(4) if cfg.hybrid.is_moe_layer(i))
    gone = f"model.layers.{layer}.mlp.experts.3.up_proj.weight"
    extra = {
        "mtp.fc.weight": torch.zeros(64, 128),
        "mtp.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(1),
    }
    save_file({**tensors, **extra}, str(tmp_path / "model.safetensors"))
    model = Qwen3NextForCausalLM(cfg, TorchPagedAttention(), max_positions=64)
    load_weights(model, tmp_path)  # mtp.* skipped
    stacked = model.model.layers[layer].mlp.experts.gate_up_proj
    assert torch.equal(stacked[3, 32:], tensors[gone])
    del tensors[gone]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=gone.replace(".", r"\.")):
        load_weights(Qwen3NextForCausalLM(cfg, TorchPagedAttention(), max_positions=64), tmp_path)


def test_state_reset_zeroes_entries():
    state = GDNState.zeros(2, 3, (5, 3), (2, 4, 4), torch.float32)
    for t in state.conv + state.ssm:
        t.fill_(1.0)
    state.reset(torch.tensor([2]))
    for t in state.conv + state.ssm:
        assert t[2].abs().sum() == 0 and t[:2].min() == 1
