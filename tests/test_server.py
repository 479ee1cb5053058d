"""The OpenAI-compatible server, started for real on a free loopback port: the official `openai`
client, streaming, 64 concurrent streaming clients with speculation on, disconnects, bad input in
the OpenAI error shape, /metrics, and a graceful SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from metrale import LLM, SamplingParams

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from metrale.server import build, http_protocol  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir, header_timeout: float = 30.0, **options) -> None:
        self.app, self.loop = build(model_dir, served_name="tiny", device="cpu", **options)
        self.port = free_port()
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            http=http_protocol(header_timeout),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started and time.time() < deadline:
            time.sleep(0.05)
        assert self.server.started
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def wait_idle(self, timeout: float = 30) -> None:
        engine = self.loop.engine
        deadline = time.time() + timeout
        while (engine.has_unfinished_requests() or self.loop._live) and time.time() < deadline:
            time.sleep(0.05)
        assert not engine.has_unfinished_requests()
        assert engine.allocator.num_free == engine.allocator.num_usable


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server(tiny_model_dir, spec={"method": "ngram", "num_drafts": 3}, max_num_seqs=64)
    yield srv
    srv.close()


def test_openai_client_models_completion_chat_and_stream(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    done = client.completions.create(
        model="tiny", prompt="def f(x):", max_tokens=12, temperature=0, logprobs=2
    )
    choice = done.choices[0]
    assert choice.finish_reason in ("length", "stop") and done.usage.completion_tokens == 12
    assert len(choice.logprobs.token_logprobs) == 12
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    msgs = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3
    )
    text = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    stream = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    two = client.completions.create(
        model="tiny", prompt="ab", max_tokens=6, n=2, seed=3, temperature=1.0
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.usage.completion_tokens == 12
    raw = httpx.post(
        server.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 5, "stream": True}
    )
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_64_concurrent_streaming_clients_match_llm_generate(server, tiny_model_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(3, 24))] for _ in range(256)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = LLM(tiny_model_dir, device="cpu", max_num_seqs=1)
    expected = [o.outputs[0].text for o in alone.generate(prompts, params, use_tqdm=False)]

    async def one_client(http: httpx.AsyncClient, ids: list[int]) -> list[str]:
        texts = []
        for i in ids:  # 4 requests each, one after another
            body = {
                "prompt": prompts[i],
                "max_tokens": 8,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            }
            text = ""
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text += json.loads(line[6:])["choices"][0]["text"]
            texts.append(text)
        return texts

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as http:
            return await asyncio.gather(
                *(one_client(http, list(range(c, 256, 64))) for c in range(64))
            )

    start = time.perf_counter()
    results = asyncio.run(main())
    seconds = time.perf_counter() - start
    for c, texts in enumerate(results):
        for i, text in zip(range(c, 256, 64), texts, strict=True):
            assert text == expected[i]
    print(
        f"\n64 clients x 4 streamed requests: {256 / seconds:.1f} requests/s, "
        f"{256 * 8 / seconds:.1f} tokens/s"
    )
    assert server.loop.engine.telemetry.spec.num_drafts > 0
    server.wait_idle()


def test_disconnect_mid_stream_frees_pages(server):
    body = {
        "prompt": [9, 8, 7, 6],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
    server.wait_idle()


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 2.0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
        ("/v1/completions", {"prompt": "x", "model": 5}, 400, "model"),  # (not a 404)
        ("/v1/completions", {"prompt": 42}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1] * 5000}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),  # (the field sent)
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "speculative": {"num_drafts": -1}},
            400,
            "speculative",
        ),
    ],
)
def test_bad_input_gets_openai_errors(server, path, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    resp = httpx.post(server.url + path, **kwargs)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_parse_and_speculative_counters_move(server, client):
    client.completions.create(
        model="tiny",
        prompt=[4, 5, 4, 5, 4, 5, 4],
        max_tokens=8,
        temperature=0,
        extra_body={"speculative": {"num_drafts": 2}},
    )
    families = {
        f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
    }
    for name in (
        "metrale:spec_decode_num_drafts",
        "metrale:spec_decode_num_draft_tokens",
        "metrale:spec_decode_num_accepted_tokens",
        "metrale:spec_decode_num_accepted_tokens_per_pos",
        "metrale:requests",
        "metrale:kv_cache_usage_perc",
    ):
        assert name in families, sorted(families)
    drafts = families["metrale:spec_decode_num_draft_tokens"].samples[0].value
    assert drafts > 0
    resp = httpx.post(
        server.url + "/v1/completions",
        json={
            "prompt": [4, 5, 4, 5, 4, 5],
            "max_tokens": 6,
            "temperature": 0,
            "speculative": {"enabled": False},
        },
    )
    assert resp.json()["metrale"]["speculative"]["num_draft_tokens"] == 0


def test_api_key_and_busy(tiny_model_dir):
    srv = Server(tiny_model_dir, api_key="sekrit", max_waiting=0, max_num_seqs=1)
    try:
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        bad = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        auth = {"Authorization": "Bearer sekrit"}
        assert httpx.get(srv.url + "/v1/models", headers=auth).status_code == 200
        for header in ("bearer sekrit", "BEARER sekrit"):  # the scheme is case-insensitive
            ok = httpx.get(srv.url + "/v1/models", headers={"Authorization": header})
            assert ok.status_code == 200, header
        for header in ("Bearer SEKRIT", "Basic sekrit", "sekrit", "Bearer  sekrit"):
            no = httpx.get(srv.url + "/v1/models", headers={"Authorization": header})
            assert no.status_code == 401, header
        assert httpx.get(srv.url + "/health").status_code == 200

        async def flood():
            async with httpx.AsyncClient(base_url=srv.url, headers=auth, timeout=120) as http:
                body = {"prompt": [3, 4, 5], "max_tokens": 30, "ignore_eos": True}
                return await asyncio.gather(
                    *(http.post("/v1/completions", json=body) for _ in range(6))
                )

        codes = [r.status_code for r in asyncio.run(flood())]
        assert 200 in codes and 503 in codes
        busy = next(r for r in asyncio.run(flood()) if r.status_code == 503)
        assert busy.headers["retry-after"] and busy.json()["error"]["type"] == "server_busy"
        srv.wait_idle()
    finally:
        srv.close()


def test_sigterm_shuts_down_cleanly(tiny_model_dir, tmp_path):
    port = free_port()
    env = {**os.environ, "METRALE_HOME": str(tmp_path)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "metrale.cli",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--device",
            "cpu",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read().decode()
    finally:
        proc.kill()
