"""Tool calling on /v1/chat/completions: `tools` with `tool_choice` in its four forms through the
openai client, streamed and not; `<tool_call>` blocks parsed into `tool_calls` (whole texts and
every chunking of a stream alike, malformed and unknown calls left as content); "required" and
named choices constrained by a grammar, equal with speculation and without, whose special-token
form fits tokenizers with the tags as tokens; tools rendered by a template that reads them, or
as Qwen3's preamble for one that does not; 400s for bad tools and choices."""

from __future__ import annotations

import json
import random
import shutil

import httpx
import jsonschema
import llguidance
import pytest
import tokenizers
from tokenizers import AddedToken

from metrale.default_model import default_model_dir
from metrale.sampling_params import SamplingParams
from metrale.server.schemas import ChatCompletionRequest
from metrale.server.tool_parser import ToolCallSplitter, split_tool_calls
from metrale.server.tools import plan_tools, tool_call_grammar, tools_preamble
from metrale.structured.grammar import GrammarCompiler
from metrale.tokenizer import Tokenizer
from tests.test_server import Server
from tests.test_server_chat_extras import HISTORY

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "today's weather",
            "parameters": WEATHER,
        },
    },
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
NAMES = frozenset(SCHEMAS)
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "add"}}


@pytest.fixture(scope="module")
def server():
    srv = Server(default_model_dir(), spec={"method": "ngram", "num_drafts": 3})
    yield srv
    srv.close()


def ask(client, stream: bool = False, **extra):
    """(content, [(name, arguments)], finish_reason) of one greedy answer."""
    body = dict(model="tiny", messages=CHAT, max_tokens=160, temperature=0, tools=TOOLS)
    body.update(extra)
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        for c in choice.message.tool_calls or ():
            assert c.type == "function" and c.id.startswith("call_") and len(c.id) == 37
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        # no empty chunks while a call takes shape (one a token before, as vLLM sends none)
        assert delta.content or delta.tool_calls or delta.role or chunk.choices[0].finish_reason
        content += delta.content or ""
        for call in delta.tool_calls or ():
            assert call.index == len(calls) and call.id.startswith("call_")
            calls[call.index] = (call.function.name, call.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [calls[i] for i in range(len(calls))], finish


def check_calls(calls):
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# -- through the server ------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_constrained_choices_give_one_valid_call(client, server, choice, stream):
    content, calls, finish = ask(client, stream, tool_choice=choice, parallel_tool_calls=False)
    assert len(calls) == 1 and content is None and finish == "tool_calls"
    check_calls(calls)
    if choice == NAMED:
        assert calls[0][0] == "add"
    server.wait_idle()


def test_parallel_calls_all_parse(client, server):
    whole = ask(client, tool_choice="required", max_tokens=120)
    streamed = ask(client, True, tool_choice="required", max_tokens=120)
    assert whole == streamed
    content, calls, finish = whole
    assert len(calls) >= 1
    check_calls(calls)
    # the small model goes on calling until max_tokens cuts a call: the grammar allowed calls
    # alone, so what was cut off is no content (found in review: it was returned as text)
    assert finish in ("tool_calls", "length") and content is None
    server.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_once_with_parallel_calls_on(client, server, stream):
    """As vLLM's named choice: one call of that function, whatever `parallel_tool_calls` says
    (the grammar let the small model repeat it until max_tokens cut the answer)."""
    content, calls, finish = ask(client, stream, tool_choice=NAMED, max_tokens=120)
    assert [name for name, _ in calls] == ["add"] and content is None
    assert finish == "tool_calls"
    check_calls(calls)
    server.wait_idle()


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_grammar_output_equals_without_speculation(client, choice):
    spec = ask(client, tool_choice=choice, max_tokens=120)
    plain = ask(
        client, tool_choice=choice, max_tokens=120, extra_body={"speculative": {"enabled": False}}
    )
    assert spec == plain


def test_none_renders_no_tools_and_parses_none(client, server):
    without = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=40, temperature=0
    )
    for stream in (False, True):
        content, calls, finish = ask(client, stream, tool_choice="none", max_tokens=40)
        assert calls == [] and finish == without.choices[0].finish_reason
        assert content == without.choices[0].message.content
    reply = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=4, tools=TOOLS, tool_choice="none"
    )
    assert reply.usage.prompt_tokens == without.usage.prompt_tokens
    server.wait_idle()


@pytest.mark.parametrize("choice", ["auto", None])
def test_auto_parses_alike_streamed_and_not(client, server, choice):
    extra = {} if choice is None else {"tool_choice": choice}
    whole = ask(client, **extra)
    assert ask(client, True, **extra) == whole
    content, calls, finish = whole
    if calls:
        assert finish in ("tool_calls", "length")
    assert calls or content  # whatever the model did, it is one or the other
    check_calls(calls)
    # the tools were rendered: the prompt is longer than without them
    plain = httpx.post(server.url + "/tokenize", json={"messages": CHAT}).json()
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, tools=TOOLS)
    assert reply.usage.prompt_tokens > plain["count"]


def test_tool_history_renders_with_the_preamble(server):
    # the question, then an assistant's get_weather call for Paris and its "sunny" result
    history = [{"role": "system", "content": "Be brief."}, *CHAT, *HISTORY[1:]]
    ids = httpx.post(server.url + "/tokenize", json={"messages": history, "tools": TOOLS}).json()
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    preamble = tools_preamble(TOOLS)
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{preamble}<|im_end|>\n")
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert json.dumps(TOOLS[0]) in text and "<|im_start|>tool\nsunny<|im_end|>" in text
    reply = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": history, "tools": TOOLS, "max_tokens": 1},
    ).json()
    assert reply["usage"]["prompt_tokens"] == ids["count"]


BAD = [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
            ]
        },
        "tools",
    ),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": NAMED}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    ({"tools": TOOLS, "tool_choice": NAMED, "guided_regex": "a+"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": TOOLS, "tool_choice": "required", "min_tokens": 2}, "min_tokens"),
]


@pytest.mark.parametrize("extra, param", BAD)
def test_bad_tools_and_choices_get_a_400(server, extra, param):
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 4, **extra}
    res = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert res.status_code == 400, res.text
    assert res.json()["error"]["param"] == param
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"$ref": "#/nope"}}},
        {"type": "object", "properties": {"a": {"type": "nope"}}},
    ],
)
def test_a_tool_schema_that_does_not_compile_is_named(server, schema):
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    body = {"messages": CHAT, "tools": [TOOLS[0], tool], "tool_choice": "required"}
    res = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert res.status_code == 400 and res.json()["error"]["param"] == "tools"
    assert res.json()["error"]["message"].startswith("tools[1].function.parameters: ")


def test_completions_refuse_tools(server):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "tools": TOOLS}
    res = httpx.post(server.url + "/v1/completions", json=body)
    assert res.status_code == 400 and res.json()["error"]["param"] == "tools"
    neutral = {"tools": [], "tool_choice": "none", "parallel_tool_calls": True}
    assert httpx.post(server.url + "/v1/completions", json={**body, **neutral}).status_code == 200


# -- a chat template that renders tools itself ---------------------------------------------

# Qwen3's template, reduced (trim_blocks eats a newline right after a block tag, as in HF)
QWEN3_LIKE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}"
    "{{ messages[0].content + '\\n\\n' }}{% endif %}# Tools\n<tools>{% for tool in tools %}"
    "{{ '\\n' + tool | tojson }}{% endfor %}{{ '\\n' }}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if not (tools and m.role == 'system') %}<|im_start|>"
    "{{ m.role + '\\n' + m.content }}{% for tc in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_tool_template(model_dir, path):
    """A copy of `model_dir` at `path` whose chat template renders tools itself (QWEN3_LIKE)."""
    shutil.copytree(model_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3_LIKE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


@pytest.fixture(scope="module")
def templated(tiny_model_dir, tmp_path_factory):
    path = with_tool_template(tiny_model_dir, tmp_path_factory.mktemp("tools") / "model")
    srv = Server(path)
    yield srv
    srv.close()


def test_a_template_that_reads_tools_renders_them(templated):
    messages = [{"role": "system", "content": "Be brief."}, *CHAT]
    ids = httpx.post(templated.url + "/tokenize", json={"messages": messages, "tools": TOOLS})
    text = httpx.post(templated.url + "/detokenize", json={"tokens": ids.json()["tokens"]})
    text = text.json()["prompt"]
    lines = "".join("\n" + json.dumps(t) for t in TOOLS)
    system = f"<|im_start|>system\nBe brief.\n\n# Tools\n<tools>{lines}\n</tools><|im_end|>\n"
    assert text.startswith(system + "<|im_start|>user\n")
    assert "You may call" not in text  # the template's words, not the preamble
    body = {"messages": messages, "tools": TOOLS, "max_tokens": 2}
    reply = httpx.post(templated.url + "/v1/chat/completions", json=body).json()
    assert reply["usage"]["prompt_tokens"] == ids.json()["count"]
    plain = httpx.post(templated.url + "/tokenize", json={"messages": messages}).json()
    for extra in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        body = {"messages": messages, "max_tokens": 2, **extra}
        reply = httpx.post(templated.url + "/v1/chat/completions", json=body).json()
        assert reply["usage"]["prompt_tokens"] == plain["count"]


# -- the parser --------------------------------------------------------------------------------

CALL_A = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
CALL_W = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
)
TEXTS = [
    CALL_A,
    f"Let me add.\n{CALL_A}",
    f"{CALL_W}\n{CALL_A}\n",
    f"{CALL_A}\nThat is all.",
    '<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>',  # malformed JSON
    '<tool_call>\n{"name": "mul", "arguments": {}}\n</tool_call>',  # unknown tool
    '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>',  # not an object
    f"{CALL_A}\n<tool_call>\n" + '{"name": "add", "argu',  # cut short
    "plain <tools> and <tool_ talk, no call",
    "   \n",
    "<tool_cal",
    "",
    # the closing tag inside an argument string, then more text
    '<tool_call>\n{"name": "add", "arguments": {"a": "x</tool_call>y"}}\n</tool_call> ok',
    # what JSON or UTF-8 cannot carry back: no call
    '<tool_call>\n{"name": "add", "arguments": {"a": 1e999}}\n</tool_call>',
    '<tool_call>\n{"name": "add", "arguments": {"a": "\\ud800"}}\n</tool_call>',
    # a malformed block, then a good one
    '<tool_call>\n{"name": oops}\n</tool_call>\n' + CALL_A,
]


def test_whole_texts_split_into_content_and_calls():
    content, calls = split_tool_calls(f"Let me add.\n{CALL_A}", NAMES)
    assert content == "Let me add.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]
    content, calls = split_tool_calls(f"{CALL_W}\n{CALL_A}\n", NAMES)
    assert content is None and [c.name for c in calls] == ["get_weather", "add"]
    assert calls[0].id != calls[1].id and calls[0].as_openai()["type"] == "function"
    for bad in TEXTS[4:7]:
        assert split_tool_calls(bad, NAMES) == (bad, [])
    assert split_tool_calls(TEXTS[7], NAMES)[0] == TEXTS[7][len(CALL_A) :]
    assert split_tool_calls(CALL_A, frozenset({"get_weather"})) == (CALL_A, [])
    assert split_tool_calls("   \n", NAMES) == (None, [])
    call = '<tool_call>\n{"name": "add"}\n</tool_call>'  # no arguments: {}
    assert split_tool_calls(call, NAMES)[1][0].arguments == "{}"


def test_calls_that_would_not_serialise_stay_text_and_a_tag_in_a_string_is_no_end():
    content, calls = split_tool_calls(TEXTS[12], NAMES)
    assert content == " ok" and json.loads(calls[0].arguments) == {"a": "x</tool_call>y"}
    for text in TEXTS[13:15]:
        assert split_tool_calls(text, NAMES) == (text, [])
    content, calls = split_tool_calls(TEXTS[15], NAMES)
    assert content.startswith("<tool_call>") and [c.name for c in calls] == ["add"]


def test_one_call_at_most_when_parallel_calls_are_off():
    text = f"{CALL_W}\n{CALL_A}"
    content, calls = split_tool_calls(text, NAMES, single=True)
    assert [c.name for c in calls] == ["get_weather"] and content == f"\n{CALL_A}"
    splitter, streamed = ToolCallSplitter(NAMES, single=True), []
    for piece in (text[:30], text[30:70], text[70:]):
        streamed += splitter.feed(piece, final=piece is text[70:])[1]
    assert [c.name for c in streamed] == ["get_weather"]


def test_a_constrained_choice_releases_calls_alone():
    """Under a "required" or named choice the grammar allows calls and the newlines between
    them: a call cut off (by max_tokens) and the separators are dropped, whole or streamed."""
    text = f"{CALL_W}\n{CALL_A}\n\n" + '<tool_call>\n{"name": "add", "argu'
    assert split_tool_calls(text, NAMES)[0] is not None  # (without it: the cut call is text)
    content, calls = split_tool_calls(text, NAMES, calls_only=True)
    assert content is None and [c.name for c in calls] == ["get_weather", "add"]
    for seed in range(20):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(len(text) + 1), 4))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        splitter, streamed = ToolCallSplitter(NAMES, calls_only=True), []
        for i, piece in enumerate(pieces):
            more, found = splitter.feed(piece, final=i == len(pieces) - 1)
            assert more == ""
            streamed += [c.name for c in found]
        assert streamed == ["get_weather", "add"]
    # a finished block that does not parse (1e999: JSON cannot carry it back, though the
    # grammar's number allows it) stays content, whole and streamed: dropped, the answer
    # looked empty (found in review)
    bad = TEXTS[13]
    content, calls = split_tool_calls(f"{CALL_A}\n{bad}", NAMES, calls_only=True)
    assert content == bad and [c.name for c in calls] == ["add"]
    splitter = ToolCallSplitter(NAMES, calls_only=True)
    pieces = [splitter.feed(f"{CALL_A}\n{bad[:20]}"), splitter.feed(bad[20:], final=True)]
    assert "".join(p[0] for p in pieces) == bad


def test_a_tag_split_across_chunks_is_held_back():
    splitter = ToolCallSplitter(NAMES)
    assert splitter.feed("Sure. <tool_") == ("Sure. ", [])
    assert splitter.feed('call>\n{"name": "add", ') == ("", [])
    content, calls = splitter.feed('"arguments": {"a": 1, "b": 2}}\n</tool_')
    assert (content, calls) == ("", [])
    content, calls = splitter.feed("call>\nDone.", final=True)
    assert content == "\nDone." and [c.name for c in calls] == ["add"]
    assert ToolCallSplitter(NAMES).feed("a <tools> b") == ("a <tools> b", [])


@pytest.mark.parametrize("text", TEXTS)
def test_every_chunking_splits_as_the_whole(text):
    want_content, want_calls = split_tool_calls(text, NAMES)
    want = (want_content or "", [(c.name, c.arguments) for c in want_calls])
    for seed in range(60):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(len(text) + 1), min(rng.randint(1, 6), len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        splitter, content, calls = ToolCallSplitter(NAMES), "", []
        for i, piece in enumerate(pieces):
            more, found = splitter.feed(piece, final=i == len(pieces) - 1)
            content += more
            calls += [(c.name, c.arguments) for c in found]
        assert (content, calls) == want


def test_end_of_text_is_stripped_when_special_tokens_are_decoded():
    text = f"{CALL_A}<|im_end|>"
    assert split_tool_calls(text, NAMES, ("<|im_end|>",))[0] is None
    splitter = ToolCallSplitter(NAMES, ("<|im_end|>",))
    assert splitter.feed(CALL_A[:20])[0] == ""
    assert splitter.feed(CALL_A[20:] + "ok<|im_end|>", final=True)[0] == "ok"


@pytest.mark.parametrize(
    "text",
    [
        "x<|im_end|>",
        f"a<|im_end|>b {CALL_A}<|im_e<|im_end|>",
        "ax<|endoftext|><|im_end|>",
        "a<|im_end|><|endoftext|>",
    ],
)
def test_end_of_text_split_across_chunks_is_stripped_as_in_the_whole(text):
    """The end-of-text texts split over a stream's pieces are dropped from the streamed
    content as from the whole answer's (they were released piece by piece, and the first of
    two in a row when the second was held: found in review)."""
    strip = ("<|im_end|>", "<|endoftext|>")
    want = split_tool_calls(text, NAMES, strip)
    want = (want[0] or "", [(c.name, c.arguments) for c in want[1]])
    for seed in range(200):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(len(text) + 1), min(rng.randint(1, 8), len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        splitter, content, calls = ToolCallSplitter(NAMES, strip), "", []
        for i, piece in enumerate(pieces):
            more, found = splitter.feed(piece, final=i == len(pieces) - 1)
            content += more
            calls += [(c.name, c.arguments) for c in found]
        assert (content, calls) == want, pieces


# -- the grammar -------------------------------------------------------------------------------


def _tool_tokenizer(tags: str):
    """The shipped model's tokenizer; `tags`: "text" (no tokens of their own), "added" (tokens
    decoded as text, as Qwen3's) or "special" (tokens decoding skips)."""
    tok = tokenizers.Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    if tags != "text":
        special = tags == "special"
        tok.add_tokens(
            [
                AddedToken(t, normalized=False, special=special)
                for t in ("<tool_call>", "</tool_call>")
            ]
        )
    config = json.loads((default_model_dir() / "tokenizer_config.json").read_text())
    tokenizer = Tokenizer(tok, config)
    return tokenizer, GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def _matcher(plan, grammars):
    grammar = plan.structured.grammar_text()
    assert llguidance.LLMatcher.validate_grammar(grammar, grammars.tokenizer) == ""
    return llguidance.LLMatcher(grammars.tokenizer, grammar, log_level=0)


@pytest.mark.parametrize("tags", ["text", "added", "special"])
def test_the_grammar_takes_the_tags_as_the_tokenizer_has_them(tags):
    tokenizer, grammars = _tool_tokenizer(tags)
    body = ChatCompletionRequest(messages=CHAT, tools=TOOLS, tool_choice="required")
    plan = plan_tools(body, tokenizer, grammars)
    assert ("<[" in plan.structured.grammar) is (tags != "text")
    two = f"{CALL_W}\n{CALL_A}"
    ids = tokenizer.encode(two, add_special_tokens=False)
    assert (tokenizer.backend.token_to_id("<tool_call>") in ids) is (tags != "text")
    matcher = _matcher(plan, grammars)
    assert matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids)
    assert matcher.is_accepting()
    spelled = _tool_tokenizer("text")[0].encode(two, add_special_tokens=False)
    if tags != "text":  # the tags spelled out are not the tags
        assert _matcher(plan, grammars).validate_tokens(spelled) < len(spelled)
    # decoding keeps the tags: special tokens are decoded where the tags are special ones,
    # and the end of text they would add is stripped
    assert plan.decode_special is (tags == "special")
    assert plan.parsing.strip == (("<|im_end|>",) if tags == "special" else ())
    assert plan.apply(SamplingParams()).skip_special_tokens is (tags != "special")


def test_the_grammar_refuses_what_does_not_parse():
    tokenizer, grammars = _tool_tokenizer("text")
    one = ChatCompletionRequest(
        messages=CHAT, tools=TOOLS, tool_choice=NAMED, parallel_tool_calls=False
    )
    plan = plan_tools(one, tokenizer, grammars)
    for text, ok in [
        (CALL_A, True),
        (CALL_W, False),  # not the named tool
        (CALL_A.replace('"a": 1', '"a": 100'), False),  # past its maximum
        (CALL_A.replace(", ", ","), False),  # written as Qwen3 writes JSON
        (f"{CALL_A}\n{CALL_A}", False),  # one call only
    ]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        matcher = _matcher(plan, grammars)
        assert (matcher.validate_tokens(ids) == len(ids)) is ok, text
    # $refs of a tool's parameters still resolve where its schema sits in the grammar
    refs = {
        "type": "object",
        "properties": {"city": {"$ref": "#/$defs/City"}},
        "$defs": {"City": {"type": "string", "maxLength": 5}},
    }
    functions = [ChatCompletionRequest(messages=CHAT, tools=TOOLS).tools[0].function]
    functions.append(functions[0].model_copy(update={"name": "city", "parameters": refs}))
    grammar = llguidance.grammar_from("lark", tool_call_grammar(functions, parallel=False))
    for city, ok in (("Paris", True), ("Parisian", False)):
        text = f'<tool_call>\n{{"name": "city", "arguments": {{"city": "{city}"}}}}\n</tool_call>'
        ids = tokenizer.encode(text, add_special_tokens=False)
        matcher = llguidance.LLMatcher(grammars.tokenizer, grammar, log_level=0)
        assert (matcher.validate_tokens(ids) == len(ids)) is ok


@pytest.mark.parametrize("name", ["default", "enum", "const", "examples", "$ref"])
def test_refs_resolve_under_properties_and_definitions_named_like_keywords(name):
    """A property or definition may be called "default", "enum" or "$ref": a name there, not
    the keyword, whose schema's $refs are rebased like any other (found in review: they were
    kept as literal values, and the tool grammar named a pointer that did not exist)."""
    tokenizer, grammars = _tool_tokenizer("text")
    refs = {
        "type": "object",
        "properties": {name: {"$ref": f"#/$defs/{name}"}},
        "$defs": {name: {"$ref": "#/$defs/City"}, "City": {"type": "string", "maxLength": 5}},
        "required": [name],
    }
    function = ChatCompletionRequest(messages=CHAT, tools=TOOLS).tools[0].function
    function = function.model_copy(update={"name": "city", "parameters": refs})
    grammar = llguidance.grammar_from("lark", tool_call_grammar([function], parallel=False))
    assert llguidance.LLMatcher.validate_grammar(grammar, grammars.tokenizer) == ""
    key = json.dumps(name)
    for city, ok in (("Paris", True), ("Parisian", False)):
        call = f'{{"name": "city", "arguments": {{{key}: "{city}"}}}}'
        ids = tokenizer.encode(f"<tool_call>\n{call}\n</tool_call>", add_special_tokens=False)
        matcher = llguidance.LLMatcher(grammars.tokenizer, grammar, log_level=0)
        assert (matcher.validate_tokens(ids) == len(ids)) is ok, (name, city)
