"""The server as a hostile client meets it (issue 18), each case against a real server on a
loopback port: the status and the OpenAI error shape, /health answering within a second during
and after, and the page pool back to idle; bounded bodies, bounded metric labels, admission
by sequences, abandoned requests aborted, keys compared in constant time, and a drain on
SIGTERM that ends every request well-formed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from metrale.tokenizer import Tokenizer
from tests.test_server import Server, free_port

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


def user(content):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server(tiny_model_dir, max_num_seqs=8, max_body_bytes=1 << 20, max_model_len=256)
    yield srv
    srv.close()


def assert_healthy(server) -> None:
    start = time.perf_counter()
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert time.perf_counter() - start < 1.0
    server.wait_idle()


def error_of(resp, status, param="?"):
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param != "?":
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        (CMPL, {"prompt": "\ud800 lone surrogate", "max_tokens": 4}, 400, "prompt"),
        (CHAT, user("\ud800"), 400, "messages"),
        (CHAT, user(None), 400, "messages"),
        (CHAT, user(42), 400, "messages"),
        (CHAT, user([{"type": "image_url", "image_url": {"url": "x"}}]), 400, "messages"),
        (CHAT, {**user("hi"), "stream_options": "yes"}, 400, "stream_options"),
        (CHAT, {**user("hi"), "stream": "no"}, 400, "stream"),
        (CHAT, {**user("hi"), "logprobs": "yes"}, 400, "logprobs"),
        (CHAT, {**user("hi"), "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        (CHAT, {**user("hi"), "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs"),
        (CHAT, {**user("hi"), "response_format": {"type": "yaml"}}, 400, "response_format"),
        (CHAT, {**user("hi"), "tools": [{"type": "function"}]}, 400, "tools"),
        (CMPL, {"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
        (CMPL, {"prompt": "x", "echo": "yes"}, 400, "echo"),
        (CMPL, {"prompt": "x", "echo": True, "logprobs": 0}, 400, "echo"),
        (CMPL, {"prompt": "x", "best_of": 3}, 400, "best_of"),
        (CMPL, {"prompt": "x", "n": 2, "best_of": 1}, 400, "best_of"),  # best_of < n, as vLLM
        (CMPL, {"prompt": "x", "n": 1000}, 400, "n"),
        (CMPL, {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
        (CMPL, {"prompt": "x" * 200000}, 400, "prompt"),  # refused from its length
        (CMPL, {"prompt": "x", "stop": ["a"] * 5000}, 400, "stop"),  # bounded stop work
        (CHAT, {**user("hi"), "top_logprobs": 2}, 400, "top_logprobs"),  # needs logprobs
        (CMPL, {"prompt": "x", "logit_bias": {"1_0": 1}}, 400, "logit_bias"),
        # conversations that cannot fit, refused before the tokenizer holds the GIL on them
        (CHAT, {**user(""), "messages": [{"role": "user", "content": ""}] * 300}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x" * 900000}]}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": ""}] * 1100}, 400, "messages"),
    ],
)
def test_bad_fields_get_4xx_and_nothing_runs(server, path, body, status, param):
    resp = httpx.post(server.url + path, content=json.dumps(body), timeout=30)
    error_of(resp, status, param)
    assert_healthy(server)


def test_malformed_bodies_and_routes_use_the_openai_shape(server):
    deep = "[" * 100000 + "]" * 100000
    error_of(httpx.post(server.url + CMPL, content=deep), 400)
    huge_int = '{"prompt": "x", "max_tokens": ' + "1" * 5000 + "}"  # past Python's 4300 digits
    error_of(httpx.post(server.url + CMPL, content=huge_int), 400)
    mixed_case = {"content-type": "Application/JSON; charset=UTF-8"}
    ok = httpx.post(
        server.url + CMPL, content='{"prompt": [3], "max_tokens": 1}', headers=mixed_case
    )
    assert ok.status_code == 200, ok.text
    error_of(
        httpx.post(server.url + CMPL, content="x", headers={"content-type": "text/plain"}), 415
    )
    error_of(httpx.get(server.url + "/v1/nothing"), 404)
    error_of(httpx.get(server.url + CMPL), 405)
    assert_healthy(server)


def test_a_conversation_rendered_past_the_context_is_refused_before_tokenising(
    server, tiny_model_dir
):
    """Short messages under every per-message bound whose rendered template cannot fit: the
    tokenizer would hold the GIL over all of it (found in review: 1,000,000 one-character
    messages stalled /health for 33 s), so the rendered text is bounded too."""
    chars = Tokenizer.from_dir(tiny_model_dir).max_token_chars * 256
    content = "y" * (chars // 250)
    body = {**user(""), "messages": [{"role": "user", "content": content}] * 250}
    error = error_of(httpx.post(server.url + CHAT, json=body, timeout=30), 400, "messages")
    assert "rendered" in error["message"]
    assert_healthy(server)


def test_health_answers_head_probes(server):
    resp = httpx.head(server.url + "/health", timeout=5)
    assert resp.status_code == 200 and not resp.content


def test_a_regex_that_does_not_compile_says_why(server):
    body = {"prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "("}}
    error = error_of(httpx.post(server.url + CMPL, json=body, timeout=30), 400)
    assert error["message"].endswith("regex parse error: unclosed group"), error
    schema = {"type": "string", "pattern": "a{5,2}"}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    error = error_of(
        httpx.post(server.url + CHAT, json={**user("hi"), "response_format": fmt}, timeout=30),
        400,
        "response_format",
    )
    assert "invalid repetition count range" in error["message"] and "a{5,2}" in error["message"]
    assert_healthy(server)


def test_text_parts_content_is_supported(server):
    parts = [{"type": "text", "text": "def f"}, {"type": "text", "text": "(x):"}]
    resp = httpx.post(server.url + CHAT, json={**user(parts), "temperature": 0}, timeout=60)
    assert resp.status_code == 200, resp.text
    same = httpx.post(server.url + CHAT, json={**user("def f\n(x):"), "temperature": 0})
    assert resp.json()["choices"][0]["message"] == same.json()["choices"][0]["message"]
    assert_healthy(server)


def rss_bytes() -> int:
    """This process's resident memory (the server runs in it)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_big_body_is_refused_before_it_is_read(server):
    """A 50 MB body is refused from its Content-Length, before a byte of it is read: the
    answer comes at once, /health answers meanwhile, and memory does not grow."""
    import socket

    before = rss_bytes()
    conn = socket.create_connection(("127.0.0.1", server.port))
    head = f"POST {CMPL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    conn.sendall((head + f"Content-Length: {50 << 20}\r\n\r\n").encode() + b'{"prompt": "')
    conn.settimeout(10)
    reply = conn.recv(4096).decode(errors="replace")
    assert reply.startswith("HTTP/1.1 413"), reply[:200]
    conn.close()
    assert_healthy(server)
    assert rss_bytes() < before * 1.1 + (8 << 20)
    # a chunked body (no length) is cut off as it crosses the limit
    big = json.dumps({"prompt": "y" * (3 << 20)}).encode()

    def chunks():
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    error_of(httpx.post(server.url + CMPL, content=chunks(), timeout=60), 413)


def test_half_sent_headers_are_not_held_forever(tiny_model_dir):
    import socket

    srv = Server(tiny_model_dir, header_timeout=1.0)
    try:
        conn = socket.create_connection(("127.0.0.1", srv.port))
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # half the headers
        conn.settimeout(10)
        start = time.time()
        assert conn.recv(100) == b""  # closed by the server
        assert time.time() - start < 5
        assert httpx.get(srv.url + "/health").status_code == 200
        # a kept-alive connection: one whole request, then half of the next one's headers
        conn = socket.create_connection(("127.0.0.1", srv.port))
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        conn.settimeout(10)
        reply = b""
        while b'"ok"' not in reply:  # the whole response, headers and body
            reply += conn.recv(4096)
        assert reply.startswith(b"HTTP/1.1 200")
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.time()
        assert conn.recv(100) == b"" and time.time() - start < 5
    finally:
        srv.close()


def test_metric_labels_stay_bounded(server):
    for i in range(40):
        httpx.get(server.url + f"/no/such/path/{i}")
    text = httpx.get(server.url + "/metrics").text
    assert "/no/such/path" not in text and "unmatched" in text


def test_an_abandoned_whole_response_request_is_aborted(server):
    finished = server.loop.engine.telemetry.requests_finished
    aborted = finished["abort"]
    body = {"prompt": [5, 6, 7], "max_tokens": 250, "ignore_eos": True, "n": 4}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + CMPL, json=body, timeout=0.1)
    server.wait_idle(timeout=15)
    assert finished["abort"] > aborted  # ended because its client left, not completed


def test_admission_counts_sequences_and_keys_guard_the_docs(tiny_model_dir):
    srv = Server(tiny_model_dir, api_key="k3y", max_waiting=0, max_num_seqs=2)
    try:
        auth = {"Authorization": "Bearer k3y"}
        for path in ("/docs", "/openapi.json", "/v1/models"):
            error_of(httpx.get(srv.url + path), 401)
            assert httpx.get(srv.url + path, headers=auth).status_code == 200
        for path in ("/tokenize", "/detokenize"):
            error_of(httpx.post(srv.url + path, json={"prompt": "x", "tokens": [1]}), 401)
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/metrics").status_code == 200
        body = {"prompt": [3, 4], "max_tokens": 200, "ignore_eos": True, "n": 2}
        first = {}
        thread = threading.Thread(
            target=lambda: first.setdefault(
                "r", httpx.post(srv.url + CMPL, json=body, headers=auth, timeout=120)
            )
        )
        thread.start()
        deadline = time.time() + 30
        while not srv.loop._live and time.time() < deadline:
            time.sleep(0.02)
        one = {"prompt": [3], "max_tokens": 2}
        busy = httpx.post(srv.url + CMPL, json=one, headers=auth, timeout=30)
        assert error_of(busy, 503)["type"] == "server_busy"  # 2 sequences in flight already
        thread.join(120)
        assert first["r"].status_code == 200
        srv.wait_idle()
        # several prompts of more sequences than the capacity, on an idle server: served, as one
        # prompt of as many (n) is; admitted prompt by prompt, the later ones were refused by
        # the earlier ones, a 503 "retry later" every time (found in review)
        several = {"prompt": [[3], [4], [5]], "max_tokens": 2, "n": 2}
        resp = httpx.post(srv.url + CMPL, json=several, headers=auth, timeout=60)
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 6
        srv.wait_idle()
    finally:
        srv.close()


def test_sigterm_drains_streams_and_whole_responses(tiny_model_dir, tmp_path):
    port = free_port()
    env = {**os.environ, "METRALE_HOME": str(tmp_path)}
    args = [sys.executable, "-m", "metrale.cli", "serve", "--model", str(tiny_model_dir)]
    args += ["--port", str(port), "--device", "cpu", "--shutdown-grace", "2"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        results: list = []
        body = {"prompt": [7, 8, 9], "max_tokens": 1000, "ignore_eos": True}

        def stream():
            finish = None
            with httpx.stream("POST", url + CMPL, json={**body, "stream": True}, timeout=60) as r:
                assert r.status_code == 200, r.read()
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            for line in lines[:-1]:
                finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
            results.append(("stream", lines[-1] == "data: [DONE]", finish))

        def whole():
            r = httpx.post(url + CMPL, json=body, timeout=60)
            results.append(("whole", r.status_code, r.json()["choices"][0]["finish_reason"]))

        threads = [threading.Thread(target=stream) for _ in range(20)]
        threads += [threading.Thread(target=whole) for _ in range(5)]
        for t in threads:
            t.start()
        time.sleep(3)
        start = time.time()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0, proc.stderr.read().decode()
        assert time.time() - start < 2 + 15
        log = proc.stderr.read().decode()
        # the start-up banner says where and what; an access line per request
        assert f"metrale serve: http://127.0.0.1:{port}/v1" in log and "KV pool" in log
        assert '"GET /health" 200' in log and '"POST /v1/completions" 200' in log
        assert len(results) == 25
        for kind, ok, finish in results:
            assert ok in (True, 200), (kind, ok)
            assert finish in ("abort", "length"), (kind, finish)
    finally:
        proc.kill()


def test_a_directory_given_as_dot_is_served_under_its_own_name(tiny_model_dir, monkeypatch):
    """`metrale serve --model .` (found in review: served as "", so every request naming a
    model got a 404); `--served-model-name` sets the name."""
    from metrale.cli import build_parser
    from metrale.server import build

    monkeypatch.chdir(tiny_model_dir)
    for given in (".", "./", f"../{tiny_model_dir.name}"):
        _, loop = build(given, device="cpu")
        assert loop.model_name == tiny_model_dir.name, given
    _, loop = build(".", served_name="mine", device="cpu")
    assert loop.model_name == "mine"
    args = build_parser().parse_args(["serve", "--served-model-name", "mine"])
    assert args.served_model_name == "mine"
    for bad in ("", " mine"):  # (an empty one was taken as none: review)
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--served-model-name", bad])


def test_an_engine_failure_adding_a_request_is_a_500_and_the_engine_goes_on(server):
    """`add_request` raising anything but a ValueError (an engine bug, not the request's) ended
    the engine thread: every later request waited forever while /health said ok (found in
    review). Now that request alone gets a 500 in the OpenAI shape."""
    engine = server.loop.engine
    real = engine.add_request

    def add_request(request_id, prompt, params):
        if params.max_tokens == 3:
            raise RuntimeError("boom while adding")
        return real(request_id, prompt, params)

    engine.add_request = add_request
    try:
        bad = httpx.post(server.url + CMPL, json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        error = error_of(bad, 500)
        assert error["type"] == "internal_error" and "boom while adding" in error["message"]
        good = httpx.post(server.url + CMPL, json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"]
    finally:
        engine.add_request = real
    assert_healthy(server)


def test_requests_still_queued_when_the_engine_stops_are_answered(tiny_model_dir):
    """A request submitted but not yet taken in by the engine thread when it stops is added and
    aborted with the rest: its client gets a final output (finish_reason "abort") rather than
    waiting forever (found in review)."""
    import asyncio

    from metrale.config import SamplingParams
    from metrale.server import build
    from metrale.server.engine_loop import EngineLoop

    _, loop = build(tiny_model_dir, served_name="tiny", device="cpu", max_model_len=64)
    idle = EngineLoop(loop.engine)  # its thread never started: nothing takes the inbox in

    async def submit_then_stop():
        queue = idle.submit("late-1", [1, 2, 3], SamplingParams(max_tokens=4))
        idle._stop.set()
        await asyncio.to_thread(idle._run)  # what the thread does once it is told to stop
        return await asyncio.wait_for(queue.get(), 5)

    out = asyncio.run(submit_then_stop())
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not idle._live and not loop.engine.has_unfinished_requests()


def test_an_engine_thread_that_dies_says_so(tiny_model_dir):
    """Anything that ends the engine thread past the step's own net (a BaseException) turns
    /health to 503 naming it and refuses new requests with 503, and the request in flight is
    answered (finish_reason "abort"), rather than every client waiting on a dead thread while
    /health said ok (found in review)."""
    srv = Server(tiny_model_dir, max_num_seqs=4, max_model_len=128)
    engine = srv.loop.engine
    real = engine.step

    def step():
        if any(r.prompt_token_ids == [7, 7, 7] for r in engine.requests.values()):
            raise SystemExit("the engine thread is told to go")
        return real()

    engine.step = step
    try:
        body = {"prompt": [7, 7, 7], "max_tokens": 4}
        first = httpx.post(srv.url + CMPL, json=body, timeout=30)
        assert first.status_code == 200, first.text
        assert first.json()["choices"][0]["finish_reason"] == "abort"
        health = httpx.get(srv.url + "/health", timeout=5)
        assert health.status_code == 503 and "engine thread stopped" in health.json()["error"]
        later = httpx.post(srv.url + CMPL, json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert error_of(later, 503)["code"] == "server_busy"
    finally:
        srv.close()
