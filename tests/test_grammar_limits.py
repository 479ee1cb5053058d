"""Grammars that run llguidance out of its limits, long forced runs and the field a constraint's
error names (review findings): a failing grammar fails its own request, the same way every time,
and never the requests after it; the forced tokens of a long run cost a bounded amount of work."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams, StructuredOutput
from metrale.default_model import default_model_dir
from metrale.structured import grammar as grammar_module
from metrale.structured.grammar import GrammarCompiler
from metrale.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(default_model_dir())


@pytest.fixture
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


@pytest.fixture(scope="module")
def shipped_ngram():
    return LLM(str(default_model_dir()), device="cpu", spec={"method": "ngram", "num_drafts": 3})


def test_a_grammar_whose_forced_start_spends_the_lexer_is_refused_every_time(shipped_ngram):
    # llguidance walks the million forced bytes and runs out on the way: every copy of the
    # compiled grammar failed after that (one request erred, the next came back empty, "stop")
    params = SamplingParams(max_tokens=4, temperature=0, structured={"regex": "a{1000000}"})
    for _ in range(2):
        with pytest.raises(ValueError, match=r"structured\.regex: too complex"):
            shipped_ngram.generate(["x"], params, use_tqdm=False)
    long_run = SamplingParams(max_tokens=6, temperature=0, structured={"regex": "a{5000}"})
    out = shipped_ngram.generate(["x"], long_run, use_tqdm=False)[0].outputs[0]
    assert out.text == "a" * len(out.text) and out.finish_reason == "length", out


def test_a_refused_grammar_is_refused_again_without_the_walk(compiler, monkeypatch):
    # the walk holds the GIL for about half a second: a client repeating the request would
    # stall the engine each time
    walks = []
    walk = grammar_module._forced_start_refusal
    monkeypatch.setattr(
        grammar_module, "_forced_start_refusal", lambda m, t: walks.append(1) or walk(m, t)
    )
    errors = []
    for _ in range(3):
        with pytest.raises(ValueError, match=r"^structured\.regex: too complex") as e:
            compiler.check(StructuredOutput(regex="a{1000000}"))
        errors.append(str(e.value))
    assert len(walks) == 1 and len(set(errors)) == 1, (walks, errors)


def test_a_sequence_that_spends_the_shared_lexer_drops_its_compiled_grammar(compiler, tokenizer):
    structured = StructuredOutput(regex="(x|y)a{1000000}")  # forced only once x or y is out
    x = tokenizer.encode("x", add_special_tokens=False)
    first = compiler.matcher(structured)
    assert first.advance(x)
    forced = first.forced(3)  # the walk of the forced run spends the lexer
    assert forced and not first.advance(forced[:1])  # the failure shows, as an error
    second = compiler.matcher(structured)  # compiled afresh: not a copy of the spent one
    assert second.advance(x) and second.valid_prefix(forced) == len(forced)


def test_an_unservable_grammar_mid_output_fails_each_request_alike(shipped_ngram):
    params = SamplingParams(max_tokens=8, temperature=0, structured={"regex": "(x|y)a{1000000}"})
    outs = [shipped_ngram.generate(["x"], params, use_tqdm=False)[0].outputs[0] for _ in range(2)]
    assert outs[0].finish_reason == "error" and outs[0].text, outs[0]
    assert (outs[1].text, outs[1].finish_reason) == (outs[0].text, outs[0].finish_reason)
    # the error is llguidance's own, not a refusal the masks made impossible
    assert outs[0].error.startswith("structured: ") and "refused token" not in outs[0].error
    assert outs[0].error_by_request  # the request's own grammar: a 400 when served
    ok = SamplingParams(max_tokens=3, temperature=0, structured={"regex": "[0-9]{3}"})
    assert shipped_ngram.generate(["x"], ok, use_tqdm=False)[0].outputs[0].text.isdigit()


class _Recording:
    """A matcher whose calls are passed on, the longest token list any of them gave recorded."""

    def __init__(self, inner) -> None:
        self._inner, self.longest = inner, 0

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            out = attr(*args, **kwargs)
            if isinstance(out, list):
                self.longest = max(self.longest, len(out))
            return out

        return call


def test_the_forced_tokens_of_a_long_run_tokenise_only_its_head(compiler, tokenizer):
    # a{200000} forces 200000 bytes; llguidance's forced tokens are all of them, tokenised on
    # every call (a batch with such a request ran ~5x slower)
    grammar = compiler.matcher(StructuredOutput(regex="a{200000}"))
    grammar.matcher = recording = _Recording(grammar.matcher)
    emitted = []
    for _ in range(3):
        forced = grammar.forced(4)
        assert len(forced) == 4 and tokenizer.decode(forced) == "a" * len(tokenizer.decode(forced))
        assert grammar.advance(forced[:2])
        emitted += forced[:2]
    assert recording.longest <= 64, recording.longest  # no call made the whole run's tokens
    assert tokenizer.decode(emitted) == "a" * len(tokenizer.decode(emitted))


def test_short_forced_runs_are_llguidance_own_tokens(compiler, tokenizer):
    grammar = compiler.matcher(StructuredOutput(choice=["abcabcabcabc"]))
    expected = grammar.matcher.deep_copy().compute_ff_tokens()
    assert grammar.forced(3) == expected[:3] and tokenizer.decode(expected) == "abcabcabcabc"


@pytest.mark.parametrize(
    "structured, field",
    [
        ({"regex": "a\udcff"}, "structured.regex"),  # a lone surrogate: a JSON "\udcff"
        ({"grammar": 'root ::= "\udcff"'}, "structured.grammar"),
        ({"choice": ["a\udcff"]}, "structured.choice"),
        ({"grammar": "root ::= missing"}, "structured.grammar"),
        ({"json": {"type": "object", "default": object()}}, "structured.json"),
        ({"json": {"type": "foo"}}, "structured.json"),
        ({"regex": "(["}, "structured.regex"),
    ],
)
def test_a_constraint_that_does_not_compile_names_its_field(compiler, structured, field):
    with pytest.raises(ValueError, match=rf"^{field.replace('.', '[.]')}: \S"):
        compiler.check(StructuredOutput(**structured))


@pytest.mark.parametrize(
    "structured",
    [
        {"json": {"const": "<|endoftext|>"}},
        {
            "json": {
                "type": "object",
                "properties": {"a": {"const": "x<|im_end|>"}},
                "required": ["a"],
            }
        },
        {"regex": r"<\|endoftext\|>"},
        {"choice": ["<|im_end|>"]},
    ],
)
def test_a_grammar_forcing_a_special_tokens_text_is_refused_before_it_runs(
    compiler, shipped_ngram, structured
):
    """Such a run let llguidance's mask allow that special token alone, and taking it failed:
    the request ran, then ended as an error (over HTTP a 400 after the work, or a stream's
    error event; found in review). Refused at the check, naming the token."""
    field = next(iter(structured))
    with pytest.raises(
        ValueError, match=rf"^structured\.{field}: it forces the text of the special"
    ):
        compiler.check(StructuredOutput(**structured))
    params = SamplingParams(max_tokens=8, temperature=0, structured=structured)
    with pytest.raises(ValueError, match="special token"):
        shipped_ngram.generate(["x"], params, use_tqdm=False)
    # a choice that need not take the text still runs
    either = SamplingParams(max_tokens=8, temperature=0, structured={"choice": ["<|im_end|>", "x"]})
    assert shipped_ngram.generate(["x"], either, use_tqdm=False)[0].outputs[0].finish_reason


def test_the_forced_start_walk_takes_a_bounded_number_of_tokens(compiler, monkeypatch):
    monkeypatch.setattr(grammar_module, "FORCED_START_TOKENS", 2)
    compiler.check(StructuredOutput(regex="ab{3000}<\\|endoftext\\|>"))  # past the walk: runs
