"""`StructuredOutput`: what a request's output must match, named as vLLM's
`StructuredOutputsParams` (json, json_object, regex, choice, grammar), validated at construction;
`grammar_text()` gives the llguidance grammar the engine compiles."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any

# JSON is compact unless a schema asks otherwise (llguidance's `x-guidance` options): a model
# free to put any whitespace between tokens can loop on it until `max_tokens` cuts the JSON short.
COMPACT = {"whitespace_flexible": False}
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of: `json` (a JSON schema, as a dict or JSON text), `json_object` (any JSON
    object), `regex`, `choice` (one of these strings), `grammar` (GBNF/EBNF, as llama.cpp and
    vLLM take it, or Lark)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object is True else [])
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured.json_object must be a bool, got {self.json_object!r}")
        if len(given) != 1:
            raise ValueError(
                "structured: give exactly one of json, json_object, regex, choice, grammar"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = jsonlib.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured.json: not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"structured.json: a schema is a JSON object, got {schema!r}")
            options = schema.get("x-guidance", {})
            if not isinstance(options, dict):  # (merged into a dict: a 500 before, in review)
                raise ValueError(f"structured.json: x-guidance must be an object, got {options!r}")
            object.__setattr__(self, "json", schema)
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"structured.regex must be a non-empty string, got {self.regex!r}")
        if self.grammar is not None and (
            not isinstance(self.grammar, str) or not self.grammar.strip()
        ):
            raise ValueError(f"structured.grammar must be a grammar, got {self.grammar!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise ValueError(f"structured.choice must be a list of strings: {self.choice!r}")
            choice = tuple(self.choice)
            if not choice or len(choice) > MAX_CHOICES:
                raise ValueError(
                    f"structured.choice: 1 to {MAX_CHOICES} strings, got {len(choice)}"
                )
            if any(not isinstance(c, str) or not c for c in choice):
                raise ValueError(f"structured.choice must hold non-empty strings: {choice!r}")
            object.__setattr__(self, "choice", choice)

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutput | None:
        """A StructuredOutput from itself, a dict of its fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"structured: unknown field(s) {sorted(unknown)}")
            return cls(**value)
        raise ValueError(f"structured: expected a StructuredOutput or a dict, got {value!r}")

    @property
    def field(self) -> str:
        """The field holding the constraint, as its errors name it: "structured.regex"."""
        if self.json_object:
            return "structured.json_object"
        return "structured." + next(
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        )

    def grammar_text(self) -> str:
        """The llguidance grammar (JSON text) for this constraint; a ValueError naming the
        field when llguidance cannot convert it."""
        import llguidance

        try:
            if self.json is not None or self.json_object:
                schema = dict(self.json) if self.json is not None else {"type": "object"}
                schema["x-guidance"] = {**COMPACT, **schema.get("x-guidance", {})}
                text = llguidance.LLMatcher.grammar_from_json_schema(schema)
            elif self.regex is not None:
                text = llguidance.LLMatcher.grammar_from_regex(self.regex)
            elif self.choice is not None:
                text = llguidance.grammar_from("choice", jsonlib.dumps(list(self.choice)))
            else:  # GBNF/EBNF or Lark: llguidance tells them apart
                text = llguidance.grammar_from("grammar", self.grammar)
            # llguidance takes UTF-8: a lone surrogate (a JSON "\udcff" escape) cannot reach it
            text.encode("utf-8")
        except ValueError as e:  # (UnicodeEncodeError is one; a schema's value not JSON too)
            raise ValueError(f"{self.field}: {e}") from None
        return text
