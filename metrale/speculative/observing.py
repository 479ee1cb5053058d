"""The verdicts side of the speculative controller (`controller.SpeculativeDecoder`, which mixes
it in): each step's verdicts go to the acceptance estimator (D-Cut's estimates), the telemetry and
the drafter's `observe`; a held verify's go to the estimator as soon as they are read
(`learn_held`), the rest at its commit. A drafter whose `observe` raises fails only the
sequences it raised for.
"""

from __future__ import annotations

import logging
import time

from metrale.engine.held_verify import StepState
from metrale.engine.sequence import Sequence
from metrale.knobs import knobs
from metrale.speculative.drafter import Verdict

log = logging.getLogger(__name__)

# Sequence-verifies between two per-width acceptance lines (METRALE_MTP_ACCEPT_DEBUG).
ACCEPT_DEBUG_EVERY = 256


def learned_matches(drafts, matches: list[bool], first: int | None, found) -> list[bool] | None:
    """What the estimates learn of one sequence's step, or None: the matches of the drafts it
    verified (`drafts`, `matches`), as many as were proposed (`found`: the step's `proposed`
    entry, or None), or, cut to depth 0, whether its first proposed draft was the token it
    emitted anyway (`first`). One rule for a step's commit and a held verify's read."""
    if drafts:
        return matches[: len(drafts) if found is None else found[0]]
    if found is not None and first is not None:
        return [found[1][0] == first]
    return None


class Observing:
    """Verdict methods of `SpeculativeDecoder` (its `cfg`, `estimator`, `telemetry`, `drafter`,
    `host`, `_proposed`, `_sources`, `_quiet`, `_last_plan` and `_debug`)."""

    def observe(
        self, verdicts: list[Verdict], state: StepState | None = None
    ) -> list[tuple[Sequence, str]]:
        """Record one step's verdicts (sequences that verified drafts and those that did not);
        returns the sequences whose drafter `observe` raised, with why (they end; the others
        go on). `state`: the step's own (`step_state`), where a later step was prepared since."""
        start = time.perf_counter()
        try:
            if state is None:
                return self._observe(verdicts, self._proposed)
            return self._observe(verdicts, state.proposed, learned=state.learned)
        finally:
            # the drafter's device work too, as far as the step waited for it (`prepare` no
            # longer does)
            # (a held step's runs while the next forward does: its host time is hidden there)
            if state is None:
                sources, self._sources = self._sources, set()
                spent = time.perf_counter() - start
            else:  # (once: a held step's ending sequences are observed before the others)
                sources, state.sources, spent = state.sources, set(), 0.0
            device = sum(source.stall_seconds() for source in sources)
            self.host.spent(spent + device)

    def learn_held(self, verdicts: list, state: StepState) -> None:
        """D-Cut's estimates from a held verify's verdicts (`SeqVerdict`s), as soon as they are
        read: its commit, which observes the rest, runs a step later (`engine/held_verify.py`),
        after the next step's plan. Learned there, the estimates lagged a step and the plans
        differed from the synchronous engine's (a closed batch's tail took 2% more steps at
        batch 64, `benchmarks/simulated_device.py`). As the commit would: not a sequence whose
        row was not finite (it ends), nor one the held step before ended at its commit, in this
        step's forward (the synchronous engine never ran it again, and its release forgot its
        entry: found in review, entries of stop-string-ended sequences piled up); a sequence
        cut to depth 0 learns its first draft. A held step taken back after a failure
        (`AheadStepper._withdraw`) has been learned: its rows run again and are learned again.
        With D-Cut off nothing reads the estimates: the commit learns, off the critical path."""
        if not (state.observing and self.cfg.dcut):
            return
        proposed_of, learned = state.proposed.get, []
        for v in verdicts:
            ids = v.token_ids  # (not `tokens`: made at the commit, off the critical path)
            if v.seq.is_finished or not ids or ids[-1] < 0:
                continue
            seq_id = v.seq.seq_id
            first = ids[0]
            matches = learned_matches(v.entry.drafts, v.matches, first, proposed_of(seq_id))
            if matches is not None:
                learned.append((seq_id, matches))
        state.learned = True
        # (the estimates themselves take them later, unless something reads them first:
        # `AcceptanceEstimator.defer`; the plans they invalidate are dropped now)
        self._learn(learned, [], defer=True)

    def _observe(
        self, verdicts: list[Verdict], proposed: dict, learned: bool = False
    ) -> list[tuple[Sequence, str]]:
        """`learned`: the estimates took these verdicts already (`learn_held`)."""
        # (gathered, then recorded in one call each: this runs for every verified sequence)
        proposed_of = proposed.get
        verifies, learns = [], []
        for v in verdicts:
            seq_id = v.seq.seq_id
            first = v.emitted[0] if v.emitted else None
            matches = learned_matches(v.drafts, v.matches, first, proposed_of(seq_id))
            if matches is None:
                continue
            if v.drafts:  # (the real drafts verified: as many as `matches`)
                verifies.append((matches, min(v.num_accepted, len(matches))))
            learns.append((seq_id, matches))
        if verifies:
            telemetry = self.telemetry
            before = telemetry.num_drafts // ACCEPT_DEBUG_EVERY
            telemetry.record_verifies(len(verifies), verifies)  # the step's verify width
            if self._debug and telemetry.num_drafts // ACCEPT_DEBUG_EVERY > before:
                for line in telemetry.width_lines():
                    log.info("spec accept %s", line)
        if not learned:
            self._learn(learns, verdicts)
        shadow = knobs().mtp_shadow_topk
        if shadow > 0:
            for v in (v for v in verdicts if v.drafts):
                log.info(
                    "SHADOW_TGT base=%d v=%s drafts=%s",
                    v.first_position + 1,
                    v.picks,
                    v.drafts,
                )
        # A sequence that finished this step (its status changes after) has nothing to draft.
        return self._drafter_observe([v for v in verdicts if v.seq.finish_reason is None])

    def _learn(
        self, learned: list[tuple[int, list[bool]]], verdicts: list, defer: bool = False
    ) -> None:
        """The estimates take one step's matches (seq_id, matches); `defer`: when next read
        (`AcceptanceEstimator.defer`)."""
        if not learned:
            return
        if defer:
            self.estimator.defer(learned)
        else:
            self.estimator.observe_many(learned)
        self._quiet = None
        for v in verdicts:
            if v.seq.is_finished:
                # observed after its release (a held verify's sequence it ended, committed
                # first and observed with the others at its commit, where D-Cut is off and
                # `learn_held` left them): the pool learned from it, its own entry goes again
                # (found in review: entries of ended sequences piled up)
                self.estimator.forget(v.seq.seq_id)
        if self._last_plan is not None and not self._last_plan[1]:
            # a depth-0 plan made before these verdicts were observed (a probe observed a step
            # late, `engine/held_verify.py`): plan again, as after a quiet plan, rather than
            # keep it `dcut_replan_every` steps, the caps worked out each step
            self._last_plan = None

    def _drafter_observe(self, verdicts: list[Verdict]) -> list[tuple[Sequence, str]]:
        """The drafter's `observe`; if it raises, each verdict alone, to find the sequence(s)
        it fails for."""
        try:
            self.drafter.observe(verdicts)
            return []
        except Exception:  # noqa: BLE001 (isolate: only the failing sequences end)
            if len(verdicts) == 1:
                return self._observe_failed(verdicts[0])
        failed = []
        for v in verdicts:
            try:
                self.drafter.observe([v])
            except Exception:  # noqa: BLE001
                failed += self._observe_failed(v)
        return failed

    def _observe_failed(self, v: Verdict) -> list[tuple[Sequence, str]]:
        log.exception("drafter %s observe failed for %s", self.drafter.name, v.seq.request_id)
        return [(v.seq, f"drafter {self.drafter.name}: observe failed")]
