"""`Emitter._emit_whole`: a verify's several tokens pushed to the detokenizer at once and searched
for stop strings once gives exactly what emitting them one at a time gives (text released, text
held back, token ids, finish and stop reasons), or steps aside for the token-by-token path (a
stop string or a token that ends the sequence among them): random streams of the shipped model's
tokens in random chunks, with stop strings cut from their own text, min_tokens, EOS,
include_stop_str_in_output and logprobs."""

from __future__ import annotations

import random

import pytest

from metrale import SamplingParams
from metrale.default_model import default_model_dir
from metrale.engine.emitter import Emitter
from metrale.engine.sequence import Sequence
from metrale.engine.step_output import SampledToken
from metrale.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer.from_dir(default_model_dir())
    assert tok.byte_level
    return tok


def _seq(tokenizer, params: SamplingParams, prompt: list[int]) -> Sequence:
    seq = Sequence(
        seq_id=0,
        request_id="0",
        prompt_token_ids=prompt,
        params=params,
        seed=0,
        eos_token_ids=(7,),
        arrival=0,
    )
    stops = () if params.include_stop_str_in_output else (*params.stop_token_ids, 7)
    seq.detokenizer = IncrementalDetokenizer(tokenizer, prompt, stop_token_ids=stops)
    return seq


def _state(seq: Sequence) -> tuple:
    return (
        list(seq.output_token_ids),
        seq.text,
        seq.pending_text,
        seq.finish_reason,
        seq.stop_reason,
        [[(t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()] for e in seq.logprobs],
        seq.cumulative_logprob,
    )


def _tokens(seq: Sequence, chunk: list[int], rng: random.Random, logprobs: bool) -> list:
    if not logprobs:
        return [SampledToken(seq, t) for t in chunk]
    return [
        SampledToken(seq, t, -rng.random(), 1 + (t % 3), [(t + 1, -0.5), (t + 2, float("-inf"))])
        for t in chunk
    ]


@pytest.mark.parametrize("trial", range(40))
def test_a_verifys_tokens_at_once_give_the_token_by_token_result(tokenizer, trial, monkeypatch):
    rng = random.Random(trial)
    vocab = tokenizer.vocab_size
    # tokens of text-like ids, now and then an EOS (7) or a stop token id (9)
    stream = [rng.randrange(100, min(vocab, 5000)) for _ in range(60)]
    for _ in range(rng.randint(0, 2)):
        stream[rng.randrange(len(stream))] = rng.choice([7, 9])
    text = tokenizer.decode(stream)
    stops = []
    for _ in range(rng.randint(0, 3)):  # pieces of the text itself, so that some are met
        at = rng.randrange(max(len(text) - 4, 1))
        stops.append(text[at : at + rng.randint(1, 4)] or "x")
    if rng.random() < 0.2:
        stops = ["never-in-the-text-\x00"]
    params = SamplingParams(
        max_tokens=rng.randint(5, 60),
        stop=stops,
        stop_token_ids=[9] if rng.random() < 0.5 else [],
        ignore_eos=rng.random() < 0.3,
        min_tokens=rng.randint(0, 8),
        include_stop_str_in_output=rng.random() < 0.3,
        logprobs=2 if rng.random() < 0.4 else None,
    )
    prompt = [rng.randrange(100, 5000) for _ in range(4)]
    whole, each = _seq(tokenizer, params, prompt), _seq(tokenizer, params, prompt)
    fast, slow = Emitter(tokenizer, 10_000), Emitter(tokenizer, 10_000)
    slow.defers = fast.defers = True
    monkeypatch.setattr(slow, "_emit_whole", lambda seq, tokens: None)
    at = 0
    while at < len(stream) and whole.finish_reason is None:
        n = rng.randint(1, 5)
        chunk = stream[at : at + n]
        at += n
        lp = params.logprobs is not None
        state = rng.getstate()
        got = fast.emit(whole, _tokens(whole, chunk, rng, lp))
        rng.setstate(state)  # (the same logprobs for both)
        want = slow.emit(each, _tokens(each, chunk, rng, lp))
        assert got == want, (trial, at)
        assert _state(whole) == _state(each), (trial, at)
    assert whole.detokenizer.text == each.detokenizer.text


def test_it_steps_aside_where_it_cannot_apply(tokenizer):
    seq = _seq(tokenizer, SamplingParams(stop=["zz"]), [300])
    emitter = Emitter(tokenizer, 10_000)
    assert emitter._emit_whole(seq, [SampledToken(seq, 400)]) is None  # nothing to gain
    seq.grammar = object()  # a grammar advances token by token
    assert emitter._emit_whole(seq, [SampledToken(seq, t) for t in (400, 401)]) is None
    seq.grammar = None
    assert emitter._emit_whole(seq, [SampledToken(seq, t) for t in (400, 401)]) is not None
