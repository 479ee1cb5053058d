"""Deferred text when a step's forward fails (isolation.run_batch re-runs each sequence alone)
and when making the deferred text itself raises inside `execute`."""

from __future__ import annotations

from metrale import LLM, SamplingParams

PROMPTS = [[10, 200, 31, 77, 401, 5, 6, 7], [3, 4, 5, 3, 4, 5, 3, 4], [99, 12, 7]]


def _params(**kw):
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, **kw})


def _drive(llm, prompts, params, hook=None):
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    streams = {f"r{i}": [] for i in range(len(prompts))}
    step = 0
    while engine.has_unfinished_requests():
        if hook:
            hook(engine, step)
        try:
            outs = engine.step()
        except Exception as e:  # noqa: BLE001 (the server's loop: log and go on)
            streams.setdefault("_errors", []).append(repr(e))
            outs = []
        for out in outs:
            streams[out.request_id].append(out)
        step += 1
    return streams


def _consistent(outs):
    text, ids = "", []
    for out in outs:
        c = out.outputs[0]
        text, ids = text + c.delta_text, ids + list(c.delta_token_ids)
        assert (c.text, list(c.token_ids)) == (text, ids)
    return text, ids


def test_a_failed_forward_keeps_every_deferred_text(tiny_model_dir):
    ref = LLM(tiny_model_dir, device="cpu").generate(
        PROMPTS, _params(stop=["zz-never"]), use_tqdm=False
    )
    llm = LLM(tiny_model_dir, device="cpu")
    runner = llm.engine.runner
    real = runner._forward
    calls = {"n": 0}

    def forward(batch, *a, **kw):
        if any(e.seq.request_id == "r2" for e in batch.entries) and e_ok(batch):
            calls["n"] += 1
            raise RuntimeError("boom")
        return real(batch, *a, **kw)

    def e_ok(batch):  # fail r2 from its fourth decode step on
        return any(
            len(e.seq.output_token_ids) >= 4 for e in batch.entries if e.seq.request_id == "r2"
        )

    runner._forward = forward
    streams = _drive(llm, PROMPTS, _params())
    assert calls["n"] >= 2
    for i in range(2):
        text, ids = _consistent(streams[f"r{i}"])
        assert (text, ids) == (ref[i].outputs[0].text, ref[i].outputs[0].token_ids)
    text, ids = _consistent(streams["r2"])
    assert streams["r2"][-1].outputs[0].finish_reason == "error"
    assert ids == ref[2].outputs[0].token_ids[: len(ids)] and len(ids) >= 4


def test_a_detokenizer_failure_ends_only_its_sequence(tiny_model_dir):
    """If making one sequence's deferred text raises, that sequence ends with an error (its
    detokenizer's state is unknown) and its tokens stay shown; it is not taken for a failed
    forward (no batch re-run one sequence at a time), and every other text is whole, made once."""
    ref = LLM(tiny_model_dir, device="cpu").generate(
        PROMPTS, _params(stop=["zz-never"]), use_tqdm=False
    )
    llm = LLM(tiny_model_dir, device="cpu")
    engine = llm.engine
    executes = {"n": 0}
    real_execute = engine.runner.execute

    def execute(batch, **kw):
        executes["n"] += 1
        return real_execute(batch, **kw)

    engine.runner.execute = execute
    armed = {"done": False}

    def hook(engine, step):
        if step == 4 and not armed["done"]:
            seq = engine.requests["r1"].seqs[0]
            real_push = seq.detokenizer.push

            def push(ids):
                if not armed["done"]:
                    armed["done"] = True
                    raise RuntimeError("detokenizer hiccup")
                return real_push(ids)

            seq.detokenizer.push = push

    streams = _drive(llm, PROMPTS, _params(), hook)
    assert armed["done"] and "_errors" not in streams
    for i in (0, 2):
        assert _consistent(streams[f"r{i}"]) == (
            ref[i].outputs[0].text,
            ref[i].outputs[0].token_ids,
        )
    failed = streams["r1"][-1].outputs[0]
    assert failed.finish_reason == "error" and "detokenizer" in failed.error
    assert not failed.error_by_request
    assert failed.token_ids == ref[1].outputs[0].token_ids[: len(failed.token_ids)]
    assert executes["n"] <= 14, executes["n"]  # one execute a step: no isolation re-runs
