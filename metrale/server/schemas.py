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

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)

from metrale.sampling_params import SamplingParams
from metrale.server.chat_messages import (
    Body,
    ChatMessage,
    TemplateKwargs,
    one_of,
    template_variables,
)
from metrale.server.structured_schemas import StructuredFields
from metrale.server.tools import Tool, ToolFields

# Fields refused until supported (never silently ignored), with the values that mean "not used".
# To support one, drop it here and give its field below a real type.
NOT_SUPPORTED: dict[str, tuple] = {
    "functions": ([],),  # OpenAI's deprecated forms of tools and tool_choice
    "function_call": ("none",),
    "suffix": ("",),
    "return_tokens_as_token_ids": (False,),  # vLLM's "token_id:N" strings for tokens
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
    "include_stop_str_in_output",
    "skip_special_tokens",
    # vLLM's fields that metrale does not implement: passed on, so that a value that would
    # change the output is a 400 naming it (`sampling_params._VLLM_UNSUPPORTED`), not ignored
    "use_beam_search",
    "length_penalty",
    "early_stopping",
    "prompt_logprobs",
    "bad_words",
    "allowed_token_ids",
    "truncate_prompt_tokens",
    "spaces_between_special_tokens",
)


class SpeculativeOptions(Body):
    """metrale's extension: speculative decoding for this request."""

    enabled: StrictBool = True
    num_drafts: StrictInt | None = Field(None, description="cap on the draft depth")


def _unused_only(values: dict[str, tuple], why: str):
    """A validator refusing each field of `values` unless absent or one of its "not used"
    values, saying `why`."""

    def check(value, info: ValidationInfo):
        if value is not None and value not in values[info.field_name]:
            raise ValueError(why)
        return value

    return field_validator(*values, mode="before")(check)


class StreamOptions(Body):
    include_usage: StrictBool | None = None
    # vLLM's usage in every chunk: refused (not ignored) until supported
    continuous_usage_stats: StrictBool | None = None

    _not_supported = _unused_only(
        {"continuous_usage_stats": (False,)}, "not supported by this server"
    )


def _not_yet():
    return Field(None, description="not supported yet: refused unless absent or unused")


def _vllm_only():
    return Field(None, description="vLLM's; not implemented: refused unless unused")


def _model():
    return Field(None, description="the served model's name (another one gets a 404)")


class _GenerationRequest(StructuredFields, Body):
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
    stop: Annotated[StrictStr | list[StrictStr], one_of("a string or a list of strings")] | None = (
        Field(None, description="strings that end a completion")
    )
    stop_token_ids: list[StrictInt] | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    use_beam_search: Any = _vllm_only()
    length_penalty: Any = _vllm_only()
    early_stopping: Any = _vllm_only()
    prompt_logprobs: Any = _vllm_only()
    bad_words: Any = _vllm_only()
    allowed_token_ids: Any = _vllm_only()
    truncate_prompt_tokens: Any = _vllm_only()
    spaces_between_special_tokens: Any = _vllm_only()
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None
    # not supported yet (NOT_SUPPORTED): refused unless absent or "not used"
    functions: Any = _not_yet()
    function_call: Any = _not_yet()
    suffix: Any = _not_yet()
    return_tokens_as_token_ids: Any = _not_yet()

    _not_supported = _unused_only(NOT_SUPPORTED, "not supported by this server")

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("only with stream: true")  # (OpenAI's and vLLM's rule)
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value, info: ValidationInfo):
        n = info.data.get("n")
        n = 1 if n is None else n
        if value is not None and value < n:  # as vLLM and OpenAI refuse it
            raise ValueError(f"best_of must be greater than or equal to n, got {value} < {n}")
        if value is not None and value != n:
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
        one_of("a string, a list of token ids, or a list of either (several prompts)"),
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
        if self.max_tokens is None and "max_tokens" in self.model_fields_set:
            # sent as null: until the context ends (vLLM's reading); left out: the default 16
            kw["max_tokens"] = None
        return kw

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts: one, or several given as a list of them."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt]


class ChatRenderFields(BaseModel):
    """How the messages end the prompt (vLLM's fields of the same names; `chat_prompt_ids`
    refuses both true, a 400 naming `continue_final_message`)."""

    add_generation_prompt: StrictBool = Field(True, description="open the assistant's turn")
    continue_final_message: StrictBool = Field(
        False,
        description="end the prompt inside the final message, for the model to go on with it "
        "(a prefilled assistant turn; add_generation_prompt false)",
    )

    # vLLM's: a template of the request's own, and RAG documents for it (refused: ignored,
    # they would change the prompt silently)
    chat_template: Any = _vllm_only()
    documents: Any = _vllm_only()

    @field_validator("chat_template", "documents", mode="before")
    @classmethod
    def _model_template_only(cls, value):
        if value is not None:
            raise ValueError("not supported: the model's own chat template renders the messages")
        return value

    def render_options(self) -> dict[str, bool]:
        """`chat_prompt_ids`'s keyword arguments for these fields."""
        return dict(
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
        )


class ChatCompletionRequest(_GenerationRequest, ToolFields, ChatRenderFields):
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

    _variables = field_validator("chat_template_kwargs")(template_variables)

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


class TokenizeRequest(ChatRenderFields, Body):
    """`POST /tokenize`: a text prompt, or chat messages rendered by the chat template."""

    model: StrictStr | None = _model()
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    chat_template_kwargs: TemplateKwargs | None = None
    tools: list[Tool] | None = Field(None, description="rendered with the messages")
    prompt: StrictStr | None = Field(None, validate_default=True)
    add_special_tokens: StrictBool = True

    _variables = field_validator("chat_template_kwargs")(template_variables)

    @field_validator("prompt")
    @classmethod
    def _prompt_or_messages(cls, value, info: ValidationInfo):
        # (messages that failed their own check are reported as such)
        if value is None and "messages" in info.data and info.data["messages"] is None:
            raise ValueError("expected a string (or give messages)")
        if value is not None:
            # (silently ignored beside a prompt: found in review)
            if info.data.get("messages") is not None:
                raise ValueError("give a prompt or messages, not both")
            for name in ("tools", "chat_template_kwargs"):
                if info.data.get(name) is not None:
                    raise ValueError(f"{name} render with messages, not a prompt")
        return value


class DetokenizeRequest(Body):
    """`POST /detokenize`."""

    model: StrictStr | None = _model()
    tokens: list[StrictInt]
