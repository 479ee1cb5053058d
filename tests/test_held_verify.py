"""Held verify steps (`engine/held_verify.py`): under asynchronous scheduling a verify's commit runs
while the next step's forward does. The engine's output must be the synchronous engine's, token
for token and stream for stream, whatever ends a sequence meanwhile (stop strings, EOS, its
length, an abort, a failure), with arrivals, preemptions and sampling; the verifies must really
be held where they may be, and not where they may not."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.knobs import knobs
from metrale.speculative.ngram import NgramDrafter
from tests.test_deferred_text_fuzz import _check_streams, _drive, _make_plan, _summary
from tests.test_hybrid_engine import hybrid_dir  # noqa: F401 (a module fixture)

NGRAM = {"method": "ngram", "num_drafts": 3}


@pytest.fixture(scope="module")
def varied(hf_qwen3_factory):
    return hf_qwen3_factory("varied", initializer_range=0.2)  # its outputs repeat at times


def _prefix(a: list, b: list) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


@pytest.mark.parametrize("dcut", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_held_verifies_give_the_synchronous_engines_outputs(varied, dcut, seed):
    """Random workloads (greedy and seeded sampling, n > 1, stop strings, stop token ids, EOS,
    logprobs, min_tokens, short lengths, arrivals, aborts) on a small KV pool (preemptions):
    every stream is its deltas added up, and every request not aborted ends as in the
    synchronous engine (an aborted one's tokens are a prefix of each other's: the asynchronous
    engine's outputs come a step later)."""
    plan = [p for p in _make_plan(seed) if "structured" not in p[2]]  # (a grammar: synchronous)
    opts = dict(
        device="cpu",
        spec={**NGRAM, "dcut": dcut},
        num_kv_pages=14,
        page_size=4,
        max_model_len=64,
        max_num_seqs=6,
        max_num_batched_tokens=32,
    )
    llm = LLM(varied, async_scheduling=True, **opts)
    streams, finals = _drive(llm, plan)
    _check_streams(streams)
    ref_streams, ref_finals = _drive(LLM(varied, async_scheduling=False, **opts), plan)
    a, b = _summary(finals), _summary(ref_finals)
    for rid in a:
        if next(p[4] for p in plan if p[0] == rid) is not None:  # aborted
            assert all(_prefix(x[1], y[1]) for x, y in zip(a[rid], b[rid], strict=True)), rid
            continue
        assert a[rid] == b[rid], rid
    engine = llm.engine
    assert engine.allocator.num_free == engine.allocator.num_usable
    assert engine._ahead.held_verifies > 0 or engine.telemetry.spec.verify_steps == 0


def _ngram_run(path, async_on: bool, params, prompts, **kw):
    llm = LLM(path, device="cpu", spec=NGRAM, async_scheduling=async_on, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs
    ]


PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [10, 200, 31, 77, 301, 5]]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),  # ends mid-verify
        SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2),
    ],
)
def test_verifies_are_held_and_lose_nothing(varied, params):
    held, got = _ngram_run(varied, True, params, PROMPTS)
    _, want = _ngram_run(varied, False, params, PROMPTS)
    assert got == want
    assert held.engine._ahead.held_verifies > 0
    if params.temperature == 0.0:
        assert held.engine.telemetry.spec.num_accepted_tokens > 0


def test_a_stop_string_inside_a_held_verify_ends_it_there(varied):
    """A stop string completed by a held verify's tokens: the sequence ends at it, the next
    step's rows for it (computed meanwhile) are thrown away, its text is the synchronous
    engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    _, free = _ngram_run(varied, False, params, PROMPTS[:1])
    text = free[0][1]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    held, got = _ngram_run(varied, True, params, PROMPTS[:1])
    _, want = _ngram_run(varied, False, params, PROMPTS[:1])
    assert got == want and got[0][2] == "stop"
    assert held.engine._ahead.held_verifies > 0


def test_not_held_where_it_may_not_be(varied, hybrid_dir, monkeypatch):  # noqa: F811
    """The knob, penalties and a hybrid target keep verifies synchronous (and the outputs)."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    _, want = _ngram_run(varied, False, params, PROMPTS)
    monkeypatch.setenv("METRALE_NO_HELD_VERIFY", "1")
    knobs.cache_clear()
    try:
        off, got = _ngram_run(varied, True, params, PROMPTS)
    finally:
        monkeypatch.undo()
        knobs.cache_clear()
    assert got == want and off.engine._ahead.held_verifies == 0
    penalised = SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3
    )
    pen, got = _ngram_run(varied, True, penalised, PROMPTS)
    assert got == _ngram_run(varied, False, penalised, PROMPTS)[1]
    assert pen.engine._ahead.held_verifies == 0
    hyb, got = _ngram_run(hybrid_dir, True, params, PROMPTS)
    assert got == _ngram_run(hybrid_dir, False, params, PROMPTS)[1]
    assert hyb.engine._ahead is None or hyb.engine._ahead.held_verifies == 0


def _step_through(engine) -> tuple[dict, int]:
    finals, errors = {}, 0
    while engine.has_unfinished_requests():
        try:
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.outputs[0].token_ids
        except RuntimeError:
            errors += 1
            # every placeholder taken back with the rows it moved past: a decoding sequence
            # stands right before its last token, as after a synchronous step
            for seq in engine.scheduler.running:
                assert seq.inflight is None
                if seq.output_token_ids:
                    assert seq.num_computed_tokens == seq.num_tokens - 1, seq.request_id
    return finals, errors


@pytest.mark.parametrize("which", [0, 1, 2])
def test_a_held_commit_that_raises_is_taken_back(varied, which):
    """The held step's commit raises (out of the step, as the server's engine loop meets it)
    after some of its sequences emitted, while others still hold tokens of a verify that
    rejected drafts (`which`: the first, second or third such moment): their placeholders and
    counters are taken back (to the rows they moved past, not the rows the step ran), their
    rows run again, and every request ends with the synchronous engine's tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    def run(async_on: bool, inject: bool) -> dict:
        engine = LLM(varied, device="cpu", spec=NGRAM, async_scheduling=async_on).engine
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params)
        requests = engine.telemetry.request
        real, seen = requests.emitted, [0]

        def rejected_held() -> bool:
            for launched, _ in engine._ahead._open:
                for e in launched.batch.entries:
                    row = e.seq.inflight
                    mine = row is not None and getattr(row, "source", None) is launched
                    if mine and getattr(row, "rows", e.num_rows) != e.num_rows:
                        return True
            return False

        def emitted(seq, *args):
            if rejected_held():
                seen[0] += 1
                if seen[0] == which + 1:
                    raise RuntimeError("a hiccup after an emission")
            return real(seq, *args)

        if inject:
            requests.emitted = emitted
        finals, errors = _step_through(engine)
        assert errors == (1 if inject else 0)
        assert engine.allocator.num_free == engine.allocator.num_usable
        return finals

    assert run(True, True) == run(False, False)


def test_a_held_step_counts_its_sampling_step_as_the_commit_does(varied):
    """Each sequence's `noise_epoch` (what a distribution-carrying draft's noise keys on) moves
    once a sampling step, held or not: at the end it is the synchronous engine's."""
    epochs = {}
    for async_on in (False, True):
        engine = LLM(varied, device="cpu", spec=NGRAM, async_scheduling=async_on).engine
        params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
        seqs = {}
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params)
            seqs[f"r{i}"] = engine.requests[f"r{i}"].seqs[0]
        while engine.has_unfinished_requests():
            engine.step()
        epochs[async_on] = {
            rid: (s.noise_epoch, len(s.output_token_ids)) for rid, s in seqs.items()
        }
        if async_on:
            assert engine._ahead.held_verifies > 0
    assert epochs[True] == epochs[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("drafter", ["ngram", "mtp"])
def test_on_cuda_graphs_held_verifies_give_the_same_bits(drafter):
    """Under CUDA graphs, with the n-gram drafter drafting ahead on the device (and MTP, which
    is never held): the shipped model's tokens, texts and logprobs equal the synchronous
    engine's (batch-invariant kernels: the rows thrown away change no other row's bits)."""
    from metrale.default_model import default_model_dir
    from tests.test_async_scheduling import _params, _prompts, same_bits

    prompts = _prompts(24, seed=9)
    params = [_params(i) for i in range(len(prompts))]
    kw = dict(device="cuda", dtype="bfloat16", deterministic=True, max_num_seqs=16)
    kw["spec"] = {"method": drafter, "num_drafts": 3}
    path = default_model_dir()
    ref = LLM(path, **kw, async_scheduling=False).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, **kw, async_scheduling=True)
    same_bits(llm.generate(prompts, params, use_tqdm=False), ref)
    held = llm.engine._ahead.held_verifies
    assert held > 0 if drafter == "ngram" else held == 0


def test_ends_now_is_the_commits_token_by_token_stop():
    """`ends_now` (from the counts) against `stop.token_stop` applied token by token, as the
    commit applies it, on random sequences and tokens: lengths, EOS with and without
    `ignore_eos`, stop token ids, `min_tokens`, the model length, a non-finite row's -1."""
    import random

    from metrale.engine.held_verify import ends_now
    from metrale.engine.sequence import Sequence
    from metrale.engine.stop import token_stop

    rng = random.Random(0)
    for case in range(3000):
        max_tokens = rng.choice([None, 3, 6, 9])
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(rng.choice([0, 0, 2, 5]), max_tokens or 9),
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=rng.choice([[], [4], [4, 7]]),
        )
        n = rng.randrange(0, 6)
        if params.max_tokens is not None:
            n = min(n, params.max_tokens - 1)
        seq = Sequence(
            seq_id=case,
            request_id="r",
            prompt_token_ids=[1, 2, 3],
            params=params,
            seed=0,
            eos_token_ids=(9,),
            arrival=0,
        )
        seq.output_token_ids = [rng.randrange(3, 12) for _ in range(n)]
        ids = [rng.choice([3, 4, 5, 7, 9, 10, 11, -1 if rng.random() < 0.05 else 6])]
        ids += [rng.randrange(3, 12) for _ in range(rng.randrange(0, 4))]
        limit = rng.choice([64, 3 + n + 2, 3 + n + len(ids) + 1])
        want = False
        for token in ids:
            seq.output_token_ids.append(token)
            if token < 0 or token_stop(seq, limit) is not None:
                want = True
                break
        del seq.output_token_ids[n:]
        assert ends_now(seq, ids, limit) == want, (params, seq.output_token_ids, ids, limit)


def test_probes_run_ahead_and_still_teach_dcut(tiny_model_dir):
    """Drafts always wrong, then always right (`test_async_scheduling._learning_figures`): the
    probe steps, whose drafts the cut left at depth 0, are launched ahead as plain steps, and
    observed at their settle they still bring D-Cut back to verifying deep."""
    from tests.test_async_scheduling import _learning_figures

    engines: list = []
    _learning_figures(tiny_model_dir, engines)  # (it checks the deep verifies)
    assert engines[-1].engine._ahead.probes_ahead > 0


class Flaky(NgramDrafter):
    """A stateless drafter (n-gram) that raises for sequence 0 once it has 12 tokens."""

    def propose(self, seqs, max_drafts):
        if any(s.seq_id == 0 and len(s.output_token_ids) >= 12 for s in seqs):
            raise RuntimeError("the drafter failed for sequence 0")
        return super().propose(seqs, max_drafts)


def _finals(llm, prompts, params) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert engine.allocator.num_free == engine.allocator.num_usable
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("where", ["drafter", "forward"])
@pytest.mark.parametrize("n", [1, 2])
def test_a_sequence_failing_while_it_holds_tokens_keeps_them(varied, where, n):
    """A sequence whose drafter (or forward, run again alone) fails in the step after a held
    verify ends with an error after the held verify's tokens, as in the synchronous engine
    (found in review: ended first, it lost them); the others go on."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    got = {}
    for async_on in (True, False):
        if where == "drafter":
            llm = LLM(
                varied,
                device="cpu",
                drafter=Flaky(),
                spec={"num_drafts": 3},
                async_scheduling=async_on,
            )
        else:
            llm = LLM(varied, device="cpu", spec=NGRAM, async_scheduling=async_on)
            runner, real = llm.engine.runner, llm.engine.runner.execute

            def execute(batch, defer=False, real=real):
                if any(
                    e.seq.seq_id == 0 and len(e.seq.output_token_ids) >= 12 for e in batch.entries
                ):
                    raise RuntimeError("the forward failed for sequence 0")
                return real(batch, defer=defer)

            runner.execute = execute
        got[async_on] = _finals(llm, PROMPTS[:n], params)
        if async_on:
            assert llm.engine._ahead.held_verifies > 0
    assert got[True] == got[False]
    assert got[True][0][1] == "error" and len(got[True][0][0]) >= 12


def test_pages_a_held_verify_fills_are_hit_by_the_next_steps_arrivals(varied):
    """B's prompt is prefilled in a held verify step (beside A's verify); C, with B's first
    pages, arrives at the next step, before that step commits the held one: it hits them as in
    the synchronous engine (found in review: offered at the commit, they were missed)."""
    shared = [101, 57, 230, 77, 19, 202, 311, 88, 9, 140, 66, 12]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for k in (3, 5, 8):
        got = {}
        for async_on in (True, False):
            engine = LLM(
                varied, device="cpu", spec=NGRAM, page_size=4, async_scheduling=async_on
            ).engine
            long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            engine.add_request("A", PROMPTS[0], long)
            cached, step = {}, 0
            while engine.has_unfinished_requests():
                if step == k:
                    engine.add_request("B", shared + [5, 6], params)
                if step == k + 1:
                    engine.add_request("C", shared + [7, 8], params)
                for out in engine.step():
                    if out.finished:
                        cached[out.request_id] = (out.num_cached_tokens, out.outputs[0].token_ids)
                step += 1
            got[async_on] = cached
        assert got[True] == got[False], k
        assert got[True]["C"][0] == 12


def test_verify_telemetry_by_width_is_the_synchronous_engines(varied):
    """A held verify some of whose sequences it ended (committed at once) is observed as one
    step: its verifies filed under the step's width (found in review: under each part's)."""
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (13, 40, 27)]
    prompts = [*PROMPTS[:2], [7, 7, 9, 7, 7, 9, 7, 7]]
    tels = []
    for async_on in (True, False):
        llm = LLM(varied, device="cpu", spec=NGRAM, async_scheduling=async_on)
        llm.generate(prompts, params, use_tqdm=False)
        t = llm.engine.telemetry.spec
        tels.append((t.num_drafts, t.num_accepted_tokens, t.by_width, t.verify_steps))
    assert tels[0] == tels[1]


def test_sequences_a_held_verify_ends_leave_no_estimate_behind(varied):
    """A held verify's sequences it ends are committed first and observed with the others, after
    their release: the estimator forgets them again (found in review: their entries piled up,
    up to its bound, where the oldest live sequences' estimates were evicted)."""
    for async_on in (False, True):
        llm = LLM(varied, device="cpu", spec=NGRAM, async_scheduling=async_on)
        for i in range(8):
            sp = SamplingParams(temperature=0.0, max_tokens=9 + i, ignore_eos=True)
            llm.generate([[3, 4, 5] * 8], sp, use_tqdm=False)
        assert len(llm.engine.spec.estimator) == 0
        assert not async_on or llm.engine._ahead.held_verifies > 0


class Wrong:
    """A stateless drafter whose drafts are always wrong."""

    name, needs_hidden, stateless = "wrong", False, True

    def propose(self, seqs, caps):
        from metrale.speculative.drafter import Draft

        return [
            Draft([(s.output_token_ids[-1] + 1) % 300 if s.output_token_ids else 1] * k)
            for s, k in zip(seqs, caps, strict=True)
        ]

    def observe(self, verdicts):
        pass

    def release(self, seq):
        pass


def test_probes_back_off_once_a_probe_as_synchronously(varied):
    """Drafts always wrong: D-Cut goes quiet and its probes' interval doubles once a probe. Run
    ahead, a probe's verdicts come a step late and the step after it is planned twice (before
    and after them): the probes come at the synchronous engine's steps all the same (found in
    review: the interval doubled twice a probe)."""
    prompts = [[(11 * i + 5 * j) % 250 + 3 for j in range(6 + 3 * i)] for i in range(4)]
    steps = {}
    for async_on in (False, True):
        spec = {"num_drafts": 3, "dcut": True, "dcut_probe_every": 8}
        llm = LLM(varied, device="cpu", async_scheduling=async_on, drafter=Wrong(), spec=spec)
        dec, probes, real = llm.engine.spec, [], llm.engine.spec._prepare

        def prepare(running, before=None, real=real, dec=dec, probes=probes):
            failed = real(running, before)
            if dec._probing:
                probes.append(dec._steps)
            return failed

        dec._prepare = prepare
        sp = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
        llm.generate(prompts, sp, use_tqdm=False)
        steps[async_on] = probes
        if async_on:
            assert llm.engine._ahead.probes_ahead > 0
    assert len(steps[True]) >= 4 and steps[True] == steps[False]


def test_dcut_plans_from_a_held_verifys_verdicts_as_synchronously(varied):
    """D-Cut learns a held verify's verdicts when they are read, not at its commit a step later:
    every step verifies the depths the synchronous engine's does (found with
    `benchmarks/simulated_device.py`: learned at the commit, the estimates lagged a step and the
    plans of a closed batch's tail took 2% more steps at batch 64)."""
    prompts = [[(7 * i + 3 * j) % 40 + 3 for j in range(8 + i)] for i in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20 + 5 * i, ignore_eos=True) for i in range(6)
    ]
    depths = {}
    for async_on in (False, True):
        spec = {"method": "ngram", "num_drafts": 3, "dcut": True, "dcut_width_cap": 2}
        llm = LLM(varied, device="cpu", spec=spec, async_scheduling=async_on)
        engine, seen = llm.engine, []
        schedule = engine.scheduler.schedule

        def scheduled(*args, schedule=schedule, seen=seen, **kwargs):
            batch = schedule(*args, **kwargs)
            if batch is not None and batch.entries:
                seen.append(sorted((e.seq.request_id, len(e.drafts)) for e in batch.entries))
            return batch

        engine.scheduler.schedule = scheduled
        llm.generate(prompts, params, use_tqdm=False)
        depths[async_on] = seen
        if async_on:
            assert engine._ahead.held_verifies > 0
    assert any(d for step in depths[False] for _, d in step)
    assert depths[True] == depths[False]


@pytest.mark.parametrize("dcut", [True, False], ids=["dcut", "no-dcut"])
def test_sequences_a_stop_string_ends_at_a_held_commit_leave_no_estimate(varied, dcut):
    """A held step's commit, in the next step's forward, ends a sequence by a stop string: that
    next step's verdicts for it are not learned (found in review: learned at their read after
    its release, its estimator entry stayed for good and the pool took a verdict the
    synchronous engine never computed). And with D-Cut off, where the commit learns, the
    sequences a held verify ends by their length (committed first) are forgotten again."""
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    spec = {"method": "ngram", "num_drafts": 3, "dcut": dcut}
    texts = [
        o.outputs[0].text
        for o in LLM(varied, device="cpu", spec=spec).generate(PROMPTS, free, use_tqdm=False)
    ]
    pools = {}
    for async_on in (False, True):
        llm = LLM(varied, device="cpu", spec=spec, async_scheduling=async_on)
        for rep in range(12):
            cut = [t[len(t) // 2 + rep % 5 : len(t) // 2 + rep % 5 + 2] for t in texts]
            params = [
                SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[c])
                for c in cut
            ]
            llm.generate(PROMPTS, params, use_tqdm=False)
            assert len(llm.engine.spec.estimator) == 0, (async_on, rep)
        # and sequences a held verify ends by their length, beside others it does not end
        ends = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (13, 27)]
        llm.generate(PROMPTS[:2], ends, use_tqdm=False)
        assert len(llm.engine.spec.estimator) == 0, async_on
        pools[async_on] = llm.engine.spec.estimator._pooled
        if async_on:
            assert llm.engine._ahead.held_verifies > 0
    assert pools[True] == pools[False]
