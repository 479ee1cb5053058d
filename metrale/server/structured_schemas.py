"""Request fields that constrain the output: OpenAI's `response_format` (`json_object`,
`json_schema`), vLLM's `structured_outputs` (json, regex, choice, grammar, json_object) and its
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. At most one may be given;
each becomes a `StructuredOutput` (the engine then checks that it compiles: an invalid schema is a
400 naming the field)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationInfo,
    field_validator,
)

from metrale.structured import StructuredOutput


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class JsonSchemaFormat(_Body):
    name: StrictStr = "response"
    description: StrictStr | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _needs_schema(cls, value, info: ValidationInfo):
        if info.data.get("type") == "json_schema" and value is None:
            raise ValueError('type "json_schema" needs json_schema: {"name", "schema"}')
        return value

    def structured(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput(json_object=True)
        if self.type == "json_schema":
            return StructuredOutput(json=self.json_schema.schema_)
        return None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one of its fields."""

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None

    def structured(self) -> StructuredOutput:
        return StructuredOutput(
            json=self.json_,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=bool(self.json_object),
        )


class StructuredFields(BaseModel):
    """The request fields (mixed into the completions and chat bodies)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    def structured_field(self) -> str | None:
        """The one constraining field given (a ValueError when several are)."""
        given = [
            name
            for name in StructuredFields.model_fields
            if getattr(self, name) is not None
            and not (name == "response_format" and self.response_format.type == "text")
        ]
        if len(given) > 1:
            raise ValueError(f"{given[1]}: give one output constraint, not {' and '.join(given)}")
        return given[0] if given else None

    def structured(self) -> StructuredOutput | None:
        """The output constraint the body gives, if any."""
        field = self.structured_field()
        if field is None:
            return None
        value = getattr(self, field)
        try:
            if field in ("response_format", "structured_outputs"):
                return value.structured()
            kind = field.removeprefix("guided_")
            return StructuredOutput(**{kind: value})
        except ValueError as e:
            # StructuredOutput names its own fields ("structured.regex ...", "structured: ..."):
            # the body's field is the one to name
            message = re.sub(r"^structured(\.\w+)?:?\s*", "", str(e))
            raise ValueError(f"{field}: {message}") from None
