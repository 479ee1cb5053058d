"""D-Cut's acceptance estimates: per sequence and draft position, how often a draft matched the
target (an EMA with a bounded memory), optionally starting new sequences from the engine-wide rate.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence

MIN_RATE = 1e-4  # the slowest EMA rate: 10,001 weights (`_weights`)


def _weights(rate: float) -> list[float]:
    """The n-th observation's weight, n = 0 .. the count where it reaches `rate`."""
    return [max(rate, 1.0 / (n + 1)) for n in range(math.ceil(1.0 / rate) + 1)]


def _update(stats: tuple[list[float], list[int]], seen: list[float], weights: list[float]) -> None:
    """Move each position's estimate toward what was seen there, by its observation's weight."""
    est, count, cap = stats[0], stats[1], len(weights) - 1
    for j, x in enumerate(seen):
        c = count[j]
        if c < cap:
            count[j] = c = c + 1
        est[j] += weights[c] * (x - est[j])


def _prob(a: float) -> float:
    """A probability from an estimate; NaN (a broken drafter's confidence) counts as never."""
    return min(float(a), 1.0) if a > 0.0 else 0.0


class AcceptanceEstimator:
    """Per sequence, per draft position j: an EMA of whether draft j matched the target, given
    that drafts 1..j-1 did (the planner's a_{i,j}, which it multiplies along the drafts).

    The engine records the match of every verified position, even past the first miss (its
    telemetry does), but a position past the first miss is not an observation of a_j: drafts
    that match in runs (an n-gram's continuation holds or it does not) have marginal rates well
    below their conditional ones, and their product underestimated the tokens a draft buys.
    A sequence never observed reads `prior`; one observed but never verified as deep as position
    j reads position j - 1's estimate there. Early on the prior counts as one observation and the
    estimate is a plain mean (weight 1/(n+1) for the n-th), until that weight falls to `rate`, so a
    new sequence leaves the prior in a few steps instead of 1/rate.

    Memory is bounded: `max_positions` per sequence (deeper positions read the deepest tracked
    one), and at most `max_sequences` sequences, the least recently observed evicted first, so a
    sequence that ended without `forget` cannot make it grow.

    With `pooled_prior`, a sequence never observed reads instead an EMA over every observation
    of every sequence (`prior` until the first), at the slower `pool_rate`: new requests start
    from what the drafter has been achieving, so an engine whose drafts all miss does not spend
    each new request's first steps re-learning that; over about 1/`pool_rate` observations, so
    that the last few verifies of a closed batch's slowest sequences do not set where the next
    batch starts.

    Why `rate` is 0.3: a sequence's acceptance rises as it generates (greedy code on the shipped
    model, closed batches of 8, first draft: 0.54 -> 0.73 -> 0.87 over observations 0-5 / 6-11
    / 12-17 with n-gram; 0.64 -> 0.87 with MTP; 0.78 -> 0.96 with DFlash), and an EMA lags a
    rising rate. At 0.2 (the pool at 0.2 too) the estimates expected 1/1.21, 1/1.13 and 1/1.14
    of the drafts accepted (n-gram, DFlash, MTP), so D-Cut cut short and its host-cost gate
    dropped plans that were winning; with each sequence's verdicts shuffled, within 1-6%. At
    0.3 with the pool at 0.02: 1/1.10, 1/1.08, 1/1.07, with the first draft's Brier score
    better for n-gram and DFlash, 1.4% worse for MTP; faster rates cut the lag further but
    predicted each draft worse (`benchmarks/acceptance_calibration.py`).
    """

    def __init__(
        self,
        max_positions: int = 8,
        prior: float = 0.5,
        rate: float = 0.3,
        max_sequences: int = 4096,
        pooled_prior: bool = False,
        pool_rate: float = 0.02,
    ) -> None:
        if max_positions < 1 or max_sequences < 1:
            raise ValueError("max_positions and max_sequences must be at least 1")
        for name, value in (("rate", rate), ("pool_rate", pool_rate)):
            # (1/rate weights are kept: a rate near 0 would ask for millions of them)
            if not MIN_RATE <= value <= 1.0:
                raise ValueError(f"{name} must be in [{MIN_RATE}, 1], got {value!r}")
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior must be in [0, 1], got {prior!r}")
        self.max_positions = max_positions
        self.prior = prior
        self.rate = rate
        self.pool_rate = pool_rate
        self.max_sequences = max_sequences
        # the n-th observation's weight: 1 / (n + 1) (the prior counts as one), at least the rate;
        # counts stop where it reaches the rate: beyond it they change nothing
        self._weights = _weights(rate)
        self._pool_weights = _weights(pool_rate)
        self._seqs: OrderedDict[Hashable, tuple[list[float], list[int]]] = OrderedDict()
        self._pooled = ([prior] * max_positions, [0] * max_positions) if pooled_prior else None
        # `observe_many` calls not applied yet (`defer`), in order
        self._deferred: list[list[tuple[Hashable, Sequence[bool]]]] = []

    def __len__(self) -> int:
        self.flush()
        return len(self._seqs)

    @property
    def pending(self) -> bool:
        """Whether observations wait to be applied (`defer`)."""
        return bool(self._deferred)

    def defer(self, verifies: list[tuple[Hashable, Sequence[bool]]]) -> None:
        """`observe_many(verifies)`, applied later: at `flush`, or first thing when the estimates
        are next read or changed, so every read sees what it would have seen at once. A held
        verify's verdicts are learned as soon as they are read (`Observing.learn_held`), on
        the step's critical path; most steps reuse their plan and read no estimate before the
        next forward, in whose overlap window the engine flushes them."""
        if verifies:
            self._deferred.append(verifies)

    def flush(self) -> None:
        """Apply the deferred observations (`defer`), in order."""
        while self._deferred:
            self._observe(self._deferred.pop(0))

    def observe(self, seq_id: Hashable, matches: Sequence[bool]) -> None:
        """Record one verify of `seq_id`: `matches[j]` is whether draft j + 1 matched (the
        positions after the first miss are not observations of a_j)."""
        self.observe_many([(seq_id, matches)])

    def observe_many(self, verifies: list[tuple[Hashable, Sequence[bool]]]) -> None:
        """`observe` for each (seq_id, matches) in turn.

        NOTE: one call a step for every verified sequence: a few microseconds each is a
        measurable share of a batch-64 step on a small model."""
        self.flush()
        self._observe(verifies)

    def _observe(self, verifies: list[tuple[Hashable, Sequence[bool]]]) -> None:
        seqs, pooled, depth = self._seqs, self._pooled, self.max_positions
        weights, pool_weights = self._weights, self._pool_weights
        for seq_id, matches in verifies:
            if not matches:
                continue  # nothing verified: no observation (a new sequence keeps the pool)
            seen = []
            for matched in matches[:depth]:
                seen.append(1.0 if matched else 0.0)
                if not matched:
                    break
            stats = seqs.get(seq_id)
            if stats is None:
                start = [self.prior] * depth
                if pooled is not None and pooled[1][0] > 0:
                    start = list(pooled[0])  # a new sequence starts where the pool stands
                stats = (start, [0] * depth)
                while len(seqs) >= self.max_sequences:
                    seqs.popitem(last=False)
                seqs[seq_id] = stats
            else:
                seqs.move_to_end(seq_id)
            _update(stats, seen, weights)
            if pooled is not None:
                _update(pooled, seen, pool_weights)

    def estimate(
        self, seq_id: Hashable, depth: int, probs: Sequence[float] | None = None
    ) -> list[float]:
        """a_{j+1} for j < depth; `probs[j]` (the drafter's confidence in draft j + 1, this step)
        replaces the EMA where given."""
        self.flush()
        stats = self._seqs.get(seq_id)
        if stats is None and self._pooled is not None and self._pooled[1][0] > 0:
            stats = self._pooled
        out = []
        for j in range(depth):
            if probs is not None and j < len(probs):
                out.append(_prob(probs[j]))
                continue
            pos = min(j, self.max_positions - 1)
            if stats is not None and stats[1][pos] > 0:
                out.append(stats[0][pos])
            elif stats is not None and j > 0:
                # Never verified this deep: assume the previous position's rate, so a sequence
                # whose first drafts land gets deeper (the prior would pin it shallow forever).
                out.append(out[-1])
            else:
                out.append(self.prior)
        return out

    def forget(self, seq_id: Hashable) -> None:
        """Drop a finished (or aborted) sequence; unknown ids are fine."""
        self.flush()
        self._seqs.pop(seq_id, None)
