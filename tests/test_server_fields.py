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


def test_echo_gives_back_the_prompt_as_sent(server):
    """A string prompt is echoed as sent, its special tokens included (its ids decoded
    dropped them); a token-id prompt is decoded with its special tokens (found in review)."""
    prompt = "x = 1<|endoftext|>y = 2"
    plain = complete(server, prompt=prompt)["text"]
    assert complete(server, prompt=prompt, echo=True)["text"] == prompt + plain
    ids = httpx.post(
        server.url + "/tokenize", json={"model": "tiny", "prompt": prompt}, timeout=30
    ).json()["tokens"]
    assert complete(server, prompt=ids, echo=True)["text"] == prompt + plain
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "echo": True}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as res:
        chunks = [json.loads(x[6:]) for x in res.iter_lines() if x.startswith("data: {")]
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == prompt + plain


def test_top_logprobs_always_hold_the_chosen_token(server):
    """Legacy completions: each position's `top_logprobs` holds the chosen token and the top
    `logprobs` (up to logprobs + 1 entries, as OpenAI and vLLM give them); `logprobs: 0`, the
    chosen token alone. It left out a sampled token outside the top (found in review)."""
    greedy = complete(server, logprobs=0, max_tokens=6)["logprobs"]
    assert all(len(top) == 1 for top in greedy["top_logprobs"])
    for top, token, lp in zip(
        greedy["top_logprobs"], greedy["tokens"], greedy["token_logprobs"], strict=True
    ):
        assert top == {token: lp}
    sampled = complete(server, logprobs=2, max_tokens=24, temperature=5.0, seed=3)["logprobs"]
    outside = 0
    for top, token in zip(sampled["top_logprobs"], sampled["tokens"], strict=True):
        # (keys are token texts, as OpenAI's: two ids of one text, such as two pieces of a
        # character, share a key)
        assert token in top and 1 <= len(top) <= 3
        outside += len(top) == 3
    assert outside  # at temperature 5 some sampled token is outside the top 2


def test_max_tokens_null_runs_to_the_context(tiny_model_dir):
    """`"max_tokens": null` generates until the context ends (vLLM), where leaving it out
    gives 16 (OpenAI's legacy default); a prompt whose default 16 would not fit is then
    accepted."""
    srv = Server(tiny_model_dir, max_model_len=48)
    try:
        base = {"model": "tiny", "prompt": [5] * 40, "temperature": 0, "ignore_eos": True}
        url = srv.url + "/v1/completions"
        left_out = httpx.post(url, json=base, timeout=60)
        assert left_out.status_code == 400 and "max_tokens" in left_out.text
        null = httpx.post(url, json={**base, "max_tokens": None}, timeout=60).json()
        assert null["usage"]["completion_tokens"] == 8
        assert null["choices"][0]["finish_reason"] == "length"
        short = {**base, "prompt": [5] * 4}
        assert httpx.post(url, json=short, timeout=60).json()["usage"]["completion_tokens"] == 16
    finally:
        srv.close()


def test_several_prompts_stream_together(server):
    """Several prompts in one streamed call: every prompt's choices in one stream, choice
    `i * n + j` prompt i's completion j, each as the call without streaming gives it, one
    usage chunk for all (vLLM streams them; metrale refused it, found in review)."""
    body = {
        "model": "tiny", "prompt": ["def f(", "class A", "x = ["], "max_tokens": 6,
        "temperature": 0.8, "seed": 5, "n": 2, "echo": True,
    }  # fmt: skip
    url = server.url + "/v1/completions"
    whole = httpx.post(url, json=body, timeout=60).json()
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url, json=stream, timeout=60) as res:
        chunks = [json.loads(x[6:]) for x in res.iter_lines() if x.startswith("data: {")]
    texts, finish = {}, {}
    for chunk in chunks:
        for ch in chunk["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            if ch["finish_reason"]:
                finish[ch["index"]] = ch["finish_reason"]
    assert len(whole["choices"]) == 6
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert finish == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    assert chunks[-1]["usage"] == whole["usage"]


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
    from metrale.server.streaming import StreamStyle, one_prompt, sse_events

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
        gen = sse_events(
            FakeRequest(), one_prompt(events()), "r", params, False, False, None, style
        )
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
        use_beam_search=False,
        bad_words=[],
        prompt_logprobs=None,
        skip_special_tokens=True,
        spaces_between_special_tokens=False,
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


def test_vllm_output_fields_not_supported_are_refused_not_ignored(server):
    """vLLM's `return_tokens_as_token_ids` and `stream_options.continuous_usage_stats` change
    what a response holds: refused with a 400 naming them when asked for (they were silently
    ignored, found in review), accepted at the values that change nothing."""
    url = server.url + "/v1/completions"
    base = {"model": "tiny", "prompt": "a", "max_tokens": 2}
    asked = httpx.post(url, json={**base, "return_tokens_as_token_ids": True}, timeout=60)
    assert asked.status_code == 400
    assert asked.json()["error"]["param"] == "return_tokens_as_token_ids"
    stream = {**base, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    refused = httpx.post(url, json=stream, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_options"
    assert httpx.post(url, json={**base, "return_tokens_as_token_ids": False}).status_code == 200
    off = {**stream, "stream_options": {"continuous_usage_stats": False}}
    assert httpx.post(url, json=off, timeout=60).status_code == 200


def test_top_logprobs_keep_the_chosen_tokens_logprob_where_texts_collide():
    """Two alternatives that decode to the chosen token's text (pieces of characters, each
    U+FFFD) share its key: the value stays the chosen token's, as `token_logprobs` gives it."""
    from metrale.outputs import Logprob
    from metrale.server.protocol import _with_chosen

    entry = {
        7: Logprob(-2.5, rank=4, decoded_token="\ufffd"),  # the chosen token comes first
        3: Logprob(-0.5, rank=1, decoded_token="\ufffd"),
        5: Logprob(-1.0, rank=2, decoded_token="a"),
        9: Logprob(-1.5, rank=3, decoded_token="a"),
    }
    assert _with_chosen(entry, 3) == {"\ufffd": -2.5, "a": -1.0}
    assert _with_chosen(entry, 0) == {"\ufffd": -2.5}
