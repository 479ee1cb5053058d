"""D-Cut plans depths before anything is drafted: a step where every sequence is planned at
depth 0 drafts nothing, verifies nothing and observes nothing; it is the plain decode step.
Every `dcut_probe_every` steps every sequence drafts again, so its estimate can recover. Dense
and hybrid targets; output always equals plain decoding."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams
from metrale.engine.sequence import Phase
from metrale.speculative import planning, probes
from metrale.speculative.drafter import Draft
from metrale.speculative.replay import ReplayDrafter
from metrale.speculative.verify_cost import VerifyCostModel
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

        def execute(batch, **kw):
            self.steps[-1]["drafts"] += sum(len(e.drafts) for e in batch.entries)
            self.steps[-1]["phases"].append(batch.phase)
            return real_execute(batch, **kw)

        def observe(verdicts, state=None):
            # (a held verify's is made in the next step's: `engine/held_verify.py`)
            self.steps[-1 if state is None else -2]["observed"] = True
            return real_observe(verdicts, state)

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
    planned_at, spec, real_plan = set(), llm.engine.spec, planning.plan

    def counting_plan(*args, **kwargs):
        planned_at.add(spec._steps)
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(planning, "plan", counting_plan)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    # Between probes, planned again only once an estimate or the running set changed: the
    # step after a probe (its observations) and the first step of a new running set.
    between = {step for step in planned_at if step % PROBE_EVERY}
    probes = {step for step in planned_at if step % PROBE_EVERY == 0}
    assert len(between) <= len(probes) + 2, (sorted(between), sorted(probes))

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
    # synchronous: the asynchronous engine also launches a step for the sequences its last
    # step ended (thrown away), a decoding step that drafts nothing
    spec = {"num_drafts": 3, "dcut": True}
    llm = LLM(path, device="cpu", drafter=drafter, spec=spec, async_scheduling=False)
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


class FailsLate:
    """Drafts wrong for prompt 0; drafts right for prompt 1 until 14 tokens, then raises."""

    name, needs_hidden = "fails-late", False

    def __init__(self, prompts, ref):
        self.prompts, self.ref = prompts, ref

    def propose(self, seqs, caps):
        out = []
        for s, k in zip(seqs, caps, strict=True):
            n = len(s.output_token_ids)
            if s.prompt_token_ids == self.prompts[0]:
                out.append(Draft([(t + 1) % 200 for t in self.ref[0][n : n + k]] or [1]))
            elif n >= 14:
                raise RuntimeError("boom")
            else:
                out.append(Draft(self.ref[1][n : n + k]))
        return out

    def observe(self, verdicts):
        pass

    def release(self, seq):
        pass


def test_a_drafter_failing_for_the_one_sequence_drafted_ends_only_it(tiny_model_dir):
    """D-Cut drafts only the sequence worth it; its drafter raising ends that sequence alone."""
    prompts = PROMPTS[:2]
    params = greedy(30)
    ref = [
        o.outputs[0].token_ids
        for o in LLM(tiny_model_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    ]
    spec = {"num_drafts": 3, "dcut": True, "dcut_probe_every": 1000}
    llm = LLM(tiny_model_dir, device="cpu", drafter=FailsLate(prompts, ref), spec=spec)
    llm.engine.spec.cost = VerifyCostModel.from_points({(1, 4.0): 1.3, (2, 4.0): 1.3})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == ref[0]
    assert outs[1].outputs[0].finish_reason == "error"


class Learner:
    """Drafts nothing useful; rebuilds each sequence's output from what `observe` shows it."""

    name, needs_hidden = "learner", False

    def __init__(self):
        self.seen: dict[int, list[int]] = {}

    def propose(self, seqs, caps):
        return [Draft([1] * k) for k in caps]

    def observe(self, verdicts):
        for v in verdicts:
            self.seen.setdefault(v.seq.seq_id, []).extend(v.emitted)

    def release(self, seq):
        pass


@pytest.mark.parametrize("dcut", [True, False])
def test_a_drafter_not_declared_stateless_sees_every_step(tiny_model_dir, dcut):
    """Only drafters that say `stateless = True` miss the verdicts of steps nothing drafted."""
    learner = Learner()
    spec = {"num_drafts": 3, "dcut": dcut}
    llm = LLM(tiny_model_dir, device="cpu", drafter=learner, spec=spec)
    outs = llm.generate(PROMPTS[:3], greedy(20), use_tqdm=False)
    for i, o in enumerate(outs):
        tokens = o.outputs[0].token_ids
        # every token but a finished sequence's last (finished sequences are not observed)
        assert learner.seen[i] == tokens[: len(learner.seen[i])]
        assert len(learner.seen[i]) >= len(tokens) - 1


def test_probe_steps_keep_the_planned_sequences(tiny_model_dir):
    """A probe step drafts the sequences D-Cut planned deep, plus a few others; never fewer."""
    prompts = [[(7 * i + 3 * j) % 200 + 3 for j in range(5 + (3 * i) % 11)] for i in range(16)]
    params = greedy(40)
    plain = LLM(tiny_model_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    ref = [o.outputs[0].token_ids for o in plain]
    drafter = ReplayDrafter(dict(zip(map(tuple, prompts), ref, strict=True)), 1.0, 200)
    llm = LLM(tiny_model_dir, device="cpu", drafter=drafter, spec={"num_drafts": 3})
    llm.engine.spec.cost = VerifyCostModel.from_points({(1, 4.0): 1.01, (16, 4.0): 1.01})
    sizes, real = [], drafter.propose
    spec = llm.engine.spec

    def propose(seqs, caps):
        sizes.append((spec._steps, len(seqs)))
        return real(seqs, caps)

    drafter.propose = propose
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    probes = [n for step, n in sizes if step % spec.cfg.dcut_probe_every == 0]
    others = [n for step, n in sizes if step % spec.cfg.dcut_probe_every != 0]
    assert probes and others and min(probes) >= max(others[:3])


@pytest.mark.parametrize("replan_every", [1, 4])
def test_a_plan_stands_for_replan_every_steps_while_the_batch_is_the_same(
    tiny_model_dir, monkeypatch, replan_every
):
    """D-Cut plans at most once per `dcut_replan_every` steps while the running sequences stay
    the same (probe steps plan afresh), and the output is still plain decoding's."""
    from metrale.speculative import planning

    prompts = [[(5 * i + 2 * j) % 200 + 3 for j in range(6 + i)] for i in range(4)]
    params = greedy(40)
    ref = [
        o.outputs[0].token_ids
        for o in LLM(tiny_model_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    ]
    drafter = ReplayDrafter(dict(zip(map(tuple, prompts), ref, strict=True)), 0.9, 200)
    spec = {"num_drafts": 3, "dcut_replan_every": replan_every, "dcut_probe_every": 1000}
    llm = LLM(tiny_model_dir, device="cpu", drafter=drafter, spec=spec)
    llm.engine.spec.cost = VerifyCostModel.from_points({(1, 4.0): 1.01, (4, 4.0): 1.01})
    planned_at, real_plan = [], planning.plan
    dec = llm.engine.spec
    ahead = [0]  # 1 while planning ahead: for the step after the one running

    def plan(inputs, cost, cap, **kw):
        planned_at.append((dec._steps + ahead[0], tuple(sorted(x.slot for x in inputs))))
        return real_plan(inputs, cost, cap, **kw)

    def plan_ahead(self, running):
        ahead[0] = 1
        try:
            real_ahead(self, running)
        finally:
            ahead[0] = 0

    real_ahead = planning.DepthPlanning.plan_ahead
    monkeypatch.setattr(planning, "plan", plan)
    monkeypatch.setattr(planning.DepthPlanning, "plan_ahead", plan_ahead)
    # probes at a fixed interval here (their backoff: tests/test_probes.py)
    monkeypatch.setattr(probes, "MAX_BACKOFF", 1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    steps = [step for step, _ in planned_at]
    assert len(steps) >= 3
    if replan_every == 1:
        assert len(set(steps)) >= max(steps) - min(steps) - 2  # every step planned
    else:
        # while the same sequences run, a plan is made at most once in any 4 steps
        same = [(a, b) for a, b in zip(planned_at, planned_at[1:]) if a[1] == b[1]]
        assert same and all(b[0] - a[0] >= replan_every for a, b in same if b[0] != a[0])
        assert len(set(steps)) < (max(steps) - min(steps)) / 2


def test_a_depth_zero_plan_outlives_arrivals_until_the_next_probe(tiny_model_dir, monkeypatch):
    """Once D-Cut plans depth 0 everywhere, sequences arriving and leaving do not make it plan
    again: only probe steps (and the two after one) plan, until no planned sequence is left
    or the batch halves (the run's tail here). The output is plain decoding's."""
    prompts = [[(5 * i + 2 * j) % 200 + 3 for j in range(6 + i)] for i in range(8)]
    params = [greedy(10 + 3 * i) for i in range(8)]  # staggered ends: one slot frees at a time
    ref = [
        o.outputs[0].token_ids
        for o in LLM(tiny_model_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    ]
    drafter = ReplayDrafter(dict(zip(map(tuple, prompts), ref, strict=True)), 0.9, 200)
    spec = {"num_drafts": 3, "dcut_probe_every": PROBE_EVERY * 2}
    llm = LLM(tiny_model_dir, device="cpu", drafter=drafter, spec=spec, max_num_seqs=4)
    # verifying costs far more than it could buy: every plan is depth 0 everywhere
    llm.engine.spec.cost = VerifyCostModel.from_points({(1, 4.0): 40.0, (4, 4.0): 40.0})
    dec, real_plan, planned_at = llm.engine.spec, planning.plan, []

    def plan(inputs, cost, cap, **kw):
        if len(inputs) >= 3:  # not the tail, where the batch halves
            planned_at.append(dec._steps)
        return real_plan(inputs, cost, cap, **kw)

    monkeypatch.setattr(planning, "plan", plan)
    # probes at a fixed interval here (their backoff: tests/test_probes.py)
    monkeypatch.setattr(probes, "MAX_BACKOFF", 1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    steps = sorted(set(planned_at))
    every = PROBE_EVERY * 2
    # (a probe runs ahead, `held_verify.probes_ahead`: the step after it plans before it is
    # observed, the next one after)
    off_probe = [s for s in steps[1:] if s % every not in (0, 1, 2)]
    assert steps and not off_probe, (steps, off_probe)
    assert max(dec._steps, 0) > 3 * every  # long enough to see several arrivals between probes
