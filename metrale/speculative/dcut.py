"""D-Cut: how many of its drafts each sequence of one verify batch verifies.

Step 3 of the engine loop. The scheduler gives each sequence's state slot, how many drafts it has
and the estimated acceptance of each; D-Cut picks depths `d_i` (0 = plain decode, the sequence
contributes `d_i + 1` rows) that maximise expected emitted tokens per unit of verify time,

    sum_i E_i(d_i) / T(M = sum_i (d_i + 1), B = n),   E_i(d) = 1 + sum_{j<=d} prod_{m<=j} a_{i,m},

then hands them to `verify_key.verify_batch_order`, so the plan and the dispatch use one order and
one arm. Under the canonical arm, which deals the depth multiset deepest first along ascending
slots, D-Cut plans only depths that never rise along ascending slots, so the deal hands every
sequence its own planned depth. Dealing freely planned depths instead (the reference system's way)
gives deep depths to whichever sequences hold low slots: in the simulated trace of
`benchmarks/canonical_key_trace.py` that cost about 7% of expected tokens, against about 2% when
planned for the deal, which also cut distinct graph keys by about half rather than a fifth.
The arm matters only to row-table programs (keyed by the depth mix); where the target's programs
take any mix (ragged programs, keyed by rows and sequences; none on the CPU), `plan` gives each
sequence its own best depth under any arm (`any_depths`).

Host-side Python (numpy for the canonical plan): a batch is at most a few hundred sequences.

T prices rows only; the controller drops a plan whose drafter's host work costs more than the
plan buys (`host_cost.drafting_loses`). The verify cost curve T is `verify_cost.VerifyCostModel`.
The per-sequence, per-position acceptance estimate the planner reads is
`estimator.AcceptanceEstimator`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from metrale.speculative.verify_cost import VerifyCostModel
from metrale.speculative.verify_key import canonical_assignment, verify_batch_order

# Relative margin a larger plan must win by: float noise in a sum must not buy a row.
_TIE = 1e-12


@dataclass(frozen=True)
class PlanInput:
    """One sequence of the batch: its state slot, drafts available, and `accept[j]` = a for draft
    j + 1 (probability it matches given drafts 1..j did); `len(accept) >= max_depth`."""

    slot: int
    max_depth: int
    accept: Sequence[float]


@dataclass(frozen=True)
class Plan:
    """The batch in dispatch order: `inputs[order[p]]` verifies `depths[p]` drafts.

    `depths[p]` can exceed that sequence's `max_depth`: under the canonical arm, when padding a
    low slot lets deeper sequences after it go deep, and above the width cap, where one depth
    stands for all: the caller pads its drafts to the depth (rows are rows to the kernel) or,
    where the programs take any mix of depths, verifies what it drafted. `expected_tokens`
    counts padding as never accepted; `rows` prices it (`sum(depths) + len(depths)`), but
    with `any_depths` only the rows that run: each sequence's depth capped at its `max_depth`.
    """

    order: list[int]
    depths: list[int]
    expected_tokens: float
    rows: int


def _gains(inp: PlanInput) -> list[float]:
    """g_j = prod_{m<=j} a_m for j = 1..max_depth: what draft j adds to the expected tokens."""
    if inp.max_depth < 0 or len(inp.accept) < inp.max_depth:
        raise ValueError(
            f"slot {inp.slot}: max_depth {inp.max_depth} needs that many acceptance estimates, "
            f"got {len(inp.accept)}"
        )
    out, g = [], 1.0
    for a in inp.accept[: inp.max_depth]:
        # a probability (NaN, a broken drafter's confidence, counts as never); inline: this
        # runs for every draft of every plan
        a = float(a)
        g *= (a if a < 1.0 else 1.0) if a > 0.0 else 0.0
        out.append(g)
    return out


def expected_tokens(inp: PlanInput, depth: int) -> float:
    """E(depth) = 1 + sum_{j<=depth} g_j; positions past `max_depth` are padding, never accepted."""
    return 1.0 + sum(_gains(inp)[:depth])


def _best_extra_rows(extra_tokens: Sequence[float], n: int, cost: VerifyCostModel) -> int:
    """The r maximising (n + extra_tokens[r]) / T(n + r), the fewest rows on a tie; r = 0 is
    all plain decode and always a candidate. -inf marks an r no plan reaches.

    NOTE: plain Python, not numpy: a few dozen values, priced at most steps of a small batch,
    where numpy's per-call overhead was most of the plan's time on the host."""
    times = cost.step_times(n, len(extra_tokens))
    value = [(n + e) / t for e, t in zip(extra_tokens, times, strict=True)]
    # the first r within float noise of the best: noise in a sum must not buy a row
    bar = max(value)
    return next(r for r, v in enumerate(value) if v * (1.0 + _TIE) >= bar)


def _free_depths(gains: list[list[float]], cost: VerifyCostModel, spare: int) -> list[int]:
    """Greedy fill. Each g_j is non-increasing in j, so the r largest gains (ties by sequence,
    then position) form a prefix of every sequence and are the most tokens r rows can buy;
    scanning every r is then the exact optimum for any cost curve, convex or not."""
    ranked = sorted(
        ((g, i, j) for i, gs in enumerate(gains) for j, g in enumerate(gs) if g > 0.0),
        key=lambda c: (-c[0], c[1], c[2]),
    )[:spare]
    extra = [0.0, *itertools.accumulate(g for g, _, _ in ranked)]
    depths = [0] * len(gains)
    for _, i, _ in ranked[: _best_extra_rows(extra, len(gains), cost)]:
        depths[i] += 1
    return depths


def _monotone_depths(
    gains: list[list[float]], order: list[int], cost: VerifyCostModel, spare: int
) -> list[int]:
    """The best depths that never rise along `order` (ascending slots, the canonical dispatch),
    so that the canonical deal hands every sequence the depth planned for it.

    Such depths are fixed by how many sequences reach each level d (the first n_d in order, with
    n_1 >= n_2 >= ... >= n_k): level d adds the d-th gains of those n_d, and n_d rows. Exact, by
    dynamic programming over the levels (k of them, a few numpy operations each, rather than
    some per sequence): best[m, r] is the most tokens levels 1..d can add with r draft rows, the
    first m in order reaching level d; level d + 1 takes any m' <= m. A sequence may be planned
    deeper than its own drafts (padding, no tokens) when that opens the way for deeper
    sequences after it.
    """
    n, k = len(gains), max(len(g) for g in gains)
    # g[p, d]: what the p-th in order adds at level d + 1 (0: padding)
    g = np.array([gains[i] + [0.0] * (k - len(gains[i])) for i in order]).reshape(n, k)
    # tokens[d, m]: level d + 1's tokens when the first m in order reach it
    tokens = np.zeros((k, n + 1))
    tokens[:, 1:] = np.cumsum(g, axis=0).T
    m = np.arange(n + 1)[:, None]
    rest = np.arange(spare + 1)[None, :] - m  # rows left to the levels before, r - m
    valid = rest >= 0
    rest = np.where(valid, rest, 0)
    best = np.where(rest == 0, tokens[0][:, None], -np.inf)
    best[~valid] = -np.inf
    levels = [best]
    for d in range(1, k):
        # the best of the levels before with at least m reaching the last one: a running max
        # from the most down
        reach = np.maximum.accumulate(best[::-1], axis=0)[::-1]
        best = np.where(valid, reach[m, rest] + tokens[d][:, None], -np.inf)
        levels.append(best)
    # the most tokens at r rows (the deepest level's m = 0 holds the plans that stop earlier)
    r = _best_extra_rows(best.max(axis=0).tolist(), n, cost)
    counts, low = [0] * k, 0  # n_d of the plan, walked back from the deepest level
    for d in range(k - 1, -1, -1):
        counts[d] = low = low + int(levels[d][low:, r].argmax())
        r -= low
    depths = [0] * n
    for p, i in enumerate(order):
        depths[i] = sum(1 for c in counts if c > p)
    return depths


def choose_depths(
    inputs: Sequence[PlanInput],
    cost: VerifyCostModel,
    width_cap: int,
    max_rows: int | None = None,
    canonical: bool = False,
    any_depths: bool = False,
) -> list[int]:
    """Depth per input (batch order, before dispatch ordering) maximising E / T.

    Up to `width_cap` sequences each has its own depth; with `canonical` they must not rise
    along ascending slots (see `_monotone_depths`). Above `width_cap`: one depth for all, up to
    the largest `max_depth`, the best of those: shorter drafts are padded to it, or, with
    `any_depths` (programs that take any mix of depths), verify what they drafted, and only
    those rows are priced.

    `max_rows` bounds the table (the widest the verify programs admit). A batch of more than
    `max_rows` sequences gets all zeros: that is a plain decode, which no verify table carries.
    """
    gains = [_gains(x) for x in inputs]
    slots = [x.slot for x in inputs]
    return _choose(gains, slots, cost, width_cap, max_rows, canonical, any_depths)


def _choose(
    gains: list[list[float]],
    slots: list[int],
    cost: VerifyCostModel,
    width_cap: int,
    max_rows: int | None,
    canonical: bool,
    any_depths: bool = False,
) -> list[int]:
    """`choose_depths` from each input's gains (`plan` reuses them for its expected tokens)."""
    n = len(gains)
    if width_cap < 0:
        raise ValueError(f"width_cap must be >= 0, got {width_cap}")
    # Draft rows the table has room for (padding included).
    spare = n * max((len(g) for g in gains), default=0)
    if max_rows is not None:
        spare = min(spare, max_rows - n)
    if spare <= 0:
        return [0] * n
    if n > width_cap:
        # One depth d for all, up to the deepest drafts: a sequence with fewer drafts than d
        # verifies d rows all the same (padded, `draft_shapes.pad_draft`: rows bought, no
        # tokens), or fewer where its cap stops it (a dear row the price counts anyway). Not up
        # to the shallowest: in a stream of requests some sequence is always a token or two
        # from its `max_tokens`, or an n-gram drafts one token, and that one pinned the whole
        # batch at its depth: 4 requests a slot through 64 slots at a forced alpha of 0.8 (the
        # H100's qwen3-8b verify cost curve) verified 2,873 of 4,168 times at depth 1, where a
        # closed batch verified 521 of 841 at depth 3 (and the H100 measured an acceptance
        # length of 2.00 against 2.64).
        # With `any_depths` a sequence verifies at most what it drafted (`planning._cut`):
        # level d then costs only the rows of those that drafted so deep (priced at n rows a
        # level, a batch of short n-gram drafts looked dearer than it is and went shallower)
        deep = max(len(g) for g in gains)
        level_rows = [0]
        for d in range(1, deep + 1):
            level_rows.append(
                level_rows[-1] + (sum(len(g) >= d for g in gains) if any_depths else n)
            )
        top = max(d for d in range(deep + 1) if level_rows[d] <= spare)
        extra = [-math.inf] * (level_rows[top] + 1)
        extra[0] = total = 0.0
        for d in range(1, top + 1):  # level d adds the d-th gain of each that drafted so deep
            total += sum(g[d - 1] for g in gains if len(g) >= d)
            extra[level_rows[d]] = total
        return [level_rows.index(_best_extra_rows(extra, n, cost))] * n
    if canonical:
        return _monotone_depths(gains, sorted(range(n), key=slots.__getitem__), cost, spare)
    return _free_depths(gains, cost, spare)


def plan(
    inputs: Sequence[PlanInput],
    cost: VerifyCostModel,
    width_cap: int,
    max_rows: int | None = None,
    any_depths: bool = False,
) -> Plan:
    """Depths for one verify batch, in the dispatch order and arm `verify_key` gives its width.

    Under the canonical arm the depths are planned for that arm's deal (non-increasing along
    ascending slots), so the deal leaves each sequence the depth planned for it. `any_depths`:
    the target's programs take any mix of depths (ragged programs, keyed by rows and sequences
    alone, or none), so the canonical arm, which exists to keep row-table keys few, buys
    nothing there: each sequence gets its own best depth (the exact greedy fill, 3-4x cheaper
    on the host than the canonical plan), verifies no more than its `max_depth`
    (`planning._cut`), and `rows` counts those rows.
    """
    canonical = canonical_assignment(len(inputs), any_depths)
    gains = [_gains(x) for x in inputs]  # once: the choice and the expected tokens read them
    slots = [x.slot for x in inputs]
    depths = _choose(gains, slots, cost, width_cap, max_rows, canonical, any_depths)
    order, dealt = verify_batch_order(slots, depths, canonical)
    # E(d) = 1 + the first d gains; a padded row (past max_depth) has none
    expected = sum(1.0 + sum(gains[i][:d]) for i, d in zip(order, dealt))
    if any_depths:
        rows = sum(min(d, len(gains[i])) for i, d in zip(order, dealt)) + len(dealt)
    else:
        rows = sum(dealt) + len(dealt)
    return Plan(order=order, depths=dealt, expected_tokens=expected, rows=rows)
