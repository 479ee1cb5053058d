"""The FastAPI plumbing under the API's models: how a POST route reads its JSON body, how a
body that fails its model is answered, and what /openapi.json adds to FastAPI's own schema.

A body is read with a size cap (413) and a deadline (408), only as JSON (415), and parsed off
the event loop when large; its `model` is checked first (404 for another model's name). FastAPI
then validates it against the route's model, except a large body, which is validated on the same
worker thread, so no request stalls the loop. A validation failure is answered as every other
error is: HTTP 400 with the OpenAI error object naming the field (`param`), not FastAPI's 422.
/openapi.json documents the error object for 4xx/5xx in place of the 422, and the stream
chunks a streamed route sends as `text/event-stream`.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import ClientDisconnect

from metrale.server.chat_messages import error_path
from metrale.server.protocol import APIError
from metrale.server.response_schemas import ErrorResponse

log = logging.getLogger(__name__)

# Bodies past this size are parsed and validated on a worker thread, not on the event loop.
_THREAD_PARSE_BYTES = 1 << 20

ERROR_RESPONSES = {
    status: {"model": ErrorResponse, "description": "OpenAI's error object"}
    for status in ("4XX", "5XX")
}


class _ReadRequest(Request):
    """A request whose body was read and parsed already: FastAPI takes it from here."""

    def __init__(self, request: Request, raw: bytes, parsed) -> None:
        super().__init__(request.scope, request.receive)
        self._raw, self._parsed = raw, parsed

    async def body(self) -> bytes:
        return self._raw

    async def json(self):
        return self._parsed


def json_body_route(model_name: str, max_body_bytes: int, body_timeout: float) -> type[APIRoute]:
    """The route class of the app: routes with a body read it as described above."""

    async def read_raw(request: Request) -> bytes:
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body_bytes:
                    raise APIError(
                        f"the body exceeds the limit of {max_body_bytes} bytes", None, 413
                    )
                chunks.append(chunk)
        except ClientDisconnect:
            # one line, not a traceback: nobody is left to answer
            log.info("client %s left mid-body", request.client.host if request.client else "?")
            raise APIError("the client disconnected mid-body", None, 400) from None
        return b"".join(chunks)

    async def read(request: Request, field) -> _ReadRequest:
        kind = request.headers.get("content-type", "application/json").split(";")[0]
        kind = kind.strip().lower()  # media types are case-insensitive
        if kind not in ("application/json", ""):
            raise APIError(f"content type {kind!r}: send application/json", None, 415)
        try:
            raw = await asyncio.wait_for(read_raw(request), body_timeout)
        except TimeoutError:
            raise APIError(
                f"the body took over {body_timeout:.0f} s to arrive", None, 408
            ) from None
        large = len(raw) > _THREAD_PARSE_BYTES
        body = await asyncio.to_thread(_loads, raw) if large else _loads(raw)
        if not isinstance(body, dict):
            raise APIError("the body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise APIError(f"model: expected a string, got {type(model).__name__}", "model")
        if model is not None and model != model_name:
            raise APIError(
                f"model {model!r} does not exist; this server has {model_name!r}",
                "model",
                404,
                code="model_not_found",
            )
        if large:  # FastAPI takes a validated model as it is
            body, errors = await asyncio.to_thread(field.validate, body, {}, loc=("body",))
            if errors:
                raise RequestValidationError(errors, body=None)
        return _ReadRequest(request, raw, body)

    class JSONBodyRoute(APIRoute):
        def get_route_handler(self):
            handle = super().get_route_handler()
            field = self.body_field
            if field is None:
                return handle

            async def read_then_handle(request: Request):
                return await handle(await read(request, field))

            return read_then_handle

    return JSONBodyRoute


def _loads(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError as e:  # JSONDecodeError, bad UTF-8, integers past 4300 digits
        raise APIError(f"malformed JSON body: {e}") from None
    except RecursionError:
        raise APIError("malformed JSON body: nested too deeply") from None


def _json_kind(value) -> str:
    if value is None:
        return "null"
    for kind, name in ((bool, "a boolean"), ((int, float), "a number"), (str, "a string")):
        if isinstance(value, kind):
            return name
    return "a list" if isinstance(value, list) else "an object"


def validation_error(exc: RequestValidationError) -> APIError:
    """The first of a body's validation errors, as the 400 that names its field."""
    error = exc.errors()[0]
    loc = list(error["loc"])[1:]  # past FastAPI's "body"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] in ("model_attributes_type", "dict_type"):
        message = "Input should be an object"
    if error["type"].endswith("_type"):  # a value of the wrong JSON type
        message += f", got {_json_kind(error.get('input'))}"
    path = error_path(loc)
    param = loc[0] if loc and isinstance(loc[0], str) else None
    return APIError(f"{path}: {message}" if path else message, param)


def document(app: FastAPI, streams: dict[str, type[BaseModel]]) -> None:
    """/openapi.json as the server answers: no 422 (validation errors are 400s, in the error
    object every 4xx/5xx declares), and each route of `streams` (path -> chunk model) sends
    its chunks as `text/event-stream` when asked to stream."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        _, defs = models_json_schema(
            [(m, "serialization") for m in streams.values()],
            ref_template="#/components/schemas/{model}",
        )
        for name, definition in defs.get("$defs", {}).items():
            components.setdefault(name, definition)
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
                if path in streams:
                    content = operation["responses"]["200"].setdefault("content", {})
                    ref = f"#/components/schemas/{streams[path].__name__}"
                    content["text/event-stream"] = {"schema": {"$ref": ref}}
        return schema

    app.openapi = openapi
