"""D-Cut prices the drafter's host work: `HostCost` measures its seconds per number of sequences
drafted, and a plan whose tokens do not pay for it is dropped, so a batch whose drafting costs
more than it buys decodes plainly (output unchanged), while cheap drafting keeps speculating."""

from __future__ import annotations

import time

import pytest

from metrale import LLM, SamplingParams
from metrale.speculative.dcut import PlanInput, plan
from metrale.speculative.host_cost import (
    WARMUP_SAMPLES,
    WINDOW,
    HostCost,
    count_bucket,
    drafting_loses,
)
from metrale.speculative.replay import ReplayDrafter
from metrale.speculative.verify_cost import VerifyCostModel
from tests.test_hybrid_engine import hybrid_dir  # noqa: F401 (a module fixture)

PROMPTS = [[(7 * i + 3 * j) % 200 + 3 for j in range(5 + 3 * i)] for i in range(4)]
TOKENS, PROBE_EVERY, REPLAN_EVERY = 80, 8, 4
FLAT = VerifyCostModel.from_points({(1, 4.0): 1.0, (64, 4.0): 1.0})


def _steps(host: HostCost, samples) -> None:
    """Steps with (sequences drafted, host seconds) each."""
    for drafted, seconds in samples:
        host.begin()
        host.spent(seconds, drafted)
    host.begin()


def test_per_bucket_estimates_from_steady_drafting_only():
    host = HostCost(enabled=True)
    assert host.seconds(8) is None
    # the first drafting step follows none, so it is no sample; then a capture among the
    # warm-up samples does not set the estimate (their median does)
    _steps(host, [(8, 5.0), (8, 8e-3), (8, 1.0), (8, 8e-3)])
    assert host.seconds(8) == pytest.approx(8e-3) and host.seconds(12) == pytest.approx(12e-3)
    assert host.seconds(64) is None and host.seconds(0) == 0.0  # another bucket: unmeasured
    # a probe after idle steps also catches up on them: no sample
    _steps(host, [(0, 1e-5)] * 5 + [(8, 1.0), (0, 1e-5)])
    assert host.seconds(8) == pytest.approx(8e-3)
    # the median of the newest samples: an outlier moves nothing, a lasting change wins
    _steps(host, [(8, 8e-3)] * 3 + [(8, 80e-3)])
    assert host.seconds(8) == pytest.approx(8e-3)
    _steps(host, [(8, 8e-3)] + [(8, 16e-3)] * WINDOW)
    assert host.seconds(8) == pytest.approx(16e-3)
    assert HostCost(enabled=False).seconds(8) is None


def test_a_step_that_captured_a_program_is_no_sample(monkeypatch):
    """A capture (a drafter's program on first use, tens of milliseconds) inside a step: that
    step's drafting seconds and its plain seconds are dropped, not sampled."""
    from metrale.engine import program_cache

    host = HostCost(enabled=True)
    _steps(host, [(8, 8e-3)] * (WARMUP_SAMPLES + 1))
    assert host.seconds(8) == pytest.approx(8e-3)
    host.spent(50e-3, 8)  # this step captures
    monkeypatch.setattr(program_cache, "_captures", program_cache.captures() + 1)
    host.begin()
    assert host.seconds(8) == pytest.approx(8e-3)
    _steps(host, [(8, 8e-3)] * 2)  # the next steady one is a sample again
    assert host.seconds(8) == pytest.approx(8e-3)
    assert len(host._buckets[count_bucket(8)].samples) == WARMUP_SAMPLES + 1  # not the capture's
    for _ in range(WARMUP_SAMPLES):
        host.plain(4, 4e-3)
    assert host.plain_seconds(4) == pytest.approx(4e-3)
    monkeypatch.setattr(program_cache, "_captures", program_cache.captures() + 1)
    host.plain(4, 80e-3)  # a plain step that captured (since this step's `begin`)
    assert len(host._plain[count_bucket(4)].samples) == WARMUP_SAMPLES


def test_an_estimate_with_no_sample_for_a_while_is_forgotten():
    host = HostCost(enabled=True, stale_after=10)
    _steps(host, [(4, 4e-3)] * (WARMUP_SAMPLES + 1))
    assert host.seconds(4) is not None
    went_stale = []
    for _ in range(12):
        host.spent(1e-5, 0)
        went_stale.append(host.begin())
    assert went_stale.count(True) == 1 and host.seconds(4) is None


def test_plain_seconds_from_points_and_json():
    cost = VerifyCostModel.from_points({(1, 4.0): 1.2, (16, 4.0): 1.5}, {1: 1e-3, 16: 2.5e-3})
    assert cost.plain_seconds(1) == 1e-3 and cost.plain_seconds(64) == 2.5e-3
    assert cost.plain_seconds(6) == pytest.approx(1.5e-3)
    doc = {"batch_sizes": [1, 16], "q": [1, 4], "ratio": [[1, 1.2], [1, 1.5]], "plain_ms": [1, 2]}
    assert VerifyCostModel.from_json(doc).plain_seconds(16) == pytest.approx(2e-3)
    assert VerifyCostModel.from_points({(1, 4.0): 1.2}).plain_seconds(1) is None
    with pytest.raises(ValueError, match="plain_ms"):
        VerifyCostModel.from_json({**doc, "plain_ms": [1]})
    with pytest.raises(ValueError, match="seconds"):
        VerifyCostModel.from_points({(1, 4.0): 1.2}, {1: 0.0})


def _measured(per_seq: float, k: int) -> HostCost:
    host = HostCost(enabled=True)
    _steps(host, [(k, per_seq * k)] * (WARMUP_SAMPLES + 1))
    return host


def test_a_plan_loses_only_when_its_host_work_outweighs_its_tokens():
    good = [PlanInput(slot=i, max_depth=3, accept=[0.9, 0.9, 0.9]) for i in range(8)]
    chosen = plan(good, FLAT, width_cap=64)
    assert chosen.depths == [3] * 8  # 8 x 3.44 tokens in one plain step's time
    plain_1ms = VerifyCostModel.from_points({(1, 4.0): 1.0}, {8: 1e-3})
    # host work of 2 plain steps: 27.5 tokens in 3 steps' time beats 8 in 1
    assert not drafting_loses(chosen, plain_1ms, _measured(0.25e-3, 8))
    # of 2.5 plain steps: 27.5 / 3.5 = 7.86 loses to 8, but within the margin: kept
    assert not drafting_loses(chosen, plain_1ms, _measured(2.5e-3 / 8, 8))
    # of 4 plain steps: 27.5 / 5 < 8 * 0.95
    assert drafting_loses(chosen, plain_1ms, _measured(0.5e-3, 8))
    # unknown plain time, unmeasured width, or nothing drafted: never dropped
    assert not drafting_loses(chosen, FLAT, _measured(0.5e-3, 8))
    assert not drafting_loses(chosen, plain_1ms, _measured(0.5e-3, 64))
    bad = [PlanInput(slot=i, max_depth=3, accept=[0.0] * 3) for i in range(8)]
    assert not drafting_loses(plan(bad, plain_1ms, 64), plain_1ms, _measured(0.5e-3, 8))


def test_host_work_is_priced_against_the_engines_whole_plain_step():
    """The calibrated plain step times the forward alone; the engine's plain steps also pay
    scheduling and emission. Host work of 3 forward-steps loses (27.5 / 4 < 8); measured plain
    steps of 3 forwards' time make it 1 whole step: 27.5 / (1 + 1) = 13.75 beats 8."""
    good = [PlanInput(slot=i, max_depth=3, accept=[0.9, 0.9, 0.9]) for i in range(8)]
    forward_1ms = VerifyCostModel.from_points({(1, 4.0): 1.0}, {8: 1e-3})
    chosen = plan(good, forward_1ms, width_cap=64)
    host = _measured(3e-3 / 8, 8)
    assert host.plain_seconds(8) is None
    assert drafting_loses(chosen, forward_1ms, host)
    for _ in range(WARMUP_SAMPLES):
        host.plain(8, 3e-3)
    assert host.plain_seconds(8) == pytest.approx(3e-3)
    assert host.plain_seconds(12) == pytest.approx(4.5e-3)  # per sequence, in its bucket
    assert not drafting_loses(chosen, forward_1ms, host)
    # a measured step faster than the calibrated forward (noise) never makes host work dearer
    cheap = _measured(3e-3 / 8, 8)
    for _ in range(WARMUP_SAMPLES):
        cheap.plain(8, 0.1e-3)
    assert drafting_loses(chosen, forward_1ms, cheap)


def test_the_asynchronous_engine_prices_the_host_work_a_verify_step_stops_hiding():
    """Asynchronous plain steps hide their host work behind the device (1 ms of it under a
    1.2 ms step of a 1 ms forward); a verify step waits for its verdicts and pays it: 8 x 1.42
    tokens in 1 + 1 + 0.1 ms lose to 8 in 1.2 ms. Synchronously (the plain step's host work is
    its 0.2 ms beyond the forward) the same plan wins, and so it does with less to hide."""
    low = [PlanInput(slot=i, max_depth=3, accept=[0.3, 0.3, 0.3]) for i in range(8)]
    forward_1ms = VerifyCostModel.from_points({(1, 4.0): 1.0}, {8: 1e-3})
    chosen = plan(low, forward_1ms, width_cap=64)
    assert chosen.depths == [3] * 8
    hosts = {hidden: _measured(0.1e-3 / 8, 8) for hidden in (None, 1e-3, 0.3e-3)}
    for hidden, host in hosts.items():
        for _ in range(WARMUP_SAMPLES):
            host.plain(8, 1.2e-3, hidden)
    assert hosts[None].hidden_seconds(8) is None
    assert hosts[1e-3].hidden_seconds(8) == pytest.approx(1e-3)
    assert not drafting_loses(chosen, forward_1ms, hosts[None])
    assert drafting_loses(chosen, forward_1ms, hosts[1e-3])
    assert not drafting_loses(chosen, forward_1ms, hosts[0.3e-3])


def test_a_step_that_ends_a_wave_of_requests_does_not_price_plain_steps():
    """The plain steps a verify step is judged against, as measured on the H200 (the shipped
    model, batch 64): 2.3 ms each, and 11.7 ms for the last one, which finished all 64 requests.
    A running mean took it in and judged drafting against a 4.2 ms plain step, so a plan that
    loses (its verify steps as measured, 6 ms for 2.2 tokens a sequence, against 2.3 ms for 1)
    was kept; the median of the newest samples prices it as a step is."""
    forward = VerifyCostModel.from_points({(1, 4.0): 1.0, (64, 4.0): 1.0}, {64: 1e-3})
    host = HostCost(enabled=True)
    for seconds in [2.3e-3] * 8 + [11.7e-3]:
        host.plain(64, seconds)
    assert host.plain_seconds(64) == pytest.approx(2.3e-3)
    for _ in range(WARMUP_SAMPLES):
        host.speculative(64, 64, 6e-3, 1.0)
    assert host.verify_seconds(64, 64) == pytest.approx(6e-3)
    mediocre = [PlanInput(slot=i, max_depth=3, accept=[0.6] * 3) for i in range(64)]
    chosen = plan(mediocre, forward, width_cap=64)
    assert chosen.expected_tokens == pytest.approx(64 * 2.176)
    assert drafting_loses(chosen, forward, host)
    # against the mean's plain step the same plan looked like a win
    inflated = HostCost(enabled=True)
    for _ in range(WARMUP_SAMPLES):
        inflated.plain(64, 4.2e-3)
        inflated.speculative(64, 64, 6e-3, 1.0)
    assert not drafting_loses(chosen, forward, inflated)


def test_a_dropped_gate_reopens_only_for_an_outright_win():
    """Near break-even the gate has two bars: an open one closes when drafting loses by more
    than GATE_MARGIN, a closed one reopens only when drafting wins outright (each reopening pays
    a transition no sample prices). 8 x 2.8 tokens in 2.9 plain steps: 0.97x plain."""
    forward = VerifyCostModel.from_points({(1, 4.0): 1.0, (64, 4.0): 1.0}, {8: 1e-3})
    host = HostCost(enabled=True)
    for _ in range(WARMUP_SAMPLES):
        host.plain(8, 1e-3)
        host.speculative(8, 8, 2.9e-3, 1.0)
    near_even = plan([PlanInput(i, 3, [0.8, 0.75, 2 / 3]) for i in range(8)], forward, 64)
    assert near_even.expected_tokens == pytest.approx(8 * 2.8)
    assert not drafting_loses(near_even, forward, host)
    assert drafting_loses(near_even, forward, host, reopen=True)
    winning = plan([PlanInput(i, 3, [0.9] * 3) for i in range(8)], forward, 64)
    assert not drafting_loses(winning, forward, host, reopen=True)


def test_the_controller_keeps_a_dropped_gate_closed_until_drafting_wins(
    tiny_model_dir, monkeypatch
):
    """`SpeculativeDecoder` asks the gate with `reopen` set, at a width where it dropped a plan,
    until a plan with drafts passes there; a plan without drafts (acceptance estimates at 0)
    passes the gate trivially and reopens nothing; other widths keep the ordinary bar; and a
    probe is not wasted on a gate that even perfect drafts could not reopen (`_hopeless`)."""
    from types import SimpleNamespace

    import metrale.speculative.planning as planning

    llm = LLM(tiny_model_dir, device="cpu", spec={"method": "ngram", "num_drafts": 3})
    spec = llm.engine.spec
    # rows cost: a sequence whose drafts all miss is worth no depth
    curve = {(b, q): r for b in (1, 4) for q, r in ((1.0, 1.0), (2.0, 1.1), (4.0, 1.3))}
    spec.cost = VerifyCostModel.from_points(curve, {1: 1e-3})
    verdicts, asked = [], []

    def gate(chosen, cost, host, reopen=False):
        asked.append((len(chosen.depths), any(chosen.depths), reopen))
        return verdicts.pop(0)

    monkeypatch.setattr(planning, "drafting_loses", gate)
    four = [SimpleNamespace(slot=i, seq_id=i) for i in range(4)]
    two = four[:2]
    verdicts += [False, True, True]  # width 4: passes, dropped, dropped again
    for _ in range(3):
        spec._worth_drafting(four, [3] * 4)
    verdicts += [False]  # width 2 (another bucket): the ordinary bar
    spec._worth_drafting(two, [3] * 2)
    verdicts += [True]  # a perfect plan at width 4 against the reopening bar: hopeless
    assert spec._hopeless(four, [3] * 4)
    for seq in four:  # acceptance 0: a plan without drafts
        for _ in range(8):
            spec.estimator.observe(seq.seq_id, [False])
    verdicts += [False, False]
    spec._worth_drafting(four, [3] * 4)  # nothing drafted: the gate stays closed
    spec._worth_drafting(four, [3] * 4)
    assert asked == [
        (4, True, False),
        (4, True, False),
        (4, True, True),
        (2, True, False),
        (4, True, True),
        (4, False, True),
        (4, False, True),
    ]


def test_the_perfect_plan_of_a_probe_is_made_once_for_the_same_batch(tiny_model_dir, monkeypatch):
    """`_hopeless` plans with every draft accepted: no estimate enters, so the plan is made again
    only for other slots, caps or cost model (a closed batch asks at every probe step), and the
    answer is the one planned afresh."""
    from types import SimpleNamespace

    import metrale.speculative.planning as planning

    llm = LLM(tiny_model_dir, device="cpu", spec={"method": "ngram", "num_drafts": 3})
    spec = llm.engine.spec
    curve = {(b, q): r for b in (1, 4) for q, r in ((1.0, 1.0), (2.0, 1.1), (4.0, 1.3))}
    spec.cost = VerifyCostModel.from_points(curve, {1: 1e-3})
    made, shown = [], []
    monkeypatch.setattr(planning, "plan", lambda *a, **k: made.append((a, k)) or plan(*a, **k))
    monkeypatch.setattr(
        planning, "drafting_loses", lambda chosen, *a: shown.append(chosen) or False
    )
    four = [SimpleNamespace(slot=i, seq_id=i) for i in range(4)]
    for _ in range(3):
        assert not spec._hopeless(four, [3] * 4)
    assert len(made) == 1 and shown[0] is shown[1] is shown[2]
    spec._hopeless(four, [3, 3, 3, 2])  # a cap shrank near max_tokens
    spec._hopeless(four[1:], [3] * 3)  # a sequence left
    spec.cost = VerifyCostModel.from_points(curve, {1: 2e-3})  # the engine calibrated
    spec._hopeless(four[1:], [3] * 3)
    assert len(made) == 4
    assert shown[-1] == plan(*made[-1][0], **made[-1][1])


def test_the_gate_files_verify_steps_under_the_count_the_plan_drafts(tiny_model_dir):
    """`prepare` records how many sequences the plan gave drafts (what `drafting_loses` looks
    verify steps up by), not how many were planned over or drafted."""
    llm = LLM(tiny_model_dir, device="cpu", spec={"method": "ngram", "num_drafts": 3})
    spec = llm.engine.spec
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for prompt in PROMPTS:
        llm.engine.add_request(str(prompt), prompt, params)
    running = llm.engine.scheduler.running
    for _ in range(8):  # the prompts' prefill
        if len(running) == 4 and all(s.output_token_ids for s in running):
            break
        llm.engine.step()
    running = list(running)
    assert len(running) == 4

    def planned(seqs, caps):
        return seqs[1:3], caps[1:3], True  # two of the four

    spec._planned = planned
    spec.prepare(running)
    assert (spec._planned_width, spec._planned_drafted) == (4, 2)


def test_plain_steps_at_an_unmeasured_width_come_from_the_nearest_measured():
    """A closed batch's tail runs at widths no plain step ran at: the nearest measured width's
    step (nearest by ratio), scaled by the calibrated forward, not the calibrated forward
    alone; the gate prices with it."""
    forward = VerifyCostModel.from_points(
        {(1, 4.0): 1.0, (64, 4.0): 1.0}, {8: 0.4e-3, 16: 0.5e-3, 32: 0.75e-3, 64: 1e-3}
    )
    host = HostCost(enabled=True)
    assert host.plain_near(16, forward) is None
    for _ in range(WARMUP_SAMPLES):
        host.plain(64, 2.3e-3)
    assert host.plain_seconds(16) is None
    assert host.plain_near(16, forward) == pytest.approx(1.15e-3)
    assert host.plain_near(64, forward) == pytest.approx(2.3e-3)
    assert host.plain_near(16, VerifyCostModel.from_points({(1, 4.0): 1.0})) is None
    for _ in range(WARMUP_SAMPLES):
        host.plain(8, 0.8e-3)
    # 31 sits between 8 and 64 by bucket; by ratio 32 is nearest to 64's side
    assert host.plain_near(31, forward) == pytest.approx(2.3e-3 * forward.plain_seconds(31) / 1e-3)
    assert host.plain_near(12, forward) == pytest.approx(
        0.8e-3 * forward.plain_seconds(12) / 0.4e-3
    )
    # the gate: 16 sequences, 2.2 tokens each in a 2 ms verify step, against plain steps of
    # 1.15 ms (from 64's): a win; against the 0.5 ms forward alone it looked like a loss
    for _ in range(WARMUP_SAMPLES):
        host.speculative(16, 16, 2e-3, 1.0)
    mediocre = plan([PlanInput(i, 3, [0.6] * 3) for i in range(16)], forward, 64)
    assert not drafting_loses(mediocre, forward, host)


class SlowReplay(ReplayDrafter):
    """Perfect drafts that take `delay` seconds of host time to propose."""

    def __init__(self, continuations, delay: float) -> None:
        super().__init__(continuations, 1.0, 200)
        self.delay = delay

    def propose(self, seqs, max_drafts):
        time.sleep(self.delay)
        return super().propose(seqs, max_drafts)


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_drafting_that_costs_more_than_it_buys_decodes_plainly(request, target):
    path = request.getfixturevalue("tiny_model_dir" if target == "dense" else "hybrid_dir")
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    reference_llm = LLM(path, device="cpu")
    start = time.perf_counter()
    plain = reference_llm.generate(PROMPTS, params, use_tqdm=False)
    # The drafter takes at least 20 of this machine's plain steps (80 ms, a few ms each when
    # the machine is idle): on a loaded one plain steps of 190 ms made 80 ms cheap, and drafting
    # rightly paid. A perfect draft buys 4 tokens a step: 20 steps' time cannot pay.
    delay = max(0.08, 20 * (time.perf_counter() - start) / TOKENS)
    reference = [o.outputs[0].token_ids for o in plain]
    continuations = dict(zip(map(tuple, PROMPTS), reference, strict=True))
    verified = {}
    # The same slow drafter (always right) against a 1 ms and a 100 s plain forward.
    for plain_s in (1e-3, 100.0):
        llm = LLM(
            path,
            device="cpu",
            drafter=SlowReplay(continuations, delay),
            spec={
                "num_drafts": 3,
                "dcut": True,
                "dcut_probe_every": PROBE_EVERY,
                "dcut_replan_every": REPLAN_EVERY,
            },
        )
        cost = VerifyCostModel.from_points({(1, 4.0): 1.0, (4, 4.0): 1.0}, {1: plain_s})
        llm.engine.spec.cost = cost
        out = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == reference
        verified[plain_s] = llm.engine.telemetry.spec.verify_steps
        if plain_s == 1e-3:  # its plain steps were measured whole, beside the 1 ms forward
            assert llm.engine.spec.host.plain_seconds(len(PROMPTS)) > 1e-4
    # priced at many plain steps, drafting stops after the warm-up; even a perfect draft would not
    # pay for that, so there are no probes either
    # (the last plan before it stands for `dcut_replan_every` steps)
    assert verified[1e-3] <= WARMUP_SAMPLES + 1 + REPLAN_EVERY
    # priced at nothing, every step speculates: about TOKENS / 4 per step
    assert verified[100.0] >= TOKENS // 4 - 2
    # the estimate holds at least the drafter's own delay a step (no bound above: a busy
    # machine only adds to it)
    assert llm.engine.spec.host.seconds(4) >= delay * 0.95


class Sparse(SlowReplay):
    """Takes the same host time for every sequence it is asked about, and drafts for one."""

    def propose(self, seqs, max_drafts):
        drafts = super().propose(seqs, max_drafts)
        return [d if i == 0 else type(d)([]) for i, d in enumerate(drafts)]


def test_host_work_is_counted_per_sequence_asked_not_per_draft_returned(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = LLM(tiny_model_dir, device="cpu").generate(PROMPTS, params, use_tqdm=False)
    continuations = {
        tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, reference, strict=True)
    }
    llm = LLM(
        tiny_model_dir,
        device="cpu",
        drafter=Sparse(continuations, 0.004),
        spec={"num_drafts": 3, "dcut": False},
    )
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in reference]
    host = llm.engine.spec.host
    assert host.seconds(4) is not None and host.seconds(1) is None


class Empty(SlowReplay):
    """Takes its host time and drafts nothing (an n-gram drafter finding no match)."""

    def propose(self, seqs, max_drafts):
        return [type(d)([]) for d in super().propose(seqs, max_drafts)]


def test_a_step_that_asked_the_drafter_is_not_a_plain_step(tiny_model_dir):
    """Steps that verify nothing because every draft came back empty still paid the drafter's
    host work: measured as plain steps, they would price that work against itself (found by a
    review: a 50 ms drafter that never drafts made the plain step 51 ms instead of 7)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(
        tiny_model_dir,
        device="cpu",
        drafter=Empty({}, 0.05),
        spec={"num_drafts": 3, "dcut": True, "dcut_probe_every": 1000},
    )
    llm.engine.spec.cost = VerifyCostModel.from_points({(1, 4.0): 1.0, (4, 4.0): 1.0}, {1: 1e-3})
    llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.telemetry.spec.verify_steps == 0
    plain = llm.engine.spec.host.plain_seconds(len(PROMPTS))
    assert plain is None or plain < 0.04


def test_verify_steps_measured_whole_price_what_the_parts_miss(monkeypatch):
    """A whole verify step is measured per width and number drafted: once known it prices a
    plan (scaled by the cost curve from its rows to the plan's) against the measured plain
    step, in place of the parts (the calibrated forward, the drafter's host work), both ways."""
    from metrale.engine import program_cache

    good = [PlanInput(slot=i, max_depth=3, accept=[0.9, 0.9, 0.9]) for i in range(8)]
    forward_1ms = VerifyCostModel.from_points({(1, 4.0): 1.0}, {8: 1e-3})
    chosen = plan(good, forward_1ms, width_cap=64)
    host = _measured(0.1e-3 / 8, 8)  # the parts: cheap drafting, so the plan is kept
    assert host.verify_seconds(8, 8) is None
    assert not drafting_loses(chosen, forward_1ms, host)
    # verify steps took 5 ms: 27.5 tokens in 5 ms lose to 8 in the 1 ms calibrated forward
    for _ in range(WARMUP_SAMPLES):
        host.speculative(8, 8, 5e-3, 1.0)
    assert host.verify_seconds(8, 8) == pytest.approx(5e-3)
    assert host.verify_seconds(8, 2) is None and host.verify_seconds(64, 8) is None
    assert drafting_loses(chosen, forward_1ms, host)
    # ... but win against plain steps measured at 3 ms (the calibration's forward was short)
    for _ in range(WARMUP_SAMPLES):
        host.plain(8, 3e-3)
    assert not drafting_loses(chosen, forward_1ms, host)
    # a step that captured a program is no sample
    monkeypatch.setattr(program_cache, "_captures", program_cache.captures() + 1)
    host.speculative(8, 8, 1.0, 1.0)
    monkeypatch.undo()
    host.begin()
    assert host.verify_seconds(8, 8) == pytest.approx(5e-3)
    # scaled by the rows' relative cost: 6 ms over rows at 1.5x is 4 ms a one-row step
    scaled = HostCost(enabled=True)
    for _ in range(WARMUP_SAMPLES):
        scaled.speculative(8, 8, 6e-3, 1.5)
    assert scaled.verify_seconds(8, 8) == pytest.approx(4e-3)
    # the other way: parts that say "too dear" (drafting 4 ms) against verify steps of 1.5 ms
    dear = _measured(4e-3 / 8, 8)
    assert drafting_loses(chosen, forward_1ms, dear)
    for _ in range(WARMUP_SAMPLES):
        dear.speculative(8, 8, 1.5e-3, 1.0)
    assert not drafting_loses(chosen, forward_1ms, dear)
    # unmeasured for a while: forgotten, and the parts price it again
    stale = HostCost(enabled=True, stale_after=4)
    for _ in range(WARMUP_SAMPLES):
        stale.speculative(8, 8, 5e-3, 1.0)
    assert stale.verify_seconds(8, 8) is not None
    assert any([stale.begin() for _ in range(6)]) and stale.verify_seconds(8, 8) is None
    off = HostCost(enabled=False)
    off.speculative(8, 8, 5e-3, 1.0)
    assert off.verify_seconds(8, 8) is None


class SlowVerify:
    """The runner's `execute`, `delay` seconds slower on steps that verify drafts: what the
    start-up calibration and the drafter's own timing do not see (a verify's host work, or
    forward seconds the calibration's context underestimates)."""

    def __init__(self, runner, delay: float) -> None:
        self.execute, self.delay = runner.execute, delay

    def __call__(self, batch, *args, **kwargs):
        if any(e.drafts for e in batch.entries):
            time.sleep(self.delay)
        return self.execute(batch, *args, **kwargs)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_verify_steps_dearer_than_priced_stop_speculation(tiny_model_dir, async_scheduling):
    """Cheap, always-right drafts whose verify steps each cost 60 ms more than the verify cost
    curve says: D-Cut measures the verify steps whole and decodes plainly after the warm-up;
    without the extra cost it keeps speculating. The output is the same either way."""
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    reference_llm = LLM(tiny_model_dir, device="cpu")
    start = time.perf_counter()
    plain = reference_llm.generate(PROMPTS, params, use_tqdm=False)
    # this machine's plain step now (a few ms idle; under load far more, where a curve priced
    # at 2 ms made every verify step look dear and closed the gate with no delay: a full run
    # failed on it once)
    step_s = max(2e-3, (time.perf_counter() - start) / TOKENS)
    reference = [o.outputs[0].token_ids for o in plain]
    continuations = dict(zip(map(tuple, PROMPTS), reference, strict=True))
    verified = {}
    for delay in (0.0, max(0.06, 20 * step_s)):
        llm = LLM(
            tiny_model_dir,
            device="cpu",
            drafter=SlowReplay(continuations, 0.0),
            async_scheduling=async_scheduling,
            spec={
                "num_drafts": 3,
                "dcut": True,
                "dcut_probe_every": PROBE_EVERY,
                "dcut_replan_every": REPLAN_EVERY,
            },
        )
        runner = llm.engine.runner
        # a forward of a few ms, as the tiny model's plain steps measure on the CPU
        llm.engine.spec.cost = VerifyCostModel.from_points(
            {(1, 4.0): 1.0, (4, 4.0): 1.0}, {1: step_s}
        )
        runner.execute = SlowVerify(runner, delay)
        out = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == reference
        verified[delay] = llm.engine.telemetry.spec.verify_steps
        if delay:
            assert llm.engine.spec.host.verify_seconds(len(PROMPTS), len(PROMPTS)) >= 0.8 * delay
    assert verified[0.0] >= TOKENS // 4 - 2
    # the warm-up's verify steps, a plan standing for `dcut_replan_every` steps, and a probe
    # every PROBE_EVERY steps whose cut may verify
    assert verified[delay] <= WARMUP_SAMPLES + 2 + REPLAN_EVERY + TOKENS // PROBE_EVERY


def _step(phase, drafts: list[int]):
    from types import SimpleNamespace

    entries = [SimpleNamespace(drafts=[0] * k) for k in drafts]
    return SimpleNamespace(phase=phase, entries=entries, num_rows=sum(drafts) + len(drafts))


def test_only_steady_verify_steps_are_samples_filed_under_the_planned_width(tiny_model_dir):
    """The first verify step after other steps is no sample (it catches up on what they emitted
    and, async, waits for the step in flight: sampled, a closed gate's probes kept it closed),
    nor is a step whose batch failed and ran again; samples are filed under the width D-Cut
    planned over, where the gate looks (a request with speculation off is in the batch, not
    in the plan). Found by review."""
    from metrale.engine.sequence import Phase

    llm = LLM(tiny_model_dir, device="cpu", spec={"method": "ngram", "num_drafts": 3})
    spec = llm.engine.spec
    taken = []
    spec.host.speculative = lambda *args: taken.append(args)
    spec._planned_width, spec._planned_drafted = 3, 3
    verify = _step(Phase.VERIFY, [3, 3, 0, 0])
    for batch, seconds in [
        (_step(Phase.DECODE, [0, 0, 0, 0]), 1e-3),
        (verify, 5e-3),  # after a plain step: no sample
        (verify, 4e-3),  # steady: a sample
        (verify, None),  # retried one at a time: no sample
        (verify, 6e-3),  # steady: a sample
        (_step(Phase.DECODE, [0, 0, 0, 0]), 1e-3),
        (verify, 7e-3),  # after a plain step again
    ]:
        spec.timed_step(batch, seconds)
    relative = spec.cost.step_time(verify.num_rows, 4)
    # (two of them drafted: an n-gram drafter finds nothing for some; the gate looks up the
    # plan's count)
    assert taken == [(3, 3, 4e-3, relative), (3, 3, 6e-3, relative)]
