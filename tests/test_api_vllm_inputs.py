"""Inputs a vLLM user's code passes: prompt dicts (`{"prompt": text}`, `{"prompt_token_ids":
ids}`) generate as the plain prompts they hold; SamplingParams fields of vLLM that metrale does
not implement (`best_of`, `prompt_logprobs`, `use_beam_search`, ...) are accepted at their "not
used" value and otherwise a ValueError naming them, not a TypeError; a chat message's role is
one chat templates render, in the Python API and over HTTP (a 400 naming `messages[i].role`)."""

from __future__ import annotations

import dataclasses
import enum

import pytest

from metrale import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0)
# vLLM's enum, as a vLLM user's code passes it
RequestOutputKind = enum.Enum("RequestOutputKind", "CUMULATIVE DELTA FINAL_ONLY")
TEXT = "hello there"


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, device="cpu", max_model_len=256)


def assert_clean(llm):
    """A refused call left nothing queued and no page taken."""
    engine = llm.engine
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.allocator.num_free == engine.allocator.num_usable


def same(a, b) -> None:
    assert a.prompt == b.prompt and a.prompt_token_ids == b.prompt_token_ids
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert [o.text for o in a.outputs] == [o.text for o in b.outputs]


# -- prompt dicts -----------------------------------------------------------------------------


def test_prompt_dicts_generate_as_the_plain_prompts_they_hold(llm):
    ids = llm.tokenizer.encode(TEXT)
    plain_text, plain_ids = llm.generate([TEXT, ids], GREEDY, use_tqdm=False)
    mixed = [{"prompt": TEXT}, TEXT, {"prompt_token_ids": ids}, ids, {"prompt_token_ids": (*ids,)}]
    outs = llm.generate(mixed, GREEDY, use_tqdm=False)
    for out, want in zip(outs, [plain_text, plain_text, plain_ids, plain_ids, plain_ids]):
        same(out, want)
    # one dict is one prompt, as one string is
    (single,) = llm.generate({"prompt": TEXT}, GREEDY, use_tqdm=False)
    same(single, plain_text)
    (single,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    same(single, plain_ids)
    assert_clean(llm)


def test_stream_takes_a_prompt_dict(llm):
    (want,) = llm.generate([TEXT], GREEDY, use_tqdm=False)
    for prompt in ({"prompt": TEXT}, {"prompt_token_ids": llm.tokenizer.encode(TEXT)}):
        *_, last = llm.stream(prompt, GREEDY)
        assert last.finished
        assert last.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([{}], r"^prompts\[0\]: a prompt dict holds exactly one of prompt, prompt_token_ids"),
        (
            [TEXT, {"prompt": TEXT, "prompt_token_ids": [1]}],  # the first one is dropped again
            r"^prompts\[1\]: a prompt dict holds exactly one",
        ),
        ([{"text": TEXT}], r"^prompts\[0\]\.text: not supported"),
        ({"prompt": TEXT, "multi_modal_data": {}}, r"^prompts\[0\]\.multi_modal_data: not supp"),
        ([{"prompt": 5}], r"^prompts\[0\]\.prompt: expected a string, got int"),
        ([{"prompt": [1, 2]}], r"^prompts\[0\]\.prompt: expected a string, got list"),
        ([{"prompt": ""}], r"^prompts\[0\]\.prompt: must not be empty"),
        ([{"prompt_token_ids": "hello"}], r"^prompts\[0\]\.prompt_token_ids: expected a non-e"),
        ([{"prompt_token_ids": []}], r"^prompts\[0\]\.prompt_token_ids: expected a non-empty"),
        ([{"prompt_token_ids": [1, True]}], r"^prompts\[0\]\.prompt_token_ids: True is not a"),
        ([{"prompt_token_ids": [1, None]}], r"^prompts\[0\]\.prompt_token_ids: None is not a"),
        ([{"prompt_token_ids": [10**9]}], r"^prompts\[0\]\.prompt_token_ids: 1000000000 is not"),
        ([{"prompt_token_ids": [1] * 300}], r"^prompts\[0\]\.prompt_token_ids: 300 tokens"),
    ],
)
def test_bad_prompt_dicts_are_value_errors_naming_the_field(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_clean(llm)


def test_stream_names_a_bad_prompt_dicts_field(llm):
    with pytest.raises(ValueError, match=r"^prompt\.prompt_token_ids: expected"):
        next(llm.stream({"prompt_token_ids": "hello"}, GREEDY))
    assert_clean(llm)


# -- vLLM's SamplingParams fields -------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"best_of": None},
        {"best_of": 1},
        {"n": 3, "best_of": 3},
        {"prompt_logprobs": None},
        {"use_beam_search": False},
        {"length_penalty": 1.0, "early_stopping": False, "detokenize": True},
        {"bad_words": [], "logits_processors": [], "allowed_token_ids": None},
        {"truncate_prompt_tokens": None, "guided_decoding": None},
        {"spaces_between_special_tokens": False, "output_kind": None},
        {"output_kind": RequestOutputKind.CUMULATIVE},
        {"spaces_between_special_tokens": True, "extra_args": {}, "structured_outputs": None},
    ],
)
def test_vllm_fields_at_their_unused_value_change_nothing(kwargs):
    base = {"n": kwargs.get("n", 1), "temperature": 0.5}
    params = SamplingParams(**{**base, **kwargs})
    assert params == SamplingParams(**base) and repr(params) == repr(SamplingParams(**base))
    assert dataclasses.replace(params, max_tokens=3).max_tokens == 3


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"best_of": 2}, "best_of"),  # n = 1
        ({"n": 2, "best_of": 4}, "best_of"),
        ({"best_of": True}, "best_of"),
        ({"prompt_logprobs": 0}, "prompt_logprobs"),
        ({"prompt_logprobs": 5}, "prompt_logprobs"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"early_stopping": True}, "early_stopping"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
        ({"logits_processors": [lambda ids, logits: logits]}, "logits_processors"),
        ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({"guided_decoding": {"regex": "a+"}}, "guided_decoding"),
        ({"detokenize": False}, "detokenize"),
        ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens"),
        ({"output_kind": 2}, "output_kind"),
        ({"output_kind": RequestOutputKind.DELTA}, "output_kind"),
        ({"extra_args": {"k": 1}}, "extra_args"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ],
)
def test_vllm_fields_metrale_lacks_are_value_errors_naming_them(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: not supported by metrale"):
        SamplingParams(**kwargs)


def test_vllm_sampling_fields_through_generate(llm):
    (want,) = llm.generate([TEXT], GREEDY, use_tqdm=False)
    vllm_style = dataclasses.replace(GREEDY, best_of=1, use_beam_search=False)
    (got,) = llm.generate([TEXT], vllm_style, use_tqdm=False)
    same(got, want)
    (got,) = llm.generate([TEXT], {"max_tokens": 4, "temperature": 0, "best_of": 1}, False)
    same(got, want)
    with pytest.raises(ValueError, match="best_of: not supported"):
        llm.generate([TEXT], {"best_of": 2}, use_tqdm=False)
    assert_clean(llm)


# -- chat roles -------------------------------------------------------------------------------

USER = {"role": "user", "content": TEXT}


def test_chat_takes_the_four_roles_and_refuses_others(llm):
    call = {"id": "c1", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "system", "content": "be brief"},
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert len(llm.chat(messages, GREEDY).outputs[0].token_ids) == 4
    for role in ("developer", "bot", "function", "User", ""):
        bad = [USER, {"role": role, "content": "x"}, USER]
        with pytest.raises(ValueError, match=rf"^messages\[1\]\.role: expected one of .*'{role}'"):
            llm.chat(bad, GREEDY)
        assert_clean(llm)


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    fastapi_testclient = pytest.importorskip("fastapi.testclient")  # (the server's tests only)
    from metrale.server import build

    app, _loop = build(tiny_model_dir, served_name="tiny", device="cpu")
    with fastapi_testclient.TestClient(app) as client:
        yield client


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_server_refuses_an_unknown_role_with_a_400(client, route):
    body = {"messages": [USER, {"role": "developer", "content": "x"}], "max_tokens": 2}
    resp = client.post(route, json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"] == {
        "message": "messages[1].role: expected one of system, user, assistant, tool, "
        "got 'developer'",
        "type": "invalid_request_error",
        "param": "messages",
        "code": None,
    }
    ok = client.post(route, json={**body, "messages": [{"role": "system", "content": "x"}, USER]})
    assert ok.status_code == 200, ok.text


def test_a_request_without_sampling_params_takes_the_checkpoints_generation_config(
    tiny_model_dir, tmp_path
):
    """vLLM's `LLM` samples a request given no SamplingParams with the checkpoint's
    generation_config.json (the server did; the Python API ignored it: found in review). Given
    params are the caller's own, untouched."""
    import json
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    gen = json.loads((model / "generation_config.json").read_text())
    recommended = {"temperature": 0.0, "top_k": 5, "top_p": 0.9, "repetition_penalty": 1.2}
    (model / "generation_config.json").write_text(json.dumps({**gen, **recommended}))
    llm = LLM(model, device="cpu", max_model_len=256)
    default = llm.get_default_sampling_params()
    assert default == SamplingParams(**recommended)
    (got,) = llm.generate([TEXT], use_tqdm=False)
    (want,) = llm.generate([TEXT], SamplingParams(**recommended), use_tqdm=False)
    same(got, want)
    (streamed,) = [o for o in llm.stream(TEXT) if o.finished]
    assert streamed.outputs[0].token_ids == want.outputs[0].token_ids
    plain = LLM(tiny_model_dir, device="cpu", max_model_len=256)
    assert plain.get_default_sampling_params() == SamplingParams()
    (mine,) = llm.generate([TEXT], GREEDY, use_tqdm=False)  # given: not the checkpoint's
    same(mine, plain.generate([TEXT], GREEDY, use_tqdm=False)[0])
