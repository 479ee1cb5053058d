"""Completion fields a vLLM client reads: `text_offset` of the legacy logprobs (each token's
character offset in the completion, whole and streamed alike) and `stop_reason` (the stop token
id or stop string that ended a choice; null for EOS and length)."""

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
