"""When D-Cut's probe steps come. A probe drafts for a few sequences that D-Cut planned at depth
0, in turn, so that their acceptance estimates can rise again; it costs a drafting step (under
async scheduling the drafter waits for the step in flight; the probe step itself, its drafts all
cut, is launched ahead and observed at its settle: `engine/held_verify.probes_ahead`). While
drafting does not pay, each probe that finds nothing worth drafting doubles the interval, up to
its bound; a plan that drafts brings it back (and the next probe with it). On the H200
(qwen3-8b shape, alpha 0, async scheduling, batch 64) a probe every 8 steps kept decoding at
0.94x plain. The price: a sequence whose acceptance rises mid-stream is noticed later.

The bound is `MAX_BACKOFF` times `dcut_probe_every`, or more where a probe step is measured to
cost so much beyond a plain step that probes at that interval would take more than
`PROBE_SHARE` of the decoding time (`priced`): on the H200 under async scheduling a probe step
after plain steps took 13.5 ms against 5.2 ms (the qwen3-8b shape, batch 64), 5% of the time at
one probe every 32 steps. A probe is priced with the step after it (`DepthPlanning._price_probe`)
and only where D-Cut measures plain steps (a `stateless` drafter, host pricing on): elsewhere
(MTP) the bound stays `MAX_BACKOFF` base intervals.
"""

from __future__ import annotations

import math

from metrale.speculative.host_cost import Window

# The longest interval, in units of `dcut_probe_every`. A probe drafts for `PROBE_SEQS`
# sequences in turn: at batch 64 and the default 8, each sequence is probed every 64 steps
# without the backoff, every 256 at most with it (more where probes are dear, `PROBE_SHARE`).
MAX_BACKOFF = 4
PROBE_SEQS = 8  # sequences a probe drafts for, beside those the plan drafts
# While nothing drafts, the share of the decoding time probes may cost beyond plain steps
# (the drafter's own host work aside, `DepthPlanning._price_probe`), and a cap on the interval
# that aims at it, in units of `dcut_probe_every`.
PROBE_SHARE = 0.02
MAX_SPACED = 32


class ProbeSchedule:
    def __init__(self, every: int) -> None:
        self.base = self.every = every
        self._next = every  # the step of the next probe
        self._last = 0  # the step of the last one
        self._probes = 0
        self._backed_off = -1  # the probe count when the interval last doubled
        # what a probe step after plain steps cost beyond a plain step, in plain steps
        self._excess = Window()

    @property
    def bound(self) -> int:
        """The longest interval: `MAX_BACKOFF` base intervals, or more where a probe step costs
        more than `PROBE_SHARE` of that many plain steps (up to `MAX_SPACED`)."""
        bound = MAX_BACKOFF * self.base
        excess = self._excess.value
        if excess is not None and excess > 0.0:
            spaced = min(math.ceil(excess / PROBE_SHARE), MAX_SPACED * self.base)
            bound = max(bound, spaced)
        return bound

    def due(self, step: int) -> bool:
        """Whether step `step` probes (asked once a step, in order)."""
        if step < self._next:
            return False
        self._next, self._last = step + self.every, step
        self._probes += 1
        return True

    def is_due(self, step: int) -> bool:
        """Whether step `step` will probe (`due` without asking)."""
        return step >= self._next

    def planned(self, drafts: bool) -> None:
        """A plan was made: drafting pays for some sequence (back to the base interval, the
        next probe included), or for none (the interval doubles, up to its bound, once a
        probe: a plan made again once a probe's verdicts are observed, a step after the plan
        that did not know them yet, is the same finding; found in review: the interval
        doubled twice a probe when probes ran ahead)."""
        if drafts:
            self.every = self.base
            self._next = min(self._next, self._last + self.base)
        elif self._backed_off != self._probes:
            self._backed_off = self._probes
            self.every = min(2 * self.every, self.bound)

    def priced(self, excess: float, step: int) -> None:
        """A probe step that followed plain steps cost `excess` plain steps beyond one."""
        self._excess.add(excess, step, 1)

    def probed(self, count: int) -> list[int]:
        """Indices, among `count` sequences, of the few this probe drafts for (in turn)."""
        first = (self._probes * PROBE_SEQS) % count
        return [(first + i) % count for i in range(min(PROBE_SEQS, count))]
