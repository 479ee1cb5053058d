"""`python -m metrale.bench.profile_e2e --phases` wraps the engine's phases by name: every
function it names must exist (a moved function breaks the H200 profiles, not the engine), and a
generation under it still gives the same tokens."""

from __future__ import annotations

import json
import sys

from metrale import LLM, SamplingParams
from metrale.bench.profile_e2e import PhaseTimer, graph_targets


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
    assert all(getattr(obj, name).__name__ != "timed" for obj, name in timer.targets)


def test_phase_timer_times_the_verify_windows_inside_the_phases():
    """The critical windows (a verify step's verdicts read -> next forward) of a speculative
    run, greedy and sampled: each positive, no phase charged more inside them than the windows
    last in all (a window still open at the end counts for no phase: found in review), nor
    more than it took; a run of plain steps opens none (review: every read opened one)."""
    llm = LLM(device="cpu", spec={"method": "ngram", "num_drafts": 3}, max_num_seqs=4)
    prompts = ["def f(x):\n    return x + x + x + x\n" * 3] * 2
    for temperature in (0.0, 0.8):
        params = SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=0)
        with PhaseTimer(llm) as timer:
            llm.generate(prompts, params, use_tqdm=False)
        assert timer.windows and all(w > 0 for w in timer.windows), temperature
        assert {"LLMEngine.step", "ModelRunner._metadata"} <= set(timer.in_window)
        for label, inside in timer.in_window.items():
            assert inside <= timer.totals[label] + 1e-9, label
            assert inside <= sum(timer.windows) + 1e-9, label
        assert "verify windows (verdicts read -> next forward)" in timer.report()
    # (the synchronous engine: each plain step reads its tokens as a verify reads its verdicts)
    sync = LLM(device="cpu", spec={"method": "ngram"}, max_num_seqs=4, async_scheduling=False)
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, speculative=False)
    with PhaseTimer(sync) as timer:
        sync.generate(prompts, plain, use_tqdm=False)
    assert timer.calls["runner.to_host"] > 0
    assert not timer.windows and "verify windows" not in timer.report()


def test_the_graph_path_phases_name_functions_that_exist():
    """The phases timed only on CUDA graphs (never on a CPU run) name real functions."""
    for obj, name in graph_targets():
        assert callable(getattr(obj, name)), name


def test_verify_window_reports_the_windows_of_a_speculative_run(monkeypatch, capsys):
    """`benchmarks/verify_window.py`: the verify steps' windows on the simulated device, and
    the functions that ran in them."""
    from benchmarks import verify_window

    argv = ["verify_window.py", "--batch", "4", "--max-tokens", "12", "--runs", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--plain-ms", "0.5", "--row-ms", "0.1"])
    verify_window.main()
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["windows"] > 0 and report["window_median_ms"] > 0
    assert {"prepare", "hold", "greedy_verdicts"} <= set(report["ms_per_window"])
