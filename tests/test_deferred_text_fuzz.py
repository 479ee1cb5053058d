"""Deferred text against the in-step path (METRALE_NO_DEFERRED_TEXT=1), on random workloads.

Random requests (n > 1, stop strings, logprobs, min_tokens, stop_token_ids, ignore_eos, small
max_model_len, structured regex), arriving at random steps, some aborted at random steps, on a
small KV pool (preemption) with and without n-gram speculation. Every streamed output is its
deltas added up, and every final output equals the in-step run's."""

from __future__ import annotations

import random

import pytest

from metrale import LLM, SamplingParams
from metrale.knobs import knobs


def _make_plan(seed: int):
    rng = random.Random(seed)
    plan = []
    for i in range(10):
        kw = dict(
            temperature=rng.choice([0.0, 0.8]),
            seed=rng.randrange(1000),
            max_tokens=rng.choice([1, 2, 5, 17, 40]),
            n=rng.choice([1, 1, 2, 3]),
        )
        if rng.random() < 0.3:
            kw["ignore_eos"] = True
        if rng.random() < 0.2:
            kw["stop"] = [rng.choice(["e", "a", "zzz-never"])]
        if rng.random() < 0.2:
            kw["logprobs"] = 1
        if rng.random() < 0.2:
            kw["min_tokens"] = min(kw["max_tokens"], rng.choice([1, 3]))
        if rng.random() < 0.3:
            kw["stop_token_ids"] = [rng.randrange(256)]
        if rng.random() < 0.1:
            kw["structured"] = {"regex": r"[0-9]{3}"}
            kw["n"] = 1
            kw.pop("min_tokens", None)
        prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 40))]
        arrive = rng.randrange(0, 12)
        abort = rng.randrange(arrive, arrive + 10) if rng.random() < 0.3 else None
        plan.append((f"r{i}", prompt, kw, arrive, abort))
    return plan


def _drive(llm, plan):
    engine = llm.engine
    streams: dict[str, list] = {}
    finals: dict[str, object] = {}
    step = 0
    while step < 500:
        for rid, prompt, kw, arrive, abort in plan:
            if arrive == step:
                engine.add_request(rid, prompt, SamplingParams(**kw))
                streams[rid] = []
            if abort == step and rid in engine.requests:
                out = engine.abort_request(rid)
                streams[rid].append(out)
                finals[rid] = out
        if not engine.has_unfinished_requests() and step > 12:
            break
        for out in engine.step():
            streams[out.request_id].append(out)
            if out.finished:
                finals[out.request_id] = out
        step += 1
    assert not engine.has_unfinished_requests()
    assert not engine.emitter.has_pending and not engine.emitter._drained
    return streams, finals


def _check_streams(streams):
    for rid, outs in streams.items():
        acc: dict[int, tuple[str, list[int]]] = {}
        for out in outs:
            for c in out.outputs:
                text, ids = acc.get(c.index, ("", []))
                text, ids = text + c.delta_text, ids + list(c.delta_token_ids)
                acc[c.index] = (text, ids)
                assert (c.text, list(c.token_ids)) == (text, ids), (rid, c.index, out)
                if c.logprobs is not None:
                    assert len(c.logprobs) == len(c.token_ids)
        assert outs[-1].finished, rid
        assert sum(o.finished for o in outs) == 1, rid


def _summary(finals):
    return {
        rid: [(c.text, list(c.token_ids), c.finish_reason, c.stop_reason) for c in out.outputs]
        for rid, out in finals.items()
    }


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_drafts": 3}])
@pytest.mark.parametrize("seed", range(12))
def test_deferred_text_equals_in_step_on_random_workloads(tiny_model_dir, monkeypatch, spec, seed):
    plan = _make_plan(seed)
    opts = dict(
        device="cpu",
        spec=spec,
        num_kv_pages=12,
        page_size=4,
        max_model_len=64,
        max_num_seqs=6,
        max_num_batched_tokens=32,
    )
    llm = LLM(tiny_model_dir, **opts)
    streams, finals = _drive(llm, plan)
    _check_streams(streams)
    monkeypatch.setenv("METRALE_NO_DEFERRED_TEXT", "1")
    knobs.cache_clear()
    try:
        ref = LLM(tiny_model_dir, **opts)
        ref_streams, ref_finals = _drive(ref, plan)
    finally:
        monkeypatch.undo()
        knobs.cache_clear()
    _check_streams(ref_streams)
    a, b = _summary(finals), _summary(ref_finals)
    for rid in a:
        aborted = next(p[4] for p in plan if p[0] == rid) is not None
        if aborted:
            continue  # abort timing vs a request that finished may differ
        assert a[rid] == b[rid], rid
