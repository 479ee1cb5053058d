"""OpenAI API surface a vLLM user expects, through the openai client and plain HTTP against a
real server: several prompts in one completions call, unique ids, `system_fingerprint`, one
`created` per stream, `/v1/models/{id}`, `/version`, `/tokenize` and `/detokenize`."""

from __future__ import annotations

import json

import httpx
import pytest

from metrale import LLM, SamplingParams
from tests.test_server import server  # noqa: F401 (a module fixture; `client` is conftest's)

openai = pytest.importorskip("openai")  # a dev dependency (the GPU machine may lack it)


def test_three_prompts_in_one_completions_call(client, server, tiny_model_dir):  # noqa: F811
    prompts = ["def f(x):", "import os", "class A:"]
    resp = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in resp.choices] == list(range(6))
    want = LLM(tiny_model_dir, device="cpu").generate(
        prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
    )
    for i, out in enumerate(want):
        assert resp.choices[2 * i].text == out.outputs[0].text
    assert resp.usage.completion_tokens == sum(
        len(c.token_ids) * 2 for o in want for c in o.outputs
    )
    assert resp.id.startswith("cmpl-") and resp.system_fingerprint.startswith("metrale-")
    server.wait_idle()


def test_ids_are_unique_and_a_stream_keeps_one_created(client, server):  # noqa: F811
    messages = [{"role": "user", "content": "hi"}]
    a = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    b = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert a.id != b.id and a.id.startswith("chatcmpl-") and len(a.id) > 20
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, stream=True, temperature=0
        )
    )
    assert len({c.created for c in chunks}) == 1 and len({c.id for c in chunks}) == 1
    assert all(c.system_fingerprint for c in chunks)


def test_streaming_several_prompts_beyond_the_limit_is_refused(server):  # noqa: F811
    """Several prompts stream (`test_server_fields`); past the completions a call may ask for,
    a 400 naming the prompt, before anything is streamed."""
    body = {"prompt": ["a"] * 65, "n": 2, "stream": True, "max_tokens": 2}
    resp = httpx.post(server.url + "/v1/completions", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"


def test_models_version_tokenize_detokenize(server):  # noqa: F811
    url = server.url
    assert httpx.get(url + "/v1/models/tiny").json()["id"] == "tiny"
    missing = httpx.get(url + "/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(url + "/version").json()["version"]
    tok = httpx.post(url + "/tokenize", json={"prompt": "def f(x): return x"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    text = httpx.post(url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text.endswith("def f(x): return x")
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["count"] > 1
    both = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    both = httpx.post(url + "/tokenize", json=both)  # one was silently ignored (review)
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"tools": []}):
        beside = httpx.post(url + "/tokenize", json={"prompt": "hi", **extra})
        assert beside.status_code == 400 and next(iter(extra)) in beside.json()["error"]["message"]
    bad = httpx.post(url + "/detokenize", content=json.dumps({"tokens": [10**9]}))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    try:
        openai.OpenAI(base_url=url + "/v1", api_key="x").models.retrieve("tiny")
    except openai.NotFoundError:  # pragma: no cover
        raise AssertionError("models.retrieve should find the served model") from None


def test_generation_config_sampling_defaults_and_cors(tiny_model_dir, tmp_path):
    """Fields a request leaves out take the checkpoint's generation_config (greedy here);
    CORS answers a browser's preflight only for the origins given."""
    import shutil

    from tests.test_server import Server

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0}))
    srv = Server(model, allowed_origins=("http://app.example",))
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 12, "ignore_eos": True}
        texts = {httpx.post(srv.url + "/v1/completions", json=body).json()["choices"][0]["text"]}
        texts.add(httpx.post(srv.url + "/v1/completions", json=body).json()["choices"][0]["text"])
        greedy = {**body, "temperature": 0}
        texts.add(httpx.post(srv.url + "/v1/completions", json=greedy).json()["choices"][0]["text"])
        assert len(texts) == 1  # every one greedy: the checkpoint's default applied
        pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
        ok = httpx.options(srv.url + "/v1/completions", headers=pre)
        assert ok.headers.get("access-control-allow-origin") == "http://app.example"
        other = httpx.options(
            srv.url + "/v1/completions", headers={**pre, "Origin": "http://evil.example"}
        )
        assert "access-control-allow-origin" not in other.headers
    finally:
        srv.close()
