"""Structured output: what the grammar forbids is never emitted, speculation changes no token
(greedy and seeded, n-gram, MTP, a drafter proposing forbidden tokens; dense and hybrid), the
masks of a verify's rows follow its drafts, and bad constraints are clear errors."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
import torch

from metrale import LLM, SamplingParams, StructuredOutput
from metrale.config import ModelConfig
from metrale.default_model import default_model_dir
from metrale.engine.sequence import ScheduledSeq, Sequence
from metrale.speculative.draft_shapes import pad_draft
from metrale.speculative.drafter import Draft
from metrale.structured.grammar import GrammarCompiler
from metrale.structured.masks import apply_grammar_masks
from tests.test_hybrid_engine import hybrid_dir  # noqa: F401 (a module fixture)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
PROMPTS = [
    "def parse(data):\n    # returns a JSON record\n",
    "import json\nrecord = ",
    "class User:\n    def to_json(self):\n        return ",
    "# config\nsettings = ",
]
CONSTRAINTS = {
    "json": {"json": SCHEMA},
    "json_object": {"json_object": True},
    "regex": {"regex": r"[a-z]{2,6}-\d{2,4}"},
    "choice": {"choice": ["yes", "no", "maybe later"]},
    "grammar": {"grammar": 'root ::= "(" num ("," num){0,4} ")"\nnum ::= [0-9]{1,3}'},
}


def _valid(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if kind == "choice":
        return text in CONSTRAINTS["choice"]["choice"]
    pattern = {"regex": r"[a-z]{2,6}-\d{2,4}", "grammar": r"\(\d{1,3}(,\d{1,3}){0,4}\)"}[kind]
    return re.fullmatch(pattern, text) is not None


@pytest.fixture(scope="module")
def shipped():
    return LLM(str(default_model_dir()), device="cpu", spec={"method": "mtp", "num_drafts": 3})


@pytest.fixture(scope="module")
def shipped_ngram():
    return LLM(str(default_model_dir()), device="cpu", spec={"method": "ngram", "num_drafts": 3})


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
@pytest.mark.parametrize("drafter", ["ngram", "mtp"])
def test_outputs_match_the_constraint_and_speculation_changes_nothing(request, kind, drafter):
    llm = request.getfixturevalue("shipped" if drafter == "mtp" else "shipped_ngram")
    for extra in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 11}):
        outs = {}
        for spec in (False, True):
            params = SamplingParams(
                max_tokens=96, structured=CONSTRAINTS[kind], speculative=spec, **extra
            )
            outs[spec] = llm.generate(PROMPTS, params, use_tqdm=False)
        for plain, fast in zip(outs[False], outs[True], strict=True):
            text = plain.outputs[0].text
            assert fast.outputs[0].token_ids == plain.outputs[0].token_ids
            if kind == "json_object" and plain.outputs[0].finish_reason == "length":
                continue  # any object: a small model may go on until max_tokens cuts it
            assert plain.outputs[0].finish_reason == "stop", (kind, text)
            assert _valid(kind, text), (kind, text)


class Forbidden:
    """Proposes `}` then `x` at every step: never a valid continuation of an integer."""

    name = "forbidden"
    needs_hidden = False
    stateless = True

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.proposed = 0

    def propose(self, seqs, max_drafts):
        self.proposed += len(seqs)
        return [Draft(self.tokens[:k]) for k in max_drafts]

    def observe(self, verdicts) -> None: ...

    def release(self, seq) -> None: ...


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_a_drafter_proposing_forbidden_tokens_changes_nothing(request, target):
    path = request.getfixturevalue("tiny_model_dir" if target == "dense" else "hybrid_dir")
    plain_llm = LLM(path, device="cpu")
    tok = plain_llm.tokenizer
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(temperature=0, max_tokens=12, structured={"regex": r"[0-9]{12}"})
    ref = plain_llm.generate(prompts, params, use_tqdm=False)
    bad = tok.encode("x", add_special_tokens=False) + tok.encode("}", add_special_tokens=False)
    drafter = Forbidden(bad)
    llm = LLM(path, device="cpu", drafter=drafter, spec={"num_drafts": 2, "dcut": False})
    out = llm.generate(prompts, params, use_tqdm=False)
    assert drafter.proposed > 0
    for a, b in zip(ref, out, strict=True):
        assert re.fullmatch(r"[0-9]{12}", b.outputs[0].text), b.outputs[0].text
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.outputs[0].num_accepted_tokens == 0


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_tokens_the_grammar_forces_are_drafted_and_accepted(request, target):
    """A drafter that knows nothing of the grammar still gets verifies full of accepted drafts
    where the grammar leaves one way on (here: one long choice)."""
    path = request.getfixturevalue("tiny_model_dir" if target == "dense" else "hybrid_dir")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(temperature=0, max_tokens=24, structured={"choice": ["abcabcabcabc"]})
    ref = LLM(path, device="cpu").generate(prompts, params, use_tqdm=False)
    drafter = Forbidden([3, 4])
    llm = LLM(path, device="cpu", drafter=drafter, spec={"num_drafts": 3, "dcut": False})
    out = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ref, out, strict=True):
        assert b.outputs[0].text == "abcabcabcabc"
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.outputs[0].num_accepted_tokens >= len(b.outputs[0].token_ids) // 2


def test_each_verify_row_is_masked_in_the_state_after_the_drafts_before_it():
    llm = LLM(str(default_model_dir()), device="cpu")
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.vocab_size, llm.engine.eos_token_ids)
    enc = lambda s: llm.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    vocab = llm.engine.vocab_size

    def entry(drafts: list[int], structured=None) -> ScheduledSeq:
        seq = Sequence(0, "r", [1, 2], SamplingParams(), 0, (), 0)
        seq.num_computed_tokens = 1  # its last token and the drafts run
        if structured is not None:
            seq.grammar = compiler.matcher(StructuredOutput(**structured))
        return ScheduledSeq(seq, 1 + len(drafts), drafts)

    digits = enc("12")
    assert len(digits) >= 1
    free = entry([5, 6])  # no grammar: its 3 rows stay as they are
    num = entry(digits + enc("x") + digits[:1], {"regex": r"[0-9]+"})
    logits = torch.zeros(3 + 1 + len(num.drafts), vocab)
    apply_grammar_masks([free, num], logits, compiler.vocab_size)
    assert torch.isfinite(logits[:3]).all()
    rows = logits[3:]
    allowed = [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in rows]
    # row j: after j drafts; digits are allowed at every row up to the forbidden `x` ...
    for j in range(len(digits) + 1):
        assert digits[0] in allowed[j] and enc("x")[0] not in allowed[j]
    # ... EOS only once a digit was committed; rows past the forbidden draft are left as they are
    eos = llm.engine.eos_token_ids[0]
    assert eos not in allowed[0] and eos in allowed[len(digits)]
    assert allowed[len(digits) + 1] == set(range(vocab))


@pytest.mark.parametrize(
    "structured, match",
    [
        ({}, "exactly one"),
        ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": [1]}, "JSON object"),
        ({"json": {"x-guidance": "x"}}, "x-guidance must be an object"),
        ({"json": {"x-guidance": [1]}}, "x-guidance must be an object"),
        ({"choice": []}, "1 to"),
        ({"choice": "yes"}, "list of strings"),
        ({"regex": ""}, "non-empty"),
        ({"grammar": "  "}, "grammar"),
        ({"colour": "red"}, "unknown"),
    ],
)
def test_bad_constraints_name_the_field(structured, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured=structured)


@pytest.mark.parametrize(
    "structured",
    [
        {"json": {"type": "foo"}},
        {"regex": "(["},
        {"grammar": "root ::= missing"},
        {"json": {"type": "array", "uniqueItems": True}},
    ],
)
def test_constraints_that_do_not_compile_are_refused_at_submission(shipped_ngram, structured):
    with pytest.raises(ValueError, match=r"structured\.\w+: "):  # the field at fault
        shipped_ngram.generate(["x"], SamplingParams(structured=structured), use_tqdm=False)
    # nothing was left behind: the next request runs
    out = shipped_ngram.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "structured",
    [
        {"regex": "[^\\x00-\\x{10FFFF}]"},
        {"regex": "a[^\\x00-\\x{10FFFF}]b"},
        {"grammar": "start: /[^\\x00-\\x{10FFFF}]/"},
    ],
)
def test_constraints_no_text_satisfies_are_refused_at_submission(shipped_ngram, structured):
    """An empty language: each sequence of it ended at its first token as an error."""
    with pytest.raises(ValueError, match=r"structured\.\w+: no text satisfies it"):
        shipped_ngram.generate(["x"], SamplingParams(structured=structured), use_tqdm=False)


@pytest.mark.parametrize("grammar", ["start: <|im_end|>", 'start: <|endoftext|> "hi"'])
def test_a_grammar_that_starts_with_an_end_token_is_not_empty(shipped_ngram, grammar):
    """Its first token is an end of text that the grammar itself takes: not an empty one."""
    shipped_ngram.engine.grammars.check(StructuredOutput(grammar=grammar))


def test_a_schema_compiles_once_and_each_sequence_gets_its_own_state(shipped_ngram):
    compiler = shipped_ngram.engine.grammars
    structured = StructuredOutput(regex=r"[0-9]{4}")
    first = compiler.matcher(structured)
    pristine = compiler._compiled[structured.grammar_text()]
    second = compiler.matcher(structured)
    assert compiler._compiled[structured.grammar_text()] is pristine  # not compiled again
    digit = shipped_ngram.tokenizer.encode("7", add_special_tokens=False)
    assert first.advance(digit * 4) and first.finished
    assert not second.finished and second.valid_prefix(digit * 5) == 4


def test_min_tokens_is_refused_and_a_single_space_is_a_regex():
    with pytest.raises(ValueError, match="^min_tokens"):
        SamplingParams(structured={"regex": "a+"}, min_tokens=2)
    assert SamplingParams(structured={"regex": " "}).structured.regex == " "


def test_logprobs_never_list_forbidden_tokens(shipped_ngram):
    params = SamplingParams(
        temperature=0, max_tokens=8, logprobs=5, structured={"choice": ["yes", "no"]}
    )
    out = shipped_ngram.generate(["answer: "], params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.logprobs
    for entry in out.logprobs:
        assert all(lp.logprob > float("-inf") for lp in entry.values())


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["ngram", "mtp"])
def test_under_cuda_graphs_outputs_match_and_speculation_changes_nothing(drafter):
    """The masks land on the logits the captured programs return, verify rows included."""
    llm = LLM(str(default_model_dir()), device="cuda", spec={"method": drafter, "num_drafts": 3})
    for kind in ("json", "regex", "choice"):
        outs = {
            spec: llm.generate(
                PROMPTS * 4,
                SamplingParams(
                    temperature=0, max_tokens=96, structured=CONSTRAINTS[kind], speculative=spec
                ),
                use_tqdm=False,
            )
            for spec in (False, True)
        }
        for plain, fast in zip(outs[False], outs[True], strict=True):
            assert _valid(kind, plain.outputs[0].text), (kind, plain.outputs[0].text)
            assert fast.outputs[0].token_ids == plain.outputs[0].token_ids
    assert llm.engine.runner.structured_seqs == 0


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_an_end_token_the_grammar_forces_mid_output_stays_lossless(method):
    """`<|im_end|>` inside the grammar, under ignore_eos: llguidance's validation, and so the
    verify's masks, stop at an end-of-text token, so a forced draft past one was verified
    against an unmasked row, and speculation emitted a token the grammar forbids (found in
    review). Forced drafts are cut where validation stops; an empty draft is never padded with
    an end token."""
    llm = LLM(str(default_model_dir()), device="cpu", spec={"method": method, "num_drafts": 4})
    grammar = 'start: "ab" <|im_end|> "cd"'
    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, structured={"grammar": grammar}
    )
    plain = dataclasses.replace(params, speculative=False)
    prompts = [[5, 6, 7], [916, 2, 9]]
    want = [o.outputs[0] for o in llm.generate(prompts, plain, use_tqdm=False)]
    got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(want, got, strict=True):
        assert a.finish_reason == "stop" and a.error is None
        assert (b.token_ids, b.finish_reason, b.error) == (a.token_ids, "stop", None)
    ends = llm.engine.eos_token_ids
    assert pad_draft(Draft([]), 3, 100, ends).tokens == [min(set(range(100)) - set(ends))] * 3


class EndTokenQ:
    """Drafts `<|im_end|>` with q one-hot on it: a q drafter's end token the grammar allows."""

    name, needs_hidden, stateless = "end-q", False, True

    def __init__(self, vocab: int, end: int) -> None:
        self.vocab, self.end = vocab, end

    def propose(self, seqs, caps):
        out = []
        for k in caps:
            q = torch.zeros(k, self.vocab)
            q[:, self.end] = 1.0
            out.append(Draft([self.end] * k, q))
        return out

    def observe(self, verdicts):
        pass

    def release(self, seq):
        pass


def test_a_q_drafters_end_token_the_grammar_allows_mid_output_stays_lossless():
    """A sampled request's q draft under a grammar is judged one-hot and cut where validation
    stops (at an end token): kept past that point, `<|im_end|>` was accepted and the unmasked
    row after it emitted what the grammar forbids ('abrc', finish "error"; found in review).
    Seeded, the output is plain decoding's."""
    model = str(default_model_dir())
    vocab = ModelConfig.from_hf(model).vocab_size
    end = LLM(model, device="cpu").tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]
    drafter = EndTokenQ(vocab, end)
    llm = LLM(model, device="cpu", drafter=drafter, spec={"num_drafts": 3, "dcut": False})
    grammar = 'start: "ab" <|im_end|> "cd"'
    params = SamplingParams(
        temperature=1.0, seed=1, max_tokens=20, ignore_eos=True, structured={"grammar": grammar}
    )
    plain = dataclasses.replace(params, speculative=False)
    prompts = [[5, 6, 7], [916, 2, 9]]
    want = [o.outputs[0] for o in llm.generate(prompts, plain, use_tqdm=False)]
    got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(want, got, strict=True):
        assert a.finish_reason == "stop" and a.error is None and a.text == "abcd"
        assert (b.token_ids, b.finish_reason, b.error) == (a.token_ids, "stop", None)
    assert llm.engine.telemetry.spec.num_draft_tokens > 0


@pytest.mark.parametrize(
    "kind, source, want",
    [
        ("regex", "(", 'invalid regex "(" (in regex): regex parse error: unclosed group'),
        ("regex", "(unclosed group", "regex parse error: unclosed group"),
        ("regex", "(?P<a>x)(?P<a>y)", "regex parse error: duplicate capture group name"),
        ("json_schema", {"pattern": "error: x("}, "unclosed group (in the pattern 'error: x(')"),
        ("json_schema", {"pattern": "a{5,2}"}, "the start must be <= the end (in the pattern"),
        ("lark", "start: x", 'at 1(8): unknown name: "x"'),
    ],
)
def test_a_compile_error_keeps_its_reason(kind, source, want):
    """llguidance's multi-line errors keep the regex parser's reason (found in review: only the
    first line was kept, 'regex parse error:'; a reason or a pattern line reading like the
    other was taken for it)."""
    import llguidance

    from metrale.structured.grammar import error_summary

    if kind == "json_schema":
        source = json.dumps({"type": "string", **source})
    error = llguidance.LLMatcher.validate_grammar(llguidance.grammar_from(kind, source))
    assert want in error_summary(error) and "\n" not in error_summary(error)
