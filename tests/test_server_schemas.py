"""The server's pydantic models (issue 19): /openapi.json lists real request and response
schemas for every route (stream chunks and the error object included, no 422), types are
strict as JSON clients expect, unknown fields are ignored while unsupported ones are refused,
and a body that fails its model gets the OpenAI error object naming the field, whether it was
validated by FastAPI or (large) on a worker thread."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from metrale.server.schemas import (
    NOT_SUPPORTED,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)

fastapi_testclient = pytest.importorskip("fastapi.testclient")

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    from metrale.server import build

    app, _loop = build(tiny_model_dir, served_name="tiny", device="cpu")
    with fastapi_testclient.TestClient(app) as client:
        yield client


def resolve(spec: dict, schema: dict) -> dict:
    ref = schema.get("$ref")
    return spec["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else schema


def test_openapi_lists_request_and_response_schemas(client):
    spec = client.get("/openapi.json").json()
    paths = spec["paths"]

    def request_schema(path: str) -> dict:
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        return resolve(spec, body)

    chat = request_schema("/v1/chat/completions")["properties"]
    for field in ("messages", "temperature", "max_tokens", "max_completion_tokens", "stream"):
        assert field in chat, sorted(chat)
    for field in ("top_logprobs", "chat_template_kwargs", "stream_options", "speculative"):
        assert field in chat
    completions = request_schema("/v1/completions")
    assert "prompt" in completions["required"]
    for field in ("prompt", "temperature", "max_tokens", "logprobs", "echo", "top_k", "min_p"):
        assert field in completions["properties"], sorted(completions["properties"])
    assert "messages" in request_schema("/tokenize")["properties"]
    assert "tokens" in request_schema("/detokenize")["properties"]
    for path, whole, chunk in (
        ("/v1/completions", "CompletionResponse", "CompletionStreamChunk"),
        ("/v1/chat/completions", "ChatCompletionResponse", "ChatCompletionStreamChunk"),
    ):
        content = paths[path]["post"]["responses"]["200"]["content"]
        assert content["application/json"]["schema"]["$ref"].endswith("/" + whole)
        assert content["text/event-stream"]["schema"]["$ref"].endswith("/" + chunk)
    schemas = spec["components"]["schemas"]
    message = resolve(spec, schemas["ChatChoice"]["properties"]["message"])
    assert {"role", "content", "reasoning_content"} <= set(message["properties"])
    assert {"usage", "metrale"} <= set(schemas["CompletionResponse"]["properties"])
    assert "delta" in schemas["ChatStreamChoice"]["properties"]
    assert set(schemas["ErrorInfo"]["properties"]) == {"message", "type", "param", "code"}
    assert (
        resolve(
            spec,
            paths["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"],
        )
        == schemas["ModelList"]
    )
    text = json.dumps(spec)
    assert '"422"' not in text and "HTTPValidationError" not in text  # errors are 400s
    for path, operations in paths.items():  # every route: a schema for the error object
        for operation in operations.values():
            assert "4XX" in operation["responses"], path
    for ref in {r for r in text.split('"$ref": "')[1:]}:  # every reference resolves
        assert ref.split('"', 1)[0].rsplit("/", 1)[1] in schemas


@pytest.mark.parametrize(
    "field, good, bad",
    [
        ("temperature", [0, 0.5, 1], [True, "0.5"]),
        ("top_k", [5, -1], [5.0, True, "5"]),
        ("seed", [0, 10**30], [1.5, False]),
        ("ignore_eos", [True, False], [1, "true"]),
        ("stop", ["x", ["a", "b"]], [5, ["a", 5]]),
        ("stop_token_ids", [[1, 2]], [[1, True], "1"]),
        ("logit_bias", [{"5": 1, "6": -0.5}], [{"5": True}, [1]]),
        ("stream_options", [{"include_usage": True}], ["yes", {"include_usage": 1}]),
        ("speculative", [{"enabled": False}, {"num_drafts": 2}], [{"num_drafts": 2.0}]),
    ],
)
def test_types_are_strict(field, good, bad):
    for value in good:  # (stream: stream_options come only with it)
        CompletionRequest(prompt="x", stream=True, **{field: value})
    for value in bad:
        with pytest.raises(ValidationError) as e:
            CompletionRequest(prompt="x", stream=True, **{field: value})
        assert e.value.errors()[0]["loc"][0] == field


def test_unknown_fields_are_ignored_and_unsupported_ones_refused():
    body = CompletionRequest(prompt="x", user="me", store=False, metadata={"a": 1})
    assert body.sampling_kwargs() == {}
    for field, neutral in NOT_SUPPORTED.items():
        for value in (None, *neutral):
            ChatCompletionRequest(messages=USER, **{field: value})
        with pytest.raises(ValidationError, match="not supported"):
            ChatCompletionRequest(messages=USER, **{field: "something"})


def test_requests_become_sampling_keywords():
    chat = ChatCompletionRequest(
        messages=USER, max_tokens=5, max_completion_tokens=7, logprobs=True, top_logprobs=2
    )
    assert chat.sampling_kwargs() == {"max_tokens": 7, "logprobs": 2}
    assert chat.max_tokens_field == "max_completion_tokens"
    assert ChatCompletionRequest(messages=USER).sampling_kwargs() == {"max_tokens": None}
    completion = CompletionRequest(
        prompt=[1, 2], n=2, temperature=0, logprobs=0, speculative={"num_drafts": 1}
    )
    assert completion.sampling_kwargs() == {
        "n": 2,
        "temperature": 0.0,
        "logprobs": 0,
        "speculative": True,
        "num_drafts": 1,
    }
    assert completion.prompts == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]
    assert CompletionRequest(prompt=["a", "b"]).prompts == ["a", "b"]


def test_messages_reach_the_template_as_text():
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    assert ChatMessage(**parts).for_template() == {"role": "user", "content": "a\nb"}
    call = {"id": "c1", "function": {"name": "f", "arguments": '{"x": 1}'}}
    turn = ChatMessage(role="assistant", content=None, tool_calls=[call], name="bot")
    assert turn.for_template() == {
        "role": "assistant",
        "content": "",
        "name": "bot",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
        ],
    }
    with pytest.raises(ValidationError):
        ChatMessage(role="user", content=None)


@pytest.mark.parametrize("size", [10, 400_000])  # FastAPI validates; a worker thread does
def test_a_body_that_fails_its_model_gets_a_400_naming_the_field(client, size):
    body = {"tokens": [1] * size + [True]}
    resp = client.post("/detokenize", content=json.dumps(body))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "tokens" and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"tokens[{size}]: ") and "boolean" in error["message"]
    resp = client.post(
        "/v1/chat/completions",
        json={"messages": [*USER, {"role": "user", "content": 3}]},
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith("messages[1].content: expected a string")
    resp = client.post("/v1/chat/completions", json={"messages": USER, "temperature": True})
    assert resp.json()["error"] == {
        "message": "temperature: Input should be a valid number, got a boolean",
        "type": "invalid_request_error",
        "param": "temperature",
        "code": None,
    }


def test_responses_are_the_models_shapes(client):
    whole = client.post(
        "/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "temperature": 0}
    ).json()
    assert whole["object"] == "chat.completion" and list(whole)[:2] == ["id", "object"]
    assert set(whole["choices"][0]["message"]) == {"role", "content", "reasoning_content"}
    lines = client.post(
        "/v1/chat/completions",
        json={"messages": USER, "max_tokens": 2, "stream": True, "stream_options": {}},
    ).text.splitlines()
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(
        "usage" not in c and "reasoning_content" not in c["choices"][0]["delta"] for c in chunks
    )
    assert client.get("/health").json() == {"status": "ok"}
