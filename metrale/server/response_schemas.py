"""The response bodies of the OpenAI-compatible API as pydantic models: what every route sends
(whole responses, stream chunks, usage, logprobs, the models list, the error object), built by
`protocol.py` and `streaming.py` and declared on the routes so /openapi.json lists them. The
shapes are OpenAI's (vLLM's where it adds fields such as `stop_reason`), plus metrale's
`metrale` object of speculative-decoding figures.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer


class _Body(BaseModel):
    """A response object; fields named in `_omit_none` are left out of the JSON when None."""

    _omit_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit(self, handler: SerializerFunctionWrapHandler):
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None or k not in self._omit_none}


class ErrorInfo(_Body):
    message: str
    type: str
    param: str | None = Field(None, description="the request field at fault")
    code: str | None = None


class ErrorResponse(_Body):
    """Every 4xx and 5xx: OpenAI's error object."""

    error: ErrorInfo


class PromptTokensDetails(_Body):
    cached_tokens: int = Field(
        description="prompt tokens whose KV came from the prefix cache (0 with caching off)"
    )


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # always sent, as OpenAI does (cached_tokens 0 without a hit or with caching off)
    prompt_tokens_details: PromptTokensDetails


class SpeculativeStats(_Body):
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float | None = Field(description="accepted / drafted; null if none drafted")


class MetraleStats(_Body):
    """metrale's extension: the request's speculative decoding."""

    speculative: SpeculativeStats


class CompletionLogprobs(_Body):
    """The legacy completions logprobs, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int] = Field(description="each token's character offset in the text")


class CompletionChoice(_Body):
    """A completion, or in a stream the text its chunk adds."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(
        None, description="the stop token id or stop string that ended it; null for EOS, length"
    )


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[ChatTokenLogprob]


class FunctionCallOut(_Body):
    name: str
    arguments: str = Field(description="the arguments object as JSON text")


class ToolCallOut(_Body):
    """A tool call the answer made (`tool_parser.py`)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(_Body):
    _omit_none = frozenset({"tool_calls"})

    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="null when the answer is only tool calls")
    reasoning_content: str | None = Field(
        None, description="the model's thinking, with --reasoning-parser"
    )
    tool_calls: list[ToolCallOut] | None = Field(None, description="left out when none")


class ChatChoice(_Body):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ToolCallDelta(ToolCallOut):
    index: int = Field(description="the call's place among the answer's calls, from 0")


class ChatDelta(_Body):
    """What a stream chunk adds to a chat choice: only the fields it has."""

    _omit_none = frozenset({"role", "content", "reasoning_content", "tool_calls"})

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = Field(
        None, description="each call whole, in the chunk where its text ends"
    )


class ChatStreamChoice(_Body):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Response(_Body):
    id: str
    object: str
    created: int = Field(description="Unix seconds; one value for every chunk of a stream")
    model: str
    system_fingerprint: str
    choices: list


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage
    metrale: MetraleStats


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    metrale: MetraleStats


class _StreamChunk(_Response):
    """One server-sent event; the last one before `[DONE]` carries `usage` (and `metrale`)
    alone, with no choices, when the request asked for it (`stream_options.include_usage`)."""

    _omit_none = frozenset({"usage", "metrale"})

    usage: Usage | None = None
    metrale: MetraleStats | None = None


class CompletionStreamChunk(_StreamChunk):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionStreamChunk(_StreamChunk):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


class ModelCard(_Body):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "metrale"
    max_model_len: int


class ModelList(_Body):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Body):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Body):
    prompt: str


class VersionResponse(_Body):
    version: str


class HealthResponse(_Body):
    _omit_none = frozenset({"error"})

    status: Literal["ok", "error"]
    error: str | None = Field(None, description="why the engine cannot run")
