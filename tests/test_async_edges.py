"""Edges of asynchronous scheduling (`engine/ahead.py`) that a review found against the
synchronous engine: prefix-cache hits of a request admitted while the step that fills the pages
is still in flight, an exception escaping a step while a step is launched and unsettled, and
the step launched for sequences the step before ended."""

from __future__ import annotations

import logging

import pytest

from metrale import LLM, SamplingParams
from tests.test_hybrid_engine import hybrid_dir  # noqa: F401 (a module fixture)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def test_pages_a_launched_step_fills_are_hit_by_the_next_step(tiny_model_dir):
    """The pages a prompt chunk fills are offered to the prefix cache when its step is
    launched, as vLLM caches a block when it is scheduled: a request the next step admits
    (before the chunk's step is settled) hits them as it does in the synchronous engine."""
    shared = list(range(10, 42))  # two pages of 16
    prompts = [shared + [100 + i] for i in range(4)]
    got = {}
    for async_on in (False, True):
        llm = LLM(
            tiny_model_dir, device="cpu", async_scheduling=async_on, max_num_batched_tokens=40
        )
        outs = llm.generate(prompts, _greedy(4), use_tqdm=False)
        tel = llm.engine.telemetry
        got[async_on] = (
            [o.num_cached_tokens for o in outs],
            [o.outputs[0].token_ids for o in outs],
            tel.prefill_tokens,
        )
        assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable
    assert got[True] == got[False]
    assert sum(got[True][0]) >= 64  # two requests hit both shared pages


def _step_through(engine) -> tuple[list, int]:
    """Step `engine` to the end as the server's engine loop does, going on after an exception
    out of a step: every output, in order, and the exceptions counted."""
    outs, errors = [], 0
    while engine.has_unfinished_requests():
        try:
            outs += engine.step()
        except RuntimeError:
            errors += 1
    return outs, errors


def _drive_failing_emit(path, async_on: bool, fail_at: int):
    """Requests a and b; the commit raises once, right after a's `fail_at`-th emission, out of
    the step (the request telemetry's record of it: a failure of the emission itself now ends
    that sequence alone, `test_failure_isolation.py`); the loop goes on as the server's engine
    loop does."""
    llm = LLM(path, device="cpu", async_scheduling=async_on)
    engine = llm.engine
    engine.add_request("a", [5, 6, 7, 8], _greedy(8, stop=["zz-never"]))
    engine.add_request("b", [9, 10, 11], _greedy(8, stop=["zz-never"]))
    requests = engine.telemetry.request
    real, count = requests.emitted, [0]

    def emitted(seq, *args):
        if seq.request_id == "a":
            count[0] += 1
            if count[0] == fail_at:
                raise RuntimeError("a hiccup after the emission")
        return real(seq, *args)

    requests.emitted = emitted
    outs, errors = _step_through(engine)
    finals = {o.request_id: o.outputs[0].token_ids for o in outs if o.finished}
    assert engine.allocator.num_free == engine.allocator.num_usable
    return finals, errors


def test_an_exception_out_of_a_step_loses_no_other_token(tiny_model_dir):
    """An exception escaping `step` while a step is launched and unsettled: the launched
    steps take their placeholders back and their rows run again, so no request's output holds
    a placeholder (before: the other request got token 0 where its token was in flight)."""
    want = LLM(tiny_model_dir, device="cpu", async_scheduling=False).generate(
        [[5, 6, 7, 8], [9, 10, 11]], _greedy(8), use_tqdm=False
    )
    for fail_at in (2, 3, 5):
        finals, errors = _drive_failing_emit(tiny_model_dir, True, fail_at)
        assert errors == 1
        assert finals["b"] == want[1].outputs[0].token_ids
        assert 0 not in finals["a"]


def test_an_exception_while_a_launched_step_moves_the_counters_loses_nothing(
    tiny_model_dir, monkeypatch
):
    """An exception while a launched step's placeholders go out (`AheadStepper._advance`; here
    the second placeholder's making raises once): those already out are taken back, so every
    output is the synchronous engine's (before: token 0 stayed in both; found in review, with
    the prefix cache's commit raising there, which now costs the cache alone)."""
    from metrale.engine import ahead

    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [9, 10, 11]]
    finals = {}
    for async_on in (False, True):
        llm = LLM(tiny_model_dir, device="cpu", async_scheduling=async_on, page_size=4)
        engine = llm.engine
        real, calls = ahead.DeviceRow, [0]

        def placeholder(*args, real=real, calls=calls):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("injected")
            return real(*args)

        monkeypatch.setattr(ahead, "DeviceRow", placeholder)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, _greedy(8), final_only=True)
        outs, errors = _step_through(engine)
        monkeypatch.undo()
        got = {o.request_id: o.outputs[0].token_ids for o in outs}
        assert errors == async_on and engine.allocator.num_free == engine.allocator.num_usable
        finals[async_on] = got
    assert finals[True] == finals[False]


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
def test_an_exception_after_a_sequence_ended_ends_it_and_keeps_its_output(tiny_model_dir, async_on):
    """An exception out of the step that ends a request, after its commit (here the step's
    telemetry raises once): the request still ends there, with `max_tokens` tokens (before: it
    ran one step more and returned max_tokens + 1), and its final output comes with the next
    step (`LLMEngine._carried`), though no sequence is left to run (found in review, with the
    prefix cache's commit raising there, which now costs the cache alone)."""
    for when in ("mid-way", "at its end"):
        llm = LLM(tiny_model_dir, device="cpu", async_scheduling=async_on, page_size=4)
        engine = llm.engine
        engine.add_request("a", [5, 6, 7], _greedy(6), final_only=True)
        seq, real, calls = engine.requests["a"].seqs[0], engine._record_step, [0]

        def record(*args, real=real, calls=calls, when=when, seq=seq):
            calls[0] += 1
            due = calls[0] == 2 if when == "mid-way" else seq.finish_reason is not None
            if due and calls[0] > 0:
                calls[0] = -100  # once
                raise RuntimeError("injected")
            return real(*args)

        engine._record_step = record
        outs, errors = _step_through(engine)
        final = next((o.outputs[0] for o in reversed(outs) if o.finished), None)
        assert errors == 1 and final is not None, when
        assert (len(final.token_ids), final.finish_reason) == (6, "length"), when
        assert engine.allocator.num_free == engine.allocator.num_usable and not engine.requests


def _finals(engine) -> dict[str, tuple]:
    """Each request's final tokens and text, and, streamed, the concatenation of its deltas
    (which must be them)."""
    outs, _ = _step_through(engine)
    deltas: dict[str, tuple[list[int], str]] = {}
    for o in outs:
        ids, text = deltas.get(o.request_id, ([], ""))
        deltas[o.request_id] = (ids + o.outputs[0].delta_token_ids, text + o.outputs[0].delta_text)
    return {
        o.request_id: (o.outputs[0].token_ids, o.outputs[0].text, deltas[o.request_id])
        for o in outs
        if o.finished
    }


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
def test_an_exception_after_a_step_made_its_outputs_loses_no_final_output(tiny_model_dir, async_on):
    """An exception after a step made its outputs (the step's telemetry, the launched step's
    placeholders, D-Cut's timing of the step) loses none of them: a request that step finished
    is still in the engine and its final output comes with the next step. Before, the outputs
    had let the finished request go, and the next step passed over it: its output never came
    (found in review, async at the third prefix-cache commit; the synchronous engine lost the
    whole step's outputs when the timing raised). A streamed request's deltas stay in order
    (made again, text drained since went in front of the text they held: found in review)."""
    prompts = {"a": ([5, 6, 7], 3), "b": ([9, 10, 11, 12, 13], 12)}
    spec = {"method": "ngram", "num_drafts": 2}
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)

    from metrale.engine import ahead

    def run(fail_record: int = 0, fail_timing: int = 0, fail_placeholder: int = 0):
        llm = LLM(tiny_model_dir, device="cpu", async_scheduling=async_on, page_size=4, spec=spec)
        engine = llm.engine
        calls = {"record": 0, "timing": 0, "placeholder": 0}

        def failing(name, real, at):
            def call(*args):
                calls[name] += 1
                if calls[name] == at:
                    raise RuntimeError("injected")
                return real(*args)

            return call

        engine._record_step = failing("record", engine._record_step, fail_record)
        engine.spec.timed_step = failing("timing", engine.spec.timed_step, fail_timing)
        mp = pytest.MonkeyPatch()
        mp.setattr(ahead, "DeviceRow", failing("placeholder", ahead.DeviceRow, fail_placeholder))
        for rid, (prompt, n) in prompts.items():
            engine.add_request(rid, prompt, _greedy(n), final_only=True)
        engine.add_request("streamed", [5, 6, 7], seeded)
        finals = _finals(engine)
        ids, text, (delta_ids, delta_text) = finals["streamed"]
        assert (delta_ids, delta_text) == (ids, text)
        assert engine.allocator.num_free == engine.allocator.num_usable and not engine.requests
        mp.undo()
        return finals, calls

    reference, calls = run()
    assert sorted(reference) == ["a", "b", "streamed"]
    for at in range(1, calls["record"] + 1):
        assert run(fail_record=at)[0] == reference, ("record", at)
    for at in range(1, calls["timing"] + 1):
        assert run(fail_timing=at)[0] == reference, ("timing", at)
    for at in range(1, calls["placeholder"] + 1):  # (the asynchronous engine's launches)
        assert run(fail_placeholder=at)[0] == reference, ("placeholder", at)


def test_the_step_after_the_last_is_not_counted(tiny_model_dir):
    """The step launched for sequences the step before ended is thrown away at once: not
    settled by the next request's first call and counted as a step that lasted the idle time
    between them (a review found 3.0 s of step time against 0.56 s synchronously): the steps
    counted and timed are the synchronous engine's."""
    counts = {}
    for async_on in (False, True):
        llm = LLM(tiny_model_dir, device="cpu", async_scheduling=async_on)
        tel = llm.engine.telemetry
        llm.generate([[1, 2, 3]], _greedy(4), use_tqdm=False)
        first = tel.steps
        assert llm.engine._ahead is None or llm.engine._ahead.launched is None
        llm.generate([[1, 2, 3]], _greedy(4), use_tqdm=False)
        counts[async_on] = (first, tel.steps, tel.step_time.count)
    assert counts[True] == counts[False]


def test_a_step_whose_requests_were_all_aborted_is_not_timed_as_the_idle_gap(tiny_model_dir):
    """A launched step whose requests were all aborted (a client left) is settled at the abort:
    kept, the next request's first step settled it, and it was counted as one step lasting the
    whole idle time in between (found in review: 2.8 s against 0.08 s synchronously). The
    steps counted, and the prompt rows, are the synchronous engine's, right after the abort."""
    got = {}
    for async_on in (False, True):
        llm = LLM(tiny_model_dir, device="cpu", async_scheduling=async_on)
        engine, tel = llm.engine, llm.engine.telemetry
        engine.add_request("a", [5, 6, 7], _greedy(50))
        for _ in range(3):
            engine.step()
        engine.abort_request("a")
        assert engine._ahead is None or engine._ahead.launched is None
        counted = (tel.steps, tel.prefill_tokens)
        llm.generate([[8, 9]], _greedy(2), use_tqdm=False)
        got[async_on] = (counted, tel.steps, tel.prefill_tokens)
        assert engine.allocator.num_free == engine.allocator.num_usable
    assert got[True] == got[False]


def test_a_failing_launch_is_logged(tiny_model_dir, caplog):
    """A step launched ahead that raises runs again synchronously, and says so: a launch that
    always failed silently made the engine synchronous."""
    llm = LLM(tiny_model_dir, device="cpu")
    runner = llm.engine.runner
    real = runner.execute

    def execute(batch, defer=False):
        if defer:
            raise RuntimeError("no deferred launch today")
        return real(batch)

    runner.execute = execute
    with caplog.at_level(logging.WARNING, logger="metrale.engine.ahead"):
        outs = llm.generate([[1, 2, 3]], _greedy(4), use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 4
    assert "runs again synchronously" in caplog.text
    assert llm.engine._ahead.launches_ahead == 0


def test_an_exception_out_of_a_step_leaves_a_hybrid_state_on_its_counters(hybrid_dir):  # noqa: F811
    """A hybrid target: an exception out of `step()` after a launched forward advanced the
    Gated-DeltaNet state (while a launched step's placeholders go out; reading back the step
    before, with this one launched) moves counters back or leaves them unmoved; the state
    is rebuilt to match them, so every request still gets the synchronous engine's tokens
    (before: their rows ran again on the advanced state; found in review)."""
    import pytest

    from metrale.engine import ahead, step_output

    def run(async_on: bool, where: str | None, prompts):
        llm = LLM(hybrid_dir, device="cpu", async_scheduling=async_on, page_size=4)
        engine, calls = llm.engine, [0]
        real_placeholder, real_settle = ahead.DeviceRow, step_output.StepOutput.settle

        def second() -> bool:
            calls[0] += 1
            return calls[0] == 2

        def placeholder(*args):
            if second():
                raise RuntimeError("injected")
            return real_placeholder(*args)

        def settle(self):
            if second():
                raise RuntimeError("injected")
            return real_settle(self)

        mp = pytest.MonkeyPatch()
        if where == "placeholder":
            mp.setattr(ahead, "DeviceRow", placeholder)
        elif where == "settle":
            mp.setattr(step_output.StepOutput, "settle", settle)
        try:
            for i, p in enumerate(prompts):
                engine.add_request(str(i), p, _greedy(8), final_only=True)
            outs, errors = _step_through(engine)
            got = {o.request_id: o.outputs[0].token_ids for o in outs}
        finally:
            mp.undo()
        assert engine.allocator.num_free == engine.allocator.num_usable
        return got, errors

    two = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [9, 10, 11]]
    for where, prompts in (("placeholder", two), ("settle", [*two, [40, 41, 42, 43, 44, 45]])):
        ref, _ = run(False, None, prompts)
        assert run(True, where, prompts) == (ref, 1)


def test_a_sequence_its_tokens_in_flight_end_by_length_is_not_scheduled_again(tiny_model_dir):
    """A sequence whose token in flight reaches its `max_tokens` (or the model length) ends when
    that token is committed, whatever it is: the asynchronous engine schedules it no more, so it
    runs the synchronous engine's forwards, outputs and pages (found in review: every closed
    batch ended with a step computed for nothing, whose page reservations evicted cached
    pages)."""
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]
    params = [_greedy(10), _greedy(4), SamplingParams(temperature=0.0, ignore_eos=True)]
    got = {}
    for async_on in (False, True):
        llm = LLM(tiny_model_dir, device="cpu", async_scheduling=async_on, max_model_len=20)
        engine, calls = llm.engine, [0]
        real = engine.runner.execute

        def execute(batch, real=real, calls=calls, **kw):
            calls[0] += 1
            return real(batch, **kw)

        engine.runner.execute = execute
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[async_on] = (
            calls[0],
            [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs],
        )
        assert engine.allocator.num_free == engine.allocator.num_usable
    assert got[True] == got[False]
    assert [len(ids) for ids, _ in got[True][1]] == [10, 4, 14]
