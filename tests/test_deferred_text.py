"""Detokenizing off the step's critical path (`engine/emitter.py`): a sequence that ends on token
ids alone has its text made while the next step's forward runs, and its outputs show tokens and
text together one step later. The in-step path (a sequence with stop strings, which the text
ends) is the reference: the same tokens and the same text, plain and speculative; every
streamed output is consistent (its text and token ids are its deltas added up); an abort or the
end of a sequence leaves no token without its text."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams
from metrale.engine.held_verify import HeldTokens

PROMPTS = [[10, 200, 31, 77, 401, 5, 6, 7], [3, 4, 5, 3, 4, 5, 3, 4], [99, 12, 7]]
NEVER = "never-appears-xyz"  # a stop string: the sequence is detokenized in the step


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 40, "ignore_eos": True, **kw})


@pytest.fixture(scope="module", params=["plain", "ngram", "plain-async", "ngram-async"])
def llm(request, tiny_model_dir):
    spec = {"method": "ngram", "num_drafts": 3} if request.param.startswith("ngram") else None
    return LLM(
        tiny_model_dir, device="cpu", spec=spec, async_scheduling=request.param.endswith("async")
    )


def _texts(outputs):
    return [
        (o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs
    ]


@pytest.mark.parametrize("extra", [{}, {"seed": 7, "temperature": 0.8}, {"max_tokens": 1}])
def test_deferred_text_equals_the_in_step_text(llm, extra):
    deferred = llm.generate(PROMPTS, params(**extra), use_tqdm=False)
    in_step = llm.generate(PROMPTS, params(stop=[NEVER], **extra), use_tqdm=False)
    assert _texts(deferred) == _texts(in_step)
    assert all(text for text, _, _ in _texts(deferred)) or extra.get("max_tokens") == 1


def test_every_streamed_output_is_its_deltas_added_up(llm):
    chunks = list(llm.stream(PROMPTS[0], params()))
    reference = llm.generate([PROMPTS[0]], params(stop=[NEVER]), use_tqdm=False)[0].outputs[0]
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    text, ids = "", []
    for chunk in chunks:
        out = chunk.outputs[0]
        text += out.delta_text
        ids += out.delta_token_ids
        assert (out.text, out.token_ids) == (text, ids)
    assert (text, ids) == (reference.text, reference.token_ids)


def test_the_text_is_made_while_the_next_forward_runs(llm):
    """Every drain runs while a forward is on the device: inside the step's `execute` (between
    launching the forward and waiting for it) or, with async scheduling, before waiting for a
    step launched ahead (`_settle`), never on its own before or after; with async scheduling
    the steps that run synchronously (verify steps) too."""
    drains_while_a_forward_runs(llm, [PROMPTS], params(max_tokens=20))


def test_a_verify_after_steps_run_ahead_makes_the_text_while_a_forward_runs(hf_qwen3_factory):
    """One request at a time on a model whose outputs repeat at times: verify steps follow
    several plain steps run ahead, whose text the settle makes before waiting (found by
    review: the commit made it after the wait)."""
    model = hf_qwen3_factory("varied", initializer_range=0.2)
    spec = {"method": "ngram", "num_drafts": 3}
    llm = LLM(model, device="cpu", spec=spec, async_scheduling=True)
    drains_while_a_forward_runs(llm, [[p] for p in PROMPTS], params(max_tokens=96))
    assert llm.engine.telemetry.spec.verify_steps > 5


def drains_while_a_forward_runs(llm, batches, sampling) -> None:
    """Counts the drains made while a forward runs (in `execute`, or in `_settle` before it
    waits for its step) and the others, which must be none."""
    from metrale.engine.step_output import StepOutput

    engine = llm.engine
    calls = {"inside": 0, "outside": 0}
    running = [False]
    spied = [(engine.runner, "execute"), (engine.emitter, "drain")]
    if engine._ahead is not None:
        spied.append((engine._ahead, "_settle"))
    wait = StepOutput.settle

    def waits(out):  # the step is done after this: its commit's drain would be on its own
        if out.pending is not None:  # (a held verify's verdicts were read already: no wait)
            running[0] = False
        return wait(out)

    def while_running(fn):
        # (nested: a held verify's `_settle` runs inside the next step's `execute`)
        def spy(*args, **kw):
            before, running[0] = running[0], True
            try:
                return fn(*args, **kw)
            finally:
                running[0] = before

        return spy

    def spy_drain(drain=engine.emitter.drain):
        calls["inside" if running[0] else "outside"] += 1
        drain()

    engine.runner.execute = while_running(engine.runner.execute)
    engine.emitter.drain = spy_drain
    if engine._ahead is not None:
        engine._ahead._settle = while_running(engine._ahead._settle)
    StepOutput.settle = waits
    try:
        for prompts in batches:
            llm.generate(prompts, sampling, use_tqdm=False)
    finally:
        StepOutput.settle = wait
        for obj, name in spied:
            delattr(obj, name)
    assert calls["inside"] >= 5 and calls["outside"] == 0


def test_an_abort_leaves_no_token_without_its_text(llm):
    engine = llm.engine
    full = llm.generate([PROMPTS[0]], params(stop=[NEVER]), use_tqdm=False)[0].outputs[0]
    stream = llm.stream(PROMPTS[0], params())
    chunks = [next(stream) for _ in range(3)]
    request_id = chunks[0].request_id
    seq = engine.requests[request_id].seqs[0]
    # the last step's text is still to be made, or (a held verify, `engine/held_verify.py`) its
    # tokens are still to be emitted: the abort drops those, as a step not yet committed
    held = isinstance(seq.inflight, HeldTokens)
    assert engine.emitter.pending_tokens(seq) > 0 or held
    out = engine.abort_request(request_id).outputs[0]
    stream.close()
    streamed = "".join(c.outputs[0].delta_text for c in chunks) + out.delta_text
    assert out.token_ids == seq.output_token_ids == full.token_ids[: len(out.token_ids)]
    assert out.text == streamed and full.text.startswith(out.text)
    assert len(out.token_ids) > len(chunks[-1].outputs[0].token_ids) or held
    assert not engine.emitter.has_pending and not engine.has_unfinished_requests()


def test_logprobs_and_stop_strings_are_detokenized_in_the_step(llm):
    engine = llm.engine
    for extra in ({"logprobs": 1}, {"stop": [NEVER]}):
        stream = llm.stream(PROMPTS[1], params(max_tokens=6, **extra))
        for chunk in stream:
            out = chunk.outputs[0]
            seq = engine.requests[chunk.request_id].seqs[0] if not chunk.finished else None
            assert seq is None or engine.emitter.pending_tokens(seq) == 0
            assert out.token_ids and (
                out.logprobs is None or len(out.logprobs) == len(out.token_ids)
            )


def test_the_ab_knob_detokenizes_in_the_step(tiny_model_dir, monkeypatch):
    from metrale.knobs import knobs

    monkeypatch.setenv("METRALE_NO_DEFERRED_TEXT", "1")
    knobs.cache_clear()
    try:
        llm = LLM(tiny_model_dir, device="cpu", async_scheduling=False)
        stream = llm.stream(PROMPTS[0], params(max_tokens=5))
        first = next(stream)
        assert first.outputs[0].token_ids and not llm.engine.emitter.has_pending
        stream.close()
    finally:
        monkeypatch.undo()
        knobs.cache_clear()
