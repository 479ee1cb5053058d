"""The server's smaller endpoints, vLLM's: `/version`, `/v1/models/{id}`, `/tokenize` and
`/detokenize` (text or chat messages to token ids and back, with the model's tokenizer)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request

from metrale import __version__
from metrale.server.protocol import APIError, chat_messages, now, template_kwargs


def add_extra_routes(app: FastAPI, engine, model_name: str, read_body) -> None:
    tok = engine.tokenizer

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise APIError(
                f"model {model_id!r} does not exist", "model", 404, code="model_not_found"
            )
        return {
            "id": model_name,
            "object": "model",
            "created": now(),
            "owned_by": "metrale",
            "max_model_len": engine.max_model_len,
        }

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_body(request)
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise APIError("add_special_tokens: expected a boolean", "add_special_tokens")
        if "messages" in body:
            messages = chat_messages(body["messages"])
            variables = template_kwargs(body)

            def render() -> list[int]:
                text = tok.apply_chat_template(messages, add_generation_prompt=True, **variables)
                return tok.encode(text, add_special_tokens=False)

        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise APIError("prompt: expected a string (or give messages)", "prompt")
            if len(prompt) > engine.max_model_len * tok.max_token_chars * 4:
                raise APIError("prompt: far longer than the context", "prompt")

            def render() -> list[int]:
                try:
                    prompt.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise APIError(
                        f"prompt: not valid Unicode text ({e.reason})", "prompt"
                    ) from None
                return tok.encode(prompt, add_special_tokens=special)

        try:
            ids = await asyncio.to_thread(render)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 (a template or text the tokenizer refuses)
            raise APIError(
                f"{type(e).__name__}: {e}", "messages" if "messages" in body else "prompt"
            ) from None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_body(request)
        ids = body.get("tokens")
        vocab, limit = engine.vocab_size, 4 * engine.max_model_len
        if not isinstance(ids, list) or len(ids) > limit:
            raise APIError(f"tokens: expected a list of at most {limit} token ids", "tokens")

        def decode() -> str:  # on a worker thread: checking and decoding scale with the list
            if not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
            ):
                raise APIError(f"tokens: expected token ids in [0, {vocab})", "tokens")
            return tok.decode(ids, skip_special_tokens=False)

        return {"prompt": await asyncio.to_thread(decode)}
