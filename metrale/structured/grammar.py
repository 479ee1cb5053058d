"""Grammar matchers on llguidance: one tokenizer per engine, one matcher per sequence.

llguidance (no dependencies, about a millisecond to compile a schema, standard JSON Schema
semantics, unsupported keywords refused rather than ignored) was measured against xgrammar on this
project's tokenizers; the comparison is in the README. A matcher holds a sequence's committed
state only: the masks of a verify's draft rows are computed from it without advancing it, so there
is nothing to roll back after a verify, and each step's emitted tokens advance it.
"""

from __future__ import annotations

import llguidance

from metrale.structured.params import StructuredOutput


class SequenceGrammar:
    """A sequence's grammar state: the tokens it has emitted, as the matcher saw them."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (drafts after the committed state) the grammar allows in order."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def advance(self, tokens: list[int]) -> bool:
        """Commit emitted tokens; False if the grammar refuses one (the state is then an error)."""
        return all(self.matcher.consume_token(t) for t in tokens)

    @property
    def finished(self) -> bool:
        """The grammar can take no token but the end of the text: the sequence is done."""
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles `StructuredOutput`s against the model's tokenizer and vocabulary (ids past the
    tokenizer's, a padded head's, are never allowed); built on first use."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._source = tokenizer
        # the matchers' vocabulary: the model's, or the tokenizer's where that is larger (a
        # test's small head: masks are cut to the logits' width)
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(
                self._source.backend.to_str(),
                n_vocab=self.vocab_size,
                eos_token=list(self.eos_token_ids) or None,
            )
        return self._tokenizer

    def check(self, structured: StructuredOutput) -> str:
        """The grammar text, or a ValueError naming what is wrong with it (an HTTP 400)."""
        text = structured.grammar_text()
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise ValueError(f"structured: {error.strip().splitlines()[0]}")
        return text

    def matcher(self, structured: StructuredOutput) -> SequenceGrammar:
        matcher = llguidance.LLMatcher(self.tokenizer, self.check(structured), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured: {matcher.get_error()}")
        return SequenceGrammar(matcher)
