"""What a request gets back: stop token ids, stop strings, min_tokens, streaming deltas, and
logprobs equal to log_softmax of transformers' logits for the same tokens."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams

PROMPT = [10, 200, 31, 77, 401, 5, 6, 7]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, device="cpu")


@pytest.fixture(scope="module")
def reference(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 40, "ignore_eos": True, **kw})


def test_stop_token_id_ends_the_output(llm, reference):
    ref = reference.token_ids
    tok = ref[7]
    first = ref.index(tok)
    out = llm.generate([PROMPT], greedy(stop_token_ids=[tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", tok)


def test_min_tokens_bans_stop_tokens_until_reached(llm, reference):
    ref = reference.token_ids
    tok = ref[3]
    first = ref.index(tok)
    min_tokens = first + 5
    sp = greedy(stop_token_ids=[tok], min_tokens=min_tokens)
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
    assert tok not in out.token_ids[:min_tokens]
    assert len(out.token_ids) >= min_tokens
    assert out.token_ids[:first] == ref[:first]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_text(llm, reference, include):
    text = reference.text
    # a 3-character stop string taken from the middle of the reference text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    idx = text.index(stop)
    sp = greedy(stop=[stop, "never-appears-xyz"], include_stop_str_in_output=include)
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
    assert out.text == text[: idx + (len(stop) if include else 0)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < len(reference.token_ids)


def _released(pieces: list[str], stops: list[str], min_tokens: int):
    """Drive `check_stop` over tokens whose texts are `pieces`, as the emitter does: (text
    released, finish reason, stop reason, tokens emitted)."""
    from types import SimpleNamespace

    from metrale.engine.stop import check_stop

    params = SamplingParams(stop=stops, min_tokens=min_tokens, max_tokens=len(pieces))
    seq = SimpleNamespace(
        params=params, pending_text="", output_token_ids=[], error=None, grammar=None,
        eos_token_ids=(), num_tokens=0, detokenizer=SimpleNamespace(flush=lambda: ""),
    )  # fmt: skip
    text = ""
    for i, piece in enumerate(pieces):
        seq.output_token_ids.append(1000 + i)
        seq.num_tokens += 1
        reason, stop_reason, released = check_stop(seq, piece, 10_000)
        text += released
        if reason is not None:
            return text, reason, stop_reason, i + 1
    return text, None, None, len(pieces)


def test_a_stop_string_before_min_tokens_never_counts():
    """A stop string the text completed before `min_tokens` does not end the output later,
    whatever other stop strings are asked for (a longer one kept it in the held-back text, and
    the first search after `min_tokens` found it there: found in review); one completed by a
    token after the first `min_tokens` does, even if it began before (as vLLM's detokenizer:
    a token within the first `min_tokens` never ends the output, by text or by id)."""
    pieces = ["\n   ", ' """', "\n   ", " Fib", "onacci", ' """', "\n", " x"]
    for extra in ([], ["ZZZZZZZZZZ"], ["ZZ"]):
        assert _released(pieces, ['"""', *extra], 3) == (
            '\n    """\n    Fibonacci ',
            "stop",
            '"""',
            6,
        )
    # begun within the first min_tokens tokens, completed after them: it counts
    assert _released(["a", '"', '""', "b"], ['"""', "ZZZZZZZZ"], 2)[1:] == ("stop", '"""', 3)
    assert _released(["a", '"', '""', "b"], ['"""'], 3) == ('a"""b', "length", None, 4)
    assert _released(["\n", "hi", "\n", "x"], ["\n"], 1) == ("\nhi", "stop", "\n", 3)


def test_stream_deltas_add_up_to_generate(llm, reference):
    sp = greedy(stop=["never-appears-xyz"])
    chunks = list(llm.stream(PROMPT, sp))
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert "".join(c.outputs[0].delta_text for c in chunks) == reference.text
    assert [t for c in chunks for t in c.outputs[0].delta_token_ids] == reference.token_ids
    assert chunks[-1].outputs[0].text == reference.text


def test_streams_and_generate_share_the_engine(llm):
    """Two open streams stepped in turn, and a `generate` while a stream is open: every
    stream's deltas add up to its output, each ends, and each gives what it gives alone (a
    caller's step used to drop the other requests' outputs; a stream whose last output was
    dropped then stepped an idle engine forever)."""
    prompts = [PROMPT, [5, 6, 7, 8, 9], [300, 301, 302]]
    alone = [o.outputs[0] for o in llm.generate(prompts, greedy(max_tokens=9), use_tqdm=False)]

    def joined(chunks):
        assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
        out = chunks[-1].outputs[0]
        assert "".join(c.outputs[0].delta_text for c in chunks) == out.text
        assert [t for c in chunks for t in c.outputs[0].delta_token_ids] == out.token_ids
        return out.token_ids

    streams = [llm.stream(p, greedy(max_tokens=9)) for p in prompts[:2]]
    chunks: list[list] = [[], []]
    live = [0, 1]
    while live:
        for i in list(live):
            out = next(streams[i], None)
            if out is None:
                live.remove(i)
            else:
                chunks[i].append(out)
    assert [joined(c) for c in chunks] == [a.token_ids for a in alone[:2]]
    stream = llm.stream(prompts[0], greedy(max_tokens=9))
    first = [next(stream)]
    gen = llm.generate(prompts[1:], greedy(max_tokens=9), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in gen] == [a.token_ids for a in alone[1:]]
    assert joined(first + list(stream)) == alone[0].token_ids
    assert not llm.engine.has_unfinished_requests() and not llm._outbox and not llm._set_aside


@pytest.mark.parametrize("speculative", [False, True])
def test_final_only_requests_return_one_whole_output(tiny_model_dir, speculative):
    """`add_request(final_only=True)` (what `generate` queues): `step` returns nothing for it
    until it ends, then one output whose text and token ids (and deltas) are the whole of what
    a streamed request with the same params adds up to; n > 1, stop strings and logprobs too.
    Streamed requests beside it still get an output every step."""
    kw = dict(spec={"method": "ngram", "num_drafts": 3}) if speculative else {}
    engine = LLM(tiny_model_dir, device="cpu", **kw).engine
    cases = [
        greedy(),
        SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=30),
        greedy(logprobs=2, max_tokens=20),
        greedy(stop=["a"], max_tokens=30),
    ]
    for i, params in enumerate(cases):
        engine.add_request(f"s{i}", PROMPT, params)
        engine.add_request(f"f{i}", PROMPT, params, final_only=True)
    got: dict[str, list] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out)
    for i in range(len(cases)):
        streamed, final = got[f"s{i}"], got[f"f{i}"]
        assert len(final) == 1 and final[0].finished and len(streamed) > 1
        for a, b in zip(streamed[-1].outputs, final[0].outputs, strict=True):
            assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
            assert a.logprobs == b.logprobs
            assert b.delta_text == b.text and b.delta_token_ids == b.token_ids
        deltas = ["".join(o.outputs[0].delta_text for o in streamed)]
        assert deltas == [final[0].outputs[0].text]
    assert steps > 10
    # aborted part-way, its one output is whole too
    engine.add_request("a", PROMPT, greedy(max_tokens=30), final_only=True)
    assert not any(o.request_id == "a" for _ in range(6) for o in engine.step())
    out = engine.abort_request("a").outputs[0]
    assert out.finish_reason == "abort" and len(out.token_ids) >= 5
    assert (out.delta_text, out.delta_token_ids) == (out.text, out.token_ids)


def test_closing_a_stream_aborts_and_frees_pages(llm):
    engine = llm.engine
    stream = llm.stream(PROMPT, greedy(max_tokens=30))
    for _ in range(3):
        next(stream)
    stream.close()
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.allocator.num_free == engine.allocator.num_usable


def test_logprobs_equal_log_softmax_of_transformers_logits(llm, tiny_model_dir):
    transformers = pytest.importorskip("transformers")
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=12, logprobs=5, repetition_penalty=1.3)
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + out.token_ids])).logits[0].float()
    # raw log_softmax at the position that predicted each emitted token
    ref = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)
    assert len(out.logprobs) == len(out.token_ids) == 12
    total = 0.0
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert next(iter(entry)) == tok  # the emitted token comes first
        assert entry[tok].logprob == pytest.approx(ref[i, tok].item(), abs=1e-4)
        assert entry[tok].rank == int((ref[i] > ref[i, tok]).sum()) + 1
        by_rank = {lp.rank: (t, lp.logprob) for t, lp in entry.items() if lp.rank <= 5}
        top = torch.topk(ref[i], 5)
        assert sorted(by_rank) == [1, 2, 3, 4, 5]
        for rank, (ref_t, ref_lp) in enumerate(zip(top.indices, top.values, strict=True), 1):
            assert by_rank[rank][0] == ref_t.item()
            assert by_rank[rank][1] == pytest.approx(ref_lp.item(), abs=1e-4)
        total += entry[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_a_stop_tokens_text_is_left_out_unless_asked_for(tiny_model_dir):
    """As vLLM: the token that stops a sequence (a stop_token_ids hit, EOS) stays in its token
    ids but adds no text, unless include_stop_str_in_output; an EOS that does not stop
    (ignore_eos) is text like any token (with skip_special_tokens off, its text shows)."""
    from metrale import LLM, SamplingParams

    llm = LLM(tiny_model_dir, device="cpu", max_model_len=64)
    tok, prompt = llm.tokenizer, [[5, 9, 2, 7, 5, 9]]
    base = dict(temperature=0.0, max_tokens=12)
    ids = llm.generate(prompt, SamplingParams(**base), use_tqdm=False)[0].outputs[0].token_ids
    stop = ids[3]
    for include in (False, True):
        params = SamplingParams(**base, stop_token_ids=[stop], include_stop_str_in_output=include)
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        end = ids.index(stop) + 1
        assert out.token_ids == ids[:end] and out.stop_reason == stop
        assert out.text == tok.decode(ids[: end if include else end - 1])
    eos = llm.engine.eos_token_ids[0]
    forced = dict(temperature=0.0, logit_bias={eos: 100.0}, skip_special_tokens=False)
    eos_text = tok.decode([eos], skip_special_tokens=False)
    assert eos_text
    out = llm.generate(prompt, SamplingParams(**forced, min_tokens=2), use_tqdm=False)[0]
    out = out.outputs[0]
    assert out.token_ids[-1] == eos and out.finish_reason == "stop"
    assert out.text == tok.decode(out.token_ids[:-1], skip_special_tokens=False)
    kept = SamplingParams(**forced, min_tokens=2, include_stop_str_in_output=True)
    assert llm.generate(prompt, kept, use_tqdm=False)[0].outputs[0].text.endswith(eos_text)
    ignored = SamplingParams(**forced, ignore_eos=True, max_tokens=3)
    assert llm.generate(prompt, ignored, use_tqdm=False)[0].outputs[0].text == eos_text * 3
