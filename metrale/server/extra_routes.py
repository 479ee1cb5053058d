"""The server's smaller endpoints, vLLM's: `/version`, `/v1/models[/{id}]`, `/tokenize` and
`/detokenize` (text or chat messages, with their tools, to token ids and back, with the model's
tokenizer)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI

from metrale import __version__
from metrale.chat_prompt import chat_error, chat_prompt_ids
from metrale.server.protocol import APIError, now
from metrale.server.response_schemas import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from metrale.server.schemas import DetokenizeRequest, TokenizeRequest
from metrale.server.tools import render_tools


def add_extra_routes(app: FastAPI, engine, model_name: str) -> None:
    tok = engine.tokenizer

    def card() -> ModelCard:
        return ModelCard(id=model_name, created=now(), max_model_len=engine.context_len)

    @app.get("/version", response_model=VersionResponse)
    async def version():
        return VersionResponse(version=__version__)

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def model(model_id: str):
        if model_id != model_name:
            raise APIError(
                f"model {model_id!r} does not exist", "model", 404, code="model_not_found"
            )
        return card()

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest):
        if body.messages is not None:
            variables = body.chat_template_kwargs or {}

            def render() -> list[int]:
                messages = [m.for_template() for m in body.messages]
                messages, tools = render_tools(messages, body.tools, tok)
                try:
                    # (as lenient as the prompt's bound below: it counts, it runs nothing)
                    return chat_prompt_ids(
                        tok,
                        messages,
                        engine.max_model_len,
                        tools,
                        variables,
                        slack=4,
                        **body.render_options(),
                    )[0]
                except Exception as e:  # noqa: BLE001 (a template fails as it fails)
                    raise APIError(*chat_error(e)) from None

        else:
            prompt = body.prompt
            if len(prompt) > engine.max_model_len * tok.max_token_chars * 4:
                raise APIError("prompt: far longer than the context", "prompt")

            def render() -> list[int]:
                try:
                    prompt.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise APIError(
                        f"prompt: not valid Unicode text ({e.reason})", "prompt"
                    ) from None
                return tok.encode(prompt, add_special_tokens=body.add_special_tokens)

        try:
            ids = await asyncio.to_thread(render)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 (a template or text the tokenizer refuses)
            field = "messages" if body.messages is not None else "prompt"
            raise APIError(f"{type(e).__name__}: {e}", field) from None
        return TokenizeResponse(count=len(ids), max_model_len=engine.context_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest):
        ids = body.tokens
        vocab, limit = engine.vocab_size, 4 * engine.max_model_len
        if len(ids) > limit:
            raise APIError(f"tokens: expected a list of at most {limit} token ids", "tokens")

        def decode() -> str:  # on a worker thread: checking and decoding scale with the list
            if not all(0 <= t < vocab for t in ids):
                raise APIError(f"tokens: expected token ids in [0, {vocab})", "tokens")
            return tok.decode(ids, skip_special_tokens=False)

        return DetokenizeResponse(prompt=await asyncio.to_thread(decode))
