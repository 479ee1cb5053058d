"""Detokenizing off the step's critical path (`engine/emitter.py`): a sequence that ends on token
ids alone has its text made while the next step's forward runs, and its outputs show tokens and
text together one step later. The in-step path (a sequence with stop strings, which the text
ends) is the reference: the same tokens and the same text, plain and speculative; every
streamed output is consistent (its text and token ids are its deltas added up); an abort or the
end of a sequence leaves no token without its text."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams

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
    """Every drain but none runs inside the step's `execute` (between launching the forward and
    waiting for it), never on its own before or after; with async scheduling the steps that run
    synchronously (verify steps) too."""
    engine = llm.engine
    calls = {"inside": 0, "outside": 0}
    running = [False]
    execute, drain = engine.runner.execute, engine.emitter.drain

    def spy_execute(batch, **kw):
        running[0] = True
        try:
            return execute(batch, **kw)
        finally:
            running[0] = False

    def spy_drain():
        calls["inside" if running[0] else "outside"] += 1
        drain()

    engine.runner.execute, engine.emitter.drain = spy_execute, spy_drain
    try:
        llm.generate(PROMPTS, params(max_tokens=20), use_tqdm=False)
    finally:
        del engine.runner.execute, engine.emitter.drain
    assert calls["inside"] >= 5 and calls["outside"] == 0


def test_an_abort_leaves_no_token_without_its_text(llm):
    engine = llm.engine
    full = llm.generate([PROMPTS[0]], params(stop=[NEVER]), use_tqdm=False)[0].outputs[0]
    stream = llm.stream(PROMPTS[0], params())
    chunks = [next(stream) for _ in range(3)]
    request_id = chunks[0].request_id
    seq = engine.requests[request_id].seqs[0]
    assert engine.emitter.pending_tokens(seq) > 0  # the last step's text is still to be made
    out = engine.abort_request(request_id).outputs[0]
    stream.close()
    streamed = "".join(c.outputs[0].delta_text for c in chunks) + out.delta_text
    assert out.token_ids == seq.output_token_ids == full.token_ids[: len(out.token_ids)]
    assert out.text == streamed and full.text.startswith(out.text)
    assert len(out.token_ids) > len(chunks[-1].outputs[0].token_ids)
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
        llm = LLM(tiny_model_dir, device="cpu")
        stream = llm.stream(PROMPTS[0], params(max_tokens=5))
        first = next(stream)
        assert first.outputs[0].token_ids and not llm.engine.emitter.has_pending
        stream.close()
    finally:
        monkeypatch.undo()
        knobs.cache_clear()
