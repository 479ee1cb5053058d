"""A completion the engine ends with finish_reason "error" reaches the client as vLLM answers it:
the OpenAI error object with the engine's message (whole responses: HTTP 500, or 400 when the
request itself caused it; streams: an error event, then [DONE]), never a 200 with an empty
choice. Against a real server on a loopback port whose forward fails for one prompt; the other
requests go on and the page pool ends idle."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from metrale.outputs import CompletionOutput, RequestOutput
from metrale.server.protocol import generation_error
from tests.test_server import Server

CMPL = "/v1/completions"
POISON = [7, 7, 7, 7, 99]  # a prompt whose forward raises


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server(tiny_model_dir, max_num_seqs=8, max_model_len=256)
    runner = srv.loop.engine.runner
    real = runner.execute

    def execute(batch, *args, **kwargs):
        if any(e.seq.prompt_token_ids == POISON for e in batch.entries):
            raise RuntimeError("boom in the forward")
        return real(batch, *args, **kwargs)

    runner.execute = execute
    yield srv
    runner.execute = real
    srv.close()


def body(prompt, **extra):
    return {"prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}


def test_a_failed_generation_is_a_500_and_the_others_go_on(server):
    """Sent together with good requests: the failed one gets a 500 naming the engine's error;
    the others their completions, as they would alone."""
    alone = httpx.post(server.url + CMPL, json=body("def f(x):"), timeout=60).json()
    results = {}

    def send(name, prompt):
        results[name] = httpx.post(server.url + CMPL, json=body(prompt), timeout=60)

    threads = [threading.Thread(target=send, args=("bad", POISON))]
    threads += [threading.Thread(target=send, args=(i, "def f(x):")) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = results["bad"]
    assert bad.status_code == 500, bad.text
    error = bad.json()["error"]
    assert "boom in the forward" in error["message"] and error["type"] == "internal_error"
    for i in range(3):
        assert results[i].status_code == 200
        assert results[i].json()["choices"][0]["text"] == alone["choices"][0]["text"]
    server.wait_idle()


def test_a_failed_stream_ends_with_the_error_event(server):
    with httpx.stream("POST", server.url + CMPL, json=body(POISON, stream=True), timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "boom in the forward" in error["message"]
    chunks = [json.loads(e) for e in events[:-2]]
    assert not any(c["finish_reason"] == "error" for ch in chunks for c in ch["choices"])
    server.wait_idle()


def _output(*reasons_and_errors):
    outputs = [
        CompletionOutput(
            index=i, text="", token_ids=[], finish_reason=r, error=e, error_by_request=own
        )
        for i, (r, e, own) in enumerate(reasons_and_errors)
    ]
    return RequestOutput("r", None, [1], outputs, finished=True)


def test_errors_the_request_caused_are_4xx():
    """An error the engine marks as the request's own (`error_by_request`: its grammar failed on
    a token, it can never fit the pool) is a 400; any other engine error the server's (500),
    whatever its message says; none without an error."""
    assert generation_error([_output(("stop", None, False), ("length", None, False))]) is None
    grammar = generation_error(
        [_output(("stop", None, False), ("error", "structured: no match", True))]
    )
    assert grammar.status == 400 and "structured: no match" in grammar.message
    pages = generation_error(
        [_output(("error", "sequence needs 9 KV pages, the pool has 4", True))]
    )
    assert pages.status == 400
    other = generation_error([_output(("error", "ValueError: drafter failed", False))])
    assert other.status == 500 and other.type == "internal_error"
    # the cause decides, not the message: an engine error that happens to read like one
    alike = generation_error([_output(("error", "structured: the drafter's mask failed", False))])
    assert alike.status == 500
    assert generation_error([_output(("error", None, False))]).status == 500
