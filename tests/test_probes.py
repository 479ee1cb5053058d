"""D-Cut's probe schedule (`speculative/probes.py`): a probe every `dcut_probe_every` steps while
plans draft; each plan that drafts nothing doubles the interval, up to its bound; a plan that
drafts brings the base interval back; probes measured dear beyond a plain step space out further.
And in the engine: with drafts that are always wrong the probes thin out (further when drafting
is slow), and once the drafts are right again speculation comes back; the output is plain
decoding's throughout."""

from __future__ import annotations

import time

import pytest

from metrale import LLM, SamplingParams
from metrale.speculative.host_cost import WARMUP_SAMPLES
from metrale.speculative.probes import (
    MAX_BACKOFF,
    MAX_SPACED,
    PROBE_SEQS,
    PROBE_SHARE,
    ProbeSchedule,
)
from metrale.speculative.replay import ReplayDrafter


def probe_steps(schedule: ProbeSchedule, steps: int, drafts=lambda step: False) -> list[int]:
    out = []
    for step in range(1, steps + 1):
        if schedule.due(step):
            out.append(step)
            schedule.planned(drafts(step))  # the plan after the probe
    return out


def test_the_interval_doubles_to_its_bound_and_comes_back():
    got = probe_steps(ProbeSchedule(4), 400)
    gaps = [b - a for a, b in zip(got, got[1:])]
    assert got[0] == 4 and gaps[:3] == [4, 8, 16]
    assert max(gaps) == 4 * MAX_BACKOFF and gaps[-1] == 4 * MAX_BACKOFF
    # a plan that drafts: back to every 4 steps from the next probe on
    back = probe_steps(ProbeSchedule(4), 400, drafts=lambda step: step > 200)
    assert [b - a for a, b in zip(back, back[1:])][-3:] == [4, 4, 4]


def test_dear_probes_space_out_to_keep_their_share_of_the_time():
    # a probe step costing 0.04 plain steps more than one: MAX_BACKOFF base intervals suffice
    cheap = ProbeSchedule(4)
    for step in range(WARMUP_SAMPLES):
        cheap.priced(0.04, step)
    assert cheap.bound == 4 * MAX_BACKOFF
    # 1.6 more (13.5 ms against 5.2 ms plain): an interval of 1.6 / PROBE_SHARE steps
    dear = ProbeSchedule(4)
    for step in range(WARMUP_SAMPLES - 1):
        dear.priced(1.6, step)
    assert dear.bound == 4 * MAX_BACKOFF  # not before the warm-up
    dear.priced(1.6, WARMUP_SAMPLES)
    assert dear.bound == round(1.6 / PROBE_SHARE) > 4 * MAX_BACKOFF
    got = probe_steps(dear, 2000)
    gaps = [b - a for a, b in zip(got, got[1:])]
    assert max(gaps) == gaps[-1] == dear.bound
    # a plan that drafts brings the base interval back, whatever the bound
    dear.planned(True)
    assert dear.every == 4
    # and no further than MAX_SPACED base intervals, however dear
    for step in range(WARMUP_SAMPLES):
        dear.priced(1e6, 10_000 + step)
    assert dear.bound == 4 * MAX_SPACED


def test_probes_take_the_sequences_in_turn():
    schedule = ProbeSchedule(1)
    seen = set()
    for step in range(1, 8):
        assert schedule.due(step)
        picked = schedule.probed(20)
        assert len(picked) == min(PROBE_SEQS, 20) and len(set(picked)) == len(picked)
        seen.update(picked)
    assert seen == set(range(20))
    assert schedule.probed(3) and set(schedule.probed(3)) <= {0, 1, 2}


class Flipping(ReplayDrafter):
    """Every draft wrong while `wrong`, then the target's own continuation."""

    wrong = True

    def propose(self, seqs, max_drafts):
        drafts = super().propose(seqs, max_drafts)
        if self.wrong:
            return [type(d)([(t + 1) % 200 for t in d.tokens]) for d in drafts]
        return drafts


PROMPTS = [[(3 * i + 5 * j) % 190 + 5 for j in range(6 + i)] for i in range(4)]


def flipping_engine(model_dir, params, **options):
    """(plain decoding's tokens, an engine probing every 4 steps with a `Flipping` drafter of
    them, the drafter)."""
    plain = LLM(model_dir, device="cpu").generate(PROMPTS, params, use_tqdm=False)
    ref = [o.outputs[0].token_ids for o in plain]
    drafter = Flipping(dict(zip(map(tuple, PROMPTS), ref, strict=True)), 1.0, 200)
    spec = {"num_drafts": 3, "dcut": True, "dcut_probe_every": 4}
    return ref, LLM(model_dir, device="cpu", drafter=drafter, spec=spec, **options), drafter


def test_probes_back_off_while_nothing_is_accepted_and_speculation_returns(
    tiny_model_dir, knob_env
):
    """Host pricing off: with it on, a loaded machine's step times could close D-Cut's gate
    on some plans of the second run (a full suite on a 2-core machine counted 19 verify steps
    there, against more than 20 asked), which is the gate's business, not the probes'."""
    knob_env(METRALE_NO_DCUT_HOST_COST="1")  # plans follow the acceptance estimates alone
    prompts = PROMPTS
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    ref, llm, drafter = flipping_engine(tiny_model_dir, params)
    spec = llm.engine.spec
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == ref
    assert spec._probes.every > 4  # nothing paid: the probes thinned out
    tel = llm.engine.telemetry.spec
    wrong_verifies = tel.verify_steps
    drafter.wrong = False
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == ref
    # new sequences start from the prior: they speculate, and the probes are back to every 4
    assert tel.verify_steps - wrong_verifies > 20 and spec._probes.every == 4


class SlowFlipping(Flipping):
    delay = 0.0

    def propose(self, seqs, max_drafts):
        time.sleep(self.delay)
        return super().propose(seqs, max_drafts)


def probing_engine(tiny_model_dir, drafter_delay: float, probe_delay: float):
    """(plain decoding's tokens, an engine whose drafts are all wrong, probing every 2 steps,
    with a drafter taking `drafter_delay` seconds a call and probe steps `probe_delay` seconds
    more beside it (as a probe that drains the asynchronous engine's pipeline does))."""
    params = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
    plain = LLM(tiny_model_dir, device="cpu").generate(PROMPTS, params, use_tqdm=False)
    ref = [o.outputs[0].token_ids for o in plain]
    drafter = SlowFlipping(dict(zip(map(tuple, PROMPTS), ref, strict=True)), 1.0, 200)
    drafter.delay = drafter_delay
    spec = {"num_drafts": 3, "dcut": True, "dcut_probe_every": 2}
    llm = LLM(tiny_model_dir, device="cpu", drafter=drafter, spec=spec)
    runner, controller = llm.engine.runner, llm.engine.spec
    execute = runner.execute

    def slow_probes(batch, **kw):
        if controller._probing:
            time.sleep(probe_delay)
        return execute(batch, **kw)

    runner.execute = slow_probes
    return ref, llm, params


def plain_step_seconds(tiny_model_dir) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    start = time.perf_counter()
    LLM(tiny_model_dir, device="cpu").generate(PROMPTS, params, use_tqdm=False)
    return (time.perf_counter() - start) / params.max_tokens


def test_dear_probe_steps_space_the_probes_of_a_closed_gate(tiny_model_dir):
    """Every draft wrong and probe steps dear beyond their drafting (10 of this machine's
    plain steps): the probes space out past `MAX_BACKOFF` base intervals."""
    delay = max(0.03, 10 * plain_step_seconds(tiny_model_dir))
    ref, llm, params = probing_engine(tiny_model_dir, 0.0, delay)
    probes = llm.engine.spec._probes
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == ref
    assert probes._excess.value is not None and probes._excess.value > 5
    assert probes.bound > 2 * MAX_BACKOFF and probes.every > 2 * MAX_BACKOFF


def test_a_slow_drafter_alone_does_not_space_the_probes(tiny_model_dir):
    """The drafter's own host work is left out of a probe's price: a probe catches its
    sequences up on every token since their last one (the n-gram index), work that grows with
    the interval, so that spacing for it only fed itself (found by review)."""
    plain = plain_step_seconds(tiny_model_dir)
    delay = max(0.05, 20 * plain)
    ref, llm, params = probing_engine(tiny_model_dir, delay, 0.0)
    probes = llm.engine.spec._probes
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == ref
    # Priced with the drafter's time, the excess would be at least its `delay / plain` (20
    # plain steps). Left out, what remains is the probe's own cost and this machine's noise:
    # under CI's load a plain step of a few ms wobbles by one or two, which is why the bound
    # (at its cap from an excess of 1.3) is not what this asserts (CI failed on that once).
    assert probes._excess.value is not None
    assert probes._excess.value < 0.25 * delay / plain


def test_a_probe_is_priced_with_the_step_after_it_and_never_leaks(tiny_model_dir):
    """What a probe step (after plain steps) and the plain step after it cost beyond two plain
    steps, the drafter's host work aside; a prefill, empty or capturing step is no price, a
    verify after it is not the probe's, and a probe flag never outlives the step it was planned
    in (found by review: an empty probe step crashed pricing, a step planning nothing inherited
    the flag, a probe that prefilled was priced with it, and so was a verify after it)."""
    from types import SimpleNamespace

    from metrale.engine.sequence import Phase

    llm = LLM(tiny_model_dir, device="cpu", spec={"method": "ngram", "num_drafts": 3})
    spec = llm.engine.spec
    for _ in range(3):
        spec.host.plain(4, 0.010)

    def step(phase, seconds, width=4, probing=False, drafting=0.0):
        spec._probing = probing
        spec.host._last = (0, drafting)
        batch = SimpleNamespace(phase=phase, entries=list(range(width)), num_rows=width)
        spec.timed_step(batch, seconds)

    probes = spec._probes
    for i in range(3):
        step(Phase.DECODE, 0.010)
        step(Phase.VERIFY, 0.050, probing=True, drafting=0.020)  # 0.030 beside the drafter
        assert len(probes._excess.samples) == i
        step(Phase.DECODE, 0.005)  # no step in flight to wait for
    assert probes._excess.value == pytest.approx((0.030 + 0.005) / 0.010 - 2)
    # the step after is a prefill: the probe alone; a prefill or empty probe is no price
    step(Phase.VERIFY, 0.050, probing=True)
    step(Phase.MIXED, 0.500)
    assert probes._excess.samples[-1] == pytest.approx(0.050 / 0.010 - 1)
    for phase, width in ((Phase.MIXED, 4), (Phase.DECODE, 0)):
        step(phase, 0.500, width=width, probing=True)
        step(Phase.DECODE, 0.010)
    assert len(probes._excess.samples) == 4
    # a verify after the probe (the gate reopened): the probe alone
    step(Phase.VERIFY, 0.050, probing=True)
    step(Phase.VERIFY, 0.300)
    assert probes._excess.samples[-1] == pytest.approx(0.050 / 0.010 - 1)
    # a probe step during which a program was captured is no price
    from metrale.engine.program_cache import captures

    spec.host._captures = captures() - 1
    step(Phase.VERIFY, 0.500, probing=True)
    spec.host._captures = captures()
    step(Phase.DECODE, 0.010)
    assert len(probes._excess.samples) == 5
    # a step that plans nothing is no probe, whatever the step before was
    spec._probing = True
    spec.prepare([])
    assert not spec._probing


def test_async_steps_that_run_synchronously_are_timed(tiny_model_dir):
    """Under async scheduling a request under a grammar makes every step synchronous; D-Cut is
    still told of each (so a verify step after plain ones is no sample) and its plain steps
    are measured (found by review: they were neither)."""
    prompts = PROMPTS
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True) for _ in prompts]
    params[0] = SamplingParams(temperature=0.0, max_tokens=40, structured={"regex": "[ab]{40}"})
    ref, llm, _ = flipping_engine(tiny_model_dir, params, async_scheduling=True)
    spec, timed = llm.engine.spec, []
    told = spec.timed_step
    spec.timed_step = lambda batch, seconds: timed.append(batch.phase) or told(batch, seconds)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == ref
    assert llm.engine._ahead.launches == 0  # nothing ran ahead
    assert len(timed) == llm.engine.telemetry.steps
    assert spec.host.plain_seconds(len(prompts)) is not None
