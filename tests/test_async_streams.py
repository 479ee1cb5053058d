"""Streams under async scheduling with n-gram speculation, where one `step` can commit twice (the
step launched before, then a verify run now) or commit and then fail a sequence: every streamed
output is its deltas added up, and the finals equal the synchronous engine's, with stop strings,
logprobs (text made in the step), aborts mid-stream and the deferred-text fuzz workloads (found
by review: the second commit's delta replaced the first's, losing its tokens and text)."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams
from metrale.speculative.ngram import NgramDrafter
from tests.test_deferred_text_fuzz import _check_streams, _drive, _make_plan, _summary

PROMPTS = [
    [10, 200, 31, 77, 401, 5, 6, 7],
    [3, 4, 5, 3, 4, 5, 3, 4],
    [99, 12, 7],
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [400, 401, 402, 13, 14],
]
NEVER = "never-appears-xyz"  # a stop string: the text is made in the step
EXTRAS = [{}, {"stop": [NEVER]}, {"logprobs": 1}, {}, {"stop": [NEVER]}]


@pytest.fixture(scope="module")
def varied(hf_qwen3_factory):
    return hf_qwen3_factory("varied", initializer_range=0.2)  # its outputs repeat at times


def streamed(engine, abort: tuple[int, str] | None = None, params=None) -> dict[str, tuple]:
    """Request id -> (text, token ids, finish reason) of its streamed outputs, each checked to
    be its deltas added up (`params`: each prompt's, else greedy with `EXTRAS`)."""
    for i, (prompt, extra) in enumerate(zip(PROMPTS, EXTRAS, strict=True)):
        sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, **extra)
        engine.add_request(f"r{i}", prompt, sp if params is None else params[i])
    outs: dict[str, list] = {f"r{i}": [] for i in range(len(PROMPTS))}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
        steps += 1
        if abort is not None and steps == abort[0] and (out := engine.abort_request(abort[1])):
            outs[abort[1]].append(out)
    whole = {}
    for rid, chunks in outs.items():
        text, ids = "", []
        for chunk in chunks:
            c = chunk.outputs[0]
            text, ids = text + c.delta_text, ids + list(c.delta_token_ids)
            assert (c.text, list(c.token_ids)) == (text, ids), rid
        assert chunks[-1].finished
        whole[rid] = (text, ids, chunks[-1].outputs[0].finish_reason)
    return whole


@pytest.mark.parametrize("dcut", [False, True])
def test_streams_equal_the_synchronous_engines(varied, dcut):
    spec = {"method": "ngram", "num_drafts": 3, "dcut": dcut}
    want = streamed(LLM(varied, device="cpu", spec=spec, async_scheduling=False).engine)
    assert streamed(LLM(varied, device="cpu", spec=spec, async_scheduling=True).engine) == want


@pytest.mark.parametrize("abort", [(3, "r1"), (5, "r2"), (8, "r0")])
def test_an_abort_mid_stream(varied, abort):
    spec = {"method": "ngram", "num_drafts": 3}
    want = streamed(LLM(varied, device="cpu", spec=spec, async_scheduling=False).engine)
    got = streamed(LLM(varied, device="cpu", spec=spec, async_scheduling=True).engine, abort)
    for rid, (text, ids, reason) in got.items():
        if rid == abort[1]:
            assert reason == "abort" and want[rid][0].startswith(text)
            assert want[rid][1][: len(ids)] == ids
        else:
            assert (text, ids, reason) == want[rid]


@pytest.mark.parametrize("dcut", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_the_deferred_text_fuzz_workloads(varied, dcut, seed):
    plan = _make_plan(seed)
    opts = dict(
        device="cpu",
        spec={"method": "ngram", "num_drafts": 3, "dcut": dcut},
        num_kv_pages=12,
        page_size=4,
        max_model_len=64,
        max_num_seqs=6,
        max_num_batched_tokens=32,
    )
    streams, finals = _drive(LLM(varied, async_scheduling=True, **opts), plan)
    _check_streams(streams)
    _, want = _drive(LLM(varied, async_scheduling=False, **opts), plan)
    got, want = _summary(finals), _summary(want)
    for rid, _, _, _, abort in plan:
        if abort is None:  # an abort lands on another step's outputs under async scheduling
            assert got[rid] == want[rid], rid


class FailsAt(NgramDrafter):
    """The n-gram drafter, raising for request r1 (stop strings) once it has `at` tokens."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def propose(self, seqs, max_drafts):
        if any(s.request_id == "r1" and len(s.output_token_ids) >= self.at for s in seqs):
            raise RuntimeError("the drafter failed for r1")
        return super().propose(seqs, max_drafts)


@pytest.mark.parametrize("at", range(3, 12))
@pytest.mark.parametrize("async_on", [False, True])
def test_a_failure_right_after_a_commit_streams_its_held_back_text_last(varied, at, async_on):
    """r1 has a stop string (its text is made in the step, its last character held back) and
    its drafter fails at the step right after a commit emitted text for it (under async
    scheduling, in the same `step` call): the held-back tail comes after that commit's delta
    (found in review: it came before, and the deltas no longer added up to the text); the
    other requests are the synchronous engine's."""
    spec = {"num_drafts": 3, "dcut": False}
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["q~"])
        for _ in PROMPTS
    ]
    ref = streamed(LLM(varied, device="cpu", spec={"method": "ngram", **spec}).engine, None, params)
    llm = LLM(varied, device="cpu", drafter=FailsAt(at), spec=spec, async_scheduling=async_on)
    got = streamed(llm.engine, None, params)  # (each stream checked to be its deltas added up)
    text, ids, reason = got["r1"]
    assert reason == "error" and len(ids) >= at
    assert ids == ref["r1"][1][: len(ids)] and ref["r1"][0].startswith(text)
    assert {k: v for k, v in got.items() if k != "r1"} == {
        k: v for k, v in ref.items() if k != "r1"
    }
