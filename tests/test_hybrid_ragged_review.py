"""Review probes of the hybrid ragged programs (commit 941a073), on CPU in float32 with a fake
capture: a "graph" reruns its captured function on every replay and writes the results into the
outputs the capture returned (as a CUDA graph rewrites them in place).

Hybrid decode steps (one row per sequence) replay ragged programs of width 1 in WRITE mode;
verify steps, programs of width 1 + K in the verify variant's mode (DEFER + a graphed commit,
or ROWS); padding sequences sit on the dummy KV page and the dummy state entry. Every probe
compares the graphed engine with plain eager decoding, token for token."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from metrale import SamplingParams
from metrale.engine import graphs
from metrale.engine.program_shapes import all_ragged_shapes
from metrale.engine.state_cache import DUMMY_ENTRY
from metrale.models.gdn_state import StateMode
from metrale.speculative.drafter import Draft
from metrale.speculative.replay import ReplayDrafter
from tests.test_hybrid_engine import greedy, hybrid_dir, hybrid_mtp_dir, llm_for  # noqa: F401

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
        if state is not None:
            self.outputs[2].pending, self.outputs[2].pending_conv = (
                state.pending,
                state.pending_conv,
            )


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


class Recorder:
    """Wraps a GraphRunner's `run`: every replay's (shape, state mode, sequences with rows)."""

    def __init__(self, runner: graphs.GraphRunner) -> None:
        self.calls: list[tuple] = []
        inner = runner.run

        def run(table, flat, device_tables=None, table_rows=None, state=None, sample_rows=None):
            rows = [b - a for a, b in zip(flat.starts, flat.starts[1:])]
            mode = None if state is None else state[0]
            self.calls.append((table, mode, rows, None if state is None else list(state[1])))
            return inner(table, flat, device_tables, table_rows, state, sample_rows)

        runner.run = run


def graphed(llm, max_rows: int | None = None, capture: bool = False):
    """`llm` with the ragged graph runner the paged kernel gets on the GPU (its programs captured
    up front when `capture`, as `ModelRunner` does at start-up)."""
    runner = llm.engine.runner
    runner.graphs = graphs.GraphRunner(
        runner.model,
        max_rows,
        llm.engine.max_model_len + llm.engine.lookahead,
        runner.page_size,
        runner.device,
        paged_kernel=True,
        state_pool=runner.states.pool,
        max_q=llm.engine.config.spec.num_drafts + 1 if llm.engine.spec is not None else 1,
        max_seqs=llm.engine.config.max_num_seqs,
        verify_mode=runner.states.verify_mode,
    )
    if capture:
        runner.graphs.capture_ragged()
    runner.graphs.recorder = Recorder(runner.graphs)
    return llm


def ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def prompts_of(n: int, seed: int = 0, lo: int = 1, hi: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def params_of(n: int, seed: int = 0, lo: int = 4, hi: int = 24, **kw) -> list[SamplingParams]:
    """Different lengths: sequences finish at different steps and waiting ones arrive."""
    rng = random.Random(seed + 1)
    return [greedy(rng.randrange(lo, hi), **kw) for _ in range(n)]


class AlternatingDrafter(ReplayDrafter):
    """A replay drafter that drafts nothing at every third step: decode steps (width 1) and
    verify steps (width 1 + K) alternate."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.calls = 0

    def propose(self, seqs, max_drafts):
        self.calls += 1
        if self.calls % 3 == 0:
            return [Draft([]) for _ in seqs]
        return super().propose(seqs, max_drafts)


def replay_drafter(prompts, want, alpha: float, keep: float = 0.7, seed: int = 3):
    """Replays of a fraction of the prompts' outputs, cut short (drafts run out mid-run): the
    other prompts never draft, so depths mix; every third step drafts nothing."""
    rng = random.Random(seed)
    truth = {}
    for p, w in zip(prompts, want, strict=True):
        if rng.random() < keep:
            truth[tuple(p)] = w[: rng.randrange(len(w) // 2, len(w) + 1)]
    return AlternatingDrafter(truth, alpha, vocab_size=320, seed=seed)


# ---------------------------------------------------------------------------------------------
# greedy output of the ragged path equals plain eager decoding


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("variant", VARIANTS)
def test_many_sequences_mixed_depths_equal_eager(hybrid_dir, fake_graphs, variant, k):  # noqa: F811
    """13 prompts, 11 at once (sequence bucket 16: padding sequences, several of them taking
    padding rows), different lengths (finishes, arrivals, slots reused), drafts for some
    prompts only, cut short: decode (width 1) and verify (width 1 + K) steps alternate."""
    prompts, params = prompts_of(13, seed=k), params_of(13, seed=k, lo=8, hi=40)
    want = ids(llm_for(hybrid_dir).generate(prompts, params, use_tqdm=False))
    drafter = replay_drafter(prompts, want, 0.6, seed=k)
    opts = dict(spec={"num_drafts": k}, hybrid_verify_state=variant, max_num_seqs=11)
    eager = llm_for(hybrid_dir, drafter=drafter, **opts)
    assert ids(eager.generate(prompts, params, use_tqdm=False)) == want
    drafter = replay_drafter(prompts, want, 0.6, seed=k)
    llm = graphed(llm_for(hybrid_dir, drafter=drafter, **opts))
    assert ids(llm.generate(prompts, params, use_tqdm=False)) == want
    calls = llm.engine.runner.graphs.recorder.calls
    modes = {(shape.max_q, mode) for shape, mode, _, _ in calls}
    verify_mode = llm.engine.runner.states.verify_mode
    assert modes == {(1, StateMode.WRITE), (k + 1, verify_mode)}
    # a step with real sequences of fewer than k + 1 rows and padding sequences holding rows
    real_seqs = lambda read: sum(r != DUMMY_ENTRY for r in read)  # noqa: E731
    assert any(
        shape.max_q == k + 1 and sum(n > 0 for n in rows[real_seqs(read) :]) >= (2 if k < 7 else 1)
        for shape, _, rows, read in calls
    )
    # one program replayed with different numbers of real rows (stale rows must not leak)
    by_shape: dict = {}
    for shape, mode, rows, read in calls:
        by_shape.setdefault((shape, mode), set()).add(sum(rows[: real_seqs(read)]))
    assert any(len(v) > 1 for v in by_shape.values())
    tel = llm.engine.telemetry.spec
    assert 0 < tel.num_accepted_tokens < tel.num_draft_tokens


class PoolWatch:
    """After every replay (and graphed commit): the state entries that changed are the dummy
    and those of the step's real sequences alone, computed here from the sequences' slots (a
    per-row-slot verify: the entries after each of its rows; else its current entry)."""

    def __init__(self, llm) -> None:
        runner = llm.engine.runner
        self.states, self.graphs = runner.states, runner.graphs
        self.expected: set[int] = set()
        self.checked = Counter()
        addresses, run, commit = self.states.plan_addresses, self.graphs.run, self.graphs.commit

        def watched_addresses(entries, verify, width=None):
            out = addresses(entries, verify, width)
            s = self.states
            self.expected = {DUMMY_ENTRY}
            for e in entries:
                if e is None:
                    continue
                slot = e.seq.slot
                if verify and s.per_row:
                    base, cur = 1 + slot * s.width, s._current[slot]
                    self.expected |= {base + (cur + r) % s.width for r in range(e.num_rows)}
                else:
                    self.expected.add(s.entry_of(slot))
            self.mode = out[0]
            return out

        def snapshot():
            pool = self.states.pool
            return [t.clone() for t in pool.conv + pool.ssm]

        def check(before, what):
            pool = self.states.pool
            for old, new in zip(before, pool.conv + pool.ssm, strict=True):
                changed = (old != new).flatten(1).any(1).nonzero().flatten().tolist()
                stray = set(changed) - self.expected
                assert not stray, f"{what} in {self.mode} wrote entries {stray}"
            self.checked[what] += 1

        def watched_run(*args, **kw):
            before = snapshot()
            out = run(*args, **kw)
            check(before, "replay")
            return out

        def watched_commit(state, num_rows):
            before = snapshot()
            commit(state, num_rows)
            check(before, "commit")

        self.states.plan_addresses = watched_addresses
        self.graphs.run = watched_run
        self.graphs.commit = watched_commit


@pytest.mark.parametrize("variant", VARIANTS)
def test_replays_write_only_their_sequences_entries(hybrid_dir, fake_graphs, variant):  # noqa: F811
    """Per-row slots with sequences of fewer rows than the program's width (their padded row
    entries go to the dummy entry), padding sequences on the dummy entry, slots reused: no
    replay or graphed commit writes another slot's entry."""
    prompts, params = prompts_of(13, seed=5), params_of(13, seed=5, lo=8, hi=40)
    want = ids(llm_for(hybrid_dir).generate(prompts, params, use_tqdm=False))
    llm = graphed(
        llm_for(
            hybrid_dir,
            drafter=replay_drafter(prompts, want, 0.5, seed=5),
            spec={"num_drafts": 3},
            hybrid_verify_state=variant,
            max_num_seqs=11,
        )
    )
    watch = PoolWatch(llm)
    assert ids(llm.generate(prompts, params, use_tqdm=False)) == want
    assert watch.checked["replay"] > 10
    assert (watch.checked["commit"] > 5) == (variant == "write_on_accept")


def poison_past_rows(g: graphs.GraphRunner, gen: torch.Generator, pages: int, page: int) -> None:
    """After each send of a step's inputs (one copy of whole buffers from the host ring, whose
    entries past the step's rows hold an older step's), fill the buffers past the step's rows
    and sequences with values that would corrupt a sequence if a program read them."""
    inputs = g.inputs
    send = inputs.send

    def poisoned_send(flat, *args, **kwargs):
        send(flat, *args, **kwargs)
        n, s = len(flat.input_ids), len(flat.seq_lens)
        for buf, lo, hi in (
            (g.input_ids, n, 300),
            (g.positions, n, 64),
            (g.slots, n, pages * page),
            (g.query_start_loc, s + 1, 64),
            (g.seq_lens, s, 64),
            (g.block_tables, s, pages),
            (g.state_read, s, 64),
        ):
            buf[lo:].copy_(torch.randint(1, hi, buf[lo:].shape, generator=gen))

    inputs.send = poisoned_send


class Poison:
    """Before every replay, fill the whole graph workspace with values that would corrupt a real
    sequence if a program read them (other slots' state entries, other pages, other tokens), and
    the dummy state entry with garbage: only what the step copies in may reach its rows (and
    past its rows, after the send, `poison_past_rows`)."""

    def __init__(self, llm, seed: int = 0) -> None:
        runner = llm.engine.runner
        g, pool = runner.graphs, runner.states.pool
        gen = torch.Generator().manual_seed(seed)
        inner = g.run
        entries, pages = pool.ssm[0].shape[0], runner.num_pages
        self.poisoned = 0

        def run(*args, **kw):
            for buf, hi in (
                (g.input_ids, 300),
                (g.positions, 64),
                (g.slots, pages * runner.page_size),
                (g.block_tables, pages),
                (g.state_read, entries),
                (g.state_rows, entries),
                (g.seq_lens, 64),
            ):
                buf.copy_(torch.randint(1, hi, buf.shape, generator=gen))
            for t in pool.conv + pool.ssm:  # the dummy entry: large, finite garbage
                t[DUMMY_ENTRY].copy_(torch.randn(t[0].shape, generator=gen) * 50)
            self.poisoned += 1
            return inner(*args, **kw)

        g.run = run
        poison_past_rows(g, gen, pages, runner.page_size)


@pytest.mark.parametrize("variant", VARIANTS)
def test_poisoned_workspace_and_dummy_entry_do_not_leak(hybrid_dir, fake_graphs, variant):  # noqa: F811
    """A program shape met again with fewer real rows than the last replay (or its capture)
    must not read stale rows: with the workspace poisoned before each replay, outputs still
    equal eager decoding."""
    prompts, params = prompts_of(13, seed=7), params_of(13, seed=7, lo=8, hi=40)
    want = ids(llm_for(hybrid_dir).generate(prompts, params, use_tqdm=False))
    llm = graphed(
        llm_for(
            hybrid_dir,
            drafter=replay_drafter(prompts, want, 0.6, seed=7),
            spec={"num_drafts": 3},
            hybrid_verify_state=variant,
            max_num_seqs=11,
        )
    )
    poison = Poison(llm)
    assert ids(llm.generate(prompts, params, use_tqdm=False)) == want
    assert poison.poisoned > 10


def seeded(i: int, n: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_seeded_sampling_equals_eager(hybrid_dir, fake_graphs, variant):  # noqa: F811
    """Temperature 0.8, a seed per request: the graphed engine (plain, and speculating with
    one-hot drafts, judged against the target's own seeded sample) emits exactly what plain
    eager seeded decoding emits."""
    prompts = prompts_of(12, seed=11)
    rng = random.Random(12)
    params = [seeded(i, rng.randrange(8, 30)) for i in range(len(prompts))]
    want = ids(llm_for(hybrid_dir).generate(prompts, params, use_tqdm=False))
    plain = graphed(llm_for(hybrid_dir, max_num_seqs=10))
    assert ids(plain.generate(prompts, params, use_tqdm=False)) == want
    llm = graphed(
        llm_for(
            hybrid_dir,
            drafter=replay_drafter(prompts, want, 0.7, seed=11),
            spec={"num_drafts": 3},
            hybrid_verify_state=variant,
            max_num_seqs=10,
        )
    )
    assert ids(llm.generate(prompts, params, use_tqdm=False)) == want
    assert {c[1] for c in llm.engine.runner.graphs.recorder.calls} >= {StateMode.WRITE}
    assert llm.engine.telemetry.spec.num_accepted_tokens > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_preemption_and_chunked_prefill_equal_eager(hybrid_dir, fake_graphs, variant):  # noqa: F811
    """A small KV pool (preemption, recompute into a fresh state) and a small token budget."""
    prompts, params = prompts_of(10, seed=13, hi=24), params_of(10, seed=13, lo=10, hi=30)
    want = ids(llm_for(hybrid_dir).generate(prompts, params, use_tqdm=False))
    llm = graphed(
        llm_for(
            hybrid_dir,
            drafter=replay_drafter(prompts, want, 0.6, seed=13),
            spec={"num_drafts": 3},
            hybrid_verify_state=variant,
            page_size=4,
            num_kv_pages=28,
            max_num_batched_tokens=16,
            max_num_seqs=9,
        )
    )
    assert ids(llm.generate(prompts, params, use_tqdm=False)) == want
    assert llm.engine.telemetry.preemptions > 0
    assert len(llm.engine.runner.graphs.recorder.calls) > 10


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_token_prompts_arrive_in_decode_steps(hybrid_dir, fake_graphs, variant):  # noqa: F811
    """Prompts of one token start in a graphed decode step (a fresh state entry zeroed there,
    a per-row slot's current entry reset) in slots that finished sequences leave behind."""
    rng = random.Random(17)
    prompts = [
        [rng.randrange(3, 300) for _ in range(rng.choice([1, 1, 1, 2, 5]))] for _ in range(14)
    ]
    params = params_of(14, seed=17, lo=3, hi=16)
    want = ids(llm_for(hybrid_dir).generate(prompts, params, use_tqdm=False))
    for spec in (False, True):
        opts = dict(hybrid_verify_state=variant, max_num_seqs=4)
        if spec:
            opts.update(drafter=replay_drafter(prompts, want, 0.5, seed=17), spec={"num_drafts": 3})
        llm = graphed(llm_for(hybrid_dir, **opts))
        assert ids(llm.generate(prompts, params, use_tqdm=False)) == want, spec


def test_mtp_drafts_on_the_ragged_path_equal_eager(hybrid_mtp_dir, fake_graphs):  # noqa: F811
    prompts, params = prompts_of(11, seed=19), params_of(11, seed=19, lo=8, hi=24)
    want = ids(llm_for(hybrid_mtp_dir).generate(prompts, params, use_tqdm=False))
    for variant in VARIANTS:
        llm = graphed(
            llm_for(
                hybrid_mtp_dir,
                spec={"method": "mtp", "num_drafts": 3},
                hybrid_verify_state=variant,
                max_num_seqs=10,
            )
        )
        assert ids(llm.generate(prompts, params, use_tqdm=False)) == want, variant
        assert llm.engine.telemetry.spec.num_draft_tokens > 0
        assert any(c[0].max_q == 4 for c in llm.engine.runner.graphs.recorder.calls)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("spec", ["replay", "ngram"])
def test_prefix_caching_snapshots_on_the_ragged_path(hybrid_dir, fake_graphs, variant, spec):  # noqa: F811
    """Prefix-cache hits resume the state from snapshots (some in a graphed step: a prompt one
    token past a page boundary), with preemption and a tight snapshot pool: outputs equal the
    uncached eager engine's, turn after turn."""
    from tests.prefix_cache_helpers import shared_prompts
    from tests.test_prefix_cache_hybrid import run_turns

    prompts = shared_prompts(12, 9, seed=3) + shared_prompts(8, 4, seed=4)
    opts = dict(
        page_size=4,
        hybrid_verify_state=variant,
        max_num_batched_tokens=12,
        num_kv_pages=30,
        max_num_seqs=5,
    )
    expected = run_turns(llm_for(hybrid_dir, prefix_caching=False, **opts), prompts)
    if spec == "ngram":
        opts["spec"] = {"method": "ngram", "num_drafts": 3}
    else:
        want = expected[: len(prompts)]
        opts.update(drafter=replay_drafter(prompts, want, 0.6, seed=2), spec={"num_drafts": 3})
    llm = graphed(llm_for(hybrid_dir, **opts))
    restored_in_graph = []
    addresses = llm.engine.runner.states.plan_addresses

    def watched(entries, verify, width=None):
        if width is not None:  # from a replay (an eager forward passes none)
            restored_in_graph.extend(
                e for e in entries if e is not None and e.seq.state_restore >= 0
            )
        return addresses(entries, verify, width)

    llm.engine.runner.states.plan_addresses = watched
    assert run_turns(llm, prompts) == expected
    stats = llm.engine.telemetry.prefix_cache
    assert stats.hits > 0 and stats.snapshots_restored > 0
    assert llm.engine.telemetry.preemptions > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_snapshot_resumed_inside_a_graphed_step(hybrid_dir, fake_graphs, variant):  # noqa: F811
    """Prompts one token past a cached page boundary: their first step is a graphed decode step
    that loads their state from the snapshot (`StateSlots._plan` inside `_replay_ragged`)."""
    prefix = [(7 * i) % 250 + 3 for i in range(12)]
    prompts = [prefix + [t] for t in (40, 41, 42)]
    params = greedy(10)
    want = ids(llm_for(hybrid_dir, page_size=4, prefix_caching=False).generate(prompts, params))
    for spec in (False, True):
        opts = dict(page_size=4, hybrid_verify_state=variant, max_num_seqs=4)
        if spec:
            drafter = replay_drafter(prompts, want, 0.6, keep=1.0, seed=23)
            opts.update(drafter=drafter, spec={"num_drafts": 3})
        llm = graphed(llm_for(hybrid_dir, **opts))
        llm.generate([prefix + [99]], greedy(2), use_tqdm=False)  # saves a snapshot at 12
        restored = []
        addresses = llm.engine.runner.states.plan_addresses

        def watched(entries, verify, width=None, addresses=addresses, restored=restored):
            if width is not None:  # from a replay (an eager forward passes none)
                restored += [e for e in entries if e is not None and e.seq.state_restore >= 0]
            return addresses(entries, verify, width)

        llm.engine.runner.states.plan_addresses = watched
        assert ids(llm.generate(prompts, params, use_tqdm=False)) == want, spec
        assert len(restored) == 3, spec


@pytest.mark.parametrize("variant", VARIANTS)
def test_startup_capture_covers_every_step(hybrid_dir, fake_graphs, variant):  # noqa: F811
    """`capture_ragged` captures every program of `ragged_programs` (decode shapes of width 1 in
    WRITE, verify shapes of width 1 + K in the variant's mode); a run then misses none."""
    prompts, params = prompts_of(13, seed=29), params_of(13, seed=29, lo=8, hi=40)
    want = ids(llm_for(hybrid_dir).generate(prompts, params, use_tqdm=False))
    llm = graphed(
        llm_for(
            hybrid_dir,
            drafter=replay_drafter(prompts, want, 0.6, seed=29),
            spec={"num_drafts": 3},
            hybrid_verify_state=variant,
            max_num_seqs=11,
        ),
        capture=True,
    )
    g = llm.engine.runner.graphs
    verify_mode = llm.engine.runner.states.verify_mode
    programs = graphs.ragged_programs(11, 4, verify_mode)
    assert programs == [(s, StateMode.WRITE) for s in all_ragged_shapes(11, 1)] + [
        (s, verify_mode) for s in all_ragged_shapes(11, 4)
    ]
    assert g.cache.cached() == g.cache.misses == len(programs) == len(fake_graphs)
    assert {key for key in g.cache._programs} == {
        (shape, (g.max_model_len, mode)) for shape, mode in programs
    }
    # the capture-time runs touched only the dummy entry: every slot's entry is still zero
    pool = llm.engine.runner.states.pool
    assert all(t[1:].abs().sum() == 0 for t in pool.conv + pool.ssm)
    assert ids(llm.generate(prompts, params, use_tqdm=False)) == want
    assert g.cache.misses == len(programs) and g.cache.hits == len(g.recorder.calls) > 10
    assert g.cache.evictions == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_steps_past_graph_max_rows_run_eagerly_between_replays(hybrid_dir, fake_graphs, variant):  # noqa: F811
    """`graph_max_rows` below the widest steps: those are refused (after `addresses` has zeroed
    fresh entries and loaded snapshots) and run eagerly; narrower ones replay; outputs equal
    eager decoding, and the start-up capture skips the shapes past the limit."""
    prompts, params = prompts_of(13, seed=31), params_of(13, seed=31, lo=8, hi=40)
    want = ids(llm_for(hybrid_dir).generate(prompts, params, use_tqdm=False))
    llm = graphed(
        llm_for(
            hybrid_dir,
            drafter=replay_drafter(prompts, want, 0.6, seed=31),
            spec={"num_drafts": 3},
            hybrid_verify_state=variant,
            max_num_seqs=11,
        ),
        max_rows=16,
        capture=True,
    )
    runner = llm.engine.runner
    assert ids(llm.generate(prompts, params, use_tqdm=False)) == want
    assert runner.graph_refusals > 0
    assert all(k[0].rows() <= 16 for k in runner.graphs.cache._programs)
    # (16 rows: a verify of four sequences at width 4; at 12 rows, three, which this
    # workload's plans stopped bringing once D-Cut planned free depths with ragged programs)
    replayed = [c for c in runner.graphs.recorder.calls if c[0].rows() <= 16]
    assert {c[1] for c in replayed} == {StateMode.WRITE, runner.states.verify_mode}


@pytest.mark.parametrize("seqs,k,page", [(1, 3, 16), (2, 3, 16), (3, 7, 2), (5, 7, 2), (9, 1, 4)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_small_and_odd_engine_shapes_equal_eager(hybrid_dir, fake_graphs, variant, seqs, k, page):  # noqa: F811
    """One to nine sequences at once, and pages smaller than a verify's width (the padding
    sequences' dummy block tables span several entries of the dummy page)."""
    prompts, params = prompts_of(7, seed=seqs + k), params_of(7, seed=seqs + k, lo=6, hi=30)
    want = ids(llm_for(hybrid_dir).generate(prompts, params, use_tqdm=False))
    llm = graphed(
        llm_for(
            hybrid_dir,
            drafter=replay_drafter(prompts, want, 0.6, seed=seqs),
            spec={"num_drafts": k},
            hybrid_verify_state=variant,
            max_num_seqs=seqs,
            page_size=page,
        ),
        capture=True,
    )
    g = llm.engine.runner.graphs
    captured = g.cache.misses
    assert ids(llm.generate(prompts, params, use_tqdm=False)) == want
    assert g.cache.misses == captured and len(g.recorder.calls) > 5


@pytest.mark.parametrize("variant", VARIANTS)
def test_per_request_draft_caps_and_opt_outs_equal_eager(hybrid_dir, fake_graphs, variant):  # noqa: F811
    """Requests that cap their depth (`num_drafts`) or opt out of speculation (`speculative`)
    beside ones at the engine's K = 5: rows per sequence 1 .. 6 in one verify program."""
    prompts = prompts_of(12, seed=37)
    rng = random.Random(38)
    caps = [rng.choice([None, 0, 1, 2, 4]) for _ in prompts]
    params = [
        greedy(rng.randrange(8, 30), **({"speculative": False} if c == 0 else {"num_drafts": c}))
        for c in caps
    ]
    want = ids(llm_for(hybrid_dir).generate(prompts, params, use_tqdm=False))
    llm = graphed(
        llm_for(
            hybrid_dir,
            drafter=replay_drafter(prompts, want, 0.8, keep=1.0, seed=37),
            spec={"num_drafts": 5},
            hybrid_verify_state=variant,
            max_num_seqs=12,
        )
    )
    assert ids(llm.generate(prompts, params, use_tqdm=False)) == want
    calls = llm.engine.runner.graphs.recorder.calls
    assert any(c[0].max_q == 6 and len(set(c[2])) >= 4 for c in calls)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_step_failing_after_its_replay_ends_only_its_sequence(
    hybrid_dir,  # noqa: F811
    fake_graphs,
    variant,
    monkeypatch,
):
    """A graphed step that fails after its replay wrote the state (a decode program in place,
    a per-row-slot verify its rows, row 0 over the current entry) and before its commit: the
    failing sequence ends with an error; the others rebuild their state and go on to exactly
    their eager output."""
    from metrale.engine import runner as runner_mod

    prompts, params = prompts_of(6, seed=41, lo=4, hi=12), params_of(6, seed=41, lo=14, hi=20)
    want = ids(llm_for(hybrid_dir).generate(prompts, params, use_tqdm=False))
    llm = graphed(
        llm_for(
            hybrid_dir,
            drafter=replay_drafter(prompts, want, 0.6, keep=1.0, seed=41),
            spec={"num_drafts": 3},
            hybrid_verify_state=variant,
        )
    )
    real = runner_mod.greedy_verdicts
    calls = iter(range(10**6))

    def failing(entries, *args, **kw):
        if any(e.seq.request_id == "req-2" for e in entries) and next(calls) >= 4:
            raise RuntimeError("bad step")
        return real(entries, *args, **kw)

    monkeypatch.setattr(runner_mod, "greedy_verdicts", failing)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[2].outputs[0].finish_reason == "error"
    for i in (0, 1, 3, 4, 5):
        assert outs[i].outputs[0].token_ids == want[i], i


@pytest.mark.parametrize("variant", VARIANTS)
def test_dcut_calibration_on_the_ragged_path_leaves_no_state_behind(
    hybrid_dir,  # noqa: F811
    fake_graphs,
    variant,
):
    """D-Cut's start-up calibration (`measured_cost_model`, run when graphs exist) replays
    decode and verify programs over synthetic sequences on slots 0..B-1 (their state entries
    advanced, per-row slots' current entries moved): requests after it equal eager decoding."""
    prompts, params = prompts_of(8, seed=43), params_of(8, seed=43, lo=8, hi=30)
    want = ids(llm_for(hybrid_dir).generate(prompts, params, use_tqdm=False))
    llm = graphed(
        llm_for(
            hybrid_dir,
            drafter=replay_drafter(prompts, want, 0.6, seed=43),
            spec={"num_drafts": 3, "dcut": True},
            hybrid_verify_state=variant,
            max_num_seqs=5,
            max_model_len=96,
        ),
        capture=True,
    )
    llm.engine._calibrate_dcut()
    g = llm.engine.runner.graphs
    assert len(g.recorder.calls) > 20 and g.cache.misses == g.cache.cached()
    assert ids(llm.generate(prompts, params, use_tqdm=False)) == want


FUZZ = int(__import__("os").environ.get("REVIEW_FUZZ", "4"))


@pytest.mark.parametrize("case", range(FUZZ))
def test_random_engines_graphed_equal_eager(hybrid_dir, fake_graphs, case):  # noqa: F811
    """Random engine shapes, pools, budgets, caching, sampling and draft caps: the graphed
    ragged engine emits exactly what the same engine emits eagerly."""
    rng = random.Random(1000 + case)
    k = rng.randint(1, 7)
    page = rng.choice([2, 4, 8, 16])
    prompts = prompts_of(rng.randint(3, 14), seed=case, hi=rng.choice([4, 20, 30]))
    sample = rng.random() < 0.5

    def param(i):
        n = rng.randrange(4, 30)
        caps = rng.choice([{}, {}, {"num_drafts": rng.randint(0, k)}, {"speculative": False}])
        if sample:
            return SamplingParams(
                temperature=0.9, top_k=rng.choice([-1, 20]), seed=i, max_tokens=n,
                ignore_eos=True, **caps,
            )  # fmt: skip
        return greedy(n, **caps)

    params = [param(i) for i in range(len(prompts))]
    want = ids(llm_for(hybrid_dir).generate(prompts, [greedy(30)] * len(prompts), use_tqdm=False))
    opts = dict(
        spec={"num_drafts": k},
        hybrid_verify_state=rng.choice(VARIANTS),
        max_num_seqs=rng.randint(1, 16),
        page_size=page,
        max_num_batched_tokens=rng.choice([16, 32, 2048]),
        prefix_caching=rng.random() < 0.5,
    )
    if rng.random() < 0.5:
        opts["num_kv_pages"] = 2 + (max(len(p) for p in prompts) + 32 + k) // page + 4
    alpha, seed = rng.choice([0.0, 0.5, 0.9, 1.0]), rng.randrange(100)
    eager = llm_for(hybrid_dir, drafter=replay_drafter(prompts, want, alpha, seed=seed), **opts)
    expected = ids(eager.generate(prompts, params, use_tqdm=False))
    llm = graphed(
        llm_for(hybrid_dir, drafter=replay_drafter(prompts, want, alpha, seed=seed), **opts)
    )
    assert ids(llm.generate(prompts, params, use_tqdm=False)) == expected, opts
    assert llm.engine.runner.graphs.recorder.calls


@pytest.mark.parametrize("variant", VARIANTS)
def test_dflash_drafter_reads_the_taps_of_ragged_programs(
    hybrid_dir,  # noqa: F811
    fake_graphs,
    variant,
    tmp_path,
):
    """A DFlash drafter on the hybrid target reads the taps the programs write (padded rows
    after the real ones): output equals plain decoding, with drafts accepted, and the same
    acceptance as the eager engine's."""
    from tests.test_spec_dflash import write_dflash

    prompts, params = prompts_of(10, seed=47), params_of(10, seed=47, lo=10, hi=30)
    want = ids(llm_for(hybrid_dir).generate(prompts, params, use_tqdm=False))
    repeated = Counter(t for w in want for t in w).most_common(1)[0][0]
    drafter = write_dflash(hybrid_dir, tmp_path / "echo", echo_mask=repeated, layers=(1,))
    spec = {"method": "dflash", "model": str(drafter), "num_drafts": 3, "dcut": False}
    accepted = {}
    for graph in (False, True):
        llm = llm_for(hybrid_dir, spec=spec, hybrid_verify_state=variant, max_num_seqs=10)
        if graph:
            graphed(llm)
        assert ids(llm.generate(prompts, params, use_tqdm=False)) == want, graph
        accepted[graph] = llm.engine.telemetry.spec.num_accepted_tokens
    assert accepted[True] == accepted[False] > 0
