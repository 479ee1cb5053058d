"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (with SSE streaming),
/health and /metrics (the smaller routes are in `extra_routes`), over an `EngineLoop`.

A client that disconnects (mid-stream, or before a whole response is ready) aborts its request
(its pages return to the pool); bad input gets a 4xx in the OpenAI error shape and never reaches
the engine: bodies are read and checked against the route's model (`schemas.py`, `routing.py`:
size cap, deadline, large ones off the event loop), tokenising runs off the loop, and every
field is checked before the request is submitted. Anything that still raises after submission
aborts the request. A full queue or a draining server gets a 503 with Retry-After. Metrics are
labelled by route template, one label for unmatched paths.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import sys
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from metrale import __version__
from metrale.chat_prompt import chat_error, chat_prompt_ids
from metrale.config import SamplingParams
from metrale.server.engine_loop import Busy, EngineLoop
from metrale.server.extra_routes import add_extra_routes
from metrale.server.metrics import ServerMetrics
from metrale.server.protocol import (
    APIError,
    chat_response,
    completion_response,
    echo_text,
    generation_error,
    sampling_params,
    sent_field_error,
)
from metrale.server.reasoning import REASONING_PARSERS, opens_block
from metrale.server.response_schemas import (
    ChatCompletionResponse,
    ChatCompletionStreamChunk,
    CompletionResponse,
    CompletionStreamChunk,
    HealthResponse,
)
from metrale.server.routing import ERROR_RESPONSES, document, json_body_route, validation_error
from metrale.server.schemas import ChatCompletionRequest, CompletionRequest
from metrale.server.streaming import StreamStyle, merged, one_prompt, sse_events
from metrale.server.tool_parser import ToolParsing
from metrale.server.tools import ToolPlan, plan_tools

log = logging.getLogger(__name__)

# Paths behind the API key when one is set (/health and /metrics stay open, as vLLM's do).
_PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/docs", "/redoc", "/openapi.json")


def create_app(
    loop: EngineLoop,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 32 << 20,
    body_timeout: float = 60.0,
    access_log: bool = False,
    allowed_origins: tuple[str, ...] = (),
    reasoning_parser: str | None = None,
) -> FastAPI:
    """`max_body_bytes`: larger bodies get a 413 before they are read; `body_timeout`: seconds
    a client may take to send its body (408 past it); `access_log`: one stderr line per
    request (client, method, path, status, milliseconds to the response's start);
    `allowed_origins`: CORS for browser clients (off unless given); `reasoning_parser`: split
    chat answers' thinking into `reasoning_content` (`reasoning.py`)."""
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(
            f"reasoning_parser: {reasoning_parser!r} is not one of {REASONING_PARSERS}"
        )
    reasoning = reasoning_parser is not None
    style = StreamStyle(loop.engine.tokenizer, model_name, reasoning)
    # strict_content_type off: a body without a Content-Type is JSON, as it always was here
    app = FastAPI(
        title="metrale",
        version=__version__,
        responses=ERROR_RESPONSES,
        strict_content_type=False,
    )
    app.router.route_class = json_body_route(model_name, max_body_bytes, body_timeout)
    document(
        app,
        {
            "/v1/completions": CompletionStreamChunk,
            "/v1/chat/completions": ChatCompletionStreamChunk,
        },
    )
    if allowed_origins:  # browsers calling the API from pages of other origins
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
        )
    metrics = ServerMetrics(loop)
    engine = loop.engine

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError):
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, exc: RequestValidationError):
        return JSONResponse(validation_error(exc).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code)
        err = APIError(str(exc.detail), None, exc.status_code, kind or "invalid_request_error")
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception):  # the last net: still JSON
        log.exception("unhandled error")
        err = APIError(f"internal error: {type(exc).__name__}", None, 500, "internal_error")
        return JSONResponse(err.body(), status_code=500)

    def route_of(request: Request) -> str:
        """The route template serving this request: a bounded set of metric labels."""
        for route in app.router.routes:
            if route.matches(request.scope)[0] is Match.FULL:
                return route.path
        return "unmatched"

    def authorized(request: Request) -> bool:
        # the header's raw bytes (Starlette decodes headers as latin-1) against the key's UTF-8
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # the scheme is case-insensitive (RFC 9110: "bearer" too), the key is not
        ok = hmac.compare_digest(given.encode("latin-1"), api_key.encode())
        return ok and scheme.lower() == "bearer"

    @app.middleware("http")
    async def auth_and_count(request: Request, call_next):
        start = time.perf_counter()
        route = route_of(request)
        length = request.headers.get("content-length", "")
        if api_key and request.url.path.startswith(_PROTECTED) and not authorized(request):
            err = APIError(
                "missing or wrong API key", None, 401, "authentication_error", "invalid_api_key"
            )
            response = JSONResponse(err.body(), status_code=401)
        elif length.isdigit() and int(length) > max_body_bytes:
            err = APIError(f"the body is {length} bytes; the limit is {max_body_bytes}", None, 413)
            response = JSONResponse(err.body(), status_code=413)
        else:
            response = await call_next(request)
        metrics.requests.labels(route, str(response.status_code)).inc()
        elapsed = time.perf_counter() - start
        metrics.latency.labels(route).observe(elapsed)
        if access_log:
            client = request.client.host if request.client else "-"
            path = request.url.path.encode("unicode_escape").decode()  # no forged lines
            print(
                f'{client} "{request.method} {path}" {response.status_code} {elapsed * 1e3:.1f}ms',
                file=sys.stderr,
                flush=True,
            )
        return response

    def validate_now(prompt, params, body) -> list[int]:
        try:
            ids = engine.validate(prompt, params)[1]
        except ValueError as e:
            field = str(e).split(":", 1)[0].split(" ", 1)[0]
            renamed = sent_field_error(e, field, body)  # (chat's prompt: its messages)
            if renamed is not None:
                raise renamed from None
            if field.split(".", 1)[0] == "structured":  # the output constraint does not compile
                field = body.structured_field() or "tools"  # (else a tool_choice's grammar)
                message = f"{field}: {str(e).split(':', 1)[1].strip()}"
                raise APIError(message, field) from None
            raise APIError(str(e), field if field.isidentifier() else "prompt") from None
        limit = engine.context_len  # (max_model_len, or less where the KV pool holds less)
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            # refused, as vLLM does, rather than cut short without a word
            sent = body.max_tokens_field  # (chat's max_completion_tokens, where that was sent)
            raise APIError(
                f"{sent}: the prompt's {len(ids)} tokens plus {sent}={params.max_tokens} "
                f"exceed the context of {limit} tokens",
                sent,
            )
        return ids

    async def validate(prompt, params, body) -> list[int]:
        """Tokenise and check on a worker thread: a long prompt never stalls the event loop."""
        return await asyncio.to_thread(validate_now, prompt, params, body)

    def submit(request_id: str, ids: list[int], params) -> asyncio.Queue:
        return submit_all([(request_id, ids, params)])[0]

    def submit_all(requests: list) -> list[asyncio.Queue]:
        try:
            return loop.submit_all(requests)
        except Busy as e:
            raise APIError(str(e), None, 503, "server_busy", "server_busy") from None

    async def outputs(request_id: str, queue: asyncio.Queue) -> AsyncIterator:
        """Every RequestOutput of a request; aborts it if the consumer stops early."""
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, ValueError):  # the request's own (a race with the pool)
                    raise APIError(str(item))
                if isinstance(item, Exception):  # the engine's fault, not the request's
                    raise APIError(f"internal error: {item}", None, 500, "internal_error")
                finished = item.finished
                yield item
        finally:
            if not finished:
                loop.abort(request_id)

    async def departure(request: Request) -> None:
        """Returns when the client disconnects (its body was read already: the next message
        the server gets for this request is the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def final_output(request: Request, request_id: str, queue: asyncio.Queue):
        """The request's last output, or None if its client left first (then it is aborted,
        by `outputs` when the collecting task is cancelled)."""

        async def collect():
            final = None
            async for out in outputs(request_id, queue):
                final = out
            return final

        collecting = asyncio.ensure_future(collect())
        watching = asyncio.ensure_future(departure(request))
        try:
            done, _ = await asyncio.wait(
                {collecting, watching}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            watching.cancel()
            if not collecting.done():
                collecting.cancel()
        return collecting.result() if collecting in done else None

    # (HEAD too, out of the schema, where it would repeat GET's operation id: load balancers'
    # health probes often send it)
    @app.head("/health", include_in_schema=False)
    @app.get("/health", response_model=HealthResponse)
    async def health():
        if loop.fatal is not None:  # the engine cannot run (a tensor-parallel rank failed)
            body = HealthResponse(status="error", error=loop.fatal)
            return JSONResponse(body.model_dump(), status_code=503)
        return HealthResponse(status="ok")

    add_extra_routes(app, engine, model_name)

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus():  # sync: runs in the threadpool, so waiting for the lock blocks no loop
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(request: Request, body: CompletionRequest):
        params = sampling_params(body, engine.tokenizer.sampling_defaults)
        prompts = body.prompts
        if len(prompts) > 1:
            return await several_prompts(request, body, prompts, params)
        ids = await validate(prompts[0], params, body)
        request_id = loop.new_id("cmpl")
        echo = echo_text(prompts[0], engine.tokenizer) if body.echo else None
        return await respond(request, body, request_id, ids, params, echo=echo)

    async def several_prompts(request: Request, body: CompletionRequest, prompts: list, params):
        """A completions call with several prompts: one request each, answered together."""
        if len(prompts) * params.n > SamplingParams.MAX_N:
            raise APIError(f"prompt: at most {SamplingParams.MAX_N} completions a call", "prompt")
        all_ids = [await validate(p, params, body) for p in prompts]  # every prompt checked first
        base = loop.new_id("cmpl")
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        try:
            # all admitted at once, or none: one by one, the later prompts were refused by the
            # earlier ones past the capacity, even on an idle server (found in review)
            queues = submit_all([(r, p, params) for r, p in zip(ids, all_ids, strict=True)])
            echoes = [echo_text(p, engine.tokenizer) for p in prompts] if body.echo else None
            if body.stream:  # one stream of every prompt's choices, as they come (as vLLM's)
                streams = [outputs(r, q) for r, q in zip(ids, queues, strict=True)]
                events = sse_events(
                    request, merged(streams), base, params, False, body.include_usage, echoes,
                    style, prompts=len(prompts),
                )  # fmt: skip
                return StreamingResponse(events, media_type="text/event-stream")
            finals = await asyncio.gather(
                *(final_output(request, r, q) for r, q in zip(ids, queues, strict=False))
            )
        except BaseException:
            for request_id in ids:
                loop.abort(request_id)
            raise
        if any(f is None for f in finals):
            return Response(status_code=499)  # the client left; every part is aborted
        failed = generation_error(finals)
        if failed is not None:
            raise failed
        return completion_response(finals, base, params, engine.tokenizer, model_name, echoes)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat(request: Request, body: ChatCompletionRequest):
        params = sampling_params(body, engine.tokenizer.sampling_defaults)
        variables = body.chat_template_kwargs or {}

        def render() -> tuple[list[int], bool, ToolPlan]:
            """The prompt's token ids, whether it leaves a thinking block open, and what its
            tools do (on a worker thread: templating, tokenising, compiling a tool grammar)."""
            plan = plan_tools(body, engine.tokenizer, engine.grammars)
            messages = [m.for_template() for m in body.messages]
            messages, tools = plan.render(messages, engine.tokenizer)
            try:
                ids, text = chat_prompt_ids(
                    engine.tokenizer,
                    messages,
                    engine.context_len,
                    tools,
                    variables,
                    **body.render_options(),
                )
            except Exception as e:  # noqa: BLE001 (a template fails as it fails: the input's fault)
                raise APIError(*chat_error(e)) from None
            if not ids:
                raise APIError("messages: the chat template rendered nothing", "messages")
            return ids, reasoning and opens_block(text), plan

        ids, opened, plan = await asyncio.to_thread(render)
        try:
            params = plan.apply(params)
        except ValueError as e:  # the tool choice's constraint and the body's other fields
            field = str(e).split(":", 1)[0]
            raise APIError(str(e), field if field in type(body).model_fields else None) from None
        ids = await validate(ids, params, body)
        request_id = loop.new_id("chatcmpl")
        return await respond(request, body, request_id, ids, params, opened, plan.parsing)

    async def respond(
        request,
        body,
        request_id,
        ids,
        params,
        opened: bool = False,
        tools: ToolParsing | None = None,
        echo: str | None = None,
    ):
        chat = isinstance(body, ChatCompletionRequest)
        queue = submit(request_id, ids, params)
        try:
            if body.stream:
                events = one_prompt(outputs(request_id, queue))
                stream = sse_events(
                    request,
                    events,
                    request_id,
                    params,
                    chat,
                    body.include_usage,
                    None if echo is None else [echo],
                    style,
                    opened,
                    tools,
                )
                return StreamingResponse(stream, media_type="text/event-stream")
            final = await final_output(request, request_id, queue)
            if final is None:  # the client went away; its request is aborted
                return Response(status_code=499)
            failed = generation_error([final])
            if failed is not None:
                raise failed
            if chat:
                return chat_response(
                    final,
                    request_id,
                    params,
                    model_name,
                    engine.tokenizer,
                    reasoning,
                    opened,
                    tools,
                )
            return completion_response(
                [final],
                request_id,
                params,
                engine.tokenizer,
                model_name,
                None if echo is None else [echo],
            )
        except BaseException:
            loop.abort(request_id)  # nothing submitted keeps running for nobody
            raise

    return app
