"""Between the API's models and the engine: a validated request body (`schemas.py`) to
`SamplingParams`, and finished `RequestOutput`s to the response models (`response_schemas.py`):
choices, logprobs, usage and metrale's speculative figures.

A request the engine refuses raises `APIError` naming the field at fault, which the app turns
into an HTTP 4xx with the OpenAI error object `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import itertools
import time

from metrale import __version__
from metrale.config import SamplingParams
from metrale.outputs import CompletionOutput, RequestOutput
from metrale.server.reasoning import split_whole
from metrale.server.response_schemas import (
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    MetraleStats,
    PromptTokensDetails,
    SpeculativeStats,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from metrale.server.tool_parser import ToolParsing

# Which build answered (OpenAI's field): the version, so clients can tell engines apart.
SYSTEM_FINGERPRINT = f"metrale-{__version__}"


class APIError(Exception):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = (
            message,
            param,
            status,
            type_,
            code,
        )

    def body(self) -> dict:
        error = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=error).model_dump()


def generation_error(outs: list[RequestOutput]) -> APIError | None:
    """The error of the first completion that the engine ended with finish_reason "error", as
    vLLM answers one (the request fails whole, with the engine's message), else None: a 400
    where the request itself caused it (`CompletionOutput.error_by_request`: its grammar failed
    on a token, it can never fit the KV pool), as a check at admission would have; else the
    server's, a 500."""
    for out in outs:
        for c in out.outputs:
            if c.finish_reason == "error":
                why = c.error or "the engine failed this request"
                if c.error_by_request:
                    return APIError(f"generation failed: {why}", None, 400)
                return APIError(f"generation failed: {why}", None, 500, "internal_error")
    return None


def sampling_params(request, defaults: dict | None = None) -> SamplingParams:
    """A completions or chat request's SamplingParams; `defaults`: the model's
    generation_config sampling, for fields the body leaves out."""
    try:
        return SamplingParams(**{**(defaults or {}), **request.sampling_kwargs()})
    except (ValueError, TypeError) as e:
        named = str(e).split(" ", 1)[0].split(":", 1)[0].split("[", 1)[0]
        renamed = sent_field_error(e, named, request)
        if renamed is not None:
            raise renamed from None
        raise APIError(str(e), named if named in type(request).model_fields else None) from None


def sent_field_error(e: Exception, named: str, body) -> APIError | None:
    """The engine's error about its field `named` as an error about the body field the client
    sent (`body_field`), message first naming it; None where the two are the same field."""
    sent = body_field(named, body)
    if sent == named:
        return None
    said = str(e)[len(named) :].lstrip(": ") if named.startswith("prompt") else str(e)
    return APIError(f"{sent}: {said}", sent)


def body_field(field: str, body) -> str:
    """The body field an engine's error about `field` is about: a chat's prompt is its messages,
    `num_drafts` comes in the speculative options, max_tokens perhaps as max_completion_tokens."""
    if field in ("prompt", "prompt_token_ids"):
        return "messages" if hasattr(body, "messages") else "prompt"
    if field in ("num_drafts", "speculative"):
        return "speculative"
    if field == "max_tokens":
        return body.max_tokens_field
    return field


def usage(outs: list[RequestOutput]) -> Usage:
    prompt = sum(len(out.prompt_token_ids) for out in outs)
    completion = sum(len(c.token_ids) for out in outs for c in out.outputs)
    cached = sum(out.num_cached_tokens for out in outs)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def spec_stats(outs: list[RequestOutput]) -> MetraleStats:
    """Per-request speculative figures (the `metrale` extension field of responses)."""
    drafted = sum(c.num_draft_tokens for out in outs for c in out.outputs)
    accepted = sum(c.num_accepted_tokens for out in outs for c in out.outputs)
    stats = SpeculativeStats(
        num_draft_tokens=drafted,
        num_accepted_tokens=accepted,
        acceptance_rate=accepted / drafted if drafted else None,
    )
    return MetraleStats(speculative=stats)


def completion_logprobs(
    c: CompletionOutput, tokenizer, k: int, start: int = 0, offset: int = 0
) -> CompletionLogprobs | None:
    """The legacy completions `logprobs` object for tokens[start:], whose text starts at
    character `offset` of the completion (a stream keeps it running: no re-decoding)."""
    if c.logprobs is None:
        return None
    entries = c.logprobs[start:]
    pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in c.token_ids[start:]]
    # each token's character offset in the completion, from its decoded piece (as vLLM's)
    offsets = list(itertools.accumulate((len(p) for p in pieces), initial=offset))
    return CompletionLogprobs(
        tokens=pieces,
        token_logprobs=[next(iter(e.values())).logprob for e in entries],
        top_logprobs=[_with_chosen(e, k) for e in entries],
        text_offset=offsets[:-1],
    )


def _with_chosen(entry: dict, k: int) -> dict[str, float]:
    """A completions position's `top_logprobs`: the chosen token, then the top-k (up to k + 1
    entries, as OpenAI's legacy completions and vLLM give them: the sampled token's logprob is
    always there, and `logprobs: 0` gives it alone)."""
    chosen = next(iter(entry.values()))
    out = {chosen.decoded_token or "": chosen.logprob}
    # Keys are texts: tokens of one text (pieces of a character, all U+FFFD) share a key, which
    # keeps the chosen token's logprob, then the best-ranked one's (found in review: a later
    # alternative overwrote the chosen token's value)
    for _, lp in _top(entry, k):
        out.setdefault(lp.decoded_token or "", lp.logprob)
    return out


def _top(entry: dict, k: int) -> list:
    """The top-k of one position's logprobs as (token id, Logprob), best first (the emitted
    token too, if in them)."""
    ranked = [(i, lp) for i, lp in entry.items() if lp.rank is not None and lp.rank <= k]
    return sorted(ranked, key=lambda pair: pair[1].rank)


def chat_logprobs(c: CompletionOutput, tokenizer, k: int, start: int = 0) -> ChatLogprobs | None:
    """The chat `logprobs` object for tokens[start:]: each token's text, logprob and bytes (the
    token's own: a byte-level token's text may be U+FFFD, a piece of a character)."""
    if c.logprobs is None:
        return None

    def item(token_id: int, lp) -> dict:
        raw = list(tokenizer.token_bytes(token_id))
        return {"token": lp.decoded_token or "", "logprob": lp.logprob, "bytes": raw}

    content = []
    for entry in c.logprobs[start:]:
        first = next(iter(entry.items()))  # the emitted token
        top = [TopLogprob(**item(*pair)) for pair in _top(entry, k)]
        content.append(ChatTokenLogprob(**item(*first), top_logprobs=top))
    return ChatLogprobs(content=content)


def tool_calls_finish(finish_reason: str | None) -> str | None:
    """An answer that made tool calls and ended by itself finishes with "tool_calls" (one cut
    short keeps "length", as an aborted one keeps "abort")."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def now() -> int:
    return int(time.time())


def echo_text(prompt: str | list[int], tokenizer) -> str:
    """A completions prompt as `echo` returns it: the string sent, as sent (its special tokens
    and whatever the tokenizer normalises kept), or token ids decoded with their special
    tokens (transformers' `decode` default, which vLLM's echo follows)."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(prompt, skip_special_tokens=False)


def completion_response(
    outs: list[RequestOutput],
    request_id: str,
    params,
    tokenizer,
    model_name: str,
    echoes: list[str] | None = None,
) -> CompletionResponse:
    """The completions response for finished requests, one per prompt: choice `i * n + j` is
    prompt i's j-th completion (as OpenAI numbers them); `echoes`: each prompt's text
    (`echo_text`), which its completions' texts start with."""
    k = params.logprobs or 0
    choices = []
    for i, out in enumerate(outs):
        echoed = echoes[i] if echoes is not None else ""
        for c in out.outputs:
            choice = CompletionChoice(
                index=i * params.n + c.index,
                text=echoed + c.text,
                logprobs=completion_logprobs(c, tokenizer, k),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            choices.append(choice)
    return CompletionResponse(choices=choices, **_envelope(outs, request_id, model_name))


def _envelope(outs: list[RequestOutput], request_id: str, model_name: str) -> dict:
    """The fields a completions and a chat response share around their choices."""
    return {
        "id": request_id,
        "created": now(),
        "model": model_name,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage(outs),
        "metrale": spec_stats(outs),
    }


def chat_response(
    out: RequestOutput,
    request_id: str,
    params,
    model_name: str,
    tokenizer,
    reasoning: bool = False,
    opened: bool = False,
    tools: ToolParsing | None = None,
) -> ChatCompletionResponse:
    """The chat response of a finished request; `reasoning`: the answer's thinking goes to
    `reasoning_content` (`reasoning.py`; `opened`: the prompt opened the block); `tools`: the
    answer's tool calls go to `tool_calls` (`tool_parser.py`), after the thinking is split."""
    k = params.logprobs or 0
    choices = []
    for c in out.outputs:
        thought, content = split_whole(c.text, opened) if reasoning else (None, c.text)
        calls, finish = None, c.finish_reason
        if tools is not None:
            content, parsed = tools.split(content)
            if parsed:
                calls = [ToolCallOut(**call.as_openai()) for call in parsed]
                finish = tool_calls_finish(finish)
        if reasoning:  # an answer that is all thinking has no content (null, as vLLM's parsers)
            content = content or None
        message = ChatResponseMessage(content=content, reasoning_content=thought, tool_calls=calls)
        choice = ChatChoice(
            index=c.index,
            message=message,
            logprobs=chat_logprobs(c, tokenizer, k),
            finish_reason=finish,
            stop_reason=c.stop_reason,
        )
        choices.append(choice)
    return ChatCompletionResponse(choices=choices, **_envelope([out], request_id, model_name))
