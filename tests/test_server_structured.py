"""Output constraints over HTTP: OpenAI's `response_format`, vLLM's `structured_outputs` and
`guided_*` fields, through the openai client (streamed and not); bad or conflicting constraints
are 400s naming the field, and the server goes on."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from metrale.default_model import default_model_dir
from tests.test_server import Server

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "rain": {"type": "boolean"},
    },
    "required": ["city", "days", "rain"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}}
CHAT = [{"role": "user", "content": "The forecast as JSON:"}]


@pytest.fixture(scope="module")
def server():
    srv = Server(default_model_dir(), spec={"method": "ngram", "num_drafts": 3})
    yield srv
    srv.close()


def test_json_schema_chat_streamed_and_not(client, server):
    def forecast(**extra):
        return client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=80,
            temperature=0,
            response_format=FORMAT,
            **extra,
        )

    reply = forecast()
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert reply.choices[0].finish_reason == "stop"
    stream = forecast(stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text
    plain = forecast(extra_body={"speculative": {"enabled": False}})
    assert plain.choices[0].message.content == text
    server.wait_idle()


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, r"\d{3}-\d{4}"),
        ({"structured_outputs": {"choice": ["alpha", "beta"]}}, r"alpha|beta"),
        ({"guided_choice": ["left", "right"]}, r"left|right"),
        ({"guided_regex": r"[A-Z]{3}"}, r"[A-Z]{3}"),
        ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]'}}, r"x\d\d"),
    ],
)
def test_vllm_structured_outputs_on_completions(client, extra, check):
    out = client.completions.create(
        model="tiny", prompt="value = ", max_tokens=16, temperature=0.7, seed=5, extra_body=extra
    )
    assert re.fullmatch(check, out.choices[0].text), out.choices[0].text


def test_json_object_and_text_formats(client):
    out = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_object"},
    )
    choice = out.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert choice.message.content.startswith("{")
    text = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=4, response_format={"type": "text"}
    )
    assert text.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format",
        ),
        ({"structured_outputs": {"regex": "(["}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_json": "{oops"}, "guided_json"),
        ({"guided_json": {"x-guidance": 1}}, "guided_json"),  # a 500 before (review)
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"x-guidance": "x"}},
                }
            },
            "response_format",
        ),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_grammar": "  "}, "guided_grammar"),
        ({"structured_outputs": {"choice": [""]}}, "structured_outputs"),
        ({"guided_choice": ["a"], "min_tokens": 3}, "min_tokens"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(server, body, param):
    payload = {"model": "tiny", "messages": CHAT, "max_tokens": 4, **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert len(error["message"]) > len(param) + 8, error  # says what is wrong
    ok = httpx.post(
        server.url + "/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 2},
        timeout=30,
    )
    assert ok.status_code == 200
