"""Prefill programs of a hybrid (Qwen3-Next, Gated DeltaNet) target: steps with prompt chunks
replay programs keyed by (rows, sequences, rows per sequence), captured at start-up, whose padding
sequences sit on the dummy KV page and the dummy state entry.

CPU, float32, with a fake capture: a "graph" reruns its captured function on every replay and
writes its results into the outputs the capture returned (as a CUDA graph rewrites them in
place). Every test compares the graphed engine with plain eager decoding token for token; the GPU
tests at the end run the real graphs."""

from __future__ import annotations

import random

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.engine import graphs
from metrale.engine.program_cache import ProgramCache
from metrale.engine.program_shapes import (
    GDNMixedShape,
    GDNPrefillShape,
    all_gdn_prefill_shapes,
    fill_rows,
    gdn_prefill_shape,
    gdn_prefill_widths,
)
from metrale.engine.sequence import Phase
from metrale.engine.state_cache import DUMMY_ENTRY
from metrale.models.gdn_state import CHUNK_MIN_ROWS, SplitState, StateMode
from metrale.speculative.replay import ReplayDrafter
from tests.prefix_cache_helpers import shared_prompts
from tests.test_hybrid_engine import PROMPTS, greedy, hybrid_dir, llm_for  # noqa: F401
from tests.test_hybrid_ragged_review import poison_past_rows

VARIANTS = ["write_on_accept", "per_row_slots"]


class RerunGraph:
    """A captured program that reruns its function on replay (see the module docstring)."""

    def __init__(self, fn, outputs) -> None:
        self.fn, self.outputs = fn, outputs
        self.replays = 0

    def replay(self) -> None:
        outputs = self.fn()
        self.replays += 1
        if outputs is None:  # a graphed commit
            return
        hidden, logits, state = outputs
        self.outputs[0].copy_(hidden)
        self.outputs[1].copy_(logits)
        kept = self.outputs[2]
        if isinstance(state, SplitState):  # a mixed program: its verify's pending rows
            state, kept = state.tail, kept.tail
        if state is not None:
            kept.pending, kept.pending_conv = state.pending, state.pending_conv


@pytest.fixture
def fake_graphs(monkeypatch):
    made: list[RerunGraph] = []

    def capture(fn, pool, device):
        graph = RerunGraph(fn, fn())
        made.append(graph)
        return graph, graph.outputs

    monkeypatch.setattr(graphs, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return made


class Watch:
    """Records every replay (shape, state mode, rows per sequence, entries read) and every eager
    forward (the batch's phase); after each prefill replay, checks that the state entries that
    changed are the dummy's and the step's real sequences' alone."""

    def __init__(self, llm) -> None:
        runner = llm.engine.runner
        self.states, g = runner.states, runner.graphs
        self.calls: list[tuple] = []
        self.eager: list[Phase] = []
        self.checked = 0
        inner_run, inner_forward = g.run, runner._forward

        def run(table, flat, device_tables=None, table_rows=None, state=None, rows=None):
            counts = [b - a for a, b in zip(flat.starts, flat.starts[1:])]
            mode = None if state is None else state[0]
            read = None if state is None else list(state[1])
            self.calls.append((table, mode, counts, read))
            pool = self.states.pool
            before = [t.clone() for t in pool.conv + pool.ssm]
            out = inner_run(table, flat, device_tables, table_rows, state, rows)
            if isinstance(table, GDNPrefillShape):
                expected = {DUMMY_ENTRY} | {r for r, n in zip(read, counts, strict=True) if n}
                for old, new in zip(before, pool.conv + pool.ssm, strict=True):
                    changed = (old != new).flatten(1).any(1).nonzero().flatten().tolist()
                    assert set(changed) <= expected, f"{table} wrote {set(changed) - expected}"
                self.checked += 1
            return out

        def forward(batch, *args, **kw):
            self.eager.append(batch.phase)
            return inner_forward(batch, *args, **kw)

        g.run = run
        runner._forward = forward

    def prefill_calls(self) -> list[tuple]:
        return [c for c in self.calls if isinstance(c[0], GDNPrefillShape)]


def graphed(llm, capture: bool = True, max_rows: int | None = None):
    """`llm` with the graph runner `ModelRunner` builds on the GPU (ragged programs with the
    paged kernel, prefill programs up to its prefill limit), captured up front, and a `Watch`."""
    runner, engine = llm.engine.runner, llm.engine
    runner.graphs = graphs.GraphRunner(
        runner.model,
        max_rows,
        max(engine.max_model_len + engine.lookahead, runner.prefill_limit),
        runner.page_size,
        runner.device,
        paged_kernel=True,
        state_pool=runner.states.pool,
        max_q=engine.config.spec.num_drafts + 1 if engine.spec is not None else 1,
        max_seqs=engine.config.max_num_seqs,
        prefill_rows=runner.prefill_limit,
        verify_mode=runner.states.verify_mode,
    )
    if capture:
        runner.graphs.capture_ragged()
    runner.watch = Watch(llm)
    return llm


def ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def params_of(n: int, seed: int = 0, lo: int = 4, hi: int = 20) -> list[SamplingParams]:
    rng = random.Random(seed + 1)
    return [greedy(rng.randrange(lo, hi)) for _ in range(n)]


# below, at and above the delta rule's chunk threshold (16), across pages of 4 and 16 rows
LENGTHS = [1, 2, 5, 9, 15, 16, 17, 23, 31, 33, 47]


# ---------------------------------------------------------------------------------------------
# shapes


@pytest.mark.parametrize("max_seqs", [1, 3, 8, 64])
@pytest.mark.parametrize("max_rows", [16, 64, 256])
@pytest.mark.parametrize("chunk_min_rows", [CHUNK_MIN_ROWS, 5, 2**62])
def test_every_hybrid_prefill_step_fits_a_captured_shape(max_seqs, max_rows, chunk_min_rows):
    """Every step of up to `max_seqs` sequences, `max_rows` rows and any longest sequence pads to
    a shape captured at start-up (never refused by a cache sized as `GraphRunner` sizes it), its
    padding rows fit padding sequences of the program's width, and the width passes the delta
    rule's chunk threshold exactly when the longest sequence does (the eager forward's form)."""
    widths = gdn_prefill_widths(max_rows, chunk_min_rows)
    captured = set(all_gdn_prefill_shapes(max_seqs, max_rows, widths))
    cache = ProgramCache(
        lambda t, extra: None, max_rows, min_seqs=max(s.num_seqs for s in captured)
    )
    met = set()
    # each width bucket's narrowest and widest longest sequence; each row bucket's ends
    longests = {1} | set(widths) | {w + 1 for w in widths if w < max_rows}
    buckets = [16 << i for i in range(max_rows.bit_length()) if 16 << i <= max_rows]
    ends = {1} | set(buckets) | {b // 2 + 1 for b in buckets}
    for seqs in range(1, min(max_seqs, max_rows) + 1):
        for longest in sorted(longests):
            lo, hi = seqs - 1 + longest, min(seqs * longest, max_rows)
            for rows in sorted({lo, hi, *ends}):
                if not lo <= rows <= hi:
                    continue
                shape = gdn_prefill_shape(seqs, rows, longest, widths)
                assert shape in captured, (seqs, rows, longest)
                assert shape.width >= longest and shape.rows() >= rows
                assert (shape.width > chunk_min_rows) == (longest > chunk_min_rows)
                pads = fill_rows(shape.rows() - rows, shape.num_seqs - seqs, shape.width)
                assert sum(pads) == shape.rows() - rows and max(pads, default=0) <= shape.width
                assert shape.samples >= seqs
                assert sum(shape.layout()) == shape.rows() <= max_rows
                assert max(shape.layout()) <= shape.width
                cache.get(shape)
                met.add(shape)
    assert met == captured  # nothing captured that no step can use
    with pytest.raises(ValueError):
        gdn_prefill_shape(2, 5, 2, widths)  # 2 sequences of at most 2 rows
    with pytest.raises(ValueError):
        gdn_prefill_shape(1, max_rows + 1, max_rows + 1, widths)  # wider than any program


def test_program_count_is_bounded():
    """At the default shape (64 sequences, 512 rows) a hybrid captures a few hundred programs at
    most, every one kept (none evicted and captured again mid-run)."""
    shapes = all_gdn_prefill_shapes(64, 512, gdn_prefill_widths(512, CHUNK_MIN_ROWS))
    assert len(shapes) <= 130
    assert len({(s.rows(), s.num_seqs, s.width) for s in shapes}) == len(shapes)


# ---------------------------------------------------------------------------------------------
# greedy output equals eager decoding


@pytest.mark.parametrize("page_size,budget", [(4, 64), (16, 32)])
def test_prefill_steps_replay_programs_and_equal_eager(hybrid_dir, fake_graphs, page_size, budget):  # noqa: F811
    """Prompts of many lengths (below and above the chunk threshold, across page boundaries,
    chunked by a token budget), arriving while others decode: every step replays a program
    captured at start-up (no eager forward, no capture mid-run), and the output equals eager
    decoding. Some steps mix prompt chunks with decode rows; some have padding sequences that
    hold padding rows."""
    prompts, params = prompts_of(LENGTHS, seed=page_size), params_of(len(LENGTHS), page_size)
    opts = dict(page_size=page_size, max_num_batched_tokens=budget, max_num_seqs=4)
    want = ids(llm_for(hybrid_dir, **opts).generate(prompts, params, use_tqdm=False))
    llm = graphed(llm_for(hybrid_dir, **opts))
    g = llm.engine.runner.graphs
    assert g.prefill_rows == budget
    captured = g.cache.misses
    assert ids(llm.generate(prompts, params, use_tqdm=False)) == want
    watch = llm.engine.runner.watch
    assert watch.eager == [] and g.cache.misses == captured
    calls = watch.prefill_calls()
    assert len(calls) >= 3 and watch.checked == len(calls)
    assert {mode for _, mode, _, _ in calls} == {StateMode.WRITE}
    widths = {shape.width for shape, _, _, _ in calls}
    assert min(widths) <= CHUNK_MIN_ROWS < max(widths)
    # mixed steps: a prompt chunk beside decode rows
    assert any(
        1 in counts[: sum(r != DUMMY_ENTRY for r in read)] and max(counts) > 1
        for _, _, counts, read in calls
    )
    # padding sequences holding padding rows (on the dummy entry)
    assert any(
        any(n and r == DUMMY_ENTRY for n, r in zip(counts, read)) for _, _, counts, read in calls
    )


def test_prompts_alone_and_batched_equal_eager(hybrid_dir, fake_graphs):  # noqa: F811
    """Each prompt alone (one sequence: the sequence bucket's spare sequences hold the padding)
    and all at once, with the default budget (whole prompts in one step)."""
    prompts = prompts_of(LENGTHS, seed=1)
    eager = llm_for(hybrid_dir)
    want = ids(eager.generate(prompts, greedy(10), use_tqdm=False))
    llm = graphed(llm_for(hybrid_dir))
    for p, w in zip(prompts, want, strict=True):
        assert ids(llm.generate([p], greedy(10), use_tqdm=False)) == [w]
    assert ids(llm.generate(prompts, greedy(10), use_tqdm=False)) == want
    watch = llm.engine.runner.watch
    assert watch.eager == [] and len(watch.prefill_calls()) >= len(LENGTHS) + 1


def test_longer_steps_run_eagerly(hybrid_dir, fake_graphs):  # noqa: F811
    """A step past the widest program (rows, or one sequence's rows) runs the eager forward."""
    prompts = prompts_of([40, 70, 5], seed=2)
    want = ids(llm_for(hybrid_dir).generate(prompts, greedy(8), use_tqdm=False))
    llm = graphed(llm_for(hybrid_dir, max_num_batched_tokens=200, graph_prefill_rows=32))
    assert llm.engine.runner.graphs.prefill_rows == 32
    assert ids(llm.generate(prompts, greedy(8), use_tqdm=False)) == want
    watch = llm.engine.runner.watch
    assert watch.eager and watch.prefill_calls()


def test_default_graph_prefill_rows(hybrid_dir, tiny_model_dir):  # noqa: F811
    """`graph_prefill_rows=None` graphs steps of the whole token budget on a dense target (a few
    admissions beside a batch-64 verify pass 512 rows), 512 on a hybrid one; a number caps both,
    and a bad one is refused by name."""
    dense = LLM(tiny_model_dir, device="cpu", max_num_batched_tokens=4096)
    assert dense.engine.runner.prefill_limit == 4096
    assert llm_for(hybrid_dir, max_num_batched_tokens=4096).engine.runner.prefill_limit == 512
    assert llm_for(hybrid_dir, max_num_batched_tokens=256).engine.runner.prefill_limit == 256
    capped = LLM(tiny_model_dir, device="cpu", graph_prefill_rows=64)
    assert capped.engine.runner.prefill_limit == 64
    with pytest.raises(ValueError, match="graph_prefill_rows"):
        LLM(tiny_model_dir, device="cpu", graph_prefill_rows=-1)


def test_deterministic_mode_keeps_the_recurrent_form(hybrid_dir, fake_graphs):  # noqa: F811
    """The deterministic mode runs every GDN row in the recurrent form (chunk_min_rows past any
    width): its programs' widths are plain powers of two, and the output equals its eager one."""
    prompts = prompts_of(LENGTHS[:8], seed=3)
    opts = dict(deterministic=True, max_num_batched_tokens=32, max_num_seqs=4)
    want = ids(llm_for(hybrid_dir, **opts).generate(prompts, greedy(8), use_tqdm=False))
    llm = graphed(llm_for(hybrid_dir, **opts))
    g = llm.engine.runner.graphs
    assert llm.engine.runner.states.pool.chunk_min_rows > g.prefill_rows
    assert g.prefill_widths == [8, 16, 32]
    assert ids(llm.generate(prompts, greedy(8), use_tqdm=False)) == want
    assert llm.engine.runner.watch.prefill_calls()


# ---------------------------------------------------------------------------------------------
# speculation, prefix caching, the dummy entry


@pytest.mark.parametrize("variant", VARIANTS)
def test_speculation_with_prefill_programs_equals_plain(hybrid_dir, fake_graphs, variant):  # noqa: F811
    """A replay drafter, a small budget (prompt chunks beside verify rows: one mixed program
    runs them, `GDNMixedShape`): greedy output equals plain decoding, no step ran eagerly and no
    batch failed (a failed one runs again one sequence at a time, through other programs)."""
    prompts = prompts_of(LENGTHS, seed=4)
    params = params_of(len(prompts), seed=4, lo=8, hi=24)
    want = ids(llm_for(hybrid_dir).generate(prompts, params, use_tqdm=False))
    truth = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    llm = graphed(
        llm_for(
            hybrid_dir,
            drafter=ReplayDrafter(truth, 0.6, vocab_size=320, seed=3),
            spec={"num_drafts": 3},
            hybrid_verify_state=variant,
            max_num_batched_tokens=32,
            max_num_seqs=4,
        )
    )
    runner = llm.engine.runner
    assert ids(llm.generate(prompts, params, use_tqdm=False)) == want
    watch = runner.watch
    assert watch.eager == [] and llm.engine.retried_batches == 0
    mixed = [c for c in watch.calls if isinstance(c[0], GDNMixedShape)]
    assert mixed and {mode for _, mode, _, _ in mixed} == {runner.states.verify_mode}
    modes = {mode for shape, mode, _, _ in watch.calls if not isinstance(shape, GDNPrefillShape)}
    assert runner.states.verify_mode in modes
    assert watch.prefill_calls()
    tel = llm.engine.telemetry.spec
    assert 0 < tel.num_accepted_tokens < tel.num_draft_tokens


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefix_cache_hits_replay_prefill_programs(hybrid_dir, fake_graphs, variant):  # noqa: F811
    """Prompts sharing a prefix, run twice: the second run resumes states from snapshots (loaded
    before the program replays) and runs only the uncached rows, through prefill programs;
    output equals an uncached eager engine's."""
    prompts = shared_prompts(13, 6, seed=13)
    opts = dict(page_size=4, hybrid_verify_state=variant, max_num_batched_tokens=32)
    plain = llm_for(hybrid_dir, prefix_caching=False, **opts)
    want = ids(plain.generate(prompts, greedy(10), use_tqdm=False))
    llm = graphed(llm_for(hybrid_dir, **opts))
    for _ in range(2):
        assert ids(llm.generate(prompts, greedy(10), use_tqdm=False)) == want
    stats = llm.engine.telemetry.prefix_cache
    assert stats.hits > 0 and stats.snapshots_restored > 0
    watch = llm.engine.runner.watch
    assert watch.eager == [] and watch.prefill_calls()


def test_garbage_in_the_dummy_entry_does_not_leak(hybrid_dir, fake_graphs):  # noqa: F811
    """Large garbage in the dummy state entry and a random workspace before every replay: only
    padding sequences read that entry, and only what the step copies in reaches its rows."""
    prompts = prompts_of(LENGTHS, seed=6)
    params = params_of(len(prompts), seed=6)
    opts = dict(max_num_batched_tokens=40, max_num_seqs=5)
    want = ids(llm_for(hybrid_dir, **opts).generate(prompts, params, use_tqdm=False))
    llm = graphed(llm_for(hybrid_dir, **opts))
    runner = llm.engine.runner
    g, pool = runner.graphs, runner.states.pool
    gen = torch.Generator().manual_seed(0)
    inner, entries = g.run, pool.ssm[0].shape[0]
    poisoned = []

    def run(*args, **kw):
        for buf, hi in ((g.input_ids, 300), (g.state_read, entries), (g.sample_rows, 64)):
            buf.copy_(torch.randint(1, hi, buf.shape, generator=gen))
        for t in pool.conv + pool.ssm:
            t[DUMMY_ENTRY].copy_(torch.randn(t[0].shape, generator=gen) * 50)
        poisoned.append(args[0])
        return inner(*args, **kw)

    g.run = run
    poison_past_rows(g, gen, runner.num_pages, runner.page_size)
    assert ids(llm.generate(prompts, params, use_tqdm=False)) == want
    assert any(isinstance(s, GDNPrefillShape) for s in poisoned)


# ---------------------------------------------------------------------------------------------
# CUDA: the real graphs


@pytest.mark.gpu
@pytest.mark.parametrize("gdn_triton", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_hybrid_prefill_programs_equal_cpu(hybrid_dir, gdn_triton, variant, monkeypatch):  # noqa: F811
    """On CUDA (float32), with the torch delta rule or the Triton kernels (chunked above 16 rows
    per sequence), plain and speculative: steps with prompt chunks replay prefill programs
    captured at start-up (no capture mid-run; a verify beside prompt chunks, mixed programs), and
    greedy output equals the CPU's."""
    from metrale.knobs import knobs

    monkeypatch.setenv("METRALE_NO_GDN_TRITON", "0" if gdn_triton else "1")
    knobs.cache_clear()
    prompts = prompts_of(LENGTHS, seed=7)
    params = params_of(len(prompts), seed=7, lo=8, hi=24)
    try:
        want = ids(llm_for(hybrid_dir).generate(prompts, params, use_tqdm=False))
        truth = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
        opts = dict(device="cuda", dtype="float32", max_num_batched_tokens=48, max_num_seqs=4)
        for llm in (
            LLM(hybrid_dir, **opts),
            LLM(
                hybrid_dir,
                drafter=ReplayDrafter(truth, 0.6, vocab_size=320, seed=3),
                spec={"num_drafts": 3},
                hybrid_verify_state=variant,
                **opts,
            ),
        ):
            g = llm.engine.runner.graphs
            assert g.prefill_rows == 32
            before, replayed, run = g.cache.stats(), [], g.run

            def recording(table, *args, run=run, replayed=replayed):
                replayed.append(table)
                return run(table, *args)

            g.run = recording
            assert ids(llm.generate(prompts, params, use_tqdm=False)) == want
            stats = g.cache.stats()
            assert stats["misses"] == before["misses"]  # every program captured at start-up
            # (a verify beside prompt chunks replays a mixed program, captured on first use)
            assert sum(isinstance(t, (GDNPrefillShape, GDNMixedShape)) for t in replayed) >= 3
            assert llm.engine.runner.graph_refusals == 0
    finally:
        knobs.cache_clear()
