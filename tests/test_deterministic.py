"""Deterministic mode (issue 13): batch-invariant kernels, so a row's logits do not depend on the
rows beside it. CPU: the kernels under the Triton interpreter against their torch references,
the engine option's wiring and refusals. GPU-marked: bitwise invariance of each kernel over
M = 1, 3, 17, 64, 256 rows at any position, and bf16 engines whose greedy output and logprobs are
the same bits alone, in a batch, with and without speculation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale import LLM, SamplingParams
from metrale.config import EngineConfig
from metrale.kernels import paged_attention
from metrale.kernels.batch_invariant import (
    InvariantLinear,
    config_for,
    fit_shared,
    invariant_linear,
    make_batch_invariant,
)
from metrale.kernels.paged_attention import TritonPagedAttention
from metrale.models.attention import AttentionMetadata, TorchPagedAttention

triton = pytest.importorskip("triton")
cuda = torch.cuda.is_available()
DEVICE = "cuda" if cuda else "cpu"


def test_invariant_linear_matches_torch_and_each_row_is_alone():
    torch.manual_seed(0)
    w, b = torch.randn(48, 80, device=DEVICE), torch.randn(48, device=DEVICE)
    x = torch.randn(7, 80, device=DEVICE)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=2, num_stages=1)
    out = invariant_linear(x, w, b, config=cfg)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    for at in (0, 3, 6):  # the same row alone, and as the last of a pair
        assert torch.equal(invariant_linear(x[at : at + 1], w, b, config=cfg), out[at : at + 1])
    assert torch.equal(invariant_linear(x[2:4], w, b, config=cfg), out[2:4])
    # leading dimensions and an empty input keep F.linear's shapes
    assert invariant_linear(x.view(7, 1, 80), w, config=cfg).shape == (7, 1, 48)
    assert invariant_linear(x[:0], w, config=cfg).shape == (0, 48)


def test_tile_configuration_depends_on_rows_and_width_only():
    assert config_for(1, 4096, 4096) == config_for(16, 4096, 4096)
    assert config_for(1, 4096, 4096) != config_for(1, 151936, 4096)  # wider tiles for the head
    for m in (1, 17, 64, 100, 256, 4096):
        cfg = config_for(m, 4096, 12288)
        assert set(cfg) == {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}


H200_SHARED = 227 * 1024


def _buffers(cfg: dict, elem_bytes: int) -> int:
    return (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * elem_bytes * cfg["num_stages"]


@pytest.mark.parametrize("n,k", [(4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)])
def test_tiles_fit_the_devices_shared_memory_in_every_dtype(n, k):
    """The tuned bf16 tiles stand on the H200; float32 operands (twice the bytes) and smaller
    GPUs get fewer stages or shorter K blocks, never more than the device has."""
    for m in (1, 16, 17, 64, 65, 128, 200, 256, 257, 4096):
        tuned = config_for(m, n, k)
        assert fit_shared(tuned, 2, H200_SHARED) == tuned
        for elem_bytes, budget in ((4, H200_SHARED), (2, 99 * 1024), (4, 99 * 1024)):
            cfg = fit_shared(tuned, elem_bytes, budget)
            assert _buffers(cfg, elem_bytes) <= budget, (m, elem_bytes, budget)
            assert {key: cfg[key] for key in ("BLOCK_M", "BLOCK_N")} == {
                key: tuned[key] for key in ("BLOCK_M", "BLOCK_N")
            }


def test_make_batch_invariant_swaps_every_linear_and_the_head(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", deterministic=True)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is InvariantLinear for m in linears)
    assert model.head_linear is invariant_linear
    assert make_batch_invariant(model) == 1  # only the head hook is set again


def test_deterministic_engine_on_cpu_gives_plain_tokens(tiny_model_dir):
    prompts = [[5, 17, 300, 42, 9, 11], [7, 8, 9, 10, 7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(tiny_model_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    det = LLM(tiny_model_dir, device="cpu", deterministic=True, spec={"method": "ngram"})
    outs = det.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_deterministic_refusals():
    with pytest.raises(ValueError, match="deterministic"):
        EngineConfig(deterministic=True, tensor_parallel_size=2)
    from metrale.kernels.batch_invariant import check_invariant_support

    class Cfg:
        page_size = 8
        head_dim = 128

    with pytest.raises(ValueError, match="page_size"):
        check_invariant_support(Cfg, Cfg, paged_kernel=True)


def step_metadata(q_lens, seq_lens, tables, page, device):
    """The metadata of a step whose sequences run their last q_len rows over `tables`."""
    slots, positions, starts = [], [], [0]
    for ql, n, table in zip(q_lens, seq_lens, tables, strict=True):
        slots += [table[p // page] * page + p % page for p in range(n - ql, n)]
        positions += range(n - ql, n)
        starts.append(starts[-1] + ql)

    def t(x):
        return torch.tensor(x, dtype=torch.long, device=device)

    return AttentionMetadata(
        slot_mapping=t(slots),
        positions=t(positions),
        query_start_loc=t(starts),
        seq_lens=t(seq_lens),
        block_tables=t(tables),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        page_size=page,
    )


def _paged_case(q_lens, seq_lens, *, heads=4, kv_heads=2, dim=16, page=16, seed=0):
    """Random q/k/v of a step (each sequence's last q_len rows) over a fresh paged cache."""
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page) for n in seq_lens]
    cache = torch.randn(2, sum(pages_per) + 1, page, kv_heads, dim, generator=g).to(DEVICE)
    tables, first = [], 1
    for n in pages_per:
        tables.append(list(range(first, first + n)) + [0] * (max(pages_per) - n))
        first += n
    rows = sum(q_lens)
    q = torch.randn(rows, heads, dim, generator=g).to(DEVICE)
    k = torch.randn(rows, kv_heads, dim, generator=g).to(DEVICE)
    v = torch.randn(rows, kv_heads, dim, generator=g).to(DEVICE)
    meta = step_metadata(q_lens, seq_lens, tables, page, DEVICE)
    return q, k, v, cache, meta


def test_invariant_paged_attention_matches_reference():
    """Decode, verify and prefill rows in one step, through the one tiled path."""
    q, k, v, cache, meta = _paged_case([1, 4, 37, 1], [40, 21, 300, 130])
    torch_ref = TorchPagedAttention()
    ref = torch_ref.forward(q, k, v, cache.clone(), torch_ref.prepare(meta), 0.25)
    out = TritonPagedAttention(invariant=True).forward(q, k, v, cache.clone(), meta, 0.25)
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("split_tokens", [48, 96])
def test_invariant_splits_of_any_size_read_every_key(monkeypatch, split_tokens):
    """Splits of 3 or 6 pages: the tile divides the split, so no page of a split is skipped."""
    from metrale.kernels import invariant_attention as ia

    monkeypatch.setattr(ia, "SPLIT_TOKENS", split_tokens)
    q, k, v, cache, meta = _paged_case([1, 4, 37], [300, 130, 200], seed=2)
    torch_ref = TorchPagedAttention()
    ref = torch_ref.forward(q, k, v, cache.clone(), torch_ref.prepare(meta), 0.25)
    out = TritonPagedAttention(invariant=True).forward(q, k, v, cache.clone(), meta, 0.25)
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)


def row_alone(q, k, v, cache, meta, seq, row, backend):
    """The position of sequence `seq`'s row `row` decoded alone, its table cut to its pages
    (the keys of the rows after it are not visible to it anyway)."""
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    at, q_len = starts[seq] + row, starts[seq + 1] - starts[seq]
    n = lens[seq] - q_len + row + 1
    one = AttentionMetadata(
        slot_mapping=meta.slot_mapping[at : at + 1],
        positions=meta.positions[at : at + 1],
        query_start_loc=torch.tensor([0, 1], device=q.device),
        seq_lens=torch.tensor([n], device=q.device),
        block_tables=meta.block_tables[seq : seq + 1, : -(-n // meta.page_size)].contiguous(),
        max_query_len=1,
        max_seq_len=n,
        page_size=meta.page_size,
    )
    return backend.forward(q[at : at + 1], k[at : at + 1], v[at : at + 1], cache, one, 0.25)


def decode_path(monkeypatch, fused: bool) -> None:
    """Route the next steps' decode and verify sequences through one program per sequence and
    KV head (`fused`, as for a batch that fills the GPU) or one per split group and a combine."""
    monkeypatch.setattr(paged_attention, "_multiprocessors", lambda *args: 1 if fused else 10**6)


# (the step's decode path, the path of each row decoded alone): every pairing gives one answer
PATHS = [(False, False), (True, False), (False, True)]


@pytest.mark.parametrize("step_fused, alone_fused", PATHS)
@pytest.mark.parametrize("small_splits", [False, True])
def test_invariant_paged_attention_row_is_alone(monkeypatch, step_fused, alone_fused, small_splits):
    """A verify row and a prefill row give the bits of the same position decoded alone, whether
    the decode rows' split groups merge in one program or through the combine kernel."""
    # the prompt chunk's rows reach three 128-key splits; with small splits, ten 32-key splits of
    # two tiles each in four groups (two groups of three splits, two of two)
    if small_splits:
        from metrale.kernels import invariant_attention as ia

        for name, value in (("SPLIT_TOKENS", 32), ("GROUPS", 4), ("TILE_KEYS", 16)):
            monkeypatch.setattr(ia, name, value)
    q, k, v, cache, meta = _paged_case([4, 37, 1], [21, 300, 130], seed=1)
    backend = TritonPagedAttention(invariant=True)
    decode_path(monkeypatch, step_fused)
    full = backend.forward(q, k, v, cache, meta, 0.25)  # writes every row's K/V first
    decode_path(monkeypatch, alone_fused)
    for seq, row, at in ((0, 2, 2), (1, 20, 24), (1, 36, 40), (2, 0, 41)):
        alone = row_alone(q, k, v, cache, meta, seq, row, backend)
        assert torch.equal(alone[0], full[at]), (seq, row)
    decode_path(monkeypatch, step_fused)
    verify = _paged_case([4, 2, 1], [21, 300, 130], seed=1)  # no prompt chunk: decode paths only
    out = backend.forward(*verify[:3], verify[3], verify[4], 0.25)
    decode_path(monkeypatch, not step_fused)
    assert torch.equal(backend.forward(*verify[:3], verify[3], verify[4], 0.25), out)


# ---- GPU: bitwise on the device ----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(96, 256), (4096, 1024), (10240, 512), (151936, 256)])
def test_cuda_invariant_linear_rows_are_bitwise_alone(n, k, dtype):
    torch.manual_seed(n)
    w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.05
    x = torch.randn(256, k, device="cuda", dtype=dtype)
    full = invariant_linear(x, w)
    ref = F.linear(x, w)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert ((full.float() - ref.float()).norm() / ref.float().norm()).item() < tol
    for m, at in ((1, 0), (1, 200), (3, 7), (17, 100), (64, 150), (256, 0)):
        assert torch.equal(invariant_linear(x[at : at + m], w), full[at : at + m]), (m, at)
    flipped = invariant_linear(x.flip(0), w).flip(0)  # every row at another position
    assert torch.equal(flipped, full)


@pytest.mark.gpu
@pytest.mark.parametrize("step_fused, alone_fused", PATHS)
# (Qwen3's heads; Qwen3-Next's 256-wide heads, 8 a KV head, whose first launch asked more
# shared memory than the device has before the tiles were fitted to the compiled kernels)
@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 2, 128), (16, 2, 256)])
def test_cuda_invariant_paged_attention_row_is_alone_bf16(
    monkeypatch, step_fused, alone_fused, heads, kv_heads, dim
):
    q, k, v, cache, meta = _paged_case(
        [4, 37, 1, 8], [21, 300, 130, 64], heads=heads, kv_heads=kv_heads, dim=dim
    )
    q, k, v, cache = (t.to(torch.bfloat16) for t in (q, k, v, cache))
    backend = TritonPagedAttention(invariant=True)
    decode_path(monkeypatch, step_fused)
    full = backend.forward(q, k, v, cache, meta, 0.25)
    decode_path(monkeypatch, alone_fused)
    for seq, row, at in ((0, 3, 3), (1, 0, 4), (1, 36, 40), (2, 0, 41), (3, 5, 47)):
        alone = row_alone(q, k, v, cache, meta, seq, row, backend)
        assert torch.equal(alone[0], full[at]), (seq, row)


def _bf16_model(factory):
    """A random bf16-sized dense model whose products are long enough to round differently."""
    return factory(
        "det-dense",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=2048,
    )


def _greedy(llm, prompts, logprobs=None):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=logprobs)
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.gpu
def test_cuda_deterministic_speculation_and_batch_give_plain_bits(hf_qwen3_factory):
    from tests.test_spec_lossless import replay

    model = _bf16_model(hf_qwen3_factory)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 2000, (int(n),), generator=g).tolist() for n in range(8, 72)]
    prompts = [p[: len(p) // 2] * 2 for p in prompts]  # repeats give the n-gram drafter matches
    common = dict(device="cuda", dtype="bfloat16", deterministic=True)
    plain = LLM(model, **common)
    alone = [_greedy(plain, [p], logprobs=2)[0].outputs[0] for p in prompts[:4]]
    batch = [o.outputs[0] for o in _greedy(plain, prompts, logprobs=2)]
    for a, b in zip(alone, batch, strict=False):
        assert a.token_ids == b.token_ids
        assert [lp for lp in a.logprobs] == [lp for lp in b.logprobs]  # every bit
    ref = [o.token_ids for o in batch]
    for drafter, spec in ((None, {"method": "ngram"}), (replay(prompts, ref, 0.8), {})):
        llm = LLM(model, drafter=drafter, spec={"num_drafts": 3, **spec}, **common)
        outs = _greedy(llm, prompts, logprobs=2)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert [o.outputs[0].logprobs for o in outs] == [o.logprobs for o in batch]
        assert llm.engine.telemetry.spec.num_accepted_tokens > 0


@pytest.mark.gpu
@pytest.mark.parametrize(
    "variant,dtype",
    [
        ("write_on_accept", "bfloat16"),
        ("per_row_slots", "bfloat16"),
        ("write_on_accept", "float32"),
    ],
)
def test_cuda_deterministic_hybrid_gives_plain_bits(tmp_path, tokenizer_dir, variant, dtype):
    """A hybrid target (GDN, gated attention, MoE) with longer products than the tiny one:
    alone, in a batch and with replayed drafts, the same tokens and logprobs to the bit (in
    float32 too, whose operands twice as wide once overflowed the GEMM's shared memory)."""
    from metrale.speculative.replay import ReplayDrafter
    from tests.test_hybrid_engine import write_hybrid

    model = write_hybrid(tmp_path / "hybrid", tokenizer_dir, seed=3, hidden_size=256)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in range(6, 40, 2)]
    common = dict(device="cuda", dtype=dtype, deterministic=True, hybrid_verify_state=variant)
    plain = LLM(model, **common)
    batch = [o.outputs[0] for o in _greedy(plain, prompts, logprobs=2)]
    for p, b in zip(prompts[:4], batch, strict=False):
        alone = _greedy(plain, [p], logprobs=2)[0].outputs[0]
        assert (alone.token_ids, alone.logprobs) == (b.token_ids, b.logprobs)
    truth = {tuple(p): o.token_ids for p, o in zip(prompts, batch, strict=True)}
    drafter = ReplayDrafter(truth, 0.8, vocab_size=320)
    llm = LLM(model, drafter=drafter, spec={"num_drafts": 3}, **common)
    outs = [o.outputs[0] for o in _greedy(llm, prompts, logprobs=2)]
    assert [(o.token_ids, o.logprobs) for o in outs] == [(b.token_ids, b.logprobs) for b in batch]
    assert llm.engine.telemetry.spec.num_accepted_tokens > 0
