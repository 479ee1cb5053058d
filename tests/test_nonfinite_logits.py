"""A forward that yields non-finite logits for one sequence (no exception: a NaN or an inf out
of the target) ends that sequence alone with finish_reason "error" at the step that would have
emitted from them, its earlier tokens those of plain decoding; the other sequences' outputs are
plain decoding's, and the page pool ends idle. Found in review: the engine emitted the argmax of
a NaN row (token 0) and went on to finish "length". Dense and hybrid targets, greedy and
seeded sampling, plain decoding (synchronous and asynchronous) and speculation, the poisoned
row a prompt's last or a row inside a verify."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.engine.commit import NONFINITE
from tests.test_hybrid_engine import hybrid_dir  # noqa: F401 (a module fixture)

# the first request's prompt is longer than the others reach: only it meets the poisoned position
PROMPTS = [[5, 17, 30, 42, 9, 11, 3, 8, 21, 5, 17, 30, 6, 2, 40, 9], [7, 8, 9, 10, 7], [3, 4, 5, 6]]
LONG = 24


def poison_position(llm, position: int, value: float) -> None:
    """Every row at `position` gets non-finite final hidden states (so its logits are too)."""
    model = llm.engine.runner.model
    forward = model.forward

    def poisoned(ids, positions, *args, **kwargs):
        hidden = forward(ids, positions, *args, **kwargs)
        bad = (positions == position).unsqueeze(-1)
        return torch.where(bad, torch.full_like(hidden, value), hidden)

    model.forward = poisoned


def params(temperature: float, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=3, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize(
    "target, spec, async_on",
    [
        ("dense", None, True),
        ("dense", None, False),
        ("dense", "ngram", True),
        ("dense", "mtp", True),
        ("hybrid", None, True),
        ("hybrid", "ngram", True),
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("where", ["prompt", "decode"])
def test_nonfinite_logits_end_only_their_sequence(
    request, target, spec, async_on, temperature, where
):
    fixture = {
        "dense": "tiny_mtp_dir" if spec == "mtp" else "tiny_model_dir",
        "hybrid": "hybrid_dir",
    }
    path = request.getfixturevalue(fixture[target])
    kw = dict(device="cpu", dtype="float32", page_size=4, async_scheduling=async_on)
    # the long request runs past the poisoned position; the others end before it
    each = [params(temperature, LONG), params(temperature, 6), params(temperature, 6)]
    want = LLM(path, **kw).generate(PROMPTS, each, use_tqdm=False)
    if spec is not None:
        kw["spec"] = {"method": spec, "num_drafts": 3, "dcut": False}
    llm = LLM(path, **kw)
    position = len(PROMPTS[0]) - 1 if where == "prompt" else len(PROMPTS[0]) + 12
    poison_position(llm, position, float("nan") if temperature else float("inf"))
    outs = llm.generate(PROMPTS, each, use_tqdm=False)
    bad, plain = outs[0].outputs[0], want[0].outputs[0]
    assert bad.finish_reason == "error" and bad.error == NONFINITE, (bad.finish_reason, bad)
    # the tokens before the poisoned row's are plain decoding's; none from it
    kept = position + 1 - len(PROMPTS[0])
    assert bad.token_ids == plain.token_ids[:kept]
    for got, ref in zip(outs[1:], want[1:], strict=True):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        assert got.outputs[0].finish_reason == ref.outputs[0].finish_reason == "length"
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.allocator.num_free == engine.allocator.num_usable
