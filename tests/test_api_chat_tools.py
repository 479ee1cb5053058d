"""`LLM.chat` as vLLM's: `tools=` rendered into the prompt (as transformers' template renders
them, or the server's preamble for a template that does not read them), and the arguments in
vLLM's order (`use_tqdm` third: `llm.chat(messages, params, True)` once streamed; review)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from metrale import LLM, SamplingParams
from tests.test_server_tools import TOOLS, with_tool_template

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}]
PARAMS = SamplingParams(max_tokens=2, temperature=0)


@pytest.fixture(scope="module")
def templated_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a Qwen3-like template that renders tools itself."""
    return with_tool_template(tiny_model_dir, tmp_path_factory.mktemp("chat-tools") / "model")


def test_tools_render_as_transformers_renders_them(templated_dir):
    llm = LLM(str(templated_dir), device="cpu", max_model_len=1024)
    hf = AutoTokenizer.from_pretrained(str(templated_dir))
    text = hf.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tools>" in text
    want = hf(text, add_special_tokens=False)["input_ids"]
    got = llm.chat(MESSAGES, PARAMS, tools=TOOLS)
    assert got.prompt_token_ids == want
    assert llm.chat(MESSAGES, PARAMS).prompt_token_ids != want  # without tools: none rendered
    batch = llm.chat([MESSAGES, MESSAGES], PARAMS, tools=TOOLS)
    assert [o.prompt_token_ids for o in batch] == [want, want]


def test_tools_reach_a_template_that_ignores_them_as_the_servers_preamble(tiny_model_dir):
    from metrale.server.tools import tools_preamble

    llm = LLM(tiny_model_dir, device="cpu", max_model_len=1024)
    got = llm.tokenizer.decode(llm.chat(MESSAGES, PARAMS, tools=TOOLS).prompt_token_ids)
    assert f"Be brief.\n\n{tools_preamble(TOOLS)}" in got


def test_chat_takes_vllms_argument_order_and_checks_its_tools(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", max_model_len=1024)
    out = llm.chat(MESSAGES, PARAMS, False)  # use_tqdm, as vLLM's third argument
    assert out.outputs[0].token_ids and out.finished
    with pytest.raises(TypeError):
        llm.chat(MESSAGES, PARAMS, False, True)  # stream is keyword-only
    stream = llm.chat(MESSAGES, PARAMS, stream=True)
    assert list(stream)[-1].outputs[0].token_ids == out.outputs[0].token_ids
    tool = TOOLS[0]
    for bad, match in (
        ("x", "^tools must be a list"),
        ([{"type": "function"}], r"^tools\[0\]\.function: "),
        ([tool, tool], r"^tools\[1\]\.function\.name: .* given twice"),
        ([{**tool, "type": "fn"}], r"^tools\[0\]\.type: "),
    ):
        with pytest.raises(ValueError, match=match):
            llm.chat(MESSAGES, PARAMS, tools=bad)
