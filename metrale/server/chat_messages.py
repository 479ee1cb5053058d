"""A chat conversation's messages as the OpenAI-compatible API takes them (pydantic): roles,
text parts, an earlier assistant turn's tool calls (their JSON arguments parsed for the chat
template), the template variables a request may set; and the helpers every request body uses
(strict unions with one clear error, errors located as JSON paths)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictStr,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    field_validator,
)

# the roles a chat message may have: what chat templates render. OpenAI's "developer" is not
# among them: the shipped template writes a role out as it is, so it would not act as "system"
CHAT_ROLES = ("system", "user", "assistant", "tool")

# template variables a request may not set: the template's own inputs
_TEMPLATE_RESERVED = ("messages", "tools", "add_generation_prompt")


def error_path(loc) -> str:
    """A pydantic error location as a JSON path: `messages[0].content`."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def one_of(expected: str) -> WrapValidator:
    """A union's failure as one error that says what the field takes (pydantic would report one
    per member), with the first error inside a list or object the value got into."""

    def check(value, handler):
        try:
            return handler(value)
        except ValidationError as e:
            inner = [err for err in e.errors() if len(err["loc"]) > 1]
            detail = ""
            if inner:  # the loc's first part names the union member: drop it
                detail = f" ({error_path(inner[0]['loc'][1:])}: {inner[0]['msg']})"
            raise ValueError(f"expected {expected}{detail}") from None

    return WrapValidator(check)


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields: ignored, as OpenAI's own


class TextPart(Body):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")  # passed on to the chat template

    name: StrictStr
    arguments: Annotated[
        StrictStr | dict[str, Any], one_of("a JSON object, or a string holding one")
    ] = Field(default_factory=dict)

    @field_validator("arguments")
    @classmethod
    def _parsed(cls, value):
        """The object chat templates render (as vLLM does), from OpenAI's JSON string."""
        if isinstance(value, str):

            def no_constant(name: str):
                raise ValueError(f"{name} is not JSON")

            try:
                value = json.loads(value, parse_constant=no_constant) if value.strip() else {}
            except (ValueError, RecursionError) as e:  # JSONDecodeError, digit limits, depth
                raise ValueError(f"not valid JSON ({e})") from None
            if not isinstance(value, dict):
                raise ValueError("expected a JSON object")
        return value


class ToolCall(BaseModel):
    """A call an earlier assistant turn made."""

    model_config = ConfigDict(extra="allow")

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One turn of the conversation. Fields beyond these (`name`, `tool_call_id`, ...) reach
    the chat template as they are."""

    model_config = ConfigDict(extra="allow")

    role: StrictStr = Field(json_schema_extra={"enum": list(CHAT_ROLES)})
    content: (
        Annotated[StrictStr | list[TextPart], one_of("a string or a list of text parts")] | None
    ) = Field(None, validate_default=True, description="null only for an assistant turn")
    tool_calls: list[ToolCall] | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, value: str) -> str:
        # any other reached the template: a turn of its own, a template's error, or dropped
        if value not in CHAT_ROLES:
            raise ValueError(f"expected one of {', '.join(CHAT_ROLES)}, got {value!r:.40}")
        return value

    @field_validator("content")
    @classmethod
    def _present(cls, value, info: ValidationInfo):
        if value is None and info.data.get("role") != "assistant":
            raise ValueError("expected a string or a list of text parts (null: assistant only)")
        return value

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it: `content` as text (text parts joined by
        newlines, as vLLM does; "" for an assistant turn of tool calls only)."""
        message = self.model_dump(exclude_unset=True)
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message["content"] = content or ""
        if self.tool_calls is not None:
            message["tool_calls"] = [
                {
                    **call.model_dump(exclude_unset=True),
                    "type": "function",
                    "function": call.function.model_dump(),  # arguments parsed, {} if none
                }
                for call in self.tool_calls
            ]
        return message


TemplateKwargs = Annotated[
    dict[str, Any],
    Field(description="extra chat template variables, such as Qwen3's enable_thinking"),
]


def template_variables(value: dict | None) -> dict | None:
    reserved = [k for k in value or () if k in _TEMPLATE_RESERVED]
    if reserved:
        raise ValueError(f"{reserved[0]!r} is the template's own input")
    return value
