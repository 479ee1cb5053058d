"""The request bodies of the OpenAI-compatible API as pydantic models: what each POST route
accepts, FastAPI's validation of it and the schemas /openapi.json lists. Types are strict, as
JSON clients expect: a boolean or a string is not a number, a float is not an integer (numbers
take integers). Fields the server does not know are ignored, as OpenAI's own extras (`user`,
`store`, ...) are; fields that would change what a request means but are not supported yet are
declared and refused with a 400 naming them (`NOT_SUPPORTED`). Checks that need the engine (the
prompt's length, token ids in the vocabulary) happen in the routes; `sampling_kwargs()` gives
the fields `SamplingParams` checks itself.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    field_validator,
)

from metrale.sampling_params import SamplingParams
from metrale.server.structured_schemas import StructuredFields
from metrale.server.tools import Tool, ToolFields

# Fields refused until supported (never silently ignored), with the values that mean "not used".
# To support one, drop it here and give its field below a real type.
NOT_SUPPORTED: dict[str, tuple] = {
    "functions": ([],),  # OpenAI's deprecated forms of tools and tool_choice
    "function_call": ("none",),
    "suffix": ("",),
}
# Chat's tool fields (`tools.py`), refused on completions likewise.
CHAT_ONLY: dict[str, tuple] = {
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (True, False),
}

# body fields handed to SamplingParams as they are, when given (it checks their ranges)
_SAMPLING_FIELDS = (
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "min_tokens",
    "ignore_eos",
    "stop",
    "stop_token_ids",
    "logit_bias",
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


def _one_of(expected: str) -> WrapValidator:
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


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields: ignored, as OpenAI's own


class StreamOptions(_Body):
    include_usage: StrictBool | None = None


class SpeculativeOptions(_Body):
    """metrale's extension: speculative decoding for this request."""

    enabled: StrictBool = True
    num_drafts: StrictInt | None = Field(None, description="cap on the draft depth")


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")  # passed on to the chat template

    name: StrictStr
    arguments: Annotated[
        StrictStr | dict[str, Any], _one_of("a JSON object, or a string holding one")
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
        Annotated[StrictStr | list[TextPart], _one_of("a string or a list of text parts")] | None
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


def _template_variables(value: dict | None) -> dict | None:
    reserved = [k for k in value or () if k in _TEMPLATE_RESERVED]
    if reserved:
        raise ValueError(f"{reserved[0]!r} is the template's own input")
    return value


def _unused_only(values: dict[str, tuple], why: str):
    """A validator refusing each field of `values` unless absent or one of its "not used"
    values, saying `why`."""

    def check(value, info: ValidationInfo):
        if value is not None and value not in values[info.field_name]:
            raise ValueError(why)
        return value

    return field_validator(*values, mode="before")(check)


def _not_yet():
    return Field(None, description="not supported yet: refused unless absent or unused")


def _model():
    return Field(None, description="the served model's name (another one gets a 404)")


class _GenerationRequest(StructuredFields, _Body):
    """What completions and chat completions share (the output constraints among them)."""

    model: StrictStr | None = _model()
    n: StrictInt | None = None
    best_of: StrictInt | None = Field(None, description="only best_of = n is supported")
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    seed: StrictInt | None = None
    min_tokens: StrictInt | None = None
    ignore_eos: StrictBool | None = None
    stop: (
        Annotated[StrictStr | list[StrictStr], _one_of("a string or a list of strings")] | None
    ) = Field(None, description="strings that end a completion")
    stop_token_ids: list[StrictInt] | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None
    # not supported yet (NOT_SUPPORTED): refused unless absent or "not used"
    functions: Any = _not_yet()
    function_call: Any = _not_yet()
    suffix: Any = _not_yet()

    _not_supported = _unused_only(NOT_SUPPORTED, "not supported by this server")

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value, info: ValidationInfo):
        n = info.data.get("n")
        if value is not None and value not in (1, 1 if n is None else n):
            raise ValueError("only best_of = n is supported")
        return value

    @property
    def max_tokens_field(self) -> str:
        """The body field that set max_tokens (what an error about it names)."""
        return "max_tokens"

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keywords for the fields the body gives."""
        kw = {k: getattr(self, k) for k in _SAMPLING_FIELDS if getattr(self, k) is not None}
        structured = self.structured()
        if structured is not None:
            kw["structured"] = structured
        if self.speculative is not None:
            kw["speculative"] = self.speculative.enabled
            if self.speculative.num_drafts is not None:
                kw["num_drafts"] = self.speculative.num_drafts
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    """`POST /v1/completions`."""

    prompt: Annotated[
        StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]],
        _one_of("a string, a list of token ids, or a list of either (several prompts)"),
    ]
    logprobs: StrictInt | None = Field(None, description="how many top logprobs per token")
    echo: StrictBool | None = Field(None, description="the prompt before each completion")
    tools: Any = Field(None, description="chat completions only: refused unless unused")
    tool_choice: Any = Field(None, description="chat completions only: refused unless unused")
    parallel_tool_calls: Any = Field(None, description="chat completions only")

    _chat_only = _unused_only(CHAT_ONLY, "supported by chat completions only")

    @field_validator("echo")
    @classmethod
    def _echo(cls, value, info: ValidationInfo):
        if value and info.data.get("logprobs") is not None:  # 0 asks for the chosen token's too
            raise ValueError("the prompt's logprobs are not computed; drop logprobs")
        return value

    def sampling_kwargs(self) -> dict[str, Any]:
        kw = super().sampling_kwargs()
        if self.logprobs is not None:
            kw["logprobs"] = self.logprobs
        return kw

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts: one, or several given as a list of them."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt]


class ChatCompletionRequest(_GenerationRequest, ToolFields):
    """`POST /v1/chat/completions` (its tool fields: `tools.py`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, description="over max_tokens if both")
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=SamplingParams.MAX_LOGPROBS)] | None = None
    echo: StrictBool | None = Field(None, description="not supported for chat: false only")
    chat_template_kwargs: TemplateKwargs | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    @field_validator("echo")
    @classmethod
    def _echo(cls, value):
        if value:
            raise ValueError("not supported for chat completions")
        return value

    _variables = field_validator("chat_template_kwargs")(_template_variables)

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def sampling_kwargs(self) -> dict[str, Any]:
        kw = super().sampling_kwargs()
        # until the context ends when neither is given, as OpenAI's chat does
        newer = self.max_completion_tokens
        kw["max_tokens"] = newer if newer is not None else self.max_tokens
        if self.logprobs:
            kw["logprobs"] = self.top_logprobs or 0
        return kw


class TokenizeRequest(_Body):
    """`POST /tokenize`: a text prompt, or chat messages rendered by the chat template."""

    model: StrictStr | None = _model()
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    chat_template_kwargs: TemplateKwargs | None = None
    tools: list[Tool] | None = Field(None, description="rendered with the messages")
    prompt: StrictStr | None = Field(None, validate_default=True)
    add_special_tokens: StrictBool = True

    _variables = field_validator("chat_template_kwargs")(_template_variables)

    @field_validator("prompt")
    @classmethod
    def _prompt_or_messages(cls, value, info: ValidationInfo):
        # (messages that failed their own check are reported as such)
        if value is None and "messages" in info.data and info.data["messages"] is None:
            raise ValueError("expected a string (or give messages)")
        return value


class DetokenizeRequest(_Body):
    """`POST /detokenize`."""

    model: StrictStr | None = _model()
    tokens: list[StrictInt]
