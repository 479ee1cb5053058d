"""Asynchronous scheduling (`async_scheduling`, on by default as in vLLM: `engine/ahead.py`) is
invisible in the output: each step is launched before the one before it is read back, and every
request gets the tokens, text, logprobs and finish reason the synchronous engine gives it —
greedy and seeded sampling, stop strings and EOS, chunked prefill and preemption, aborts
mid-stream, a failing sequence, arrivals mid-run — on dense and hybrid targets. Requests that
need the tokens before the next step (speculation, grammars) keep the engine synchronous while
they run; penalties do not (their counts take a launched step's tokens on the device)."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from tests.test_batching import prompts_of_mixed_lengths
from tests.test_hybrid_engine import hybrid_dir  # noqa: F401 (a module fixture)


def _target(request, name):
    return request.getfixturevalue("tiny_model_dir" if name == "dense" else "hybrid_dir")


def _prompts(n: int = 10, seed: int = 1) -> list[list[int]]:
    return [[t % 300 for t in p] for p in prompts_of_mixed_lengths(n, seed)]


def _params(i: int) -> SamplingParams:
    """A mix: greedy, seeded sampling, logprobs, a stop string, EOS allowed, n = 2."""
    kind = i % 5
    if kind == 0:
        return SamplingParams(temperature=0.0, max_tokens=9 + i, ignore_eos=True)
    if kind == 1:
        return SamplingParams(temperature=0.8, top_p=0.9, seed=40 + i, max_tokens=12)
    if kind == 2:
        return SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True)
    if kind == 3:
        return SamplingParams(temperature=1.0, seed=i, max_tokens=20, stop=["e", "a"])
    return SamplingParams(temperature=0.7, seed=7 + i, max_tokens=8, n=2)


def same_bits(outs, ref) -> None:
    """Tokens, text, finish reason and logprobs exactly (CUDA's batch-invariant kernels)."""
    assert len(outs) == len(ref)
    for o, r in zip(outs, ref, strict=True):
        for c, d in zip(o.outputs, r.outputs, strict=True):
            assert (c.token_ids, c.text, c.finish_reason) == (d.token_ids, d.text, d.finish_reason)
            assert c.logprobs == d.logprobs


def _same(outs, ref) -> None:
    """Tokens, text and finish reason exactly; logprobs to 1e-4 (a step ahead runs beside other
    rows, and CPU kernels round by the row count: issue 13)."""
    assert len(outs) == len(ref)
    for o, r in zip(outs, ref, strict=True):
        for c, d in zip(o.outputs, r.outputs, strict=True):
            assert (c.token_ids, c.text, c.finish_reason) == (d.token_ids, d.text, d.finish_reason)
            assert (c.logprobs is None) == (d.logprobs is None)
            if d.logprobs is not None:
                assert c.cumulative_logprob == pytest.approx(d.cumulative_logprob, abs=1e-3)
                for e, f in zip(c.logprobs, d.logprobs, strict=True):
                    assert list(e) == list(f)
                    for t in f:
                        assert e[t].logprob == pytest.approx(f[t].logprob, abs=1e-4)


def _run(path, prompts, params, **kw):
    kw.setdefault("async_scheduling", False)  # the reference: the synchronous engine
    llm = LLM(path, device="cpu", **kw)
    return llm, llm.generate(prompts, params, use_tqdm=False)


def test_async_scheduling_is_the_default(tiny_model_dir):
    """On unless turned off: `LLM` and the command line (`--no-async-scheduling`) alike."""
    from metrale.cli import build_parser

    llm = LLM(tiny_model_dir, device="cpu")
    assert llm.engine.config.async_scheduling and llm.engine._ahead is not None
    outs = llm.generate(_prompts(3), [_params(i) for i in range(3)], use_tqdm=False)
    assert llm.engine._ahead.launches_ahead > 0 and all(o.finished for o in outs)
    assert LLM(tiny_model_dir, device="cpu", async_scheduling=False).engine._ahead is None
    parser = build_parser()
    for command in (["serve"], ["generate", "x"], ["bench"]):
        assert parser.parse_args(command).async_scheduling is True
        assert parser.parse_args([*command, "--no-async-scheduling"]).async_scheduling is False


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_async_engine_gives_the_synchronous_output(request, target):
    path = _target(request, target)
    prompts = _prompts()
    params = [_params(i) for i in range(len(prompts))]
    _, ref = _run(path, prompts, params)
    llm, outs = _run(path, prompts, params, async_scheduling=True)
    _same(outs, ref)
    stepper = llm.engine._ahead
    assert stepper.launches_ahead > stepper.launches // 2  # it did run ahead
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable
    assert llm.engine.sync_seqs == 0 and not llm.engine.requests


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_chunked_prefill_and_preemption_under_async_scheduling(request, target):
    path = _target(request, target)
    prompts = _prompts(12, seed=3)
    params = [_params(i) for i in range(len(prompts))]
    _, ref = _run(path, prompts, params)
    # a pool far smaller than the batch needs: sequences are preempted and recomputed
    small = dict(max_num_batched_tokens=48, page_size=4, num_kv_pages=40, prefix_caching=False)
    llm, outs = _run(path, prompts, params, async_scheduling=True, **small)
    assert llm.engine.telemetry.preemptions > 0
    _same(outs, ref)
    assert llm.engine._ahead.launches_ahead > 0
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable


def _stream(engine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]], aborts):
    """Step the engine to the end, adding requests and aborting others at given steps; returns
    each request's streamed token ids and text, and its last output."""
    seen: dict[str, tuple[list[int], str]] = {}
    last = {}

    def take(out) -> None:
        ids, text = seen.get(out.request_id, ([], ""))
        c = out.outputs[0]
        seen[out.request_id] = (ids + c.delta_token_ids, text + c.delta_text)
        last[out.request_id] = out

    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid, prompt, sp in arrivals.get(step, []):
            engine.add_request(rid, prompt, sp)
        for rid in aborts.get(step, []):
            out = engine.abort_request(rid)
            if out is not None:
                take(out)
        for out in engine.step():
            take(out)
        step += 1
    return seen, last


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_arrivals_and_aborts_mid_stream(request, target):
    path = _target(request, target)
    prompts = _prompts(8, seed=5)
    params = [_params(i) for i in range(8)]
    params[4] = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    arrivals = {0: [], 3: [], 6: []}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        arrivals[(0, 3, 6)[i % 3]].append((f"r{i}", p, sp))
    aborts = {5: ["r0"], 9: ["r4", "r7"]}
    results = []
    for async_on in (False, True):
        llm = LLM(path, device="cpu", async_scheduling=async_on)
        results.append(_stream(llm.engine, arrivals, aborts))
        engine = llm.engine
        assert engine.allocator.num_free == engine.allocator.num_usable
        assert engine.sync_seqs == 0 and not engine.requests
    (seen_sync, last_sync), (seen_async, last_async) = results
    for rid, out in last_sync.items():
        ref, got = out.outputs[0], last_async[rid].outputs[0]
        if ref.finish_reason == "abort":
            # aborted one step apart at most: what it shows is a prefix of the other's, never
            # a placeholder for a token still in flight
            assert got.finish_reason == "abort"
            a, b = sorted((ref.token_ids, got.token_ids), key=len)
            assert b[: len(a)] == a and len(b) - len(a) <= 1
            assert seen_async[rid][0] == got.token_ids
            continue
        assert (got.token_ids, got.text, got.finish_reason) == (
            ref.token_ids,
            ref.text,
            ref.finish_reason,
        )
        assert seen_async[rid] == seen_sync[rid] == (ref.token_ids, ref.text)


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_a_launch_that_fails_once_after_its_forward_runs_again_on_the_right_state(
    request, target, monkeypatch
):
    """A step launched ahead that raises after its forward ran (a hybrid target's GDN state
    advanced by its rows, its K/V written): it runs again synchronously, each sequence alone
    after its state is rebuilt, and every request still gets the synchronous engine's tokens
    (run again whole, the hybrid's would have started from the state the failed run left)."""
    path = _target(request, target)
    prompts = _prompts(5, seed=8)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 5
    _, ref = _run(path, prompts, params)
    llm = LLM(path, device="cpu", async_scheduling=True)
    runner = llm.engine.runner
    real_execute = runner.execute
    deferred = {"n": 0}

    def execute(batch, defer=False):
        out = real_execute(batch, defer=defer)
        if defer:
            deferred["n"] += 1
            if deferred["n"] in (4, 7):  # a transient failure, after the forward
                raise RuntimeError("the device said no")
        return out

    monkeypatch.setattr(runner, "execute", execute)
    outs = llm.generate(prompts, params, use_tqdm=False)
    _same(outs, ref)
    # (a hybrid's two failed steps ran one sequence at a time; a dense one's again whole)
    assert llm.engine.retried_batches == (2 if target == "hybrid" else 0)
    assert llm.engine._ahead.launches_ahead > 0
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable


def test_a_failing_forward_ends_only_its_sequence(tiny_model_dir, monkeypatch):
    prompts = _prompts(5, seed=2)
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)] * 5
    _, ref = _run(tiny_model_dir, prompts, params)
    llm = LLM(tiny_model_dir, device="cpu", async_scheduling=True)
    runner = llm.engine.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def execute(batch, defer=False):
        calls["n"] += 1
        if calls["n"] > 3 and any(e.seq.request_id == "2" for e in batch.entries):
            raise RuntimeError("NaN in the forward")
        return real_execute(batch, defer=defer)

    monkeypatch.setattr(runner, "execute", execute)
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp, final_only=True)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    failed = outs["2"].outputs[0]
    assert failed.finish_reason == "error" and "NaN in the forward" in failed.error
    assert ref[2].outputs[0].token_ids[: len(failed.token_ids)] == failed.token_ids
    for i in (0, 1, 3, 4):
        assert outs[str(i)].outputs[0].token_ids == ref[i].outputs[0].token_ids
    assert engine.allocator.num_free == engine.allocator.num_usable


def test_requests_under_a_grammar_keep_the_engine_synchronous(tiny_model_dir):
    prompts = _prompts(4, seed=4)
    base = dict(temperature=0.0, max_tokens=10, ignore_eos=True, speculative=False)
    grammar = dict(max_tokens=40, structured={"regex": "[ab]+"}, ignore_eos=False)
    longer = SamplingParams(**(base | grammar))
    params = [SamplingParams(**base)] * 3 + [longer]
    spec = {"method": "ngram", "num_drafts": 3}
    _, ref = _run(tiny_model_dir, prompts, params, spec=spec)
    llm, outs = _run(tiny_model_dir, prompts, params, spec=spec, async_scheduling=True)
    _same(outs, ref)
    engine = llm.engine
    assert engine._ahead.launches_ahead == 0  # the fourth request outlives the others
    assert engine.sync_seqs == 0
    # with it gone, the others run ahead again
    llm.generate(prompts[:3], params[:3], use_tqdm=False)
    assert engine._ahead.launches_ahead > 0


@pytest.mark.parametrize("target", ["dense", "hybrid"])
@pytest.mark.parametrize("dcut", [True, False], ids=["dcut", "no-dcut"])
def test_speculative_requests_under_async_scheduling(request, target, dcut):
    """Steps that draft wait for the step before (the drafter reads its tokens) and verify
    synchronously; the others run ahead. Lossless either way: the plain engine's tokens."""
    path = _target(request, target)
    prompts = [p * 3 for p in _prompts(8, seed=6)]  # repeats: n-gram drafts
    params = [_params(i) for i in range(8)]
    spec = {"method": "ngram", "num_drafts": 3, "dcut": dcut}
    _, plain = _run(path, prompts, params)
    _, ref = _run(path, prompts, params, spec=spec)
    llm, outs = _run(path, prompts, params, spec=spec, async_scheduling=True)
    _same(outs, ref)
    _same(outs, plain)
    tel = llm.engine.telemetry.spec
    assert tel.num_drafts > 0
    assert llm.engine._ahead.launches_ahead > 0  # prefill, depth 0
    assert llm.engine.sync_seqs == 0 and not llm.engine.requests


def test_steps_dcut_plans_at_depth_zero_run_ahead(tiny_model_dir):
    """Drafts that are always wrong: D-Cut learns it and plans depth 0, and those steps run
    ahead like plain ones (a probe step now and then drafts and waits)."""
    from metrale.speculative.replay import ReplayDrafter

    prompts = _prompts(6, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    _, plain = _run(tiny_model_dir, prompts, params)
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain, strict=True)}
    drafter = ReplayDrafter(truth, 0.0, 200)
    llm = LLM(tiny_model_dir, device="cpu", drafter=drafter, async_scheduling=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    _same(outs, plain)
    stepper = llm.engine._ahead
    assert llm.engine.telemetry.spec.num_drafts > 0  # it tried
    assert stepper.launches_ahead > stepper.launches // 2


@pytest.mark.parametrize("held", [False, True])
def test_dcut_learns_under_async_scheduling_as_it_does_synchronously(
    tiny_model_dir, monkeypatch, held
):
    """D-Cut's probes teach it the same acceptance either way: drafts always wrong, then always
    right, and it goes back to verifying (a probe whose drafts the cut left at depth 0 once ran
    ahead, its verdicts unobserved, and D-Cut never verified again: the H200's forced grid at
    alpha 0.8 after alpha 0). Host pricing off: the plans then depend on counts alone, and with
    verifies committed before the next step (`METRALE_NO_HELD_VERIFY=1`) the speculative
    telemetry of both engines is the same. Held (`engine/held_verify.py`), each verify is
    observed one step later: the wrong drafts cost the same verifies (the probes'), and the
    right ones are learned and verified deep again (`_learning_figures` checks)."""
    from metrale.knobs import knobs

    monkeypatch.setenv("METRALE_NO_DCUT_HOST_COST", "1")
    if not held:
        monkeypatch.setenv("METRALE_NO_HELD_VERIFY", "1")
    knobs.cache_clear()
    try:
        figures = _learning_figures(tiny_model_dir)
    finally:
        knobs.cache_clear()
    if held:
        assert figures[1][0] == figures[0][0]
    else:
        assert figures[1] == figures[0]


def _learning_figures(path, engines: list | None = None) -> list[tuple]:
    """(wrong, right, drafts) of a synchronous then an asynchronous engine (each `LLM` appended
    to `engines` when given)."""
    from metrale.speculative.replay import ReplayDrafter

    prompts = _prompts(6, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    _, plain = _run(path, prompts, params)
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain, strict=True)}
    figures = []
    for async_scheduling in (False, True):
        drafter = ReplayDrafter(truth, 0.0, 200)
        llm = LLM(
            path,
            device="cpu",
            drafter=drafter,
            async_scheduling=async_scheduling,
            spec={"num_drafts": 3, "dcut": True},
        )
        tel = llm.engine.telemetry.spec
        _same(llm.generate(prompts, params, use_tqdm=False), plain)
        wrong = (tel.verify_steps, tel.num_accepted_tokens)
        drafter.record(truth, 1.0)
        _same(llm.generate(prompts, params, use_tqdm=False), plain)
        right = (tel.verify_steps - wrong[0], tel.num_accepted_tokens - wrong[1])
        assert right[0] > 0 and right[1] > 3 * right[0] // 2  # it verifies again, deep
        figures.append((wrong, right, tel.num_drafts))
        if engines is not None:
            engines.append(llm)
    return figures


def test_steps_whose_drafter_finds_nothing_are_launched_deferred(tiny_model_dir):
    """D-Cut off, a drafter with nothing to propose: asked every step, it waits for the step
    before (it reads tokens) but drafts nothing, so there is nothing to learn from the verdicts
    and each step is launched without waiting for its own (its commit comes with the next)."""
    from metrale.speculative.replay import ReplayDrafter

    prompts = _prompts(4, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    _, plain = _run(tiny_model_dir, prompts, params)
    drafter = ReplayDrafter({}, 1.0, 200)  # no continuation recorded: empty drafts
    llm = LLM(
        tiny_model_dir,
        device="cpu",
        drafter=drafter,
        async_scheduling=True,
        spec={"num_drafts": 3, "dcut": False},
    )
    _same(llm.generate(prompts, params, use_tqdm=False), plain)
    assert llm.engine._ahead.launches >= 12  # the prefill and every decode step
    assert llm.engine.telemetry.spec.verify_steps == 0


def test_a_drafter_that_learns_from_every_step_keeps_it_synchronous(tiny_model_dir):
    """MTP observes every step's verdicts (it catches up on the hidden states), even of
    requests that do not speculate."""
    from metrale.speculative.replay import ReplayDrafter

    class Learning(ReplayDrafter):
        stateless = False

    drafter = Learning({}, 1.0, 200)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, speculative=False)
    llm = LLM(tiny_model_dir, device="cpu", drafter=drafter, async_scheduling=True)
    llm.generate(_prompts(3), params, use_tqdm=False)
    assert llm.engine._ahead.launches_ahead == 0


def test_mtp_speculation_under_async_scheduling_is_the_synchronous_engine(tiny_model_dir, tmp_path):
    """A real MTP head (it observes every step of a sequence that drafts with it): the engine
    stays synchronous while one runs (here to the end: the request without speculation ends
    first), and every request, speculative or not, gets the synchronous engine's tokens."""
    import shutil

    from metrale.config import ModelConfig
    from metrale.models.mtp import write_mtp_weights

    path = tmp_path / "mtp"
    shutil.copytree(tiny_model_dir, path)
    write_mtp_weights(path, ModelConfig.from_hf(path), "qwen3_next", num_layers=1, seed=4)
    prompts = [p * 2 for p in _prompts(8, seed=4)]
    params = [_params(i) for i in range(8)]
    params[1] = SamplingParams(temperature=0.0, max_tokens=10, speculative=False)
    spec = {"method": "mtp", "num_drafts": 3}
    _, ref = _run(path, prompts, params, spec=spec)
    llm, outs = _run(path, prompts, params, spec=spec, async_scheduling=True)
    _same(outs, ref)
    assert llm.engine.telemetry.spec.num_draft_tokens > 0
    assert llm.engine._ahead.launches_ahead == 0


def test_an_mtp_engine_runs_requests_without_speculation_ahead():
    """MTP learns from the sequences that draft with it alone (`observes_drafting_only`): an
    engine with an MTP head serving requests with `speculative=False` runs their steps ahead
    (before, every step waited: `metrale bench`'s plain runs of an MTP cell were synchronous),
    and a speculative request arriving mid-run is still shown every step from its prompt on:
    the synchronous engine's tokens, and its drafts and acceptance to the draft, which a missed
    catch-up of its prompt changes (checked by making the engine skip it)."""
    from metrale.default_model import default_model_dir

    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, speculative=False)
    spec = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def run(async_scheduling: bool):
        llm = LLM(
            default_model_dir(),
            device="cpu",
            spec={"method": "mtp", "num_drafts": 3},
            async_scheduling=async_scheduling,
        )
        engine, outs, steps = llm.engine, {}, 0
        for i, prompt in enumerate(["def fibonacci(n):", "import os\nimport sys\n"]):
            engine.add_request(f"plain{i}", prompt, plain)
        while engine.has_unfinished_requests():
            steps += 1
            if steps == 4:  # after a few steps launched ahead
                engine.add_request("spec", "def quicksort(items):\n    if len(items) <= 1:", spec)
            for out in engine.step():
                outs[out.request_id] = out
        counts = (
            outs["spec"].outputs[0].num_draft_tokens,
            outs["spec"].outputs[0].num_accepted_tokens,
        )
        tokens = {k: o.outputs[0].token_ids for k, o in outs.items()}
        return engine, tokens, counts

    engine, tokens, counts = run(True)
    _, ref_tokens, ref_counts = run(False)
    assert tokens == ref_tokens and counts == ref_counts and counts[1] > 0
    assert engine._ahead.launches_ahead >= 3  # the plain steps before the arrival, at least
    assert not engine._sync_seq_ids  # every sequence left its count at its end


def test_an_mtp_hook_after_a_program_is_not_bound_to_a_step_left_on_the_device():
    """`ModelRunner._follow` (the GPU path's catch-up queued after a program) is not bound to a
    step left on the device (`defer`): under MTP only steps of sequences that do not draft with
    it run ahead (`runs_ahead`), in which the catch-up has no work (bound, it stood in the
    way of leaving the verdicts pending). A step run synchronously still gets it."""
    from types import SimpleNamespace

    from metrale.engine.program_shapes import RaggedShape
    from metrale.engine.runner import ModelRunner
    from metrale.engine.sequence import ScheduledSeq, Sequence

    def entry(i: int, speculative: bool) -> ScheduledSeq:
        params = SamplingParams(max_tokens=4, speculative=speculative)
        return ScheduledSeq(
            Sequence(i, f"r{i}", [1, 2, 3], params, 0, (), arrival=i, num_computed_tokens=2), 1
        )

    runner = SimpleNamespace(
        replayed_shape=RaggedShape(2, 2, 4),
        after_verify=lambda *a: None,
        after_verify_drafts_only=False,
        forced_acceptance=None,
        verify_raw_argmax=False,
    )
    plain = [entry(0, False), entry(1, False)]
    assert ModelRunner._follow(runner, SimpleNamespace(entries=plain), plain, defer=True) is None
    mixed = [entry(0, False), entry(1, True)]
    assert ModelRunner._follow(runner, SimpleNamespace(entries=mixed), mixed) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("target", ["shipped", "hybrid"])
def test_on_cuda_graphs_the_async_engine_gives_the_same_bits(tmp_path, tokenizer_dir, target):
    """Under CUDA graphs, with the tokens in flight read by the next step's program from the
    device: the same tokens and logprobs as the synchronous engine (batch-invariant kernels, so
    that the thrown-away rows of ended sequences change no other row's bits)."""
    from metrale.default_model import default_model_dir
    from tests.test_hybrid_engine import write_hybrid

    if target == "shipped":
        path = default_model_dir()
    else:  # bf16, as `test_deterministic.py`'s hybrid (float32 exceeds a kernel's shared memory)
        path = write_hybrid(tmp_path / "hybrid", tokenizer_dir, seed=3, hidden_size=256)
    prompts = _prompts(24, seed=9)
    params = [_params(i) for i in range(len(prompts))]
    kw = dict(device="cuda", dtype="bfloat16", deterministic=True, max_num_seqs=16)
    ref = LLM(path, **kw, async_scheduling=False).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, **kw, async_scheduling=True)
    same_bits(llm.generate(prompts, params, use_tqdm=False), ref)
    stepper = llm.engine._ahead
    assert stepper.launches_ahead > stepper.launches // 2
    assert llm.engine.runner.graph_refusals == 0
