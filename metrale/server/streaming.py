"""A streamed completion or chat completion as server-sent events: one chunk per engine output
that changed a choice (its text delta, logprobs, finish and stop reasons; for chat the role
first and, with a reasoning parser, thinking as `reasoning_content`; with tools, each tool call
whole as a `tool_calls` delta), the usage chunk when asked for, then `[DONE]`. One `created`
for every chunk of a stream. A completion the engine fails ends the stream with the OpenAI
error object instead (`protocol.generation_error`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from metrale.server.protocol import (
    SYSTEM_FINGERPRINT,
    chat_logprobs,
    completion_logprobs,
    generation_error,
    now,
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


async def one_prompt(events: AsyncIterator) -> AsyncIterator:
    """A single request's outputs as `sse_events` takes them: (prompt 0, output)."""
    async for out in events:
        yield 0, out


async def merged(streams: list[AsyncIterator]) -> AsyncIterator:
    """Several requests' outputs as they come, each as (its index, output); stopping early (or
    one stream raising) closes every stream, which aborts their unfinished requests."""
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):  # (in prompt order within a wake-up)
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def sse_events(
    request,
    events: AsyncIterator,
    request_id: str,
    params,
    chat: bool,
    include_usage: bool,
    echo: list[str] | None,
    style: StreamStyle,
    opened: bool = False,
    tools: ToolParsing | None = None,
    prompts: int = 1,
) -> AsyncIterator[str]:
    """`events`: (prompt index, RequestOutput) of the call's requests, one per prompt
    (`one_prompt`, `merged`; ending the iteration early aborts them); prompt i's completion j
    is choice i * n + j, as OpenAI numbers them. `echo`: each prompt's text, which its
    completions' first chunks start with (`protocol.echo_text`); `opened`: the chat prompt
    opened a thinking block (`reasoning.py`); `tools`: the answer's tool calls are sent as
    `tool_calls` deltas (`tool_parser.py`), after thinking is split."""
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

    width = params.n * prompts
    sent = [0] * width  # tokens already sent per choice
    offset = [0] * width  # characters of completion text sent per choice (text_offset)
    done = [False] * width  # choices whose finish was sent: never sent again
    thinking = None
    if style.reasoning and chat:
        thinking = [ThinkSplitter(opened) for _ in range(width)]
    calling = None
    if tools is not None and chat:
        calling = [tools.splitter() for _ in range(width)]
    finals = [None] * prompts
    async for i, out in events:
        finals[i] = out
        if await request.is_disconnected():
            return  # the finally of `outputs` aborts the request
        failed = generation_error([out])
        choices = []
        for c in out.outputs:
            at = i * params.n + c.index  # the choice's index in the response
            if done[at] or not (c.delta_text or c.finish_reason or c.delta_token_ids):
                continue
            if c.finish_reason == "error":  # sent as the stream's error event below
                continue
            if chat:
                ends, finish = c.finish_reason is not None, c.finish_reason
                think, text, calls = None, c.delta_text, None
                if thinking is not None:
                    think, text = thinking[at].feed(text, ends)
                if calling is not None:
                    splitter = calling[at]
                    first = splitter.count
                    text, parsed = splitter.feed(text, ends)
                    calls = [
                        ToolCallDelta(index=first + i, **call.as_openai())
                        for i, call in enumerate(parsed)
                    ]
                    if splitter.count:
                        finish = tool_calls_finish(finish)
                delta = ChatDelta(
                    role="assistant" if sent[at] == 0 else None,
                    content=text if text or not (think or calls) else None,
                    reasoning_content=think or None,
                    tool_calls=calls or None,
                )
                choice = ChatStreamChoice(
                    index=at,
                    delta=delta,
                    logprobs=chat_logprobs(c, style.tokenizer, k, sent[at]),
                    finish_reason=finish,
                    stop_reason=c.stop_reason,
                )
                if not (text or think or calls or finish or delta.role or choice.logprobs):
                    # tokens a parser holds back (a tool call taking shape): nothing to send
                    # yet, as vLLM sends nothing (their logprobs go with the next chunk)
                    continue
            else:
                echoed = echo[i] if echo is not None and not sent[at] else ""
                logprobs = completion_logprobs(c, style.tokenizer, k, sent[at], offset[at])
                if logprobs is not None:
                    offset[at] += sum(len(t) for t in logprobs.tokens)
                choice = CompletionChoice(
                    index=at,
                    text=echoed + c.delta_text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            done[at] = c.finish_reason is not None  # its finish is sent once
            sent[at] = len(c.token_ids)
            choices.append(choice)
        if choices:
            yield event(choices)
        if failed is not None:
            # as vLLM streams a failed generation: the error object, then the end (returning
            # stops `events`, which aborts the request's other completions)
            yield f"data: {json.dumps(failed.body())}\n\n"
            yield "data: [DONE]\n\n"
            return
    ended = [f for f in finals if f is not None]
    if include_usage and ended:
        yield event([], usage=usage(ended), metrale=spec_stats(ended))
    yield "data: [DONE]\n\n"
