"""Grammar matchers on llguidance: one tokenizer per engine, one matcher per sequence.

llguidance (no dependencies, about a millisecond to compile a schema, standard JSON Schema
semantics, unsupported keywords refused rather than ignored) was measured against xgrammar on this
project's tokenizers; the comparison is in the README. A matcher holds a sequence's committed
state only: the masks of a verify's draft rows are computed from it without advancing it, so there
is nothing to roll back after a verify, and each step's emitted tokens advance it.

The copies of one compiled grammar share its lexer, and with it llguidance's limits on the lexer's
work (states, fuel): a copy that runs the lexer out fails every other copy, those made later too,
though none says so until it is used (`is_error()` is False on them). So a grammar whose forced
output from the start runs the lexer out is refused when it compiles, and a compiled grammar one
of whose sequences failed is dropped from the cache, so the next request compiles it afresh and
fares as the first one did.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import llguidance

from metrale.structured.params import StructuredOutput

# Errors without llguidance's dump of the parser state and grammar (a long text, and the schema
# of one request in the logs and answers of another)
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# How much of a forced run `forced` tokenises: its tokens are a few drafts a step, while a counted
# repetition forces as many bytes as its count (a{100000}: tokenising all of it each step made
# the whole batch ~5x slower, in review).
FORCED_BYTES = 512
# How many tokens of the output a grammar forces from its start are taken at compile time
# (`_forced_start_refusal`)
FORCED_START_TOKENS = 64
# llguidance's marker of a special token in forced bytes (never a byte of UTF-8 text)
SPECIAL_MARKER = b"\xff"


class SequenceGrammar:
    """A sequence's grammar state: the tokens it has emitted, as the matcher saw them."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        tokenizer: llguidance.LLTokenizer,
        on_error: Callable[[], None],
    ) -> None:
        self.matcher = matcher
        self._tokenizer = tokenizer
        self._on_error = on_error  # drops the compiled grammar whose lexer this copy shares

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (drafts after the committed state) the grammar allows in order."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (a JSON schema's keys and punctuation):
        the target can emit nothing else, so they are drafts it accepts (llguidance's own
        tokens of the run; of a long run's head, the tokenizer's)."""
        if limit <= 0:
            return []
        run = self.matcher.compute_ff_bytes()  # walked once: llguidance keeps it as tokens go
        if len(run) <= FORCED_BYTES:
            # (cut where validation stops: at an end-of-text token the grammar itself forces,
            # `start: "ab" <|im_end|> "cd"` under ignore_eos, validation stops, and so do the
            # verify's masks; a draft past it was verified against an unmasked row and emitted
            # a token the grammar forbids: found in review)
            tokens = self.matcher.compute_ff_tokens()[:limit]
            return tokens[: self.valid_prefix(tokens)]
        # A long run: its head alone, without the last token (the cut may split it); checked,
        # as a special token's marker or a token across the cut could make it one the grammar
        # refuses.
        head = run[:FORCED_BYTES].split(SPECIAL_MARKER, 1)[0]
        tokens = self._tokenizer.tokenize_bytes(head)[:-1][:limit]
        return tokens[: self.valid_prefix(tokens)]

    def advance(self, tokens: list[int]) -> bool:
        """Commit emitted tokens; False if the grammar refuses one or the matcher failed (the
        state is then an error, and the compiled grammar is dropped: see the module's note)."""
        ok = all(self.matcher.consume_token(t) for t in tokens) and not self.matcher.is_error()
        if not ok:
            self._on_error()
        return ok

    @property
    def finished(self) -> bool:
        """The grammar can take no token but the end of the text: the sequence is done."""
        return self.matcher.is_stopped()


# Compiled grammars kept (a pristine matcher each, or the reason it was refused): requests of one
# client share a schema.
CACHE_SIZE = 256


class GrammarCompiler:
    """Compiles `StructuredOutput`s against the model's tokenizer and vocabulary (ids past the
    tokenizer's, a padded head's, are never allowed); built on first use.

    Compiling a JSON schema costs milliseconds, as much as several decode steps of a batch, so a
    compiled grammar is kept (LRU, `CACHE_SIZE`) and each new sequence gets a copy of its
    pristine matcher (microseconds). Thread-safe: the server checks requests on its own threads.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._source = tokenizer
        # the matchers' vocabulary: the model's, or the tokenizer's where that is larger (a
        # test's small head: masks are cut to the logits' width)
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        # a grammar's text -> its pristine matcher, or why it was refused
        self._compiled: OrderedDict[str, llguidance.LLMatcher | str] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            # EOS ids the tokenizer itself knows (a shape's random head may name others)
            known = [t for t in self.eos_token_ids if t < self._source.vocab_size]
            self._tokenizer = llguidance.LLTokenizer(
                self._source.backend.to_str(), n_vocab=self.vocab_size, eos_token=known or None
            )
        return self._tokenizer

    def check(self, structured: StructuredOutput) -> None:
        """A ValueError naming what is wrong with the constraint (an HTTP 400), if anything."""
        self._pristine(structured)

    def matcher(self, structured: StructuredOutput) -> SequenceGrammar:
        text, pristine = self._pristine(structured)
        with self._lock:
            copy = pristine.deep_copy()
        return SequenceGrammar(copy, self.tokenizer, lambda: self._forget(text, pristine))

    def _forget(self, text: str, pristine: llguidance.LLMatcher) -> None:
        with self._lock:
            if self._compiled.get(text) is pristine:  # (not one compiled again since)
                del self._compiled[text]

    def _pristine(self, structured: StructuredOutput) -> tuple[str, llguidance.LLMatcher]:
        text = structured.grammar_text()
        with self._lock:
            cached = self._compiled.get(text)
            if cached is not None:
                self._compiled.move_to_end(text)
                if isinstance(cached, str):  # refused before: at once, in the same words
                    raise ValueError(f"{structured.field}: {cached}")
                return text, cached
            tokenizer = self.tokenizer
        error = llguidance.LLMatcher.validate_grammar(text, tokenizer, limits=LIMITS)
        matcher = refused = None
        if error:
            refused = error_summary(error)
        else:
            matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=LIMITS)
            error = matcher.get_error()
            if error:
                refused = f"too complex: {error_summary(error)}"
            else:
                refused = _forced_start_refusal(matcher, tokenizer)
            # (the end-of-text ids: the engine's, and llguidance's own when it was given none)
            ends = (*self.eos_token_ids, tokenizer.eos_token)
            if refused is None and _accepts_nothing(matcher, ends):
                # (a regex such as [^\x00-\x{10FFFF}]: before, every sequence of it ended
                # at its first token as an error, over HTTP a 200)
                refused = "no text satisfies it (the constraint's language is empty)"
        with self._lock:
            # a refusal is kept too: finding it again can hold the GIL for half a second
            self._compiled[text] = refused or matcher
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        if refused:
            raise ValueError(f"{structured.field}: {refused}")
        return text, matcher


def _accepts_nothing(matcher: llguidance.LLMatcher, eos_token_ids: tuple[int, ...]) -> bool:
    """Whether no text satisfies `matcher`'s grammar, as far as its first token shows: the empty
    text does not, and no token may come first but an end of text that the grammar itself does
    not take (llguidance's mask of an empty language allows the ends, and taking one is then an
    error; `start: <|im_end|>` takes it). One mask, on copies, at compile time only. An empty
    part further on (a lark rule after a first token) is not seen here."""
    if matcher.is_accepting():
        return False
    allowed = int.from_bytes(matcher.deep_copy().compute_bitmask(), "little")  # bit t: token t
    ends = [t for t in dict.fromkeys(eos_token_ids) if t is not None and allowed >> t & 1]
    for t in ends:
        allowed &= ~(1 << t)
    if allowed:
        return False
    for t in ends:
        probe = matcher.deep_copy()
        if probe.consume_token(t) and not probe.is_error():
            return False  # the grammar's own first token
    return True


def _forced_start_refusal(matcher: llguidance.LLMatcher, tokenizer) -> str | None:
    """Why the output `matcher`'s grammar forces from its start cannot be followed (None if it
    can). llguidance walks that run whole (a{1000000}: a million lexer states), which can spend
    the lexer its copies share: the walk is kept on `matcher` (its copies start past it) and the
    run's first `FORCED_START_TOKENS` tokens taken on a copy, where a spent lexer shows, and so
    does a run through the text of a special token (a JSON const "<|endoftext|>": llguidance's
    mask then allows that token alone, and taking it fails, so every request of the grammar
    ended as an error after its first token; found in review)."""
    forced = matcher.compute_ff_tokens()[:FORCED_START_TOKENS]
    probe = matcher.deep_copy()
    for token in forced:
        if not probe.consume_token(token) or probe.is_error():
            if tokenizer.is_special_token(token):
                text = tokenizer.decode_bytes([token]).decode("utf-8", "replace")
                return f"it forces the text of the special token {text!r}, which no text carries"
            return f"too complex: {error_summary(probe.get_error())}"
    return None


def error_summary(error: str) -> str:
    """One line of llguidance's multi-line error: its first line, with the reason its regex
    parser gives below the pattern and its caret line (`error: unclosed group`), and, where the
    first line does not quote it, the pattern at fault (a JSON schema's `pattern`)."""
    lines = error.strip("\n").splitlines()
    if not lines:
        return ""
    summary = lines[0].strip().rstrip(":")
    carets = next(
        (i for i, line in enumerate(lines) if line.strip() and set(line) <= {"^", " "}), None
    )
    start = 1 if carets is None else carets + 1
    reason = next((ln.strip()[6:].strip() for ln in lines[start:] if ln.startswith("error:")), "")
    if reason:
        summary = f"{summary}: {reason}"
        if carets == 2 and lines[0].strip().endswith("regex parse error:"):
            pattern = lines[1][4:] if lines[1].startswith("    ") else lines[1].strip()
            if pattern not in lines[0]:
                summary += f" (in the pattern {pattern!r})"
    return summary
