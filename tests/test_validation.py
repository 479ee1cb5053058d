"""Bad input is refused with a ValueError naming the field, and refusing it leaves the engine
intact: nothing queued, no pages held, the next request runs normally."""

from __future__ import annotations

import math

import pytest

from metrale import LLM, SamplingParams
from metrale.config import EngineConfig


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, device="cpu", max_model_len=64)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=math.nan), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(n=0), "n"),
        (dict(seed="x"), "seed"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(logit_bias={"a": 1.0}), "logit_bias"),
        (dict(logit_bias={3: 500.0}), "logit_bias"),
        (dict(logprobs=99), "logprobs"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([1, 2, 100000], SamplingParams(), "prompt_token_ids"),
        ([1, -4], SamplingParams(), "prompt_token_ids"),
        ([1, 2.5], SamplingParams(), "prompt_token_ids"),
        (list(range(1, 80)), SamplingParams(), "max_model_len"),
        ([1, 2], SamplingParams(stop_token_ids=[9999]), "stop_token_ids"),
        ([1, 2], SamplingParams(logit_bias={9999: 1.0}), "logit_bias"),
    ],
)
def test_bad_requests_leave_the_engine_intact(llm, prompt, params, field):
    engine = llm.engine
    with pytest.raises(ValueError, match=field):
        llm.generate(["fine", prompt], params, use_tqdm=False)
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.allocator.num_free == engine.allocator.num_usable
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_bad_engine_options_name_the_option(tiny_model_dir):
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig(page_size=-1)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int3")
    with pytest.raises(ValueError, match="bogus_option"):
        LLM(tiny_model_dir, bogus_option=1)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_model_dir, device="cpu", max_model_len=10**6)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/nonexistent/model/dir")


def test_sampling_params_list_length_must_match(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
