"""The prompt tokens a request took from the prefix cache, as it reports them: the Python API's
`RequestOutput.num_cached_tokens` (vLLM's field) and the server's
`usage.prompt_tokens_details.cached_tokens` (OpenAI's), in completions and chat completions,
whole and streamed. The expected counts come from the pages mapped into block tables
(`PageAllocator.share`) or from page arithmetic, not from the hit the engine recorded."""

from __future__ import annotations

import json

import httpx
import pytest

from metrale import LLM, SamplingParams
from tests.prefix_cache_helpers import greedy, shared_prompts
from tests.test_server import Server

PAGE = 4


def count_shared_pages(llm: LLM) -> dict[str, list[int]]:
    """Per request id, the number of cached pages each admission of its sequences mapped."""
    alloc, mapped = llm.engine.allocator, {}
    share = alloc.share

    def counting(seq, pages):
        mapped.setdefault(seq.request_id, []).append(len(pages))
        return share(seq, pages)

    alloc.share = counting
    return mapped


# ---- the Python API ---------------------------------------------------------------------------


def test_request_output_reports_the_reused_pages(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", page_size=PAGE)
    mapped = count_shared_pages(llm)
    a = list(range(10, 32))  # 22 tokens: 5 full pages
    first = llm.generate([a], greedy(4), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and mapped[first.request_id] == [0]
    again = llm.generate([a], greedy(4), use_tqdm=False)[0]
    assert mapped[again.request_id] == [5]
    assert again.num_cached_tokens == 5 * PAGE == 20
    # parts ways inside page 3: pages 0-2
    other = llm.generate([a[:14] + [99] * 9], greedy(4), use_tqdm=False)[0]
    assert other.num_cached_tokens == PAGE * mapped[other.request_id][0] == 12
    # every streamed output carries it, from the first one on
    streamed = list(llm.stream(a, greedy(3)))
    assert [o.num_cached_tokens for o in streamed] == [20] * len(streamed)
    # n > 1: the prompt's hit once (usage counts the prompt once), not once per sample
    params = SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=3, ignore_eos=True)
    assert llm.generate([a], params, use_tqdm=False)[0].num_cached_tokens == 20


def test_request_output_reports_zero_with_caching_off(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", page_size=PAGE, prefix_caching=False)
    a = list(range(10, 32))
    outs = [llm.generate([a], greedy(4), use_tqdm=False)[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in outs] == [0, 0]


def test_a_preempted_sequence_reports_its_first_admissions_hit(tiny_model_dir):
    """A pool that preempts: a sequence recomputed after a preemption finds more of its own
    pages than its first admission did; it still reports the first admission's hit."""
    options = dict(max_num_batched_tokens=16, num_kv_pages=24, max_num_seqs=6)
    llm = LLM(tiny_model_dir, device="cpu", page_size=PAGE, **options)
    mapped = count_shared_pages(llm)
    prompts = shared_prompts(4 * PAGE, 10, seed=16)
    outs = llm.generate(prompts, greedy(12), use_tqdm=False)
    outs += llm.generate(prompts, greedy(12), use_tqdm=False)
    assert llm.engine.telemetry.preemptions > 0
    assert any(len(set(m)) > 1 for m in mapped.values())  # a recompute's hit differed
    assert [o.num_cached_tokens for o in outs] == [PAGE * mapped[o.request_id][0] for o in outs]
    assert outs[0].num_cached_tokens == 0 and max(o.num_cached_tokens for o in outs) > 0


# ---- the server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server(tiny_model_dir, page_size=PAGE)
    yield srv
    srv.close()


def post(server, route: str, body: dict) -> dict:
    res = httpx.post(server.url + route, json=body, timeout=60)
    assert res.status_code == 200, res.text
    return res.json()


def streamed_usage(server, route: str, body: dict) -> dict:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    res = httpx.post(server.url + route, json=body, timeout=60)
    assert res.status_code == 200, res.text
    chunks = [
        json.loads(line[6:])
        for line in res.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    assert chunks[-1]["choices"] == []
    return chunks[-1]["usage"]


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_completions_report_cached_tokens(server):
    prompt = list(range(100, 130))  # 30 tokens: 7 full pages short of the last token
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0}
    body["ignore_eos"] = True
    first = post(server, "/v1/completions", body)["usage"]
    assert first["prompt_tokens"] == 30 and cached(first) == 0
    whole = post(server, "/v1/completions", body)["usage"]
    assert cached(whole) == 7 * PAGE == 28
    assert streamed_usage(server, "/v1/completions", body) == whole
    # several prompts: summed like the other usage fields (the second parts ways in page 3)
    both = post(server, "/v1/completions", {**body, "prompt": [prompt, prompt[:13] + [7] * 9]})
    assert both["usage"]["prompt_tokens"] == 52 and cached(both["usage"]) == 28 + 3 * PAGE
    assert streamed_usage(server, "/v1/completions", {**body, "prompt": prompt, "n": 2}) == {
        **whole,
        "completion_tokens": 6,
        "total_tokens": 36,
    }


def test_chat_completions_report_cached_tokens(server):
    messages = [{"role": "user", "content": "count the pages of this cached prompt: " * 4}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 3, "temperature": 0}
    body["ignore_eos"] = True
    first = post(server, "/v1/chat/completions", body)["usage"]
    assert first["prompt_tokens"] > 3 * PAGE and cached(first) == 0
    whole = post(server, "/v1/chat/completions", body)["usage"]
    # the same prompt again: every full page short of its last token
    assert cached(whole) == (first["prompt_tokens"] - 1) // PAGE * PAGE > 0
    assert streamed_usage(server, "/v1/chat/completions", body) == whole


def test_openai_client_reads_cached_tokens(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    prompt = list(range(200, 222))  # 22 tokens: 5 full pages
    for expected in (0, 5 * PAGE):
        done = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
        assert done.usage.prompt_tokens_details.cached_tokens == expected


def test_caching_off_reports_zero(tiny_model_dir):
    srv = Server(tiny_model_dir, page_size=PAGE, prefix_caching=False)
    try:
        body = {"model": "tiny", "prompt": list(range(100, 130)), "max_tokens": 2}
        for _ in range(2):
            usage = post(srv, "/v1/completions", body)["usage"]
            assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
        assert cached(streamed_usage(srv, "/v1/completions", body)) == 0
    finally:
        srv.close()
