"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (with SSE streaming),
/v1/models, /health and /metrics, over an `EngineLoop`.

A client that disconnects mid-stream aborts its request (its pages return to the pool); bad input
gets a 4xx in the OpenAI error shape and never reaches the engine; a full waiting queue gets a 503
with Retry-After.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from metrale.server.engine_loop import Busy, EngineLoop
from metrale.server.metrics import ServerMetrics
from metrale.server.protocol import (
    APIError,
    chat_logprobs,
    completion_logprobs,
    now,
    sampling_params,
    spec_stats,
    usage,
)


def create_app(loop: EngineLoop, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="metrale", version="0.1.0")
    metrics = ServerMetrics(loop)
    engine = loop.engine

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError):
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.middleware("http")
    async def auth_and_count(request: Request, call_next):
        start = time.perf_counter()
        path = request.url.path
        authorized = request.headers.get("authorization", "") == f"Bearer {api_key}"
        if api_key and path.startswith("/v1/") and not authorized:
            err = APIError(
                "missing or wrong API key", None, 401, "authentication_error", "invalid_api_key"
            )
            metrics.requests.labels(path, "401").inc()
            return JSONResponse(err.body(), status_code=401)
        response = await call_next(request)
        metrics.requests.labels(path, str(response.status_code)).inc()
        metrics.latency.labels(path).observe(time.perf_counter() - start)
        return response

    async def read_body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise APIError("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != model_name:
            raise APIError(
                f"model {model!r} does not exist; this server has {model_name!r}",
                "model",
                404,
                code="model_not_found",
            )
        return body

    def validate(prompt, params) -> list[int]:
        try:
            return engine.validate(prompt, params)[1]
        except ValueError as e:
            field = str(e).split(":", 1)[0].split(" ", 1)[0]
            raise APIError(str(e), field if field.isidentifier() else "prompt") from None

    def submit(request_id: str, ids: list[int], params) -> asyncio.Queue:
        try:
            return loop.submit(request_id, ids, params)
        except Busy as e:
            raise APIError(str(e), None, 503, "server_busy", "server_busy") from None

    async def outputs(request_id: str, queue: asyncio.Queue) -> AsyncIterator:
        """Every RequestOutput of a request; aborts it if the consumer stops early."""
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise APIError(str(item))
                finished = item.finished
                yield item
        finally:
            if not finished:
                loop.abort(request_id)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": now(),
                    "owned_by": "metrale",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.get("/metrics")
    def prometheus():  # sync: runs in the threadpool, so waiting for the lock blocks no loop
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        params = sampling_params(body, chat=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError("prompt: one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if prompt is None or not isinstance(prompt, (str, list)):
            raise APIError("prompt: expected a string or a list of token ids", "prompt")
        ids = validate(prompt, params)
        request_id = loop.new_id("cmpl")
        return await respond(request, body, request_id, ids, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_body(request)
        params = sampling_params(body, chat=True)
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
        ):
            raise APIError("messages: expected a non-empty list of {role, content}", "messages")
        try:
            text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as e:
            raise APIError(str(e), "messages") from None
        ids = validate(engine.tokenizer.encode(text, add_special_tokens=False), params)
        request_id = loop.new_id("chatcmpl")
        return await respond(request, body, request_id, ids, params, chat=True)

    async def respond(request, body, request_id, ids, params, chat: bool):
        queue = submit(request_id, ids, params)
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            stream = sse(request, request_id, queue, params, chat, include_usage)
            return StreamingResponse(stream, media_type="text/event-stream")
        final = None
        async for out in outputs(request_id, queue):
            final = out
        return whole_response(final, request_id, params, chat)

    def whole_response(out, request_id, params, chat: bool) -> dict:
        k = params.logprobs or 0
        choices = []
        for c in out.outputs:
            finish = c.finish_reason
            if chat:
                choices.append(
                    {
                        "index": c.index,
                        "finish_reason": finish,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": chat_logprobs(c, k),
                    }
                )
            else:
                choices.append(
                    {
                        "index": c.index,
                        "text": c.text,
                        "finish_reason": finish,
                        "logprobs": completion_logprobs(c, engine.tokenizer, k),
                    }
                )
        return {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": now(),
            "model": model_name,
            "choices": choices,
            "usage": usage(out),
            "metrale": {"speculative": spec_stats(out)},
        }

    async def sse(request, request_id, queue, params, chat: bool, include_usage: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"
        k = params.logprobs or 0
        sent = [0] * params.n  # tokens already sent per choice
        final = None
        async for out in outputs(request_id, queue):
            final = out
            if await request.is_disconnected():
                return  # the finally of `outputs` aborts the request
            choices = []
            for c in out.outputs:
                if not c.delta_text and not c.finish_reason and not c.delta_token_ids:
                    continue
                if chat:
                    delta = {"content": c.delta_text}
                    if sent[c.index] == 0:
                        delta["role"] = "assistant"
                    choice = {
                        "index": c.index,
                        "delta": delta,
                        "logprobs": chat_logprobs(c, k, sent[c.index]),
                    }
                else:
                    choice = {
                        "index": c.index,
                        "text": c.delta_text,
                        "logprobs": completion_logprobs(c, engine.tokenizer, k, sent[c.index]),
                    }
                choice["finish_reason"] = c.finish_reason
                sent[c.index] = len(c.token_ids)
                choices.append(choice)
            if choices:
                chunk = {
                    "id": request_id,
                    "object": kind,
                    "created": now(),
                    "model": model_name,
                    "choices": choices,
                }
                yield f"data: {json.dumps(chunk)}\n\n"
        if include_usage and final is not None:
            chunk = {
                "id": request_id,
                "object": kind,
                "created": now(),
                "model": model_name,
                "choices": [],
                "usage": usage(final),
                "metrale": {"speculative": spec_stats(final)},
            }
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return app
