"""Sampling values the float32 sampler cannot hold (review finding): a top_p that is 0 in
float32 or a repetition penalty whose division overflows it made every token -inf or NaN, and
token 0 came out with finish "stop". They are ValueErrors naming the field; the values at the
bounds, and the tiny values of the other fields, sample as their references do."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from tests.test_sampler import assert_matches_reference, row


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, device="cpu", max_model_len=64)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(top_p=1e-320), "top_p"),  # a float64 denormal: 0 in float32
        (dict(top_p=1e-46), "top_p"),  # below float32's smallest denormal
        (dict(repetition_penalty=1e-39), "repetition_penalty"),  # 1e38 times a logit: inf
        (dict(repetition_penalty=2e-38), "repetition_penalty"),  # normal, yet 10 / 2e-38 = inf
        (dict(repetition_penalty=5e-5), "repetition_penalty"),
        (dict(logit_bias={"9" * 5000: 1.0}), "logit_bias"),  # int() refuses it in its own words
        (dict(logit_bias={"9" * 30: 1.0}), "logit_bias"),
    ],
)
def test_values_the_sampler_cannot_hold_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


def _tokens(llm, **params) -> list[int]:
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=7, **params)
    return llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "tiny, reference",
    [
        (dict(top_p=1e-45), dict(temperature=0.0)),  # float32's smallest: the top token only
        (dict(temperature=1e-320), dict(temperature=0.0)),  # below the greedy threshold
        (dict(min_p=1e-320), dict(min_p=0.0)),
        (dict(presence_penalty=1e-320), dict(presence_penalty=0.0)),
        (dict(frequency_penalty=-1e-320), dict(frequency_penalty=0.0)),
    ],
)
def test_the_smallest_values_sample_as_their_limits(llm, tiny, reference):
    assert _tokens(llm, **tiny) == _tokens(llm, **reference)


def test_the_repetition_penalty_at_its_bounds_matches_the_float64_reference():
    torch.manual_seed(0)
    vocab = 64
    logits = torch.randn(2, vocab) * 40  # large logits: 40 / 1e-4 is far from overflowing
    rows = [
        row(temperature=0.0, repetition_penalty=1e-4, prompt=range(0, vocab, 2)),
        row(temperature=0.0, repetition_penalty=1e4, prompt=range(1, vocab, 3)),
    ]
    assert torch.isfinite(assert_matches_reference(logits, rows)).all()
