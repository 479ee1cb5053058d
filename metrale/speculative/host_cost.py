"""What drafting costs a step beyond its verify rows, measured as the engine runs, and D-Cut's
gate on it.

The verify cost curve (`verify_cost.VerifyCostModel`) prices rows: what the forward pays for them. A
speculative step also pays host work a plain step does not: the drafter's `propose`, D-Cut's cut,
the verdict bookkeeping and, for a drafter that keeps no state, its `observe`. On a small model at
a large batch that work costs more than the tokens it buys (the shipped model with n-gram at
batch 64 on the H200: about 2.5 ms of it against a 1.7 ms step). `HostCost` measures those seconds
per number of sequences drafted; `drafting_loses` compares a plan's tokens per unit of time, host
work included, with plain decoding's, and the controller then decodes plainly.

The plain step the gate compares with is the engine's whole step (its scheduling, emission and
bookkeeping beside the forward), as measured on the engine's own plain decode steps
(`HostCost.plain`): the start-up calibration times the forward alone, and on a small model the
rest is most of a step (the shipped model at batch 8 on the H200: 0.58 ms a step, 0.44 ms of it
the forward), so pricing the drafter's host work in forward-steps overstated it.

Parts can miss what a verify step costs: its own metadata and verdicts, its commit, a
calibration made at another context, and in the asynchronous engine the wait for the step in
flight that drafting settles (the qwen3-8b shape at batch 64 with async scheduling on the H200:
verify steps of about 12 ms against 7 priced, so D-Cut speculated at 0.77x plain). So verify
steps are also timed whole (`HostCost.speculative`), and once a width and a number drafted have
been measured, that prices the plan instead, against the plain step as measured.

Whole steps are measured at one width and priced at another (a bucket spans a factor of two, and
a closed batch narrows through every width): a sample is kept over the calibrated forward at its
width, and priced at a width by the forward there (`HostCost.shape`), not per sequence. A step of
a small model is mostly fixed host work: per sequence, plain steps measured at batch 33 priced
a plain step at batch 59 at 3.5 ms where it took 2.7 (the shipped model on the H200), and verify
steps measured elsewhere in their bucket priced theirs apart from it, so the gate dropped plans
that won by 25% in the steps before and after.

The gate is all or nothing on the plan D-Cut makes from rows alone: a plan cut down to fewer
sequences would be a new verify shape, and a batch flipping between half-drafted plans paid more
than either (measured: n-gram at batch 8 fell from 1.02x to 0.80x when D-Cut priced the host work
per sequence inside its search).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable

from metrale.engine.program_cache import captures
from metrale.speculative.dcut import Plan
from metrale.speculative.verify_cost import VerifyCostModel

# A plan is dropped only when it loses to plain decoding by more than this: near break-even the
# estimates cannot tell, and flipping costs more than either choice.
GATE_MARGIN = 0.05
# Samples before a bucket has an estimate.
WARMUP_SAMPLES = 3
# Samples a bucket's estimate is the median of (the newest). A median, not a running mean: a
# step can cost several times its kind for reasons that are no price of it (the last step of a
# wave of requests finishing them: 11.7 ms against 2.3 ms for the shipped model at batch 64 on
# the H200; a collection; the first step after a prefill), and one such step in an EMA (rate
# 0.2) moved the plain step's estimate from 2.3 to 4.2 ms, so D-Cut judged drafting against a
# plain step 80% too dear and speculated where it lost (n-gram, batch 64: 0.78x).
WINDOW = 9


class Window:
    """The median of the last `WINDOW` samples of one bucket, once it has `WARMUP_SAMPLES`,
    and the step of the newest."""

    __slots__ = ("samples", "at", "count", "_median")

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=WINDOW)
        self.at = self.count = 0  # the step and the number of sequences of the newest sample
        self._median: float | None = None

    def add(self, sample: float, step: int, count: int) -> None:
        self.samples.append(sample)
        self.at, self.count, self._median = step, count, None

    @property
    def value(self) -> float | None:
        if len(self.samples) < WARMUP_SAMPLES:
            return None
        if self._median is None:
            self._median = statistics.median(self.samples)
        return self._median


def count_bucket(k: int) -> int:
    """The bucket of `k` sequences: 1, 2-3, 4-7, ... (k's bit length)."""
    return k.bit_length()


class HostCost:
    """Host seconds per drafted sequence, per bucket of the number drafted (powers of two), the
    median of its newest samples (`Window`).

    A sample is a drafting step that follows a drafting step: the first one after steps that
    drafted nothing also catches up on what they emitted (a probe extends the n-gram index by
    several steps' tokens), which a drafter drafting every step pays in slices. A bucket with no
    sample for `stale_after` steps is forgotten, so D-Cut drafts by rows alone and measures it
    again: an estimate that once said "too dear" is not believed forever. A step during which a
    program was captured (a drafter's or the target's, tens of milliseconds) is no sample of
    either kind.
    """

    def __init__(
        self,
        enabled: bool,
        stale_after: int = 256,
        forward: Callable[[int], float | None] | None = None,
    ) -> None:
        """`forward`: the calibrated plain forward's seconds at a width (None where not
        calibrated), which `shape` scales whole steps by."""
        self.enabled = enabled
        self.stale_after = stale_after
        self._forward = forward
        self._step = 0
        # bucket -> seconds per sequence drafted
        self._buckets: dict[int, Window] = {}
        self._last = (0, 0.0)  # (sequences drafted, seconds) of the step in flight
        # bucket -> a whole plain decode step's seconds over its `shape` (`plain`)
        self._plain: dict[int, Window] = {}
        # the same of its host work alone (the asynchronous engine's, whose plain steps hide it
        # behind the device: `plain`'s `host`)
        self._exposed: dict[int, Window] = {}
        # (width bucket, drafted bucket) -> a whole verify step's seconds over its `shape` and
        # its rows' relative cost (`speculative`)
        self._verify: dict[tuple[int, int], Window] = {}
        self._drafted_before = False
        self._captures = captures()  # programs captured before the step in flight

    def begin(self) -> bool:
        """A step starts: record the one before it. True when an estimate just went stale (the
        controller then plans afresh)."""
        self._step += 1
        drafted, spent = self._last
        steady, self._captures = self._captures == captures(), captures()
        if self.enabled and drafted > 0 and self._drafted_before and spent > 0.0 and steady:
            self._sample(self._buckets, count_bucket(drafted), spent / drafted, drafted)
        self._drafted_before, self._last = drafted > 0, (0, 0.0)
        stale = False
        for buckets in (self._buckets, self._verify):
            old = [b for b, w in buckets.items() if self._step - w.at > self.stale_after]
            for b in old:
                del buckets[b]
            stale = stale or bool(old)
        return stale

    @property
    def drafting_seconds(self) -> float:
        """The host seconds of drafting in the step in flight so far (`spent`)."""
        return self._last[1]

    @property
    def captured(self) -> bool:
        """Whether a program was captured during the step in flight (its time is no price)."""
        return self._captures != captures()

    def spent(self, seconds: float, drafted: int | None = None) -> None:
        """Add host seconds to the step in flight (and, from `prepare`, how many it drafted)."""
        k, s = self._last
        self._last = (k if drafted is None else drafted, s + seconds)

    def shape(self, width: int) -> float:
        """How a whole step's seconds grow with its width: the calibrated forward's seconds
        there, else the width itself (per sequence, where nothing was calibrated). On a model
        whose step is mostly fixed host work the forward barely grows with the width, and
        neither does the step; on a large one the forward is most of the step."""
        forward = self._forward(width) if self._forward is not None and width > 0 else None
        return forward if forward else float(width)

    def _sample(self, buckets: dict, key, per_seq: float, count: int) -> None:
        window = buckets.get(key)
        if window is None:
            window = buckets[key] = Window()
        window.add(per_seq, self._step, count)

    def plain(self, width: int, seconds: float, host: float | None = None) -> None:
        """A plain decode step of `width` sequences took `seconds`, start to end (since the
        `begin` of this step); `host`: the seconds of it the host worked rather than waited for
        the device, where a plain step hides its host work behind the device's (the
        asynchronous engine), and a synchronous verify step would not."""
        if not self.enabled or width <= 0 or self.captured:
            return
        shape = self.shape(width)
        self._sample(self._plain, count_bucket(width), seconds / shape, width)
        if host is not None:
            self._sample(self._exposed, count_bucket(width), host / shape, width)

    def speculative(self, width: int, drafted: int, seconds: float, relative: float) -> None:
        """A verify step of `width` sequences, `drafted` of them planned to draft, took
        `seconds` start to end: everything a drafting step costs (the drafter, planning, the
        verify's metadata and verdicts, the commit, and in the asynchronous engine the wait
        for the step in flight). `relative`: its rows' time on the verify cost curve (1.0: one
        row a sequence), so that `verify_seconds` can price a plan of other depths."""
        if not self.enabled or width <= 0 or drafted <= 0 or self.captured:
            return
        key = (count_bucket(width), count_bucket(drafted))
        self._sample(self._verify, key, seconds / max(relative, 1.0) / self.shape(width), width)

    def verify_seconds(self, width: int, drafted: int) -> float | None:
        """A whole verify step of `width` sequences, `drafted` planned to draft, as measured at
        about that many, scaled to one row a sequence (times a plan's relative row cost: its
        step); None until then."""
        return self._shaped(self._verify, (count_bucket(width), count_bucket(drafted)), width)

    def plain_seconds(self, width: int) -> float | None:
        """A whole plain decode step of `width` sequences, as measured; None until then."""
        return self._shaped(self._plain, count_bucket(width), width)

    def plain_near(self, width: int, cost: VerifyCostModel) -> float | None:
        """A whole plain step of `width` sequences from the nearest width whose plain steps were
        measured, scaled by the calibrated forward between the two widths; None without either.
        A closed batch's tail runs at widths no plain step ran at, and the calibrated forward
        alone (timed at a 1k context) priced its plain steps at 6.5 ms where they took 5.0 ms
        (the qwen3-8b shape, async, on the H200): D-Cut verified where it lost."""
        forward = cost.plain_seconds(width) if width > 0 else None
        measured = [w for w in self._plain.values() if w.value is not None]
        if not self.enabled or forward is None or not measured:
            return None
        near = min(measured, key=lambda w: abs(math.log2(w.count / width)))
        ref = cost.plain_seconds(near.count)
        # (`near.value` is over the `shape` of its own width: back to seconds there first)
        return None if not ref else near.value * self.shape(near.count) * forward / ref

    def hidden_seconds(self, width: int) -> float | None:
        """The host work of a plain step of `width` sequences that the asynchronous engine
        hides behind the device, as measured; None until then, and in the synchronous engine."""
        return self._shaped(self._exposed, count_bucket(width), width)

    def seconds(self, drafted: int) -> float | None:
        """Host seconds that drafting `drafted` sequences adds to a step; None until measured
        at about that many (or when pricing is off)."""
        if drafted <= 0:
            return 0.0
        return self._per_seq(self._buckets, count_bucket(drafted), drafted)

    def _per_seq(self, buckets: dict, key, count: int) -> float | None:
        value = self._value(buckets, key)
        return None if value is None else count * value

    def _shaped(self, buckets: dict, key, width: int) -> float | None:
        value = self._value(buckets, key)
        return None if value is None else self.shape(width) * value

    def _value(self, buckets: dict, key) -> float | None:
        window = buckets.get(key)
        return None if window is None or not self.enabled else window.value


def drafting_loses(plan: Plan, cost: VerifyCostModel, host: HostCost, reopen: bool = False) -> bool:
    """Whether `plan` (from rows alone) emits fewer tokens per second than plain decoding, by
    more than `GATE_MARGIN`, once the drafter's host work is paid; with `reopen` (the last plan
    was dropped) whether it fails to win outright. False while the plain step's forward seconds
    are unknown, or both the verify steps and the host work at this many drafted sequences are.

    The two bars keep a gate near break-even from flipping every few steps: each reopening pays
    a transition no sample prices (the first verify after plain steps catches up on them and,
    with async scheduling, drains the pipeline). On the H200 (the qwen3-8b shape, async, batch
    64, alpha 0.5: verify steps at 0.92-0.96x plain) the gate flipped on plans of 117 and 119
    expected tokens, and every probe's plan reopened it for a few steps.

    Once verify steps of about this width and this many drafted have run, the plan's step is
    what they took, scaled by the verify cost curve from their rows to the plan's
    (`verify_seconds`), against the engine's whole plain step P as measured (at this width,
    else at the nearest width measured, `plain_near`; else F, the calibrated forward): the
    engine's own step times, whatever the calibration's error at the
    running context (calibrated at 1k tokens, a 64-token run's steps are half as long) or the
    engine's overlap. Before that the plan's step is priced from its parts: F T(rows) for its
    rows, the host work of a step and the drafter's H, against P (else F). In the synchronous
    engine a step's host work is what P adds to F; the asynchronous one hides it behind the
    device in a plain step but not in a verify step, which waits for its verdicts: there it is
    measured (`HostCost.hidden_seconds`)."""
    width = len(plan.depths)
    drafted = sum(d > 0 for d in plan.depths)
    forward = cost.plain_seconds(width)
    if drafted == 0 or forward is None:
        return False
    plain = host.plain_seconds(width)
    if plain is None:
        plain = host.plain_near(width, cost)
    verify = host.verify_seconds(width, drafted)
    if verify is not None:
        step = forward if plain is None else plain
        speculative = verify * cost.step_time(plan.rows, width)
    else:
        seconds = host.seconds(drafted)
        if seconds is None:
            return False
        step = max(plain or 0.0, forward)
        hidden = host.hidden_seconds(width)
        host_work = step - forward if hidden is None else hidden
        speculative = forward * cost.step_time(plan.rows, width) + host_work + seconds
    bar = 1.0 if reopen else 1.0 - GATE_MARGIN
    return plan.expected_tokens / speculative < bar * width / step
