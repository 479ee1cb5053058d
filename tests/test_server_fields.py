"""Completion fields a vLLM client reads: `text_offset` of the legacy logprobs (each token's
character offset in the completion, whole and streamed alike), `stop_reason` (the stop token
id or stop string that ended a choice; null for EOS and length) and `echo` (the prompt before
each completion's text, for text and token-id prompts, whole, streamed and several at once)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.test_server import Server

MAX = "max_completion_tokens"


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


class FakeRequest:
    async def is_disconnected(self) -> bool:
        return False


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(97 + i % 26) * (1 + i % 3) for i in ids)


def test_a_stream_sends_each_choices_finish_once():
    """Choice 0 stops at the first output, choice 1 goes on: choice 0's finish is sent once,
    and each choice's text_offset runs on across its chunks."""
    import asyncio

    from metrale.outputs import CompletionOutput, Logprob, RequestOutput
    from metrale.sampling_params import SamplingParams
    from metrale.server.streaming import StreamStyle, sse_events

    def lp(t):
        return {t: Logprob(logprob=-1.0, rank=1, decoded_token="x")}

    def choice(index, ids, new, finish):
        return CompletionOutput(
            index=index,
            text="",
            token_ids=ids,
            finish_reason=finish,
            delta_text="t",
            delta_token_ids=ids[-new:],
            logprobs=[lp(t) for t in ids],
        )

    steps = [
        [choice(0, [1, 2], 2, "stop"), choice(1, [3, 4], 2, None)],
        [choice(0, [1, 2], 0, "stop"), choice(1, [3, 4, 5], 1, None)],
        [choice(0, [1, 2], 0, "stop"), choice(1, [3, 4, 5, 6], 1, "length")],
    ]

    async def events():
        for i, outs in enumerate(steps):
            yield RequestOutput("r", None, [0], outs, finished=i == len(steps) - 1)

    async def collect():
        params = SamplingParams(n=2, logprobs=1)
        style = StreamStyle(FakeTokenizer(), "tiny", False)
        gen = sse_events(FakeRequest(), events(), "r", params, False, False, False, style)
        return [json.loads(x[6:]) async for x in gen if x.startswith("data: {")]

    chunks = asyncio.run(collect())
    finishes = [ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == [0, 1]
    tok = FakeTokenizer()
    for index, ids in ((0, [1, 2]), (1, [3, 4, 5, 6])):
        mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == index]
        offsets = [o for ch in mine for o in ch["logprobs"]["text_offset"]]
        pieces = [tok.decode([t]) for t in ids]
        assert offsets == [sum(len(p) for p in pieces[:i]) for i in range(len(ids))]


def test_include_stop_str_in_output_and_the_unused_vllm_fields(server):
    """vLLM's `include_stop_str_in_output` keeps the stop string in the text (it was ignored),
    and vLLM's fields metrale does not implement pass at the values that change nothing."""
    text = complete(server, max_tokens=16)["text"]
    stop = text[5:7]
    cut = text.index(stop)
    assert complete(server, max_tokens=16, stop=stop)["text"] == text[:cut]
    kept = complete(server, max_tokens=16, stop=stop, include_stop_str_in_output=True)
    assert kept["text"] == text[: cut + len(stop)] and kept["stop_reason"] == stop
    unused = dict(
        use_beam_search=False, bad_words=[], prompt_logprobs=None, skip_special_tokens=True
    )
    assert complete(server, max_tokens=16, **unused)["text"] == text


def test_skip_special_tokens_reaches_the_sampling_params():
    from metrale.server.schemas import CompletionRequest

    body = {"prompt": "x", "skip_special_tokens": False, "include_stop_str_in_output": True}
    kw = CompletionRequest(**body).sampling_kwargs()
    assert kw["skip_special_tokens"] is False and kw["include_stop_str_in_output"] is True


def test_a_small_pool_is_the_context_the_server_advertises_and_keeps(tiny_model_dir):
    """`num_kv_pages` below max_model_len: /v1/models and /tokenize name what a sequence can
    reach, prompt + max_tokens past it is a 400, and one that reaches it ends with "length" (before:
    these were accepted and ended where the pool did, a 200 with finish_reason "error")."""
    srv = Server(tiny_model_dir, max_model_len=256, page_size=4, num_kv_pages=12)
    try:
        limit = srv.loop.engine.context_len
        assert limit < 256
        model = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]
        assert model["max_model_len"] == limit
        base = {"model": "tiny", "prompt": [5, 6, 7, 8], "temperature": 0, "ignore_eos": True}
        url = srv.url + "/v1/completions"
        res = httpx.post(url, json={**base, "max_tokens": limit}, timeout=60)
        assert res.status_code == 400 and res.json()["error"]["param"] == "max_tokens", res.text
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        res = httpx.post(srv.url + "/v1/chat/completions", json={**chat, MAX: limit}, timeout=60)
        assert res.status_code == 400 and res.json()["error"]["param"] == MAX, res.text
        res = httpx.post(url, json={**base, "max_tokens": limit - 4}, timeout=60)
        choice, usage = res.json()["choices"][0], res.json()["usage"]
        assert res.status_code == 200 and choice["finish_reason"] == "length", res.text
        assert usage["prompt_tokens"] + usage["completion_tokens"] == limit
    finally:
        srv.close()
