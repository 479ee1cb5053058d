"""Structured output: a request's text constrained to a JSON schema, a regex, a choice or a
grammar, with speculation on (`params.StructuredOutput`, `grammar.GrammarCompiler`, `masks`)."""

from metrale.structured.params import StructuredOutput

__all__ = ["StructuredOutput"]
