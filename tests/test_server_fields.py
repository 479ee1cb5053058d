"""Completion fields a vLLM client reads: `text_offset` of the legacy logprobs (each token's
character offset in the completion, whole and streamed alike), `stop_reason` (the stop token
id or stop string that ended a choice; null for EOS and length) and `echo` (the prompt before
each completion's text, for text and token-id prompts, whole, streamed and several at once)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.test_server import Server


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server(tiny_model_dir)
    yield srv
    srv.close()


def complete(server, **body) -> dict:
    base = {"model": "tiny", "prompt": "def f(", "max_tokens": 8, "temperature": 0}
    res = httpx.post(server.url + "/v1/completions", json={**base, **body}, timeout=60)
    assert res.status_code == 200, res.text
    return res.json()["choices"][0]


def test_text_offset_counts_each_tokens_characters(server):
    choice = complete(server, logprobs=2)
    lp = choice["logprobs"]
    offsets, tokens = lp["text_offset"], lp["tokens"]
    assert len(offsets) == len(tokens) == 8
    assert offsets[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], tokens, strict=False))
    body = {"model": "tiny", "prompt": "def f(", "max_tokens": 8, "temperature": 0}
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={**body, "logprobs": 2, "stream": True},
        timeout=60,
    ) as res:
        chunks = [json.loads(x[6:]) for x in res.iter_lines() if x.startswith("data: {")]
    streamed = [o for c in chunks for ch in c["choices"] for o in ch["logprobs"]["text_offset"]]
    assert streamed == offsets


def test_stop_reason_names_what_stopped_a_choice(server):
    free = complete(server)
    assert free["finish_reason"] == "length" and free["stop_reason"] is None
    ids = httpx.post(
        server.url + "/tokenize", json={"model": "tiny", "prompt": free["text"]}, timeout=30
    ).json()["tokens"]
    token = ids[1]
    by_token = complete(server, stop_token_ids=[token])
    assert by_token["finish_reason"] == "stop" and by_token["stop_reason"] == token
    stop = free["text"][2:4]
    by_string = complete(server, stop=[stop])
    assert by_string["finish_reason"] == "stop" and by_string["stop_reason"] == stop


def test_echo_puts_the_prompt_before_the_completion(server):
    plain = complete(server)["text"]
    assert complete(server, echo=True)["text"] == "def f(" + plain
    ids = httpx.post(
        server.url + "/tokenize", json={"model": "tiny", "prompt": "def f("}, timeout=30
    ).json()["tokens"]
    assert complete(server, prompt=ids, echo=True)["text"] == "def f(" + plain
    body = {"model": "tiny", "prompt": "def f(", "max_tokens": 8, "temperature": 0}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**body, "echo": True, "stream": True}
    ) as res:
        chunks = [json.loads(x[6:]) for x in res.iter_lines() if x.startswith("data: {")]
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == "def f(" + plain
    several = httpx.post(
        server.url + "/v1/completions",
        json={**body, "prompt": ["def f(", "def f("], "echo": True},
        timeout=60,
    ).json()["choices"]
    assert [c["text"] for c in several] == ["def f(" + plain] * 2
