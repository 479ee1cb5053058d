"""D-Cut: depth planning against brute force, the arms of the dispatch, the acceptance estimator
and the verify cost model."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.knobs import knobs
from metrale.speculative.dcut import (
    PlanInput,
    choose_depths,
    expected_tokens,
    plan,
)
from metrale.speculative.estimator import AcceptanceEstimator
from metrale.speculative.verify_cost import VerifyCostModel
from metrale.speculative.verify_key import verify_batch_order


@pytest.fixture
def arm(monkeypatch):
    """set(min_width): canonical from that width (0: always); set(None): never canonical."""

    def set_arm(min_width: int | None) -> None:
        monkeypatch.delenv("METRALE_NO_CANONICAL_VERIFY_KEY", raising=False)
        monkeypatch.delenv("METRALE_CANONICAL_KEY_MIN_WIDTH", raising=False)
        if min_width is None:
            monkeypatch.setenv("METRALE_NO_CANONICAL_VERIFY_KEY", "0")
        else:
            monkeypatch.setenv("METRALE_CANONICAL_KEY_MIN_WIDTH", str(min_width))
        knobs.cache_clear()

    yield set_arm
    knobs.cache_clear()


def objective(inputs, depths, cost) -> float:
    n = len(inputs)
    tokens = sum(expected_tokens(x, d) for x, d in zip(inputs, depths))
    return tokens / cost.step_time(n + sum(depths), n)


def brute_force(inputs, cost, max_rows=None, uniform=False, canonical=False) -> float:
    n = len(inputs)
    if uniform:
        # One depth for all, up to the deepest drafts (shorter ones padded: rows, no tokens).
        top = max(x.max_depth for x in inputs)
        space = [[d] * n for d in range(top + 1)]
    elif canonical:
        # Any depth up to the deepest drafts (padding allowed), never rising along the slots.
        top = max(x.max_depth for x in inputs)
        by_slot = sorted(range(n), key=lambda i: inputs[i].slot)
        space = [
            ds
            for ds in itertools.product(range(top + 1), repeat=n)
            if all(ds[a] >= ds[b] for a, b in itertools.pairwise(by_slot))
        ]
    else:
        space = itertools.product(*(range(x.max_depth + 1) for x in inputs))
    return max(
        objective(inputs, ds, cost)
        for ds in space
        if max_rows is None or n + sum(ds) <= max_rows or not any(ds)
    )


probs = st.one_of(st.sampled_from([0.0, 1.0, 0.5]), st.floats(0.0, 1.0))


@st.composite
def batches(draw, max_n: int = 4, max_depth: int = 3):
    n = draw(st.integers(1, max_n))
    out = []
    for slot in draw(st.lists(st.integers(0, 63), min_size=n, max_size=n, unique=True)):
        d = draw(st.integers(0, max_depth))
        out.append(PlanInput(slot, d, draw(st.lists(probs, min_size=d, max_size=d + 1))))
    return out


@st.composite
def costs(draw):
    """The default curve at some knee, or a measured curve with random (noisy) increments."""
    if draw(st.booleans()):
        return VerifyCostModel(knee_rows=draw(st.floats(0.05, 1000.0)))
    points = {}
    for b in (1, 2, 4):
        ratio = 1.0
        for q in (1.5, 2.0, 3.0, 4.0):
            ratio += draw(st.floats(-0.05, 1.5))
            points[(b, q)] = max(ratio, 0.5)
    return VerifyCostModel.from_points(points)


# --- optimality --------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(batches(), costs(), st.one_of(st.none(), st.integers(1, 14)))
def test_greedy_fill_matches_brute_force(inputs, cost, max_rows):
    depths = choose_depths(inputs, cost, width_cap=64, max_rows=max_rows)
    assert all(0 <= d <= x.max_depth for d, x in zip(depths, inputs))
    if max_rows is not None and any(depths):
        assert len(inputs) + sum(depths) <= max_rows
    best = brute_force(inputs, cost, max_rows)
    assert objective(inputs, depths, cost) == pytest.approx(best, rel=1e-9)


@settings(max_examples=300, deadline=None)
@given(batches(), costs(), st.one_of(st.none(), st.integers(1, 14)))
def test_canonical_plan_matches_brute_force(inputs, cost, max_rows):
    depths = choose_depths(inputs, cost, width_cap=64, max_rows=max_rows, canonical=True)
    by_slot = [depths[i] for i in sorted(range(len(inputs)), key=lambda i: inputs[i].slot)]
    assert by_slot == sorted(by_slot, reverse=True)
    if max_rows is not None and any(depths):
        assert len(inputs) + sum(depths) <= max_rows
    best = brute_force(inputs, cost, max_rows, canonical=True)
    assert objective(inputs, depths, cost) == pytest.approx(best, rel=1e-9)


@settings(max_examples=150, deadline=None)
@given(batches(), costs())
def test_uniform_depth_above_width_cap_is_the_best_uniform(inputs, cost):
    depths = choose_depths(inputs, cost, width_cap=len(inputs) - 1)
    assert len(set(depths)) == 1
    best = brute_force(inputs, cost, uniform=True)
    assert objective(inputs, depths, cost) == pytest.approx(best, rel=1e-9)


def test_steps_in_the_cost_curve_do_not_stop_the_fill_early():
    # Measured curves have steps (a kernel tile fills up): one more row can cost a lot and the
    # next few nothing, so the fill must look past a drop in the objective.
    stepped = VerifyCostModel.from_points({(1, 2.0): 2.5, (1, 4.0): 2.5})
    assert choose_depths([PlanInput(0, 3, [1.0, 1.0, 1.0])], stepped, width_cap=8) == [3]
    assert choose_depths([PlanInput(0, 3, [1.0, 1.0, 1.0])], stepped, width_cap=0) == [3]


def test_no_speculation_when_it_cannot_pay():
    inputs = [PlanInput(s, 4, [1e-6] * 4) for s in range(8)]
    assert choose_depths(inputs, VerifyCostModel(), width_cap=64) == [0] * 8
    # Rows cost as much as a whole decode step each (pure compute bound): never worth it.
    steep = VerifyCostModel.from_points({(8, 2.0): 2.0, (8, 5.0): 5.0})
    good = [PlanInput(s, 4, [0.95] * 4) for s in range(8)]
    assert choose_depths(good, steep, width_cap=64) == [0] * 8
    assert choose_depths(good, steep, width_cap=2) == [0] * 8


def test_cheap_rows_take_every_draft_worth_anything():
    flat = VerifyCostModel(knee_rows=1e9)
    inputs = [PlanInput(0, 3, [0.2, 0.1, 0.0]), PlanInput(1, 2, [0.9, 0.9])]
    assert choose_depths(inputs, flat, width_cap=64) == [2, 2]


def test_high_acceptance_sequences_go_deeper(arm):
    arm(None)
    accept = [0.95, 0.3, 0.7, 0.05]
    inputs = [PlanInput(slot, 4, [a * 0.97**j for j in range(4)]) for slot, a in enumerate(accept)]
    cost = VerifyCostModel(knee_rows=16.0)
    depths = choose_depths(inputs, cost, width_cap=64)
    assert depths[0] > depths[2] > depths[1] >= depths[3]
    p = plan(inputs, cost, width_cap=64)
    assert [inputs[i].slot for i in p.order] == [0, 2, 1, 3]  # deepest first
    assert p.depths == [depths[i] for i in p.order]


def test_equal_depths_above_width_cap():
    inputs = [PlanInput(s, 4, [0.9 - 0.2 * (s % 4)] * 4) for s in range(10)]
    cost = VerifyCostModel()
    assert len(set(choose_depths(inputs, cost, width_cap=10))) > 1
    depths = choose_depths(inputs, cost, width_cap=9)
    assert len(set(depths)) == 1 and depths[0] > 0
    # A sequence with one draft (an n-gram's short match, a request a token from max_tokens)
    # does not pin the batch at its depth: it is padded (the uniform depth once stopped at the
    # shallowest sequence's drafts, and in a stream of requests some sequence always had one).
    capped = [*inputs[:9], PlanInput(99, 1, [0.9])]
    assert choose_depths(capped, cost, width_cap=9) == depths
    p = plan(capped, cost, width_cap=9)
    assert p.rows == 10 * (depths[0] + 1)  # the padded rows are priced
    padded = sum(expected_tokens(x, depths[0]) for x in capped)
    assert p.expected_tokens == pytest.approx(padded)  # and buy nothing
    assert padded == pytest.approx(sum(expected_tokens(x, depths[0]) for x in inputs[:9]) + 1.9)
    # where padding is not worth its rows, the depth stops short of the deepest drafts
    steep = VerifyCostModel.from_points({(10, 2.0): 1.05, (10, 3.0): 1.1, (10, 5.0): 5.0})
    shallow = [PlanInput(s, 1, [0.9]) for s in range(9)] + [PlanInput(9, 4, [0.9] * 4)]
    assert choose_depths(shallow, steep, width_cap=9) == [1] * 10


@settings(max_examples=150, deadline=None)
@given(batches(max_n=5, max_depth=4), costs(), st.one_of(st.none(), st.integers(1, 16)))
def test_ragged_uniform_depth_prices_only_the_rows_drafted(inputs, cost, max_rows):
    # Programs that take any mix of depths (`any_depths`): above the width cap each sequence
    # verifies min(d, its drafts) of the one depth d, and only those rows are priced.
    depths = choose_depths(inputs, cost, width_cap=0, max_rows=max_rows, any_depths=True)
    assert len(set(depths)) == 1
    real = [min(depths[0], x.max_depth) for x in inputs]
    n = len(inputs)
    top = max(x.max_depth for x in inputs)
    space = [[min(d, x.max_depth) for x in inputs] for d in range(top + 1)]
    best = max(
        objective(inputs, ds, cost)
        for ds in space
        if max_rows is None or n + sum(ds) <= max_rows or not any(ds)
    )
    assert objective(inputs, real, cost) == pytest.approx(best, rel=1e-9)
    if max_rows is not None and any(real):
        assert n + sum(real) <= max_rows
    p = plan(inputs, cost, width_cap=0, max_rows=max_rows, any_depths=True)
    assert p.rows == n + sum(real)
    assert p.expected_tokens == pytest.approx(
        sum(expected_tokens(x, d) for x, d in zip(inputs, real))
    )


@settings(max_examples=100, deadline=None)
@given(batches(max_n=5, max_depth=3), costs())
def test_programs_taking_any_depth_mix_get_free_depths_under_the_canonical_arm(inputs, cost):
    # The canonical arm keeps row-table keys few; ragged programs are keyed by rows and
    # sequences alone, so there each sequence gets its own best depth (the free optimum).
    knobs.cache_clear()
    p = plan(inputs, cost, width_cap=64, any_depths=True)
    depths = [0] * len(inputs)
    for i, d in zip(p.order, p.depths, strict=True):
        depths[i] = d
    assert all(d <= x.max_depth for d, x in zip(depths, inputs, strict=True))
    assert objective(inputs, depths, cost) == pytest.approx(brute_force(inputs, cost), rel=1e-9)
    assert p.depths == sorted(p.depths, reverse=True)  # dispatched deepest first


def test_short_drafts_do_not_make_a_ragged_wide_batch_go_shallow():
    # Nine one-draft sequences and one with four, above the width cap: priced as padded rows
    # (row-table programs) the deep drafts do not pay for nine empty rows a level; where each
    # verifies what it drafted (ragged programs) a level past the first costs one row.
    steep = VerifyCostModel.from_points({(10, 2.0): 1.05, (10, 3.0): 1.1, (10, 5.0): 5.0})
    shallow = [PlanInput(s, 1, [0.9]) for s in range(9)] + [PlanInput(9, 4, [0.9] * 4)]
    assert choose_depths(shallow, steep, width_cap=9) == [1] * 10
    assert choose_depths(shallow, steep, width_cap=9, any_depths=True) == [4] * 10
    assert plan(shallow, steep, width_cap=9).rows == 20
    assert plan(shallow, steep, width_cap=9, any_depths=True).rows == 10 + 9 + 4


def test_max_rows_caps_the_table():
    inputs = [PlanInput(s, 4, [0.99] * 4) for s in range(6)]
    flat = VerifyCostModel(knee_rows=1e9)
    for max_rows in range(6, 31):
        depths = choose_depths(inputs, flat, width_cap=64, max_rows=max_rows)
        assert len(inputs) + sum(depths) == min(max_rows, 30)
        uniform = choose_depths(inputs, flat, width_cap=1, max_rows=max_rows)
        assert uniform == [min((max_rows - 6) // 6, 4)] * 6
    # Wider than any verify table: a plain decode batch.
    assert choose_depths(inputs, flat, width_cap=64, max_rows=5) == [0] * 6


def test_ties_go_to_the_lower_index():
    inputs = [PlanInput(7, 2, [0.8, 0.8]), PlanInput(3, 2, [0.8, 0.8])]
    flat = VerifyCostModel(knee_rows=1e9)
    assert choose_depths(inputs, flat, width_cap=64, max_rows=3) == [1, 0]
    assert choose_depths(inputs, flat, width_cap=64, max_rows=5) == [2, 1]


def test_bad_inputs():
    with pytest.raises(ValueError, match="max_depth 3"):
        choose_depths([PlanInput(0, 3, [0.5, 0.5])], VerifyCostModel(), width_cap=8)
    with pytest.raises(ValueError, match="width_cap"):
        choose_depths([PlanInput(0, 1, [0.5])], VerifyCostModel(), width_cap=-1)
    # A NaN confidence (a broken drafter) reads as "never accepted", not as an error.
    nan = [PlanInput(0, 2, [math.nan, 0.9]), PlanInput(1, 2, [0.9, 0.9])]
    assert choose_depths(nan, VerifyCostModel(knee_rows=1e9), width_cap=8) == [0, 2]
    assert plan([], VerifyCostModel(), width_cap=8).rows == 0


# --- arms --------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(batches(max_n=12, max_depth=4), st.sampled_from([None, 0, 3, 8]), st.booleans())
def test_plan_is_verify_batch_order_of_the_chosen_depths(inputs, min_width, uniform):
    knobs.cache_clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("METRALE_NO_CANONICAL_VERIFY_KEY", raising=False)
        mp.delenv("METRALE_CANONICAL_KEY_MIN_WIDTH", raising=False)
        if min_width is None:
            mp.setenv("METRALE_NO_CANONICAL_VERIFY_KEY", "1")
        else:
            mp.setenv("METRALE_CANONICAL_KEY_MIN_WIDTH", str(min_width))
        cost = VerifyCostModel(knee_rows=32.0)
        cap = 0 if uniform else 64
        canonical = min_width is not None and len(inputs) >= min_width
        chosen = choose_depths(inputs, cost, width_cap=cap, canonical=canonical)
        p = plan(inputs, cost, width_cap=cap)
        assert (p.order, p.depths) == verify_batch_order(
            [x.slot for x in inputs], chosen, canonical
        )
        # Under either arm every sequence verifies the depth planned for it.
        assert p.depths == [chosen[i] for i in p.order]
        assert p.rows == len(inputs) + sum(chosen)
        assert p.expected_tokens == pytest.approx(
            sum(expected_tokens(inputs[i], d) for i, d in zip(p.order, p.depths))
        )
        if canonical:
            slots = [inputs[i].slot for i in p.order]
            assert slots == sorted(slots) and p.depths == sorted(p.depths, reverse=True)
    knobs.cache_clear()


def test_canonical_plan_pads_a_low_slot_when_that_pays(arm):
    deep, empty = PlanInput(5, 3, [0.9, 0.9, 0.9]), PlanInput(1, 0, [])
    cost = VerifyCostModel()
    arm(None)
    own = plan([deep, empty], cost, width_cap=64)
    assert (own.order, own.depths) == ([0, 1], [3, 0])
    arm(0)
    # Slot 1 dispatches first and must be at least as deep: it is padded to 3 rows of nothing.
    dealt = plan([deep, empty], cost, width_cap=64)
    assert (dealt.order, dealt.depths, dealt.rows) == ([1, 0], [3, 3], 8)
    assert dealt.expected_tokens == pytest.approx(own.expected_tokens)
    assert dealt.expected_tokens == pytest.approx(2 + 0.9 + 0.81 + 0.729)
    # When rows are dear, the padding does not pay and neither does the deep draft.
    steep = VerifyCostModel(knee_rows=1.0)
    assert plan([deep, empty], steep, width_cap=64).depths == [0, 0]
    arm(3)  # below the threshold width: each keeps its own depth, unpadded
    assert plan([deep, empty], cost, width_cap=64).depths == [3, 0]


# --- acceptance estimator ----------------------------------------------------------------------


def test_estimator_prior_and_update():
    est = AcceptanceEstimator(max_positions=4, prior=0.4, rate=0.25)
    assert est.estimate("a", 3) == [0.4, 0.4, 0.4]
    est.observe("a", [True, False])
    # The prior counts as one observation: a plain mean at first. Position 3, never verified,
    # reads position 2's estimate.
    assert est.estimate("a", 3) == pytest.approx([0.7, 0.2, 0.2])
    est.observe("a", [True, True, True])
    assert est.estimate("a", 3) == pytest.approx([0.8, 1.4 / 3, 0.7])
    for _ in range(3):
        est.observe("a", [False])
    # The n-th observation weighs 1 / (n + 1) until that reaches `rate`, from the 3rd on here.
    assert est.estimate("a", 1)[0] == pytest.approx(0.8 * 0.75**3)
    assert est.estimate("b", 2) == [0.4, 0.4]


def test_estimator_learns_each_position():
    est = AcceptanceEstimator(max_positions=3)
    for i in range(200):
        est.observe(0, [True, i % 2 == 0, False])
    a = est.estimate(0, 3)
    assert a[0] == pytest.approx(1.0, abs=1e-6)
    assert 0.35 < a[1] < 0.65
    assert a[2] == pytest.approx(0.0, abs=1e-6)


def test_estimator_estimates_acceptance_given_the_drafts_before():
    """Drafts that match in runs: every position matches half the time, but a draft after a
    match always matches. The planner multiplies a_j along the drafts, so a_j must be the rate
    given the drafts before it matched (1.0 here), not the marginal rate (0.5)."""
    est = AcceptanceEstimator(max_positions=3, rate=0.1)
    for i in range(400):
        est.observe(0, [i % 2 == 0] * 3)  # all three match, or none does
    a = est.estimate(0, 3)
    assert 0.4 < a[0] < 0.6
    assert a[1] == pytest.approx(1.0) and a[2] == pytest.approx(1.0)


def test_estimator_is_bounded():
    est = AcceptanceEstimator(max_positions=2, max_sequences=3)
    est.observe("s", [True, True, False, False])  # positions past max_positions are not kept
    assert est.estimate("s", 4) == pytest.approx([0.75, 0.75, 0.75, 0.75])
    for sid in range(5):
        est.observe(sid, [False])
    assert len(est) == 3
    assert est.estimate("s", 1) == [0.5]  # least recently observed: evicted
    est.observe(2, [False])  # 2 is now the most recent, 3 the oldest
    est.observe(9, [True])
    assert est.estimate(3, 1) == [0.5] and est.estimate(2, 1) == pytest.approx([0.5 / 3])
    est.forget(2)
    est.forget("never seen")
    assert len(est) == 2 and est.estimate(2, 1) == [0.5]


def test_estimator_takes_draft_confidences():
    est = AcceptanceEstimator(max_positions=4, prior=0.5)
    est.observe(1, [True, True, False])
    assert est.estimate(1, 3, probs=[0.9, math.nan]) == pytest.approx([0.9, 0.0, 0.25])
    assert est.estimate(1, 2, probs=[1.5, -1.0]) == [1.0, 0.0]


def test_estimator_rejects_bad_settings():
    with pytest.raises(ValueError):
        AcceptanceEstimator(rate=0.0)
    with pytest.raises(ValueError):
        AcceptanceEstimator(max_positions=0)
    with pytest.raises(ValueError):
        AcceptanceEstimator(prior=1.5)


# --- cost model --------------------------------------------------------------------------------


def test_default_cost_curve():
    cost = VerifyCostModel()
    for width in (1, 16, 64):
        assert cost.step_time(width, width) == pytest.approx(1.0)
    assert cost.step_time(64, 16) == pytest.approx(1.6)
    assert cost.step_time(256, 64) == pytest.approx(2.5)
    with pytest.raises(ValueError):
        cost.step_time(3, 4)
    with pytest.raises(ValueError):
        VerifyCostModel(knee_rows=0)


def test_measured_curve_interpolates_in_q_and_batch():
    cost = VerifyCostModel.from_points(
        {(1, 2): 1.1, (1, 4): 1.3, (16, 4): 1.5, (64, 4): 2.7, (64, 16): 4.9}
    )
    assert cost.step_time(1, 1) == pytest.approx(1.0)  # the implicit q = 1 point
    assert cost.step_time(3, 1) == pytest.approx(1.2)
    assert cost.step_time(6, 1) == pytest.approx(1.5)  # past the last q, the last segment goes on
    assert cost.step_time(40, 16) == pytest.approx(1.25)  # q = 2.5 on (1, 1) .. (4, 1.5)
    assert cost.step_time(4 * 40, 40) == pytest.approx(1.5 + (2.7 - 1.5) * 24 / 48)
    assert cost.step_time(10 * 64, 64) == pytest.approx(2.7 + 2.2 / 2)
    # Outside the measured batch sizes: the nearest curve.
    assert cost.step_time(4 * 128, 128) == pytest.approx(2.7)
    assert cost.step_time(2 * 64, 64) == pytest.approx(1 + 1.7 / 3)


def test_measured_dips_are_ironed_out():
    cost = VerifyCostModel.from_points({(8, 2): 1.4, (8, 3): 1.2, (8, 4): 1.6})
    times = [cost.step_time(8 * q, 8) for q in (1, 2, 3, 4, 5)]
    assert times == pytest.approx([1.0, 1.4, 1.4, 1.6, 1.8])


def test_from_json():
    doc = {
        "batch_sizes": [1, 64],
        "q": [1, 4, 16],
        "ratio": [[1.0, 1.15, None], [1.0, 2.74, 4.9]],
    }
    cost = VerifyCostModel.from_json(doc)
    assert cost.step_time(4, 1) == pytest.approx(1.15)
    assert cost.step_time(16 * 64, 64) == pytest.approx(4.9)
    assert cost.step_time(4 * 32, 32) == pytest.approx(1.15 + (2.74 - 1.15) * 31 / 63)
    with pytest.raises(ValueError, match="'q'"):
        VerifyCostModel.from_json({"batch_sizes": [1], "ratio": [[1.0]]})
    with pytest.raises(ValueError, match="2 rows of 3"):
        VerifyCostModel.from_json({**doc, "ratio": [[1.0, 1.1, 1.2]]})
    with pytest.raises(ValueError, match="no point with q > 1"):
        VerifyCostModel.from_json({**doc, "ratio": [[1.0, None, None], [1.0, 2.0, 3.0]]})
    with pytest.raises(ValueError):
        VerifyCostModel.from_points({(0, 2.0): 1.5})
    with pytest.raises(ValueError):
        VerifyCostModel.from_points({})


def test_pooled_prior_starts_new_sequences_from_the_engine_wide_rate():
    est = AcceptanceEstimator(max_positions=3, prior=0.6, rate=0.25, pooled_prior=True)
    assert est.estimate("new", 2) == [0.6, 0.6]  # nothing observed yet: the prior
    for sid in range(20):
        est.observe(sid, [False, False])
    pooled = est.estimate("new", 3)
    # a plain mean of the 20 observations and the prior, counted as one
    assert pooled[:2] == pytest.approx([0.6 / 21] * 2) and pooled[2] == pooled[1]
    est.observe("new", [True])  # once observed, a sequence reads its own estimate
    assert est.estimate("new", 1)[0] == pytest.approx((0.6 / 21 + 1) / 2)  # half-way to its match


def test_pooled_prior_is_not_set_by_the_last_few_sequences():
    """A closed batch ends with its slowest sequences, whose drafts seldom land: the pooled
    prior that the next batch starts from averages many sequences' observations, not theirs."""
    est = AcceptanceEstimator(max_positions=2, prior=0.6, pooled_prior=True)
    for sid in range(100):
        est.observe(sid, [True, True])
    for sid in range(100, 104):
        est.observe(sid, [False])  # the tail: four verifies that missed
    assert est.estimate("next", 1)[0] > 0.85
    # a sequence's own estimate still follows its own last verifies closely
    for _ in range(4):
        est.observe(0, [False])
    assert est.estimate(0, 1)[0] < 0.25
    for bad in (0.0, 1e-9, 1.5, math.nan):
        with pytest.raises(ValueError, match="^pool_rate must be"):
            AcceptanceEstimator(pool_rate=bad)
        with pytest.raises(ValueError, match="^rate must be"):
            AcceptanceEstimator(rate=bad)
    # a record with no verified draft is no observation: a new sequence still reads the pool
    pooled = est.estimate("unseen", 1)
    est.observe("unseen", [])
    assert est.estimate("unseen", 1) == pooled
