"""Chat extras of the server: `chat_template_kwargs` reach the template (Qwen3's
`enable_thinking`); assistant messages with `tool_calls` (and tool results) render through it,
their JSON arguments as objects; and `--reasoning-parser qwen3` returns a `<think>` block as
`reasoning_content`, alike in whole and streamed responses, whatever the stream's chunking."""

from __future__ import annotations

import json
import random
import shutil

import httpx
import pytest

from metrale.default_model import default_model_dir
from metrale.outputs import CompletionOutput, Logprob, RequestOutput
from metrale.sampling_params import SamplingParams
from metrale.server.protocol import chat_logprobs, chat_response
from metrale.server.reasoning import ThinkSplitter, split_whole
from metrale.tokenizer import Tokenizer
from tests.test_server import Server

# Qwen3's switch, reduced: with thinking off the template writes an empty block itself.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    '{% for tc in m.tool_calls or [] %}<tool_call>{"name": "{{ tc.function.name }}", '
    '"arguments": {{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n'
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% if open_think is defined and open_think %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_model_dir, path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    srv = Server(path, reasoning_parser="qwen3")
    yield srv
    srv.close()


def chat(server, **extra) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return httpx.post(server.url + "/v1/chat/completions", json={**body, **extra}, timeout=60)


def test_chat_template_kwargs_reach_the_template(server):
    plain = chat(server).json()["usage"]["prompt_tokens"]
    off = chat(server, chat_template_kwargs={"enable_thinking": False}).json()
    assert off["usage"]["prompt_tokens"] > plain  # the empty block was rendered
    on = chat(server, chat_template_kwargs={"enable_thinking": True}).json()
    assert on["usage"]["prompt_tokens"] == plain


@pytest.mark.parametrize(
    "kwargs, status",
    [("yes", 400), ({"messages": []}, 400), ({"add_generation_prompt": False}, 400)],
)
def test_bad_chat_template_kwargs_get_a_400(server, kwargs, status):
    res = chat(server, chat_template_kwargs=kwargs)
    assert res.status_code == status
    assert res.json()["error"]["param"] == "chat_template_kwargs"


def _tokenize(server, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    return httpx.post(server.url + "/tokenize", json=body, timeout=60).json()["tokens"]


def test_continue_final_message_and_add_generation_prompt(server):
    """vLLM's chat fields: the prompt ends after the final message's text with
    `continue_final_message` (a prefilled assistant turn the model goes on with), after its
    turn without `add_generation_prompt`, with the assistant's turn opened by default; both
    true is a 400 naming `continue_final_message` (they were ignored: found in review); a
    per-request template or documents are refused, not ignored."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def f("}]
    turns = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\ndef f("
    cases = [
        ({}, turns + "<|im_end|>\n<|im_start|>assistant\n"),
        ({"add_generation_prompt": False}, turns + "<|im_end|>\n"),
        ({"add_generation_prompt": False, "continue_final_message": True}, turns),
    ]
    for fields, text in cases:
        body = {"messages": messages, **fields}
        got = httpx.post(server.url + "/tokenize", json=body, timeout=60).json()["tokens"]
        assert got == _tokenize(server, text), fields
        res = chat(server, messages=messages, **fields)
        assert res.status_code == 200 and res.json()["usage"]["prompt_tokens"] == len(got)
    for route in ("/v1/chat/completions", "/tokenize"):
        body = {"model": "tiny", "messages": messages, "continue_final_message": True}
        res = httpx.post(server.url + route, json=body, timeout=60)
        assert res.status_code == 400 and res.json()["error"]["param"] == "continue_final_message"
    for field, value in (("chat_template", "{{ messages }}"), ("documents", [{"t": "x"}])):
        res = chat(server, **{field: value})
        assert res.status_code == 400 and res.json()["error"]["param"] == field


def test_an_answer_without_a_block_is_all_content(server):
    whole = chat(server, max_tokens=8, temperature=0).json()["choices"][0]["message"]
    assert "<think>" not in whole["content"]
    assert whole["reasoning_content"] is None
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
        },
        timeout=60,
    ) as res:
        deltas = [
            json.loads(line[6:])["choices"]
            for line in res.iter_lines()
            if line.startswith("data: {")
        ]
    text = "".join(c[0]["delta"].get("content") or "" for c in deltas if c)
    assert text == whole["content"]
    assert not any(c and "reasoning_content" in c[0]["delta"] for c in deltas)


TEXTS = [
    "<think>\nweigh it\n</think>\n\nthe answer",
    "no block at all",
    "<think>cut by max_tokens",
    "  <think>x</think>y</think>z",
    "<thi",
    "\n\nlate</think>tag",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_splits_equal_the_whole_split(text):
    want = split_whole(text)
    for seed in range(100):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        splitter, thought, content = ThinkSplitter(), "", ""
        for i, piece in enumerate(pieces):
            a, b = splitter.feed(piece, final=i == len(pieces) - 1)
            thought, content = thought + a, content + b
        assert ((thought if splitter.opened else None), content) == want


def test_whole_response_puts_the_block_in_reasoning_content():
    text = "<think>\nweigh it\n</think>\n\nthe answer"
    c = CompletionOutput(index=0, text=text, token_ids=[1, 2, 3], finish_reason="stop")
    out = RequestOutput("r", None, [5], [c], finished=True)
    body = chat_response(out, "chatcmpl-1", SamplingParams(), "tiny", None, reasoning=True)
    message = body.model_dump()["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "the answer",
        "reasoning_content": "\nweigh it\n",
    }
    assert split_whole("<think>x</think>y") == ("x", "y")


HISTORY = [
    {"role": "user", "content": "weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_tool_call_history_renders_through_the_template(server):
    ids = httpx.post(
        server.url + "/tokenize", json={"model": "tiny", "messages": HISTORY}, timeout=30
    ).json()["tokens"]
    text = httpx.post(
        server.url + "/detokenize", json={"model": "tiny", "tokens": ids}, timeout=30
    ).json()["prompt"]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\nsunny<|im_end|>" in text
    res = chat(server, messages=HISTORY)
    assert res.status_code == 200
    assert res.json()["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(
    "calls",
    ["oops", [{"function": {"arguments": "{}"}}], [{"function": {"name": "f", "arguments": "{"}}]],
)
def test_bad_tool_calls_in_history_get_a_400(server, calls):
    bad = [HISTORY[0], {**HISTORY[1], "tool_calls": calls}]
    res = chat(server, messages=bad)
    assert res.status_code == 400 and res.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("arguments", ["9" * 5000, "[" * 100000 + "]" * 100000, '{"a": NaN}'])
def test_tool_call_arguments_json_cannot_hit_a_500(server, arguments):
    call = {"type": "function", "function": {"name": "f", "arguments": arguments}}
    bad = [HISTORY[0], {**HISTORY[1], "tool_calls": [call]}]
    res = chat(server, messages=bad)
    assert res.status_code == 400 and res.json()["error"]["param"] == "messages"


def test_a_block_the_template_opened_is_reasoning_until_it_closes(server):
    """Qwen3's thinking-only templates end the prompt inside `<think>`: the output is reasoning
    from its first token (this model never closes the block), whole and streamed alike."""
    extra = dict(chat_template_kwargs={"open_think": True}, temperature=0, max_tokens=8)
    whole = chat(server, **extra).json()["choices"][0]["message"]
    assert whole["content"] is None and whole["reasoning_content"]  # (vLLM's null)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json={**body, **extra}, timeout=60
    ) as res:
        deltas = [json.loads(x[6:])["choices"] for x in res.iter_lines() if x.startswith("data: {")]
    thought = "".join(c[0]["delta"].get("reasoning_content") or "" for c in deltas if c)
    assert thought == whole["reasoning_content"]
    assert split_whole("a</think>\n\nb", opened=True) == ("a", "b")


def test_chat_logprobs_give_each_tokens_own_bytes():
    """A byte-level token that is a piece of a character reads as U+FFFD; its `bytes` are its
    own, so the client can rebuild the character (found in review: they were U+FFFD's)."""
    tok = Tokenizer.from_dir(default_model_dir())
    ids = tok.encode("日本", add_special_tokens=False)
    other = tok.encode(" x", add_special_tokens=False)[0]
    entries = [{t: Logprob(-0.1, 1, tok.decode([t])), other: Logprob(-3.0, 2, " x")} for t in ids]
    c = CompletionOutput(0, "日本", ids, logprobs=entries, finish_reason="length")
    content = chat_logprobs(c, tok, 2).model_dump()["content"]
    assert [e["token"] for e in content] == [tok.decode([t]) for t in ids]
    assert bytes(b for e in content for b in e["bytes"]) == "日本".encode()
    assert [e["top_logprobs"][1]["bytes"] for e in content] == [list(b" x")] * len(ids)
