"""With deferred text a token's time-to-first-token and inter-token observations are made
when the step returns it to the caller, not when it was sampled: the metrics measure what a
client sees."""

from __future__ import annotations

from metrale import LLM, SamplingParams


def test_ttft_is_observed_when_the_first_token_is_returned(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu")
    engine = llm.engine
    engine.add_request(
        "a", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    outs = engine.step()  # the prefill step samples the first token
    returned = sum(len(c.token_ids) for o in outs for c in o.outputs)
    observed = (
        engine.telemetry.request.ttft.count
        if hasattr(engine.telemetry.request.ttft, "count")
        else None
    )
    seq_first = engine.requests["a"].seqs[0].first_token_time
    assert not (seq_first is not None and returned == 0), (
        f"TTFT recorded (observed={observed}) but the step returned {returned} tokens"
    )
