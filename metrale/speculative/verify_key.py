"""Dispatch order and depth assignment of one batched verify, and its CUDA-graph key.

The depth planner orders a batch with `verify_batch_order`, the runner dispatches in that order and
the graph cache keys its verify graphs with `verify_graph_key` over the same order, so all three see
one order. Two arms:

- canonical: slots ascend along the dispatch and the depths (the multiset the planner chose)
  descend, so the key depends only on the slot set and the depth multiset, not on which sequence got
  which depth: fewer distinct keys, hence fewer graph captures. Ascending slots also keep a run of
  equal depth on consecutive state slots when the pool handed out consecutive slots.
- per-sequence: each sequence keeps the depth it was given; deepest first, then by slot.

With all depths equal both arms give the same order, so the arm only matters below the planner's
width cap, where depths differ.
"""

from __future__ import annotations

from collections.abc import Sequence

from metrale.knobs import knobs

# Measured with benchmarks/canonical_key_trace.py (3 seeds x 3000 steps of a mixed trace, widths
# 1..64, K = 4, H200 cost points): from width 4 the arm leaves 0.44 of the distinct verify keys
# (graph hit rate 0.12 -> 0.62) for 1.9% fewer expected tokens per step; thresholds up to 16 pay
# the same loss (it comes from widths >= 16), and 4 keeps >= 96% of the key reduction in every
# variant tried (random slots included), where 8 keeps 61% with fragmented slots.
CANONICAL_KEY_MIN_WIDTH: int = 4

_U32_MAX = 0xFFFFFFFF


def canonical_key_min_width() -> int:
    """`METRALE_CANONICAL_KEY_MIN_WIDTH` when it parses (0: every width), else the constant."""
    override = knobs().canonical_key_min_width
    return CANONICAL_KEY_MIN_WIDTH if override is None else override


def canonical_verify_key_enabled() -> bool:
    """True unless `METRALE_NO_CANONICAL_VERIFY_KEY` is present, whatever its value."""
    return knobs().canonical_verify_key_enabled


def canonical_assignment(n: int, any_depths: bool = False) -> bool:
    """Whether a batch of `n` sequences gets the canonical arm. `any_depths`: the target's
    programs take any mix of depths (ragged programs, keyed by rows and sequences alone, or
    none): the arm, which keeps row-table keys few, buys nothing there and never applies.

    NOTE: the planner and the dispatcher must ask with the same width, so that the order the planner
    assigned depths in is the one dispatched.
    """
    return not any_depths and canonical_verify_key_enabled() and n >= canonical_key_min_width()


def _check_lengths(slots: Sequence[int], ks: Sequence[int]) -> None:
    if len(slots) != len(ks):
        raise ValueError(
            f"verify batch has {len(slots)} slots but {len(ks)} depths; they must pair up"
        )


def verify_batch_permutation(slots: Sequence[int], ks: Sequence[int], canonical: bool) -> list[int]:
    """Dispatch order of one verify batch: `order[j]` is the batch index dispatched j-th.

    `slots[i]` is sequence i's state slot and `ks[i]` its depth (rows it contributes). Ties keep the
    batch order, so the result is deterministic for any input.
    """
    _check_lengths(slots, ks)
    n = len(slots)
    if canonical:
        return sorted(range(n), key=lambda i: slots[i])
    return sorted(range(n), key=lambda i: (-ks[i], slots[i]))


def verify_batch_order(
    slots: Sequence[int], ks: Sequence[int], canonical: bool
) -> tuple[list[int], list[int]]:
    """`(order, depths)`: the dispatch order and the depth assigned at each dispatch position.

    Canonical: the given depths, sorted deepest first, are dealt out along ascending slots, so the
    lowest slot gets the deepest depth whichever sequence the planner meant it for; the planner then
    cuts each sequence's drafts to the depth it was dealt. Per-sequence: `depths[j] ==
    ks[order[j]]`.
    """
    order = verify_batch_permutation(slots, ks, canonical)
    if canonical:
        return order, sorted(ks, reverse=True)
    return order, [ks[i] for i in order]


def verify_graph_key(
    pairs: Sequence[tuple[int, int]], wy_tables_null: bool, write_on_accept: bool
) -> tuple[int, ...]:
    """The batched-verify graph key: `(slot, rows)` pairs in dispatch order, then one sentinel.

    The sentinel `0xFFFFFFFF - wy_tables_null - 2 * write_on_accept` takes a distinct value for each
    of the four kernel variants, which capture different launches for the same pairs.
    """
    sentinel = _U32_MAX - int(wy_tables_null) - 2 * int(write_on_accept)
    return (*(v for pair in pairs for v in pair), sentinel)
