"""`python -m metrale.bench.profile_e2e --phases` wraps the engine's phases by name: every
function it names must exist (a moved function breaks the H200 profiles, not the engine), and a
generation under it still gives the same tokens."""

from __future__ import annotations

from metrale import LLM, SamplingParams
from metrale.bench.profile_e2e import PhaseTimer


def test_phase_timer_wraps_every_phase_and_restores_them():
    llm = LLM(device="cpu", spec={"method": "ngram", "num_drafts": 3}, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["def fibonacci(n):", "for i in range(10):"]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    timer = PhaseTimer(llm)
    for obj, name in timer.targets:
        assert callable(getattr(obj, name)), name
    with timer:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    report = timer.report()
    assert "LLMEngine.step" in report and "runner.greedy_verdicts" in report
    assert all("timed" not in repr(getattr(obj, name)) for obj, name in timer.targets)
