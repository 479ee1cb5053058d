"""A streamed completion or chat completion as server-sent events: one chunk per engine output
that changed a choice (its text delta, logprobs, finish and stop reasons; for chat the role
first and, with a reasoning parser, thinking as `reasoning_content`; with tools, each tool call
whole as a `tool_calls` delta), the usage chunk when asked for, then `[DONE]`. One `created`
for every chunk of a stream. A completion the engine fails ends the stream with the OpenAI
error object instead (`protocol.generation_error`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from metrale.server.protocol import (
    SYSTEM_FINGERPRINT,
    chat_logprobs,
    completion_logprobs,
    generation_error,
    now,
    prompt_text,
    spec_stats,
    tool_calls_finish,
    usage,
)
from metrale.server.reasoning import ThinkSplitter
from metrale.server.response_schemas import (
    ChatCompletionStreamChunk,
    ChatDelta,
    ChatStreamChoice,
    CompletionChoice,
    CompletionStreamChunk,
    ToolCallDelta,
)
from metrale.server.tool_parser import ToolParsing


@dataclass(frozen=True)
class StreamStyle:
    """What every stream of one server shares."""

    tokenizer: object
    model_name: str
    reasoning: bool  # split chat thinking into reasoning_content


async def sse_events(
    request,
    events: AsyncIterator,
    request_id: str,
    params,
    chat: bool,
    include_usage: bool,
    echo: bool,
    style: StreamStyle,
    opened: bool = False,
    tools: ToolParsing | None = None,
) -> AsyncIterator[str]:
    """`events`: the request's RequestOutputs (ending the iteration early aborts it);
    `opened`: the chat prompt opened a thinking block (`reasoning.py`); `tools`: the answer's
    tool calls are sent as `tool_calls` deltas (`tool_parser.py`), after thinking is split."""
    chunk_type = ChatCompletionStreamChunk if chat else CompletionStreamChunk
    k, created = params.logprobs or 0, now()  # one `created` for every chunk of a stream

    def event(choices: list, **extra) -> str:
        chunk = chunk_type(
            id=request_id,
            created=created,
            model=style.model_name,
            system_fingerprint=SYSTEM_FINGERPRINT,
            choices=choices,
            **extra,
        )
        return f"data: {chunk.model_dump_json()}\n\n"

    sent = [0] * params.n  # tokens already sent per choice
    offset = [0] * params.n  # characters of completion text sent per choice (text_offset)
    done = [False] * params.n  # choices whose finish was sent: never sent again
    thinking = None
    if style.reasoning and chat:
        thinking = [ThinkSplitter(opened) for _ in range(params.n)]
    calling = None
    if tools is not None and chat:
        calling = [tools.splitter() for _ in range(params.n)]
    final = None
    async for out in events:
        final = out
        if await request.is_disconnected():
            return  # the finally of `outputs` aborts the request
        failed = generation_error([out])
        choices = []
        for c in out.outputs:
            if done[c.index] or not (c.delta_text or c.finish_reason or c.delta_token_ids):
                continue
            if c.finish_reason == "error":  # sent as the stream's error event below
                continue
            if chat:
                ends, finish = c.finish_reason is not None, c.finish_reason
                think, text, calls = None, c.delta_text, None
                if thinking is not None:
                    think, text = thinking[c.index].feed(text, ends)
                if calling is not None:
                    splitter = calling[c.index]
                    first = splitter.count
                    text, parsed = splitter.feed(text, ends)
                    calls = [
                        ToolCallDelta(index=first + i, **call.as_openai())
                        for i, call in enumerate(parsed)
                    ]
                    if splitter.count:
                        finish = tool_calls_finish(finish)
                delta = ChatDelta(
                    role="assistant" if sent[c.index] == 0 else None,
                    content=text if text or not (think or calls) else None,
                    reasoning_content=think or None,
                    tool_calls=calls or None,
                )
                choice = ChatStreamChoice(
                    index=c.index,
                    delta=delta,
                    logprobs=chat_logprobs(c, style.tokenizer, k, sent[c.index]),
                    finish_reason=finish,
                    stop_reason=c.stop_reason,
                )
                if not (text or think or calls or finish or delta.role or choice.logprobs):
                    # tokens a parser holds back (a tool call taking shape): nothing to send
                    # yet, as vLLM sends nothing (their logprobs go with the next chunk)
                    continue
            else:
                echoed = prompt_text(out, style.tokenizer) if echo and not sent[c.index] else ""
                logprobs = completion_logprobs(
                    c, style.tokenizer, k, sent[c.index], offset[c.index]
                )
                if logprobs is not None:
                    offset[c.index] += sum(len(t) for t in logprobs.tokens)
                choice = CompletionChoice(
                    index=c.index,
                    text=echoed + c.delta_text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            done[c.index] = c.finish_reason is not None  # its finish is sent once
            sent[c.index] = len(c.token_ids)
            choices.append(choice)
        if choices:
            yield event(choices)
        if failed is not None:
            # as vLLM streams a failed generation: the error object, then the end (returning
            # stops `events`, which aborts the request's other completions)
            yield f"data: {json.dumps(failed.body())}\n\n"
            yield "data: [DONE]\n\n"
            return
    if include_usage and final is not None:
        yield event([], usage=usage([final]), metrale=spec_stats([final]))
    yield "data: [DONE]\n\n"
