"""Grammar matchers on llguidance: one tokenizer per engine, one matcher per sequence.

llguidance (no dependencies, about a millisecond to compile a schema, standard JSON Schema
semantics, unsupported keywords refused rather than ignored) was measured against xgrammar on this
project's tokenizers; the comparison is in the README. A matcher holds a sequence's committed
state only: the masks of a verify's draft rows are computed from it without advancing it, so there
is nothing to roll back after a verify, and each step's emitted tokens advance it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance

from metrale.structured.params import StructuredOutput


class SequenceGrammar:
    """A sequence's grammar state: the tokens it has emitted, as the matcher saw them."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (drafts after the committed state) the grammar allows in order."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (a JSON schema's keys and punctuation):
        the target can emit nothing else, so they are drafts that are always accepted."""
        return self.matcher.compute_ff_tokens()[:limit] if limit > 0 else []

    def advance(self, tokens: list[int]) -> bool:
        """Commit emitted tokens; False if the grammar refuses one (the state is then an error)."""
        return all(self.matcher.consume_token(t) for t in tokens)

    @property
    def finished(self) -> bool:
        """The grammar can take no token but the end of the text: the sequence is done."""
        return self.matcher.is_stopped()


# Compiled grammars kept (a pristine matcher each): requests of one client share a schema.
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
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
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
        pristine = self._pristine(structured)
        with self._lock:
            return SequenceGrammar(pristine.deep_copy())

    def _pristine(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        text = structured.grammar_text()
        with self._lock:
            cached = self._compiled.get(text)
            if cached is not None:
                self._compiled.move_to_end(text)
                return cached
            tokenizer = self.tokenizer
        error = llguidance.LLMatcher.validate_grammar(text, tokenizer)
        if error:
            raise ValueError(f"structured: {error.strip().splitlines()[0]}")
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured: {matcher.get_error()}")
        with self._lock:
            self._compiled[text] = matcher
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher
