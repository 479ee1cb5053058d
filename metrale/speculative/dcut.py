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

Host-side Python (numpy for the canonical plan): a batch is at most a few hundred sequences.

T prices rows only; the controller drops a plan whose drafter's host work costs more than the
plan buys (`host_cost.drafting_loses`). Also here: the verify cost curve T (`VerifyCostModel`).
The per-sequence, per-position acceptance estimate the planner reads is
`estimator.AcceptanceEstimator`.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from metrale.speculative.verify_key import canonical_assignment, verify_batch_order

DEFAULT_KNEE_ROWS = 64.0
# (rows, width) points a cost model remembers (a bounded memo: a batch has a few hundred)
MEMO_POINTS = 1 << 16

# Relative margin a larger plan must win by: float noise in a sum must not buy a row.
_TIE = 1e-12


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), len >= 2; the last segment extends past the end."""
    i = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class VerifyCostModel:
    """Step time of a verify over `rows` rows and `width` sequences, as the ratio to a plain
    decode step (one row per sequence) of the same width.

    Only ratios at one width matter to the planner, because a plan never changes the width.

    Default, when nothing was measured: a step reads the weights once and then pays per row
    (attention over the cache, activations), t(M) = 1 + M / knee in weight-read units, so
    `ratio = (1 + M/knee) / (1 + B/knee)`. With knee = 64 rows this is within about 10% of the H200
    calibration in ARCHITECTURE.md at q = 4 rows per sequence (batch 1: 1.05 vs 1.15, 16: 1.60 vs
    1.53, 64: 2.50 vs 2.74) and over-estimates deep tables (batch 64, q = 16: 8.5 vs 4.9), which
    errs toward less speculation. The pure roofline `max(1, M/knee)` fits worse both ways (1.0 at
    batch 16 and 4.0 at batch 64), and being flat up to the knee it would call any depth free for
    small batches.

    Measured (`from_points` / `from_json`): per batch size, piecewise linear in q = M / B through
    the measured points and (q = 1, 1.0); a dip in q is raised to the running maximum (more rows
    never cost less; a dip is noise the planner would chase), and past the last q the last segment
    extends, so unmeasured depths never look free. Across batch sizes, linear between the two
    measured neighbours, clamped to the nearest outside the measured range.
    """

    def __init__(
        self,
        knee_rows: float = DEFAULT_KNEE_ROWS,
        measured: Mapping[tuple[int, float], float] | None = None,
        plain_seconds: Mapping[int, float] | None = None,
    ) -> None:
        if not knee_rows > 0:
            raise ValueError(f"knee_rows must be positive, got {knee_rows}")
        self.knee_rows = float(knee_rows)
        # Seconds of a plain decode step per batch size, when measured: what prices the host
        # work of drafting (`host_cost`) against the rows.
        plain = sorted((int(b), float(s)) for b, s in (plain_seconds or {}).items())
        if any(b < 1 or not (math.isfinite(s) and s > 0) for b, s in plain):
            raise ValueError(f"plain step seconds need batch >= 1 and seconds > 0: {plain}")
        self._plain = plain
        by_batch: dict[int, dict[float, float]] = {}
        for (b, q), r in (measured or {}).items():
            if b < 1 or not q >= 1 or not (math.isfinite(r) and r > 0):
                raise ValueError(
                    f"verify cost point (batch {b}, q {q}) = {r}: need b, q >= 1, r > 0"
                )
            by_batch.setdefault(int(b), {})[float(q)] = float(r)
        self._memo: dict[tuple[int, int], float] = {}
        self._batches: list[int] = sorted(by_batch)
        self._curves: list[tuple[list[float], list[float]]] = []
        for b in self._batches:
            pts = {1.0: 1.0, **by_batch[b]}
            if len(pts) < 2:
                raise ValueError(f"verify cost curve for batch {b} has no point with q > 1")
            qs = sorted(pts)
            ratios = [pts[q] for q in qs]
            for k in range(1, len(ratios)):
                ratios[k] = max(ratios[k], ratios[k - 1])
            self._curves.append((qs, ratios))

    @classmethod
    def from_points(
        cls,
        points: Mapping[tuple[int, float], float],
        plain_seconds: Mapping[int, float] | None = None,
    ) -> VerifyCostModel:
        """`{(batch_size, q): ratio}`: step time at q rows per sequence over that at q = 1;
        `plain_seconds`: `{batch_size: seconds}` of the plain step (q = 1), if known."""
        if not points:
            raise ValueError("a measured verify cost model needs at least one point")
        return cls(measured=points, plain_seconds=plain_seconds)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> VerifyCostModel:
        """The `metrale bench` verify cost curve:

        `{"batch_sizes": [1, 16, 64], "q": [1, 2, 4, 8], "ratio": [[1.0, 1.04, 1.15, null], ...]}`,
        `ratio[b][k]` for `batch_sizes[b]` at `q[k]`; `null` marks a point not measured; an
        optional `"plain_ms": [0.8, 1.1, 2.0]` gives the plain step's time per batch size.
        """
        try:
            batches, qs, table = doc["batch_sizes"], doc["q"], doc["ratio"]
        except KeyError as e:
            raise ValueError(f"verify cost curve JSON lacks {e.args[0]!r}") from None
        if len(table) != len(batches) or any(len(row) != len(qs) for row in table):
            raise ValueError(
                f"verify cost curve JSON: ratio must be {len(batches)} rows of {len(qs)} values"
            )
        points = {
            (int(b), float(q)): float(r)
            for b, row in zip(batches, table)
            for q, r in zip(qs, row)
            if r is not None
        }
        plain_ms = doc.get("plain_ms")
        if plain_ms is not None and len(plain_ms) != len(batches):
            raise ValueError(f"verify cost curve JSON: plain_ms must have {len(batches)} values")
        plain = None if plain_ms is None else {int(b): ms / 1e3 for b, ms in zip(batches, plain_ms)}
        return cls.from_points(points, plain)

    def plain_seconds(self, width: int) -> float | None:
        """Seconds of a plain step of `width` sequences (linear between measured batch sizes,
        the nearest outside them); None when none was measured."""
        if not self._plain:
            return None
        bs = [b for b, _ in self._plain]
        if len(bs) == 1 or width <= bs[0]:
            return self._plain[0][1]
        if width >= bs[-1]:
            return self._plain[-1][1]
        return _interp(bs, [s for _, s in self._plain], width)

    def step_time(self, rows: int, width: int) -> float:
        """Relative time of a verify of `rows` rows over `width` sequences (1.0 at one each)."""
        key = (rows, width)
        cached = self._memo.get(key)
        if cached is None:
            # The planner asks for the same few hundred points every step: compute each once.
            if len(self._memo) >= MEMO_POINTS:
                self._memo.clear()
            cached = self._memo[key] = self._step_time(rows, width)
        return cached

    def step_times(self, width: int, count: int) -> tuple[float, ...]:
        """Relative times of verifies of `width` sequences and width + r rows, r = 0 ..
        count - 1 (the planner prices every r of a batch at once; kept per width and count)."""
        key = (-width, count)  # beside the (rows, width) points, never equal to one
        table = self._memo.get(key)
        if table is None:
            if len(self._memo) >= MEMO_POINTS:
                self._memo.clear()
            table = self._memo[key] = tuple(self.step_time(width + r, width) for r in range(count))
        return table

    def _step_time(self, rows: int, width: int) -> float:
        if width < 1 or rows < width:
            raise ValueError(
                f"a verify of {width} sequences has at least that many rows, not {rows}"
            )
        if not self._batches:
            return (1.0 + rows / self.knee_rows) / (1.0 + width / self.knee_rows)
        q, batches = rows / width, self._batches
        if width <= batches[0]:
            return _interp(*self._curves[0], q)
        if width >= batches[-1]:
            return _interp(*self._curves[-1], q)
        i = bisect.bisect_left(batches, width)  # batches[i - 1] < width <= batches[i]
        t = (width - batches[i - 1]) / (batches[i] - batches[i - 1])
        return (1 - t) * _interp(*self._curves[i - 1], q) + t * _interp(*self._curves[i], q)


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
    counts padding as never accepted; `rows = sum(depths) + len(depths)` prices it.
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
) -> list[int]:
    """Depth per input (batch order, before dispatch ordering) maximising E / T.

    Up to `width_cap` sequences each has its own depth; with `canonical` they must not rise
    along ascending slots (see `_monotone_depths`). Above `width_cap`: one depth for all, up to
    the largest `max_depth` (shorter drafts are padded), the best of those.

    `max_rows` bounds the table (the widest the verify programs admit). A batch of more than
    `max_rows` sequences gets all zeros: that is a plain decode, which no verify table carries.
    """
    gains = [_gains(x) for x in inputs]
    return _choose(gains, [x.slot for x in inputs], cost, width_cap, max_rows, canonical)


def _choose(
    gains: list[list[float]],
    slots: list[int],
    cost: VerifyCostModel,
    width_cap: int,
    max_rows: int | None,
    canonical: bool,
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
        top = min(max(len(g) for g in gains), spare // n)
        extra = [-math.inf] * (n * top + 1)
        extra[0] = total = 0.0
        for d in range(1, top + 1):  # level d adds the d-th gain of each that drafted so deep
            total += sum(g[d - 1] for g in gains if len(g) >= d)
            extra[n * d] = total
        return [_best_extra_rows(extra, n, cost) // n] * n
    if canonical:
        return _monotone_depths(gains, sorted(range(n), key=slots.__getitem__), cost, spare)
    return _free_depths(gains, cost, spare)


def plan(
    inputs: Sequence[PlanInput],
    cost: VerifyCostModel,
    width_cap: int,
    max_rows: int | None = None,
) -> Plan:
    """Depths for one verify batch, in the dispatch order and arm `verify_key` gives its width.

    Under the canonical arm the depths are planned for that arm's deal (non-increasing along
    ascending slots), so the deal leaves each sequence the depth planned for it.
    """
    canonical = canonical_assignment(len(inputs))
    gains = [_gains(x) for x in inputs]  # once: the choice and the expected tokens read them
    slots = [x.slot for x in inputs]
    depths = _choose(gains, slots, cost, width_cap, max_rows, canonical)
    order, dealt = verify_batch_order(slots, depths, canonical)
    # E(d) = 1 + the first d gains; a padded row (past max_depth) has none
    expected = sum(1.0 + sum(gains[i][:d]) for i, d in zip(order, dealt))
    return Plan(order=order, depths=dealt, expected_tokens=expected, rows=sum(dealt) + len(dealt))
