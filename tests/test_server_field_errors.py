"""Bad values over HTTP (review findings): a constraint whose error the engine raises (a lone
surrogate, a grammar llguidance cannot follow), a logit_bias key past int()'s digit limit, a
top_p or repetition_penalty float32 cannot hold: each a 400 whose `param` is the field the
client sent, the same each time, and the server goes on."""

from __future__ import annotations

import json

import httpx
import pytest

from metrale.default_model import default_model_dir
from tests.test_server import Server

CHAT = [{"role": "user", "content": "hi"}]
MAX_COMPLETION = "max_completion_tokens"


@pytest.fixture(scope="module")
def server():
    srv = Server(default_model_dir(), spec={"method": "ngram", "num_drafts": 3})
    yield srv
    srv.close()


@pytest.mark.parametrize(
    "body, param",
    [
        ({"guided_regex": "a\udcff"}, "guided_regex"),  # a "\udcff" escape: a lone surrogate
        ({"structured_outputs": {"regex": "a\udcff"}}, "structured_outputs"),
        ({"guided_grammar": 'root ::= "\udcff"'}, "guided_grammar"),
        ({"guided_regex": "a{1000000}"}, "guided_regex"),  # runs llguidance's lexer out
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
            "response_format",
        ),
        ({"logit_bias": {"9" * 5000: 1.0}}, "logit_bias"),
        ({"logit_bias": {"99999999999999999999999": 1.0}}, "logit_bias"),
        ({"top_p": 1e-320}, "top_p"),
        ({"repetition_penalty": 1e-39}, "repetition_penalty"),
        # constraints no text satisfies (each sequence of them ended at once as an error, 200)
        ({"guided_regex": "[^\\x00-\\x{10FFFF}]"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a[^\\x00-\\x{10FFFF}]"}}, "structured_outputs"),
        ({"guided_grammar": "start: /[^\\x00-\\x{10FFFF}]/"}, "guided_grammar"),
        # vLLM's fields metrale does not implement, at values that would change the output
        ({"use_beam_search": True}, "use_beam_search"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"bad_words": ["a"]}, "bad_words"),
        ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
        ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
        ({"length_penalty": 2.0}, "length_penalty"),
        ({"spaces_between_special_tokens": "no"}, "spaces_between_special_tokens"),
        ({"seed": 2**63}, "seed"),  # vLLM's int64 range (it wrapped: 2**63 gave seed 0's text)
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ],
)
@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_bad_values_are_400s_naming_the_field_sent(server, body, param, route):
    payload = {"model": "tiny", "max_tokens": 4, **body}
    payload.update({"messages": CHAT} if route == "chat/completions" else {"prompt": "hi"})
    for _ in range(2):  # the same answer again: nothing was left behind
        r = httpx.post(
            f"{server.url}/v1/{route}",
            content=json.dumps(payload),  # (ASCII: a lone surrogate goes as its escape)
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert error["message"].startswith(f"{param}") and len(error["message"]) > len(param) + 8
    ok = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 2, "guided_regex": "a{4}"},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "aa", ok.text
    server.wait_idle()


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("completions", {"prompt": [1, -1]}, "prompt"),  # the engine says prompt_token_ids
        ("chat/completions", {"messages": [{"role": "user", "content": "x " * 5000}]}, "messages"),
        ("completions", {"prompt": "hi", "speculative": {"num_drafts": -1}}, "speculative"),
        ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, MAX_COMPLETION),
    ],
)
def test_an_engine_error_names_the_field_the_client_sent(server, route, body, param):
    """Errors the engine raises about its own names (prompt_token_ids, num_drafts, max_tokens)
    come back naming the body's field."""
    r = httpx.post(f"{server.url}/v1/{route}", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error
