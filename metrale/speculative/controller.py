"""The engine's speculative side: ask the drafter for drafts, cut them to planned depths, and
feed verdicts back to the drafter, the acceptance estimator and the telemetry.

Per step, before scheduling, `prepare(running)` leaves on each decoding sequence the drafts it will
verify (`seq.draft`), within its caps (the engine's K, the request's `num_drafts`, the room left
under `max_tokens` and `max_model_len`). After the verify, `observe(...)` records the verdicts.
A drafter that raises fails only the sequences it was drafting for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from metrale.config import SpecConfig
from metrale.engine.device_tokens import DeviceDrafts, DeviceRow
from metrale.engine.sequence import Batch, Phase, Sequence
from metrale.knobs import knobs
from metrale.speculative.dcut import PlanInput, VerifyCostModel, plan
from metrale.speculative.draft_shapes import draft_caps, grammar_drafts, pad_draft
from metrale.speculative.drafter import Draft, Drafter, Verdict
from metrale.speculative.estimator import AcceptanceEstimator
from metrale.speculative.host_cost import HostCost, count_bucket, drafting_loses
from metrale.speculative.probes import ProbeSchedule
from metrale.speculative.row_table import RowTable
from metrale.speculative.verify_key import (
    canonical_assignment,
    verify_batch_order,
    verify_graph_key,
)
from metrale.telemetry import SpecTelemetry

log = logging.getLogger(__name__)

# Sequence-verifies between two per-width acceptance lines (METRALE_MTP_ACCEPT_DEBUG).
ACCEPT_DEBUG_EVERY = 256


class SpeculativeDecoder:
    def __init__(
        self,
        cfg: SpecConfig,
        drafter: Drafter,
        telemetry: SpecTelemetry,
        max_model_len: int,
        vocab_size: int,
        cost: VerifyCostModel | None = None,
        write_on_accept: bool = False,
        any_depths: bool = False,
    ) -> None:
        """`write_on_accept`: the target keeps recurrent state and writes it after acceptance
        (hybrid targets in that variant, not per-row slots); it selects the variant's verify
        graph keys. `any_depths`: the target's step programs take any mix of depths (ragged
        programs keyed by rows and sequences, or none): a sequence that drafted fewer tokens
        than D-Cut planned verifies what it drafted, with no second plan to keep the verify
        table canonical."""
        self.cfg = cfg
        self.drafter = drafter
        self.telemetry = telemetry
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.cost = cost or VerifyCostModel()
        self.write_on_accept = write_on_accept
        self.any_depths = any_depths
        self.estimator = AcceptanceEstimator(
            max_positions=max(cfg.num_drafts, 1), prior=cfg.dcut_prior, pooled_prior=True
        )
        self._debug = knobs().mtp_accept_debug
        # seq_id -> (real drafts verified this step, the drafts proposed): padding is kept out of
        # the estimates, and a sequence cut to depth 0 still learns from its first draft.
        self._proposed: dict[int, tuple[int, list[int] | DeviceRow | None]] = {}
        # the device drafts of the step in flight: their device time is drafting's cost too
        self._sources: set[DeviceDrafts] = set()
        self._asked = 0
        self._steps = 0
        self._probes = ProbeSchedule(cfg.dcut_probe_every)
        self._probing = False  # whether this step is a probe step
        self._planned_width = 0  # sequences D-Cut planned over this step
        self._planned_drafted = 0  # and of those, the ones it planned to draft
        # the width buckets (`host_cost.count_bucket`) where the gate dropped the last plan with
        # drafts: there drafting must win outright to come back (`drafting_loses`'s `reopen`)
        self._gated: set[int] = set()
        self._verified_before = False  # whether the engine's last timed step verified
        self._waited = 0.0  # seconds of `prepare` spent in `before_drafting`
        # the running sequences of the last step D-Cut planned at depth 0 everywhere, while no
        # estimate has changed since and no probe step came (None: plan again)
        self._quiet: frozenset[int] | None = None
        # (running seq_ids, seq_id -> planned depth, the step it was planned at) of the last
        # plan, reused while the running set is the same, for `dcut_replan_every` steps
        self._last_plan: tuple[tuple[int, ...], dict[int, int], int] | None = None
        # (depth, the step it was planned at) of the last plan wider than `dcut_width_cap`:
        # one depth for all, which stands for `dcut_replan_every` steps while the batch stays
        # that wide, whoever comes and goes (None: plan again)
        self._uniform: tuple[int, int] | None = None
        # whether this step's verdicts go to `observe` (False: nothing drafted, and the drafter
        # is `stateless`, so the step is a plain decode step end to end)
        self.observing = False
        # What drafting costs the step on the host (the seconds of `prepare` and `observe`).
        # Priced for a `stateless` drafter only: its drafting is host work a depth-0 step skips
        # whole. A stateful one (MTP) catches up every step whatever the plan and chains its
        # drafts inside that catch-up when most sequences draft, so its marginal cost is small
        # and its probe steps (few drafting, the slow path) would misprice it: on the H200 the
        # shipped model's MTP at batch 64 fell from 0.94x to 0.59x when priced.
        priced = getattr(drafter, "stateless", False) and not knobs().no_dcut_host_cost
        self.host = HostCost(bool(priced))

    @property
    def needs_verdicts(self) -> bool:
        """Whether this step's verdicts teach the drafter or D-Cut anything: drafts were
        proposed (verified, or cut to depth 0, whose first draft D-Cut learns), or the drafter
        learns from every step. A step without drafts that does not may run ahead
        (`engine/ahead.py`)."""
        stateless = getattr(self.drafter, "stateless", False)
        return self.observing and (bool(self._proposed) or not stateless)

    @property
    def asked(self) -> int:
        """Sequences the drafter was asked to draft for this step."""
        return self._asked

    def prepare(
        self, running: list[Sequence], before_drafting: Callable[[], None] | None = None
    ) -> list[tuple[Sequence, str]]:
        """Set `seq.draft` on every running sequence; returns sequences whose drafting failed.
        Times itself and `observe` for `HostCost`. `before_drafting`: called once the plan
        drafts, before the drafter is asked (the asynchronous engine settles the step in flight
        there: a plan needs counts alone, a draft the tokens; not timed as drafting)."""
        if self.host.begin():
            # an estimate went stale: plan afresh
            self._quiet = self._last_plan = self._uniform = None
        start = time.perf_counter()
        self._waited = 0.0
        failed = self._prepare(running, before_drafting)
        self.host.spent(time.perf_counter() - start - self._waited, self._asked)
        return failed

    def _prepare(
        self, running: list[Sequence], before_drafting: Callable[[], None] | None = None
    ) -> list[tuple[Sequence, str]]:
        """`prepare`'s work.

        With D-Cut the depths are planned first, from the acceptance estimates: only sequences
        planned deeper than 0 are drafted, so a step planned at depth 0 everywhere drafts
        nothing and runs as a plain decode step (`observing` tells the engine whether its
        verdicts are wanted at all). At probe steps (`probes.ProbeSchedule`) a few sequences
        draft anyway, and the ones cut to depth 0 learn from their first draft."""
        seqs, caps = [], []
        for seq in running:
            seq.draft = None
            cap = draft_caps(seq, self.cfg, self.max_model_len)
            if cap > 0:
                seqs.append(seq)
                caps.append(cap)
        self._proposed, self._sources = {}, set()
        self._asked = 0  # sequences the drafter is asked for (what its host work scales with)
        self._steps += 1
        self._planned_width = len(seqs)  # what D-Cut plans over (`timed_step` files under it)
        planned = False  # caps are depths D-Cut already chose
        if self.cfg.dcut and seqs:
            seqs, caps, planned = self._planned(seqs, caps)
        # What the gate looks verify steps up by: the plan's count, not how many drafted (an
        # n-gram drafter finds nothing for some; filed by those, the samples of a batch of 64
        # were never found under the plan's 64 and the gate priced from parts all along).
        self._planned_drafted = len(seqs)
        if seqs and before_drafting is not None:
            waited = time.perf_counter()
            before_drafting()
            self._waited = time.perf_counter() - waited
            # the step it settled may have ended some (their caps stand for the others)
            kept = [i for i, seq in enumerate(seqs) if not seq.is_finished]
            seqs, caps = [seqs[i] for i in kept], [caps[i] for i in kept]
        # A drafter that declares itself `stateless` learns nothing from verdicts it did not
        # draft for; any other is shown every step's verdicts, as the protocol says.
        self.observing = bool(seqs) or not getattr(self.drafter, "stateless", False)
        if not seqs:
            return []
        self._asked = len(seqs)
        drafts, failed = self._propose(seqs, caps)
        live = []
        for seq, draft, cap in zip(seqs, drafts, caps, strict=True):
            if draft is not None and seq.grammar is not None:
                draft = grammar_drafts(seq, draft, cap)
            if draft is not None and draft.tokens:
                live.append((seq, draft))
        for seq, draft in live:
            if draft.probs is not None:
                seq.fresh_noise = True  # from now on, for good: see `SamplingRow.fresh_noise`
        cap_of = {s.seq_id: c for s, c in zip(seqs, caps, strict=True)}
        if planned and (self.any_depths or all(len(d.tokens) == cap_of[s.seq_id] for s, d in live)):
            # Every sequence drafted as deep as planned, or not at all (it decodes plainly, as
            # it would at depth 0; dropping it keeps the others' depths in the deal's order):
            # the plan stands, no second planning; with `any_depths`, whatever they drafted (a
            # second plan, 0.15 ms a step at batch 8 on the H200's host, could only cut rows).
            for seq, draft in live:
                seq.draft = draft
        elif self.cfg.dcut and live:
            self._cut(live, cap_of)
        else:
            for seq, draft in live:
                seq.draft = draft
        # (the proposed tokens, not their first: drafts on the device are read at the verdicts)
        self._proposed = {
            s.seq_id: (min(len(d.tokens), len(s.draft.tokens) if s.draft else 0), d.tokens)
            for s, d in live
        }
        self._sources = {d.tokens.source for _, d in live if isinstance(d.tokens, DeviceRow)}
        return failed

    def _planned(self, seqs: list[Sequence], caps: list[int]):
        """The sequences to draft this step, their caps, and whether the caps are depths D-Cut
        chose (D-Cut on).

        A step planned at depth 0 everywhere is remembered: until an estimate changes, the next
        probe step comes, none of the sequences it planned still runs, or the batch is half as
        wide (drafting pays more in a narrower batch), the next steps skip planning (a plain
        step does no D-Cut work). Arrivals and departures alone do not end it: at 64 slots
        the batch changes nearly every step, and re-planning each time put D-Cut's planning
        (about 0.3 ms a step at batch 64 on CPU) back into steps that draft nothing.
        Any other plan stands for `dcut_replan_every` steps while the running set is the same.
        At probe steps (`probes.ProbeSchedule`) a few sequences, in turn, draft anyway, unless
        drafting cannot pay even with every draft accepted (then their acceptance does not
        matter)."""
        self._probing = self._probes.due(self._steps) and not self._hopeless(seqs, caps)
        if self._probing:
            # The plan's sequences, plus a few of the others in turn, drafting up to their caps
            # (the cut after drafting decides their depths; those at 0 learn their first draft).
            self._quiet = self._last_plan = self._uniform = None
            chosen = set(self._worth_drafting(seqs, caps)[0])
            picked = sorted(chosen.union(self._probes.probed(len(seqs))))
            return [seqs[i] for i in picked], [caps[i] for i in picked], False
        running = tuple(s.seq_id for s in seqs)
        quiet = self._quiet
        # In a batch half as wide drafting may pay where it did not: plan again then too.
        if quiet is not None and 2 * len(running) > len(quiet) and not quiet.isdisjoint(running):
            return [], [], False
        last = self._last_plan
        fresh = last is not None and self._steps - last[2] < self.cfg.dcut_replan_every
        if fresh and last[0] == running:
            keep = [i for i, s in enumerate(seqs) if last[1].get(s.seq_id, 0) > 0]
            depths = [min(caps[i], last[1][seqs[i].seq_id]) for i in keep]
            return [seqs[i] for i in keep], depths, True
        wide = len(seqs) > self.cfg.dcut_width_cap
        uniform = self._uniform
        if wide and uniform is not None and self._steps - uniform[1] < self.cfg.dcut_replan_every:
            # One depth for all: an arrival or a departure moves the batch's mean estimate
            # little, and planning 64 sequences cost about 0.3 ms a step on the H200's host.
            return seqs, [min(c, uniform[0]) for c in caps], True
        keep, depths = self._worth_drafting(seqs, caps)
        self._probes.planned(bool(keep))
        self._quiet = None if keep else frozenset(running)
        depth_of = {seqs[i].seq_id: d for i, d in zip(keep, depths, strict=True)}
        self._last_plan = (running, depth_of, self._steps)
        self._uniform = (max(depths), self._steps) if wide and keep else None
        return [seqs[i] for i in keep], depths, True

    def _hopeless(self, seqs: list[Sequence], caps: list[int]) -> bool:
        """Whether the drafter's measured host work costs more than the most tokens drafting
        could buy: D-Cut plans depth 0 everywhere even if every draft would be accepted."""
        if not self.host.enabled or self.cost.plain_seconds(len(seqs)) is None:
            return False
        perfect = [PlanInput(s.slot, c, [1.0] * c) for s, c in zip(seqs, caps, strict=True)]
        chosen = plan(perfect, self.cost, self.cfg.dcut_width_cap)
        # (the bar a plan must clear here: a probe that could not reopen the gate is wasted)
        reopen = count_bucket(len(seqs)) in self._gated
        return drafting_loses(chosen, self.cost, self.host, reopen)

    def _worth_drafting(self, seqs: list[Sequence], caps: list[int]):
        """(indices into `seqs`, depths) of the sequences D-Cut gives a depth when every one of
        them drafts its cap at its estimated acceptance; the others are not drafted."""
        inputs = [
            PlanInput(slot=s.slot, max_depth=c, accept=self.estimator.estimate(s.seq_id, c))
            for s, c in zip(seqs, caps, strict=True)
        ]
        chosen = plan(inputs, self.cost, self.cfg.dcut_width_cap)
        width = count_bucket(len(seqs))
        if drafting_loses(chosen, self.cost, self.host, reopen=width in self._gated):
            # Planned before drafting: the drafter's host work is still to be paid.
            self.telemetry.host_gated_plans += 1
            self._gated.add(width)
            return [], []
        if any(chosen.depths):
            self._gated.discard(width)
        keep = sorted(i for i, d in zip(chosen.order, chosen.depths, strict=True) if d > 0)
        # Drafting deeper than the plan buys nothing: the cut after drafting keeps at most this.
        depth = dict(zip(chosen.order, chosen.depths, strict=True))
        return keep, [min(caps[i], depth[i]) for i in keep]

    def _propose(self, seqs: list[Sequence], caps: list[int]):
        try:
            drafts = self.drafter.propose(seqs, caps)
            return [self._checked(d, c) for d, c in zip(drafts, caps, strict=True)], []
        except Exception as e:  # noqa: BLE001 (isolate: find the sequence(s) that make it fail)
            if len(seqs) == 1:  # that one sequence: it ends, the others go on
                log.exception("drafter %s failed for %s", self.drafter.name, seqs[0].request_id)
                return [None], [(seqs[0], f"drafter {self.drafter.name}: {type(e).__name__}: {e}")]
        drafts, failed = [], []
        for seq, cap in zip(seqs, caps, strict=True):
            try:
                drafts.append(self._checked(self.drafter.propose([seq], [cap])[0], cap))
            except Exception as e:  # noqa: BLE001
                log.exception("drafter %s failed for %s", self.drafter.name, seq.request_id)
                drafts.append(None)
                failed.append((seq, f"drafter {self.drafter.name}: {type(e).__name__}: {e}"))
        return drafts, failed

    def _checked(self, draft: Draft, cap: int) -> Draft:
        if isinstance(draft.tokens, DeviceRow):
            # a device drafter's picks from the target's head: in the vocabulary by
            # construction, and reading them here would wait for its forward
            return draft.truncate(cap)
        bad = [t for t in draft.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"draft token {bad[0]} is outside the vocabulary ({self.vocab_size})")
        return draft.truncate(cap)

    def _cut(self, live: list[tuple[Sequence, Draft]], cap_of: dict[int, int]) -> None:
        """D-Cut: per-sequence depths from the acceptance estimates and the verify cost.

        NOTE: the canonical deal may give a sequence more rows than it drafted (padded rows);
        never more than its cap, or an accepted padded row would emit past `max_tokens` or
        write KV past `max_model_len`. That sequence then breaks the canonical table: correct
        output first."""
        inputs = [
            PlanInput(
                slot=seq.slot,
                max_depth=len(draft.tokens),
                accept=self.estimator.estimate(seq.seq_id, len(draft.tokens)),
            )
            for seq, draft in live
        ]
        # The drafts are paid for by now: only their rows are priced.
        chosen = plan(inputs, self.cost, self.cfg.dcut_width_cap)
        for idx, depth in zip(chosen.order, chosen.depths, strict=True):
            seq, draft = live[idx]
            depth = min(depth, cap_of[seq.seq_id])
            seq.draft = pad_draft(draft, depth, self.vocab_size) if depth else None

    def timed_step(self, batch: Batch, seconds: float | None) -> None:
        """The engine's step of `batch` took `seconds`, start to end (None: no sample, a step
        whose batch failed and ran again one sequence at a time). Told of every step: a verify
        step following a verify step is what D-Cut's gate prices drafting with once measured
        (`HostCost.speculative`), filed under the width D-Cut planned over and the number it
        planned to draft, where the gate looks them up. The first after
        other steps is no sample: it also catches up on what they emitted (a drafter's index)
        and, under async scheduling, waits for the step in flight; sampled, the probes of a
        closed gate would keep it closed."""
        verify = batch.phase is Phase.VERIFY
        steady, self._verified_before = self._verified_before, verify
        probing, self._probing = self._probing, False
        if seconds is None or not self.cfg.dcut:
            return
        if probing and not steady:
            self._price_probe(len(batch.entries), seconds)
        if not verify or not steady:
            return
        relative = self.cost.step_time(batch.num_rows, len(batch.entries))
        self.host.speculative(self._planned_width, self._planned_drafted, seconds, relative)

    def _price_probe(self, width: int, seconds: float) -> None:
        """A probe step after steps that did not verify took `seconds`: what it cost beyond a
        plain step spaces the probes (`ProbeSchedule.priced`). Not a step during which a
        program was captured."""
        plain = self.host.plain_seconds(width) or self.host.plain_near(width, self.cost)
        if plain and not self.host.captured:
            self._probes.priced(seconds / plain - 1.0, self._steps)

    def observe(self, verdicts: list[Verdict]) -> list[tuple[Sequence, str]]:
        """Record one step's verdicts (sequences that verified drafts and those that did not);
        returns the sequences whose drafter `observe` raised, with why (they end; the others
        go on)."""
        start = time.perf_counter()
        try:
            return self._observe(verdicts)
        finally:
            # the drafter's device work too, as far as the step waited for it (`prepare` no
            # longer does)
            sources, self._sources = self._sources, set()
            device = sum(source.stall_seconds() for source in sources)
            self.host.spent(time.perf_counter() - start + device)

    def _observe(self, verdicts: list[Verdict]) -> list[tuple[Sequence, str]]:
        verified = [v for v in verdicts if v.drafts]
        if verified:
            slots = [v.seq.slot for v in verified]
            ks = [len(v.drafts) for v in verified]
            order, depths = verify_batch_order(slots, ks, canonical_assignment(len(verified)))
            pairs = [(slots[i], d + 1) for i, d in zip(order, depths, strict=True)]
            table = RowTable.from_dispatch([s for s, _ in pairs], [rows for _, rows in pairs])
            # Verify never uses WY tables here (the recurrent form runs the verify rows).
            key = verify_graph_key(pairs, True, self.write_on_accept)
            self.telemetry.record_key(key, table)
        for v in verdicts:
            real, proposed = self._proposed.get(v.seq.seq_id, (len(v.drafts), None))
            first = None if proposed is None else proposed[0]
            if v.drafts:
                matches = v.matches[:real]
                self.telemetry.record(len(verified), matches, min(v.num_accepted, real))
                self.estimator.observe(v.seq.seq_id, matches)
                self._quiet = None
                if self._debug and self.telemetry.num_drafts % ACCEPT_DEBUG_EVERY == 0:
                    for line in self.telemetry.width_lines():
                        log.info("spec accept %s", line)
            elif first is not None and v.emitted:
                # Cut to depth 0: whether its first draft was the token it emitted anyway.
                self.estimator.observe(v.seq.seq_id, [first == v.emitted[0]])
                self._quiet = None
        shadow = knobs().mtp_shadow_topk
        if shadow > 0:
            for v in verified:
                log.info(
                    "SHADOW_TGT base=%d v=%s drafts=%s",
                    v.first_position + 1,
                    v.picks,
                    v.drafts,
                )
        # A sequence that finished this step (its status changes after) has nothing to draft.
        return self._drafter_observe([v for v in verdicts if v.seq.finish_reason is None])

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

    def release(self, seq: Sequence) -> None:
        seq.draft = None
        self.estimator.forget(seq.seq_id)
        try:
            self.drafter.release(seq)
        except Exception:  # noqa: BLE001 (the sequence is leaving anyway: never lose its output)
            log.exception("drafter %s release failed for %s", self.drafter.name, seq.request_id)
