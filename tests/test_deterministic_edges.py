"""Edge cases of the deterministic mode (issue 13), found by trying to break it.

CPU tests run the Triton kernels under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1
without CUDA): the invariant attention over odd lengths, split boundaries, GQA groups 1-8,
head sizes 16-256, pages 16-256 and NaN-poisoned memory, each row equal to its position computed
alone; the partials' memory and offsets at long contexts; the GEMM with strided bias, empty
reductions and rows across tile buckets; a hybrid target's GDN in-projection through the
invariant product, and its prompt rows independent of how the prompt is chunked.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

from metrale.kernels.paged_attention import TritonPagedAttention
from metrale.models.attention import AttentionMetadata, TorchPagedAttention
from tests.test_deterministic import row_alone, step_metadata

triton = pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="needs Triton's interpreter")


# ---- attention: edge cases that hold (NaN-poisoned pool, row alone == row in the step) --------


def _poisoned_case(q_lens, seq_lens, *, heads, kv_heads, dim, page, seed=0):
    """A step over a shuffled pool whose dummy page 0, unused pages and unused tail slots of
    each sequence's last page hold NaN."""
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page) for n in seq_lens]
    total = sum(pages_per) + 3
    cache = torch.randn(2, total, page, kv_heads, dim, generator=g)
    cache[:, 0] = float("nan")
    order = list(range(1, total))
    random.Random(seed).shuffle(order)
    width, tables, used = max(max(pages_per), 1), [], 0
    for n in pages_per:
        tables.append(order[used : used + n] + [0] * (width - n))
        used += n
    for p in order[used:]:
        cache[:, p] = float("nan")
    for n, table in zip(seq_lens, tables, strict=True):
        if n % page:
            cache[:, table[(n - 1) // page], n % page :] = float("nan")
    rows = sum(q_lens)
    q = torch.randn(rows, heads, dim, generator=g)
    k = torch.randn(rows, kv_heads, dim, generator=g)
    v = torch.randn(rows, kv_heads, dim, generator=g)
    meta = step_metadata(q_lens, seq_lens, tables, page, "cpu")
    return q, k, v, cache, meta


@pytest.fixture
def row_exact_dot(monkeypatch):
    """The interpreter's tl.dot is np.matmul, and OpenBLAS's float32 rows follow M for some
    shapes (a transposed [64, 64] operand: rows 0..15 of a 64-row product differ from the same
    16 rows alone), which is no property of the kernel. A float64 product rounded once makes each
    row a function of that row alone, so the bitwise checks below test the kernels' masks, splits
    and merges. (Without it, D >= 32 with pages of 32+ keys fails spuriously.)"""
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        prod = np.einsum("mk,kn->mn", a.data.astype(np.float64), b.data.astype(np.float64))
        return interpreter.TensorHandle(prod.astype(d.data.dtype) + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@needs_interpreter
@pytest.mark.parametrize(
    "q_lens, seq_lens, shape",
    [
        # length 1, exact multiples of 128 and of the page, q_len 16 and 17, an empty sequence
        ([1, 1, 16, 17, 0], [1, 128, 144, 145, 0], dict(heads=4, kv_heads=2, dim=16, page=16)),
        ([1, 20], [128, 300], dict(heads=3, kv_heads=1, dim=64, page=64)),  # group 3, padded
        ([16, 1], [200, 64], dict(heads=8, kv_heads=1, dim=256, page=32)),  # group 8, D 256
    ],
    ids=["lengths", "group3-d64-page64", "group8-d256-page32"],
)
def test_invariant_attention_edge_cases_hold(monkeypatch, row_exact_dot, q_lens, seq_lens, shape):
    """Checked fine: every row equals the reference and, bitwise, its position decoded alone,
    with NaN in the dummy page, unused pages, unused slots and every torch.empty buffer."""
    real_empty, real_like = torch.empty, torch.empty_like

    def nan_empty(*a, **kw):
        out = real_empty(*a, **kw)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    def nan_like(*a, **kw):
        out = real_like(*a, **kw)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    q, k, v, cache, meta = _poisoned_case(q_lens, seq_lens, **shape)
    ref_backend = TorchPagedAttention()
    ref = ref_backend.forward(q, k, v, cache.clone(), ref_backend.prepare(meta), 0.25)
    monkeypatch.setattr(torch, "empty", nan_empty)
    monkeypatch.setattr(torch, "empty_like", nan_like)
    backend = TritonPagedAttention(invariant=True)
    out = backend.forward(q, k, v, cache, meta, 0.25)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    starts = meta.query_start_loc.tolist()
    for seq, q_len in enumerate(q_lens):
        for row in {0, q_len // 2, q_len - 1} if q_len else ():
            alone = row_alone(q, k, v, cache, meta, seq, row, backend)
            assert torch.equal(alone[0], out[starts[seq] + row]), (seq, row)


# ---- attention: the partials' buffer, compiled once whatever the table's width --------


class _Launch:
    """Stands for a Triton kernel: records the grid, runs nothing."""

    def __init__(self, grids):
        self.grids = grids

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args, **kwargs: None

    def warmup(self, *args, grid, **kwargs):
        return None  # compiles nothing: the tile's estimate stands


@pytest.mark.parametrize(
    "heads, kv_heads, max_model_len",
    [(64, 8, 40960), (32, 8, 131072)],
    ids=["qwen3-32b-default-len", "qwen3-8b-128k"],
)
def test_attention_partials_fit_int32_offsets(monkeypatch, heads, kv_heads, max_model_len):
    """A captured prefill program (graphs.py: 64 sequences + the padding one, 512 rows, block
    tables max_model_len / page + 1 wide) with a prompt chunk: the decode partials are bounded by
    the split groups, not by the table's width (a 40k-128k context once needed 10-16 GiB, past
    int32 offsets)."""
    from metrale.kernels import invariant_attention as ia

    sizes, grids = [], []
    real_empty = torch.empty

    def record_empty(*shape, **kw):
        sizes.append(shape[0] if len(shape) == 1 else None)
        return real_empty(0, **kw)

    for name in ("_decode_group_kernel", "_combine_kernel", "_tile_kernel"):
        monkeypatch.setattr(ia, name, _Launch(grids))
    page, dim, seqs, rows = 16, 128, 65, 512
    width = -(-max_model_len // page) + 1  # GraphRunner's block table width
    q = torch.zeros(rows, heads, dim, dtype=torch.bfloat16)
    kv = torch.zeros(2, 2, page, kv_heads, dim, dtype=torch.bfloat16)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(rows, dtype=torch.long),
        positions=torch.zeros(rows, dtype=torch.long),
        query_start_loc=torch.zeros(seqs + 1, dtype=torch.long),
        seq_lens=torch.zeros(seqs, dtype=torch.long),
        block_tables=torch.zeros(seqs, width, dtype=torch.long),
        max_query_len=rows,
        max_seq_len=max_model_len,
        page_size=page,
    )
    monkeypatch.setattr(torch, "empty", record_empty)
    ia.invariant_attention(
        q, kv[0], kv[1], meta, 0.1, max_rows=16, prompt_tile_rows=64, interpreted=False
    )
    monkeypatch.undo()
    (numel,) = [s for s in sizes if s is not None]
    assert numel * 4 < 2**30, f"partials: {numel:,} floats ({numel * 4 / 2**30:.1f} GiB)"


@pytest.mark.gpu
def test_cuda_invariant_attention_compiles_once_per_tile_shape():
    """The same decode step over tables 24, 40 and 56 pages wide (3, 5 and 7 splits; strides
    Triton's integer specialisation does not tell apart) reuses one compiled group kernel: the
    table's width is no compile-time constant."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from metrale.kernels import invariant_attention as ia

    backend = TritonPagedAttention(invariant=True)
    page, kv_heads, dim = 16, 2, 64
    cache = torch.randn(2, 60, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    kernel = ia._decode_group_kernel
    before = None
    for pages in (24, 40, 56):
        n = pages * page
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([n - 1], device="cuda"),
            positions=torch.tensor([n - 1], device="cuda"),
            query_start_loc=torch.tensor([0, 1], device="cuda"),
            seq_lens=torch.tensor([n], device="cuda"),
            block_tables=torch.arange(1, pages + 1, device="cuda")[None],
            max_query_len=1,
            max_seq_len=n,
            page_size=page,
        )
        q = torch.randn(1, 4, dim, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(1, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        backend.forward(q, kv, kv, cache, meta, 0.125)
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            pytest.skip("this Triton keeps no device_caches")
        compiled = len(caches[torch.cuda.current_device()][0])
        before = compiled if before is None else before
    assert compiled == before, f"{compiled - before} more compiles for wider tables"


# ---- the GEMM wrapper ----------------------------------------------------------------------

CFG = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=2, num_stages=1)


@needs_interpreter
def test_invariant_linear_strided_bias():
    """F.linear's signature takes any bias; the kernel reads bias_ptr + rn as if contiguous."""
    from metrale.kernels.batch_invariant import invariant_linear

    torch.manual_seed(0)
    w, x = torch.randn(40, 70), torch.randn(5, 70)
    bias = torch.randn(80)[::2]
    torch.testing.assert_close(
        invariant_linear(x, w, bias, config=CFG), F.linear(x, w, bias), rtol=1e-4, atol=1e-4
    )


@needs_interpreter
def test_invariant_linear_empty_reduction():
    """K = 0: F.linear gives the bias; x.reshape(-1, 0) raises."""
    from metrale.kernels.batch_invariant import invariant_linear

    x, w, b = torch.randn(3, 0), torch.randn(4, 0), torch.randn(4)
    torch.testing.assert_close(invariant_linear(x, w, b, config=CFG), F.linear(x, w, b))


@needs_interpreter
def test_interpreted_invariant_linear_rows_across_tile_buckets(row_exact_dot):
    """Low severity, interpreter only: tl.dot runs as numpy there, so each BLOCK_K chunk is
    reduced on its own and added to the accumulator; config_for's BLOCK_K changes with M (256 at
    M <= 16, 128 at M <= 64), so a row's bits follow M. The CPU tests (and a deterministic engine
    under the interpreter) cannot check the GPU's invariance unless the interpreted path keeps
    one BLOCK_K for every M."""
    from metrale.kernels.batch_invariant import invariant_linear

    torch.manual_seed(0)
    w, x = torch.randn(64, 1024), torch.randn(17, 1024)
    assert torch.equal(invariant_linear(x[:1], w), invariant_linear(x, w)[:1])


def spy_launches(monkeypatch, module, names, launched: list) -> None:
    """Route the launches of `module`'s Triton kernels `names` through a recorder: each appends
    (kernel name, grid, keyword arguments) to `launched`, then launches."""

    class Spy:
        def __init__(self, name):
            self.name, self.real = name, getattr(module, name)

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((self.name, grid, kwargs))
                return self.real[grid](*args, **kwargs)

            return launch

    for name in names:
        monkeypatch.setattr(module, name, Spy(name))


# ---- hybrid targets ------------------------------------------------------------------------

from tests.test_hybrid_engine import hybrid_dir  # noqa: E402,F401


@pytest.fixture
def fused(knob_env):
    """The hybrid target's fused (CUDA) paths, forced under the interpreter."""
    knob_env(METRALE_FORCE_FUSED_KERNELS="1")


class _LinearSpy:
    """Stands for torch.nn.functional in a module: counts `linear` calls, or reroutes them."""

    def __init__(self, linear=None):
        self.calls, self._linear = [], linear or F.linear

    def __getattr__(self, name):
        return getattr(F, name)

    def linear(self, x, w, b=None):
        self.calls.append(tuple(x.shape))
        return self._linear(x, w, b)


def _greedy_logprobs(llm, prompt, n):
    from metrale import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [next(iter(lp.values())).logprob for lp in out.logprobs]


@needs_interpreter
def test_gdn_in_projection_is_invariant_in_deterministic_mode(
    hybrid_dir,  # noqa: F811
    fused,
    monkeypatch,
):
    """GatedDeltaNet._fused (the CUDA path since 84da8f9, after the deterministic mode) runs
    `F.linear(hidden, self._in_proj)` on the packed weight: make_batch_invariant never sees it,
    so on CUDA every GDN layer's in-projection is cuBLAS, batch-variant."""
    from metrale import LLM
    from metrale.models import qwen3_next_gdn

    spy = _LinearSpy()
    monkeypatch.setattr(qwen3_next_gdn, "F", spy)
    llm = LLM(hybrid_dir, device="cpu", dtype="float32", deterministic=True)
    _greedy_logprobs(llm, [5, 6, 7, 8], 2)
    assert spy.calls == [], f"raw F.linear in the GDN layers: {spy.calls}"


@needs_interpreter
def test_hybrid_prompt_rows_do_not_depend_on_chunking(hybrid_dir, fused, monkeypatch):  # noqa: F811
    """The same 44-token prompt, prefilled in one chunk (alone) or in chunks of 20 + 20 + 4 (as
    when other sequences take the step's token budget): the dense target gives the same bits
    (checked), the hybrid does not. The GDN in-projection is routed to the invariant GEMM here,
    to isolate the cause: chunks of more than 16 rows run the chunked (WY) delta rule, whose
    16-row blocks start at the chunk's first row, while 16 or fewer run the recurrent form;
    forcing the recurrent form everywhere (gdn_state.CHUNK_MIN_ROWS = inf) makes the two equal."""
    from metrale import LLM
    from metrale.kernels.batch_invariant import invariant_linear
    from metrale.models import qwen3_next_gdn

    monkeypatch.setattr(qwen3_next_gdn, "F", _LinearSpy(invariant_linear))
    prompt = [(7 * j) % 250 + 3 for j in range(44)]
    got = []
    for budget in (2048, 20):
        llm = LLM(
            hybrid_dir,
            device="cpu",
            dtype="float32",
            deterministic=True,
            prefix_caching=False,
            max_num_batched_tokens=budget,
        )
        got.append(_greedy_logprobs(llm, prompt, 3))
    assert got[0] == got[1]


@needs_interpreter
@pytest.mark.parametrize("deterministic", [False, True])
def test_hybrid_delta_rule_keeps_one_tile_at_every_batch_in_deterministic_mode(
    tmp_path_factory, tokenizer_dir, fused, monkeypatch, deterministic
):
    """Found on an H100 at Qwen3-Next's shape: the delta-rule kernel's value columns per program
    followed the batch (`_block_v`: 16 at 1-2 sequences, 64 from 5 there), and a program's sums
    over dk reduce in an order that follows its tile, so with the mode on a request alone gave
    other tokens than in a batch of 64 (every one of 64 prompts). The interpreter's sums do not
    follow the tile, so this pins the tile itself: with the GPU's program count, every launch of
    a deterministic engine (decode, verify, commit, prompt) takes `invariant_block_v`, and the
    one binary whose mode is a runtime value (`_invariant_delta_rule_kernel`)."""
    from metrale import LLM, SamplingParams
    from metrale.kernels import gdn_recurrent
    from metrale.speculative.replay import ReplayDrafter
    from tests.test_hybrid_engine import write_hybrid

    # value heads of 64 columns (the tiny target's 12 leave one tile to choose), and as many
    # programs wanted as five sequences' heads make: 16 columns a program alone, 64 from five
    hv = 4
    model = write_hybrid(
        tmp_path_factory.mktemp("wide_v"), tokenizer_dir, seed=3, linear_value_head_dim=64,
        linear_num_value_heads=hv,
    )  # fmt: skip
    monkeypatch.setattr(gdn_recurrent, "_programs_wanted", lambda device: 5 * hv)
    calls = []
    names = ("_recurrent_delta_rule_kernel", "_invariant_delta_rule_kernel")
    spy_launches(monkeypatch, gdn_recurrent, names, calls)
    drafter = ReplayDrafter({}, 1.0, vocab_size=320)
    llm = LLM(
        model, device="cpu", dtype="float32", deterministic=deterministic, drafter=drafter,
        spec={"num_drafts": 3, "dcut": False},
    )  # fmt: skip
    dv = llm.engine.runner.states.pool.ssm[0].shape[-1]
    prompts = [[5 + i, 6, 7, 8, 9][: 3 + i % 3] for i in range(6)]
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, speculative=False)
    truth = llm.generate(prompts, plain, use_tqdm=False)  # a batch of six, and its prompts
    drafter.record({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, truth)}, 1.0)
    alone = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert alone[0].outputs[0].token_ids == truth[0].outputs[0].token_ids
    assert llm.engine.telemetry.spec.num_accepted_tokens > 0
    launched = [(grid[0], kw["BV"], bool(kw["HAS_LENS"]), name) for name, grid, kw in calls]
    kinds = {(bsz, commit) for bsz, _, commit, _ in launched}
    # a lone sequence's prompt, verify and commit, and a batch of six's prompts and decode
    assert {(1, False), (1, True), (6, False)} <= kinds
    tiles = {bv for _, bv, _, _ in launched}
    kernels = {name for *_, name in launched}
    if deterministic:  # one tile, and one binary for every mode
        assert tiles == {gdn_recurrent.invariant_block_v(dv)}
        assert kernels == {"_invariant_delta_rule_kernel"}
    else:  # the fastest tile for each batch: the hazard the mode removes
        assert len(tiles) > 1
        assert kernels == {"_recurrent_delta_rule_kernel"}


def test_invariant_block_v_fits_the_value_heads():
    from metrale.kernels.gdn_recurrent import INVARIANT_BLOCK_V, invariant_block_v

    assert invariant_block_v(128) == invariant_block_v(256) == INVARIANT_BLOCK_V
    assert [invariant_block_v(d) for d in (1, 8, 12, 16)] == [1, 8, 16, 16]


def test_fitted_tile_pages_halve_until_the_compiled_kernels_fit_and_stay_decided():
    """`kv_tiles.fitted_pages`: the estimate's tile halves while the compiled kernels ask more
    shared memory than the device has, decided once per configuration (a row's bits follow
    its tile, so no later step may use another)."""
    from metrale.kernels import kv_tiles

    asked = []

    def shared_of(pages):  # as a 256-wide head's kernels: 80 KiB a K/V page pair and more
        asked.append(pages)
        return 100_000 + pages * 29_000

    key = ("test", object())
    assert kv_tiles.fitted_pages(key, 8, shared_of, 232_448) == 4
    assert asked == [8, 4]
    assert kv_tiles.fitted_pages(key, 8, lambda pages: 0, 232_448) == 4  # decided: not asked
    assert asked == [8, 4]
    assert kv_tiles.fitted_pages(("test", object()), 8, lambda pages: 10**9, 232_448) == 1
    assert kv_tiles.fitted_pages(("test", object()), 4, lambda pages: 0, 232_448) == 4


def test_invariant_attention_launches_with_the_tile_its_compiled_kernels_fit(monkeypatch):
    """Qwen3-Next's attention (256-wide heads, 8 query heads a KV head): the estimate's tile
    compiled to 333 KB of shared memory against the H100's 232 KB, and the first launch
    failed (found on the H100). Every kernel launches with the tile the compiled kernels fit,
    decided by compiling (no launch) before the first launch."""
    from types import SimpleNamespace

    from metrale.kernels import invariant_attention as ia
    from metrale.kernels import kv_tiles

    tiles_launched, warmed = [], []

    class Kernel(_Launch):
        def __getitem__(self, grid):
            return lambda *args, **kwargs: tiles_launched.append(kwargs["TILE_PAGES"])

        def warmup(self, *args, grid, **kwargs):
            warmed.append(kwargs["TILE_PAGES"])
            # as measured: 332,800 bytes with 8 pages (128 keys) a tile
            return SimpleNamespace(
                metadata=SimpleNamespace(shared=100_000 + 29_100 * kwargs["TILE_PAGES"])
            )

    for name in ("_decode_group_kernel", "_combine_kernel", "_tile_kernel"):
        monkeypatch.setattr(ia, name, Kernel([]))
    monkeypatch.setattr(kv_tiles, "_FITTED", {})
    monkeypatch.setattr(kv_tiles, "shared_budget", lambda device: 232_448)
    page, heads, kv_heads, dim = 16, 16, 2, 256
    for q_lens in ([40, 1], [1, 1]):  # a step with a prompt chunk, then a decode step
        rows, seqs = sum(q_lens), len(q_lens)
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(rows, dtype=torch.long),
            positions=torch.zeros(rows, dtype=torch.long),
            query_start_loc=starts,
            seq_lens=torch.full((seqs,), 300),
            block_tables=torch.zeros(seqs, 20, dtype=torch.long),
            max_query_len=max(q_lens),
            max_seq_len=300,
            page_size=page,
        )
        q = torch.zeros(rows, heads, dim, dtype=torch.bfloat16)
        kv = torch.zeros(2, 4, page, kv_heads, dim, dtype=torch.bfloat16)
        ia.invariant_attention(
            q, kv[0], kv[1], meta, 0.1, max_rows=16, prompt_tile_rows=64, interpreted=False
        )
    assert sorted(set(warmed)) == [4, 8]  # 8 compiled past the budget; 4 fits; asked once
    assert len(warmed) == 6
    assert tiles_launched and set(tiles_launched) == {4}
    # a smaller split in the same process (a test, a bench's sweep) is decided anew: a tile
    # of the first configuration's would not divide it, and its keys would go unread
    monkeypatch.setattr(ia, "SPLIT_TOKENS", 32)
    tiles_launched.clear()
    ia.invariant_attention(
        q, kv[0], kv[1], meta, 0.1, max_rows=16, prompt_tile_rows=64, interpreted=False
    )
    assert set(tiles_launched) == {2}


@needs_interpreter
def test_decode_and_verify_steps_launch_one_attention_tile(monkeypatch):
    """The invariant attention's decode and verify launches take one query tile, the engine's
    `invariant_rows`, whatever the step's longest query: the tile once followed it (2 rows a
    decode, 4 a verify at Qwen3-Next's 8 query heads a KV head), a second binary of the same
    arithmetic (found in review). Queries longer than the tile take the prompt tiles."""
    from metrale.kernels import invariant_attention as ia
    from tests.test_deterministic import _paged_case

    launched = []
    spy_launches(
        monkeypatch, ia, ("_decode_group_kernel", "_combine_kernel", "_tile_kernel"), launched
    )
    backend = TritonPagedAttention(invariant=True)
    backend.invariant_rows = 4
    tiles = {}
    for q_lens in ([1, 1], [4, 2], [3], [1, 9]):
        q, k, v, cache, meta = _paged_case(q_lens, [40, 70][: len(q_lens)], heads=8, kv_heads=1)
        launched.clear()
        backend.forward(q, k, v, cache, meta, 0.25)
        tiles[tuple(q_lens)] = {
            (name, kw["BLOCK_Q"]) for name, _, kw in launched if kw.get("DECODE") is not False
        }
    want = {("_decode_group_kernel", 4), ("_combine_kernel", 4)}
    assert all(got == want for got in tiles.values()), tiles
