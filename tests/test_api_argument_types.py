"""The Python API's arguments of the wrong type (review finding): `generate("x", 5)`,
`generate(None)`, a chat message whose content is an int were TypeErrors or AttributeErrors from
deep inside; they are ValueErrors naming the argument, and leave the engine as it was. A chat
message's content may be a list of OpenAI text parts, as the server takes it."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams
from metrale.speculative.replay import ReplayDrafter

USER = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, device="cpu", max_model_len=64)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda llm: llm.generate("x", 5), "^sampling_params must be"),
        (lambda llm: llm.generate(["x"], "greedy"), "^sampling_params must be"),
        (lambda llm: llm.generate(None), "^prompts must be"),
        (
            lambda llm: llm.generate(["a", "b"], [{"max_tokens": 2}, {"max_tokens": 0}]),
            r"^sampling_params\[1\]: max_tokens",
        ),
        (lambda llm: llm.generate(["a", "b"], [None, {"bogus": 1}]), r"^sampling_params\[1\]: "),
        (lambda llm: llm.stream(["a", "b"]), "^prompt: stream takes one prompt, got a list of 2"),
        (lambda llm: llm.generate(5), "^prompts must be"),
        (lambda llm: llm.generate(b"hello"), "^prompts must be"),
        (lambda llm: llm.generate({"prompt": 5}), r"^prompts\[0\]\.prompt: "),
        (lambda llm: llm.stream("x", 5), "^sampling_params"),
        (lambda llm: llm.chat(None), "^messages must be"),
        (lambda llm: llm.chat("hello"), "^messages must be"),
        (lambda llm: llm.chat([]), "^messages must be"),
        (lambda llm: llm.chat(["hello"]), r"^messages\[0\]"),
        (lambda llm: llm.chat([{"content": "hi"}]), r"^messages\[0\]\.role"),
        (lambda llm: llm.chat([{"role": "user", "content": 5}]), r"^messages\[0\]\.content"),
        (lambda llm: llm.chat([{"role": "user", "content": None}]), r"^messages\[0\]\.content"),
        (
            lambda llm: llm.chat([{"role": "user", "content": [{"type": "image_url"}]}]),
            r"^messages\[0\]\.content",
        ),
        (lambda llm: llm.chat(USER, 5), "^sampling_params must be"),
        (lambda llm: llm.chat(USER, stream="yes"), "^stream must be a bool"),
        (lambda llm: llm.chat(USER, continue_final_message=True), "^continue_final_message: "),
        (
            lambda llm: llm.chat(USER, add_generation_prompt=False, continue_final_message=1),
            "^continue_final_message must be a bool",
        ),
        # a conversation's own faults name its messages, not a prompt (found in review: a
        # lone surrogate was a TypeError from the tokenizer)
        (lambda llm: llm.chat([{"role": "user", "content": "\ud800"}]), "^messages: not valid"),
        (lambda llm: llm.chat([{"role": "user", "content": "x " * 200}]), r"^messages: \d+ tok"),
        (lambda llm: llm.chat([{"role": "user", "content": ""}] * 65), "^messages: 65 messages"),
        (lambda llm: llm.chat(USER, {"max_tokens": 1, "logit_bias": {99999: 1}}), "^logit_bias"),
    ],
)
def test_arguments_of_the_wrong_type_are_value_errors_naming_them(llm, call, match):
    with pytest.raises(ValueError, match=match):
        out = call(llm)
        if hasattr(out, "__next__"):  # a stream checks its arguments when first read
            next(out)
    engine = llm.engine
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.allocator.num_free == engine.allocator.num_usable


def test_chat_content_as_text_parts_is_the_text_joined(llm):
    params = SamplingParams(max_tokens=4, temperature=0)
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]
    got = llm.chat([{"role": "user", "content": parts}], params)
    want = llm.chat([{"role": "user", "content": "hello\nthere"}], params)
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_chat_continues_the_final_message(llm):
    """`continue_final_message` (vLLM's `LLM.chat` option): the prompt ends after the final
    message's text, so the reply goes on with it; without the generation prompt it ends after
    that turn."""
    messages = [*USER, {"role": "assistant", "content": "def f("}]
    params = SamplingParams(max_tokens=2, temperature=0)
    turns = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    cut = turns[: turns.rindex("def f(") + len("def f(")]
    for kwargs, text in (
        (dict(add_generation_prompt=False, continue_final_message=True), cut),
        (dict(add_generation_prompt=False), turns),
    ):
        out = llm.chat(messages, params, **kwargs)
        assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    opened = turns + "<|im_start|>assistant\n"  # by default a new turn follows
    ids = llm.tokenizer.encode(opened, add_special_tokens=False)
    assert llm.chat(messages, params).prompt_token_ids == ids


@pytest.mark.parametrize(
    "content", ["<", "|>", "end", " x ", "", "a\n", "<|im_end|>", "<think>\nhm"]
)
def test_continue_final_message_renders_as_transformers(tiny_model_dir, content):
    """The prompt transformers' `apply_chat_template(continue_final_message=True)` renders,
    for final messages the template's own closing text holds too (cut at their last
    occurrence, "<" came out doubled and "end" ended inside the closing tag: found in review)
    and with spaces it trims."""
    from transformers import AutoTokenizer

    from metrale.chat_prompt import chat_prompt_ids
    from metrale.tokenizer import Tokenizer

    messages = [*USER, {"role": "assistant", "content": content}]
    want = AutoTokenizer.from_pretrained(tiny_model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    tok = Tokenizer.from_dir(tiny_model_dir)
    options = dict(add_generation_prompt=False, continue_final_message=True)
    assert chat_prompt_ids(tok, messages, 4096, **options)[1] == want


def test_chat_keeps_an_assistant_turn_of_tool_calls(llm):
    call = {"function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}, *USER]
    out = llm.chat(messages, SamplingParams(max_tokens=2, temperature=0))
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "drafter, spec, match",
    [
        ("x", None, "^drafter must be a Drafter object"),
        (object, None, "^drafter must be a Drafter object"),
        (ReplayDrafter({}, 0.5, 512), {"method": "ngram"}, "^drafter: given with spec.method"),
    ],
)
def test_a_drafter_that_is_none_or_beside_a_method_is_refused(tiny_model_dir, drafter, spec, match):
    """Found in review: LLM(drafter="x") was taken and failed at the first step with an
    AttributeError; a drafter beside spec.method silently won."""
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model_dir, device="cpu", drafter=drafter, spec=spec)


def test_chat_takes_template_variables_as_vllm_does(tiny_model_dir, tmp_path):
    """`chat_template_kwargs` (vLLM's `LLM.chat` and the server take it; found missing in
    review): the template renders with them; its own inputs, or a value that is no dict of
    names, are a ValueError naming the argument."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
        "{% endif %}"
    )
    llm = LLM(model, device="cpu", max_model_len=64)
    params = SamplingParams(max_tokens=2, temperature=0)
    rendered = set()
    for variables in ({"enable_thinking": False}, {"enable_thinking": True}):
        text = llm.tokenizer.apply_chat_template(USER, add_generation_prompt=True, **variables)
        rendered.add(text)
        out = llm.chat(USER, params, chat_template_kwargs=variables)
        assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    assert len(rendered) == 2  # the variable reached the template
    for bad, match in (({"messages": []}, "'messages' is the template's own"), ([1], "a dict")):
        with pytest.raises(ValueError, match=f"^chat_template_kwargs(: | must be ).*{match}"):
            llm.chat(USER, params, chat_template_kwargs=bad)


def test_chat_takes_a_batch_of_conversations_as_vllm_does(llm):
    """vLLM's `LLM.chat` takes a list of conversations and returns a list of outputs (found
    missing in review): each equals its conversation run alone; a fault names its index."""
    params = SamplingParams(max_tokens=3, temperature=0)
    other = [{"role": "user", "content": "how are you"}]
    outs = llm.chat([USER, other], params)
    assert isinstance(outs, list) and len(outs) == 2
    for conv, out in zip([USER, other], outs, strict=True):
        alone = llm.chat(conv, params)
        assert out.prompt_token_ids == alone.prompt_token_ids
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    per = [SamplingParams(max_tokens=1, temperature=0), SamplingParams(max_tokens=2, temperature=0)]
    assert [len(o.outputs[0].token_ids) for o in llm.chat([USER, other], per)] == [1, 2]
    with pytest.raises(ValueError, match=r"^messages\[1\]\[0\]\.content"):
        llm.chat([USER, [{"role": "user", "content": 5}]], params)
    with pytest.raises(ValueError, match=r"^messages\[1\] must be a non-empty list"):
        llm.chat([USER, []], params)
    with pytest.raises(ValueError, match="^stream: one conversation"):
        llm.chat([USER, other], params, stream=True)
    engine = llm.engine
    assert not engine.requests and engine.allocator.num_free == engine.allocator.num_usable
