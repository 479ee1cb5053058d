"""Seed 000: dispatch order, canonical depth assignment and the batched-verify graph key."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from metrale.knobs import knobs
from metrale.speculative import verify_key
from metrale.speculative.verify_key import (
    CANONICAL_KEY_MIN_WIDTH,
    canonical_assignment,
    canonical_key_min_width,
    canonical_verify_key_enabled,
    verify_batch_order,
    verify_batch_permutation,
    verify_graph_key,
)


@st.composite
def batches(draw, min_size: int = 0, uniform: bool = False):
    """(slots, ks): distinct slots, as a state pool hands them out, and depths 1..8."""
    n = draw(st.integers(min_size, 24))
    slots = draw(st.lists(st.integers(0, 63), min_size=n, max_size=n, unique=True))
    if uniform:
        ks = [draw(st.integers(1, 8))] * n
    else:
        ks = draw(st.lists(st.integers(1, 8), min_size=n, max_size=n))
    return slots, ks


def key_of(slots, ks, canonical, wy=False, woa=False):
    order, depths = verify_batch_order(slots, ks, canonical)
    return verify_graph_key([(slots[i], d) for i, d in zip(order, depths)], wy, woa)


# --- order -------------------------------------------------------------------------------------


@given(batches(), st.booleans())
def test_permutation_of_range(batch, canonical):
    slots, ks = batch
    assert sorted(verify_batch_permutation(slots, ks, canonical)) == list(range(len(slots)))


@given(batches(), st.booleans())
def test_order_is_the_permutation(batch, canonical):
    slots, ks = batch
    order, depths = verify_batch_order(slots, ks, canonical)
    assert order == verify_batch_permutation(slots, ks, canonical)
    assert len(depths) == len(order)


@given(
    st.lists(st.integers(0, 9), max_size=6), st.lists(st.integers(1, 4), max_size=6), st.booleans()
)
def test_length_mismatch_is_refused(slots, ks, canonical):
    assume(len(slots) != len(ks))
    for fn in (verify_batch_permutation, verify_batch_order):
        with pytest.raises(ValueError, match=f"{len(slots)} slots but {len(ks)} depths"):
            fn(slots, ks, canonical)


@given(batches())
def test_canonical_slots_ascend_depths_descend_multiset_kept(batch):
    slots, ks = batch
    order, depths = verify_batch_order(slots, ks, canonical=True)
    dispatched_slots = [slots[i] for i in order]
    assert dispatched_slots == sorted(dispatched_slots)
    assert depths == sorted(depths, reverse=True)
    assert Counter(depths) == Counter(ks)


@given(batches(min_size=1))
def test_canonical_lowest_slot_gets_deepest_depth(batch):
    slots, ks = batch
    order, depths = verify_batch_order(slots, ks, canonical=True)
    assert slots[order[0]] == min(slots)
    assert depths[0] == max(ks)


@given(batches())
def test_per_sequence_keeps_depths_deepest_first_then_slot(batch):
    slots, ks = batch
    order, depths = verify_batch_order(slots, ks, canonical=False)
    assert depths == [ks[i] for i in order]
    keys = [(-ks[i], slots[i]) for i in order]
    assert keys == sorted(keys)


def test_ties_keep_batch_order():
    # Equal slots never happen in a real batch, but the order must still be deterministic.
    assert verify_batch_permutation([5, 5, 5], [2, 2, 2], canonical=True) == [0, 1, 2]
    assert verify_batch_permutation([5, 5, 5], [2, 3, 2], canonical=False) == [1, 0, 2]


def test_worked_example():
    slots, ks = [7, 2, 9, 4], [1, 3, 2, 3]
    assert verify_batch_order(slots, ks, canonical=True) == ([1, 3, 0, 2], [3, 3, 2, 1])
    assert verify_batch_order(slots, ks, canonical=False) == ([1, 3, 2, 0], [3, 3, 2, 1])


@given(batches(uniform=True))
def test_uniform_depths_identical_under_both_arms(batch):
    slots, ks = batch
    assert verify_batch_order(slots, ks, True) == verify_batch_order(slots, ks, False)
    assert key_of(slots, ks, True) == key_of(slots, ks, False)


# --- key ---------------------------------------------------------------------------------------


@given(st.lists(st.tuples(st.integers(0, 2**16), st.integers(1, 16)), max_size=12))
def test_key_is_pairs_then_sentinel(pairs):
    for wy in (False, True):
        for woa in (False, True):
            key = verify_graph_key(pairs, wy, woa)
            assert key[:-1] == tuple(v for p in pairs for v in p)
            assert key[-1] == 0xFFFFFFFF - wy - 2 * woa


def test_four_distinct_sentinels():
    sentinels = {verify_graph_key([], wy, woa)[-1] for wy in (False, True) for woa in (False, True)}
    assert sentinels == {0xFFFFFFFF, 0xFFFFFFFE, 0xFFFFFFFD, 0xFFFFFFFC}


@given(batches(min_size=1), st.randoms(use_true_random=False), st.booleans(), st.booleans())
def test_canonical_key_depends_on_slot_set_and_depth_multiset(batch, rng, wy, woa):
    slots, ks = batch
    shuffled_ks = list(ks)
    rng.shuffle(shuffled_ks)
    shuffled_slots = list(slots)
    rng.shuffle(shuffled_slots)
    key = key_of(slots, ks, True, wy, woa)
    assert key_of(slots, shuffled_ks, True, wy, woa) == key
    assert key_of(shuffled_slots, ks, True, wy, woa) == key


def test_per_sequence_key_follows_the_assignment():
    assert key_of([0, 1], [3, 1], False) != key_of([0, 1], [1, 3], False)
    assert key_of([0, 1], [3, 1], True) == key_of([0, 1], [1, 3], True)


# --- arm selection -----------------------------------------------------------------------------


@pytest.fixture
def env(monkeypatch):
    """Set knob variables for one test; the cached knobs are re-read around it."""
    for name in ("METRALE_CANONICAL_KEY_MIN_WIDTH", "METRALE_NO_CANONICAL_VERIFY_KEY"):
        monkeypatch.delenv(name, raising=False)
    knobs.cache_clear()

    def set_env(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        knobs.cache_clear()

    yield set_env
    knobs.cache_clear()


def test_default_threshold_is_the_constant(env):
    assert canonical_key_min_width() == CANONICAL_KEY_MIN_WIDTH
    assert canonical_verify_key_enabled()
    assert not canonical_assignment(CANONICAL_KEY_MIN_WIDTH - 1)
    assert canonical_assignment(CANONICAL_KEY_MIN_WIDTH)
    assert canonical_assignment(CANONICAL_KEY_MIN_WIDTH + 100)
    # programs taking any mix of depths never get the arm
    assert not canonical_assignment(CANONICAL_KEY_MIN_WIDTH + 100, any_depths=True)


def test_constant_is_read_at_call_time(env, monkeypatch):
    monkeypatch.setattr(verify_key, "CANONICAL_KEY_MIN_WIDTH", 3)
    assert canonical_key_min_width() == 3
    assert canonical_assignment(3)
    assert not canonical_assignment(2)


@pytest.mark.parametrize(("value", "width"), [("4", 4), ("0", 0), ("+16", 16)])
def test_threshold_override(env, value, width):
    env(METRALE_CANONICAL_KEY_MIN_WIDTH=value)
    assert canonical_key_min_width() == width
    assert canonical_assignment(width)
    if width > 0:
        assert not canonical_assignment(width - 1)


def test_zero_threshold_is_every_width(env):
    env(METRALE_CANONICAL_KEY_MIN_WIDTH="0")
    assert all(canonical_assignment(n) for n in range(0, 40))


@pytest.mark.parametrize("value", ["", "-1", "eight", "8.0", str(2**64)])
def test_bad_override_falls_back_to_the_constant(env, value):
    env(METRALE_CANONICAL_KEY_MIN_WIDTH=value)
    assert canonical_key_min_width() == CANONICAL_KEY_MIN_WIDTH


@pytest.mark.parametrize("value", ["", "0", "1", "no"])
def test_disable_flag_wins_at_every_width(env, value):
    env(METRALE_NO_CANONICAL_VERIFY_KEY=value, METRALE_CANONICAL_KEY_MIN_WIDTH="0")
    assert not canonical_verify_key_enabled()
    assert not any(canonical_assignment(n) for n in range(0, 300))


def test_arm_is_read_once(env, monkeypatch):
    assert canonical_assignment(CANONICAL_KEY_MIN_WIDTH)
    monkeypatch.setenv("METRALE_NO_CANONICAL_VERIFY_KEY", "1")
    monkeypatch.setenv("METRALE_CANONICAL_KEY_MIN_WIDTH", "1000")
    assert canonical_assignment(CANONICAL_KEY_MIN_WIDTH)
    knobs.cache_clear()
    assert not canonical_assignment(CANONICAL_KEY_MIN_WIDTH)
