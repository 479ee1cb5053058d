"""An engine failure while serving one sequence, outside its forward (its detokenizer, its
grammar, its prefix-cache look-up, its admission), ends that sequence alone with finish_reason
"error" and a message naming what failed (the prefix cache failing to take its pages costs the
cache those pages, and the sequence nothing); nothing escapes `step` (which failed every request of
the call, or, raised each step, stopped the engine), the other requests give a fresh engine's
output, the pool ends idle and the engine's counts come back to zero (found by a review that
injected failures one component at a time). Synchronous and asynchronous, plain and with n-gram
speculation."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams
from metrale.structured.grammar import SequenceGrammar

PROMPTS = [[(5 * i + 3 * j) % 200 + 3 for j in range(6 + i)] for i in range(4)]
VICTIM = 0


def boom(*args, **kwargs):
    raise RuntimeError("injected")


def params(structured: bool = False, stop: bool = False) -> list[SamplingParams]:
    out = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True) for _ in PROMPTS]
    if structured:
        out[VICTIM] = SamplingParams(
            temperature=0.0, max_tokens=10, structured={"regex": "[a-z]{3,40}"}
        )
    if stop:
        out[VICTIM] = SamplingParams(temperature=0.0, max_tokens=10, stop=["\x00never"])
    return out


def victim_only(seq) -> bool:
    return seq.request_id.endswith(f"-{VICTIM}") or seq.request_id == str(VICTIM)


def inject(llm, where: str, monkeypatch) -> None:
    engine = llm.engine
    if where in ("detokenizer", "detokenizer-stop"):
        real = engine.add_request

        def add_request(request_id, prompt, p=None, final_only=False):
            real(request_id, prompt, p, final_only)
            if victim_only(engine.requests[request_id].seqs[0]):
                for seq in engine.requests[request_id].seqs:
                    seq.detokenizer.push = seq.detokenizer.push_each = boom

        monkeypatch.setattr(engine, "add_request", add_request)
    elif where in ("grammar-advance", "grammar-forced"):
        name = "advance" if where == "grammar-advance" else "forced"
        real = getattr(SequenceGrammar, name)

        def failing(self, *args):
            if self is victim_grammar[0]:
                raise RuntimeError("injected")
            return real(self, *args)

        victim_grammar = [None]
        matcher = engine.grammars.matcher

        def made(spec):
            victim_grammar[0] = matcher(spec)
            return victim_grammar[0]

        monkeypatch.setattr(engine.grammars, "matcher", made)
        monkeypatch.setattr(SequenceGrammar, name, failing)
    elif where in ("cache-match", "cache-commit"):
        cache = engine.allocator.cache
        real = getattr(cache, where.split("-")[1])

        def failing(seq, *args):
            if victim_only(seq):
                raise RuntimeError("injected")
            return real(seq, *args)

        monkeypatch.setattr(cache, where.split("-")[1], failing)
    elif where == "admission":
        allocator = engine.allocator
        real = allocator.reserve

        def reserve(seq, rows):
            if victim_only(seq) and not seq.block_table:
                raise MemoryError("injected")
            return real(seq, rows)

        monkeypatch.setattr(allocator, "reserve", reserve)


@pytest.mark.parametrize(
    "where",
    [
        "detokenizer",
        "detokenizer-stop",
        "grammar-advance",
        "grammar-forced",
        "cache-match",
        "cache-commit",
        "admission",
    ],
)
@pytest.mark.parametrize("spec", [None, "ngram"])
@pytest.mark.parametrize("async_on", [True, False])
def test_one_sequence_s_failure_ends_it_alone(tiny_model_dir, monkeypatch, where, spec, async_on):
    if where == "grammar-forced" and spec is None:
        pytest.skip("forced tokens are asked for drafting alone")
    kw = dict(device="cpu", async_scheduling=async_on, page_size=4)
    if spec is not None:
        kw["spec"] = {"method": spec, "num_drafts": 2, "dcut": False}
    each = params(structured=where.startswith("grammar"), stop=where == "detokenizer-stop")
    want = LLM(tiny_model_dir, **kw).generate(PROMPTS, each, use_tqdm=False)
    llm = LLM(tiny_model_dir, **kw)
    inject(llm, where, monkeypatch)
    got = llm.generate(PROMPTS, each, use_tqdm=False)  # nothing escapes a step
    bad = got[VICTIM].outputs[0]
    if where == "cache-commit":  # it costs the cache its pages, never its output
        assert bad.token_ids == want[VICTIM].outputs[0].token_ids and bad.error is None
    else:
        assert bad.finish_reason == "error" and "injected" in bad.error, (bad.finish_reason, bad)
    for i, (out, ref) in enumerate(zip(got, want, strict=True)):
        if i != VICTIM:
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
            assert out.outputs[0].finish_reason == ref.outputs[0].finish_reason
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.allocator.num_free == engine.allocator.num_usable
    assert engine.sync_seqs == 0 and engine.runner.structured_seqs == 0
    monkeypatch.undo()
    again = llm.generate(PROMPTS, params(), use_tqdm=False)
    fresh = LLM(tiny_model_dir, **kw).generate(PROMPTS, params(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in fresh]


@pytest.mark.parametrize("where", ["detokenizer", "detokenizer-stop", "grammar-advance"])
@pytest.mark.parametrize("async_on", [True, False])
@pytest.mark.parametrize("fail_at", [1, 3])
def test_the_streamed_deltas_of_a_failed_sequence_add_up(
    tiny_model_dir, monkeypatch, where, async_on, fail_at
):
    """A failure partway through an emission (its `fail_at`-th call) loses none of the tokens
    it recorded from the stream: the deltas add up to the final token ids and text (found in
    review: the tokens recorded before the raise were in the final output and in no delta)."""
    llm = LLM(tiny_model_dir, device="cpu", async_scheduling=async_on, page_size=4)
    engine = llm.engine
    each = params(structured=where.startswith("grammar"), stop=where == "detokenizer-stop")
    for i, (prompt, p) in enumerate(zip(PROMPTS, each, strict=True)):
        engine.add_request(f"req-{i}", prompt, p)
    victim = engine.requests[f"req-{VICTIM}"].seqs[0]
    calls = [0]
    if where.startswith("detokenizer"):
        detokenizer = victim.detokenizer
        real_push, real_each = detokenizer.push, detokenizer.push_each

        def failing(real):
            def call(*args):
                calls[0] += 1
                if calls[0] >= fail_at:
                    raise RuntimeError("injected")
                return real(*args)

            return call

        detokenizer.push, detokenizer.push_each = failing(real_push), failing(real_each)
    else:
        real = SequenceGrammar.advance

        def advance(self, tokens):
            if self is victim.grammar:
                calls[0] += 1
                if calls[0] >= fail_at:
                    raise RuntimeError("injected")
            return real(self, tokens)

        monkeypatch.setattr(SequenceGrammar, "advance", advance)
    summed: dict[str, tuple[list[int], str]] = {}
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids, text = summed.get(out.request_id, ([], ""))
            one = out.outputs[0]
            summed[out.request_id] = (ids + one.delta_token_ids, text + one.delta_text)
            last[out.request_id] = one
    bad = last[f"req-{VICTIM}"]
    assert bad.finish_reason == "error" and "injected" in bad.error
    for rid, one in last.items():
        ids, text = summed[rid]
        assert ids == list(one.token_ids), rid
        assert text == one.text, rid


@pytest.mark.parametrize("deferred", [True, False])
def test_a_detokenizer_failing_at_the_end_fails_its_sequence(tiny_model_dir, knob_env, deferred):
    """The detokenizer's tail raising as a sequence ends: that sequence ends in error, on the
    deferred-text path as on the in-step one (review), its ids all in its deltas."""
    if not deferred:
        knob_env(METRALE_NO_DEFERRED_TEXT="1")
    engine = LLM(tiny_model_dir, device="cpu").engine
    engine.add_request("a", [5, 17, 30, 42], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request("b", [7, 8, 9], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.requests["a"].seqs[0].detokenizer.flush = boom
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    final = {o.request_id: o.outputs[0] for o in outs if o.finished}
    assert final["a"].finish_reason == "error" and "injected" in final["a"].error
    assert final["b"].finish_reason == "length"
    ids = [t for o in outs if o.request_id == "a" for t in o.outputs[0].delta_token_ids]
    assert ids == list(final["a"].token_ids) and len(ids) == 5


@pytest.mark.parametrize("async_on", [True, False])
def test_a_detokenizer_failing_inside_a_verify_keeps_a_logprob_a_token(varied_dir, async_on):
    """The victim's detokenizer raises on a verify's tokens (pushed whole, `_emit_whole`), with
    logprobs asked for: it ends with an error, showing those tokens with their logprob entries
    (found in review: the tokens without them), and the others are unaffected."""
    llm = LLM(
        varied_dir,
        device="cpu",
        spec={"method": "ngram", "num_drafts": 3},
        async_scheduling=async_on,
    )
    engine, real = llm.engine, llm.engine.add_request
    pushed = [0]

    def push_each(ids, push=None):
        pushed[0] += 1
        if len(ids) >= 2 and pushed[0] > 3:  # a verify's tokens, after a few steps
            raise RuntimeError("injected")
        return push(ids)

    def add_request(request_id, prompt, p=None, final_only=False):
        real(request_id, prompt, p, final_only)
        seq = engine.requests[request_id].seqs[0]
        if victim_only(seq):
            seq.detokenizer.push_each = lambda ids, push=seq.detokenizer.push_each: push_each(
                ids, push
            )

    engine.add_request = add_request
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    victim, other = outs[0].outputs[0], outs[1].outputs[0]
    assert victim.finish_reason == "error" and pushed[0] > 3
    assert len(victim.logprobs) == len(victim.token_ids)
    ref = LLM(varied_dir, device="cpu").generate(prompts, sp, use_tqdm=False)
    assert victim.token_ids == ref[0].outputs[0].token_ids[: len(victim.token_ids)]
    assert (other.token_ids, other.text) == (ref[1].outputs[0].token_ids, ref[1].outputs[0].text)


@pytest.fixture(scope="module")
def varied_dir(hf_qwen3_factory):
    return hf_qwen3_factory("varied", initializer_range=0.2)  # its outputs repeat at times
