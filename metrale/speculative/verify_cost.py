"""The verify cost curve D-Cut plans with: the time of a verify step over M rows and B sequences,
as the ratio to a plain decode step of the same width (`VerifyCostModel`).

Measured at start-up on the device (`engine/calibrate.py`: T(q) / T(1) per batch size) or by
`metrale bench` (its JSON's `verify_cost`); without a measurement, a default that reads the weights
once and pays per row.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_KNEE_ROWS = 64.0
# (rows, width) points a cost model remembers (a bounded memo: a batch has a few hundred)
MEMO_POINTS = 1 << 16


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
