"""D-Cut's gate prices whole steps measured at one width at another: a width bucket spans a
factor of two, and a closed batch narrows through every width. Steps are scaled by the calibrated
forward between widths (`HostCost.shape`), not per sequence: a small model's step is mostly fixed
host work, and per sequence a plain step measured at batch 50 and a verify step measured at 36
priced a plan at 59 that wins by 25% as a loss (the shipped model on the H200: the gate dropped
such plans for seven steps of a closed batch of 64)."""

from __future__ import annotations

import pytest

from metrale import LLM
from metrale.speculative.dcut import Plan
from metrale.speculative.host_cost import WARMUP_SAMPLES, HostCost, drafting_loses
from metrale.speculative.verify_cost import VerifyCostModel

# A host-bound target: its forward (the calibration) barely grows with the width, and so does
# its whole step, whose host work is mostly fixed. Verify rows cost nothing more here.
COST = VerifyCostModel.from_points({(1, 4.0): 1.0, (64, 4.0): 1.0}, {1: 0.20e-3, 64: 0.26e-3})


def plain_step(width: int) -> float:
    return 2.40e-3 + 0.005e-3 * width


def verify_step(width: int) -> float:
    return 4.40e-3 + 0.020e-3 * width


def _measured(host: HostCost, plain_width: int, verify_width: int) -> None:
    """Plain steps timed at `plain_width` and verify steps at `verify_width`, of one bucket."""
    for _ in range(WARMUP_SAMPLES):
        host.begin()
        host.plain(plain_width, plain_step(plain_width))
        host.speculative(verify_width, verify_width, verify_step(verify_width), 1.0)


def _plan(width: int, tokens_each: float) -> Plan:
    return Plan(list(range(width)), [1] * width, tokens_each * width, 2 * width)


def test_whole_steps_are_priced_at_another_width_by_the_calibrated_forward():
    host = HostCost(enabled=True, forward=COST.plain_seconds)
    _measured(host, plain_width=50, verify_width=36)
    bare = HostCost(enabled=True)  # nothing calibrated: per sequence (the CPU engine's case)
    _measured(bare, plain_width=50, verify_width=36)
    for width in (33, 59, 63):  # the bucket of 32 to 63 sequences
        assert host.plain_seconds(width) == pytest.approx(plain_step(width), rel=0.05)
        assert host.verify_seconds(width, width) == pytest.approx(verify_step(width), rel=0.05)
        assert bare.plain_seconds(width) == pytest.approx(plain_step(50) * width / 50)
    # per sequence, the bucket's far end was a fifth to three fifths off
    assert bare.plain_seconds(63) > 1.2 * plain_step(63)
    assert bare.verify_seconds(59, 59) > 1.5 * verify_step(59)


def test_a_plan_that_wins_at_its_width_is_not_dropped_for_where_its_bucket_was_measured():
    width, tokens_each = 59, 2.6  # 2.6 tokens a sequence for a verify step of 1.9 plain steps
    truth = tokens_each * width / verify_step(width) / (width / plain_step(width))
    assert truth > 1.25  # it wins by a quarter
    host = HostCost(enabled=True, forward=COST.plain_seconds)
    _measured(host, plain_width=50, verify_width=36)
    assert not drafting_loses(_plan(width, tokens_each), COST, host)
    assert not drafting_loses(_plan(width, tokens_each), COST, host, reopen=True)
    # and one that loses at its width is still dropped: 1.6 tokens for 1.9 plain steps
    assert drafting_loses(_plan(width, 1.6), COST, host)
    # the per-sequence pricing this replaces dropped the winning plan
    per_seq = HostCost(enabled=True)
    _measured(per_seq, plain_width=50, verify_width=36)
    assert drafting_loses(_plan(width, tokens_each), COST, per_seq, reopen=True)


def test_the_engines_gate_scales_by_the_cost_model_it_plans_with(tiny_model_dir):
    """The engine calibrates D-Cut's cost model after the controller is made: the gate looks
    the forward up in the model in use, not in the one it started with."""
    llm = LLM(tiny_model_dir, device="cpu", spec={"method": "ngram", "num_drafts": 3})
    spec = llm.engine.spec
    assert spec.host.shape(12) == 12.0  # nothing calibrated on the CPU: per sequence
    spec.cost = COST
    assert spec.host.shape(12) == pytest.approx(COST.plain_seconds(12))


def test_a_width_no_plain_step_ran_at_is_priced_from_the_nearest_by_the_forward():
    """`plain_near`: plain steps measured at batch 64 only, a closed batch's tail asks for 16:
    the measured step scaled by the calibrated forward between the two widths."""
    host = HostCost(enabled=True, forward=COST.plain_seconds)
    for _ in range(WARMUP_SAMPLES):
        host.begin()
        host.plain(64, 2.3e-3)
    assert host.plain_seconds(16) is None  # another bucket: not measured
    want = 2.3e-3 * COST.plain_seconds(16) / COST.plain_seconds(64)
    assert host.plain_near(16, COST) == pytest.approx(want)


def test_the_async_engines_hidden_host_work_is_priced_in_the_same_units():
    """The host work a plain step hides behind the device (the asynchronous engine's
    `hidden_seconds`) is kept and priced by the same shape as the whole step."""
    host = HostCost(enabled=True, forward=COST.plain_seconds)
    for _ in range(WARMUP_SAMPLES):
        host.begin()
        host.plain(50, plain_step(50), 1.5e-3)
    assert host.hidden_seconds(50) == pytest.approx(1.5e-3)
    want = 1.5e-3 * COST.plain_seconds(59) / COST.plain_seconds(50)
    assert host.hidden_seconds(59) == pytest.approx(want)
