"""D-Cut plans depths before anything is drafted: a step where every sequence is planned at
depth 0 drafts nothing, verifies nothing and observes nothing; it is the plain decode step.
Every `dcut_probe_every` steps every sequence drafts again, so its estimate can recover. Dense
and hybrid targets; output always equals plain decoding."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams
from metrale.engine.sequence import Phase
from metrale.speculative import controller
from metrale.speculative.dcut import VerifyCostModel
from metrale.speculative.replay import ReplayDrafter
from tests.test_hybrid_engine import hybrid_dir  # noqa: F401 (a module fixture)

PROMPTS = [[(7 * i + 3 * j) % 200 + 3 for j in range(5 + 3 * i)] for i in range(4)]
PROBE_EVERY = 4


def greedy(n: int = 14) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


class Recorder:
    """Wraps the engine's drafter, runner and controller to log what each step did."""

    def __init__(self, llm: LLM) -> None:
        engine = llm.engine
        self.steps: list[dict] = []
        spec, runner, drafter = engine.spec, engine.runner, engine.spec.drafter
        real_propose, real_execute, real_observe = drafter.propose, runner.execute, spec.observe
        real_step = engine.step

        def step():
            self.steps.append({"proposed": 0, "drafts": 0, "observed": False, "phases": []})
            return real_step()

        def propose(seqs, caps):
            self.steps[-1]["proposed"] += len(seqs)
            self.steps[-1]["step"] = spec._steps
            return real_propose(seqs, caps)

        def execute(batch):
            self.steps[-1]["drafts"] += sum(len(e.drafts) for e in batch.entries)
            self.steps[-1]["phases"].append(batch.phase)
            return real_execute(batch)

        def observe(verdicts):
            self.steps[-1]["observed"] = True
            return real_observe(verdicts)

        engine.step, drafter.propose, runner.execute, spec.observe = step, propose, execute, observe


def _model(request, name):
    return request.getfixturevalue("tiny_model_dir" if name == "dense" else "hybrid_dir")


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_depth_zero_everywhere_is_the_plain_decode_step(request, target, monkeypatch):
    path = _model(request, target)
    plain = LLM(path, device="cpu").generate(PROMPTS, greedy(), use_tqdm=False)
    reference = [o.outputs[0].token_ids for o in plain]
    # Every draft wrong, and a verify row costing as much as a whole decode step: D-Cut should
    # stop drafting as soon as the estimates say so, and only probe afterwards.
    drafter = ReplayDrafter(dict(zip(map(tuple, PROMPTS), reference, strict=True)), 0.0, 200)
    llm = LLM(
        path,
        device="cpu",
        drafter=drafter,
        spec={"num_drafts": 3, "dcut": True, "dcut_prior": 0.0, "dcut_probe_every": PROBE_EVERY},
    )
    llm.engine.spec.cost = VerifyCostModel.from_points({(1, 2.0): 2.0, (4, 2.0): 2.0})
    rec = Recorder(llm)
    plans = []
    real_plan = controller.plan
    monkeypatch.setattr(controller, "plan", lambda *a, **k: plans.append(1) or real_plan(*a, **k))
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    # planned again only when the running set or an estimate changed (probes, finishes)
    assert len(plans) <= len(rec.steps) // 2

    decode_steps = [s for s in rec.steps if s["phases"] and set(s["phases"]) == {Phase.DECODE}]
    assert decode_steps, "no plain decode step ran"
    for s in rec.steps:
        if s["proposed"] and s["step"] % PROBE_EVERY == 0:
            continue  # a probe step: drafted (and, at these estimates, cut to depth 0)
        assert s["proposed"] == 0, f"a non-probe step drafted: {s}"
        assert s["drafts"] == 0 and not s["observed"], f"a depth-0 step did speculative work: {s}"
    probes = [s for s in rec.steps if s["proposed"]]
    assert probes and all(s["drafts"] == 0 for s in probes)
    assert llm.engine.telemetry.spec.num_drafts == 0


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_sequences_planned_deeper_than_zero_are_drafted_every_step(request, target):
    """Right drafts and cheap rows: every decoding step drafts and verifies; lossless."""
    path = _model(request, target)
    plain = LLM(path, device="cpu").generate(PROMPTS, greedy(), use_tqdm=False)
    reference = [o.outputs[0].token_ids for o in plain]
    drafter = ReplayDrafter(dict(zip(map(tuple, PROMPTS), reference, strict=True)), 1.0, 200)
    llm = LLM(path, device="cpu", drafter=drafter, spec={"num_drafts": 3, "dcut": True})
    llm.engine.spec.cost = VerifyCostModel.from_points({(1, 4.0): 1.01, (4, 4.0): 1.01})
    rec = Recorder(llm)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    steady = {Phase.DECODE, Phase.VERIFY}
    decoding = [s for s in rec.steps if s["phases"] and set(s["phases"]) <= steady]
    # every decoding step verifies drafts but the last (one token left: nothing to draft)
    assert len(decoding) > 2 and all(s["proposed"] and s["drafts"] for s in decoding[:-1])
    tel = llm.engine.telemetry.spec
    assert tel.num_accepted_tokens == tel.num_draft_tokens > 0
