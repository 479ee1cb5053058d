"""The engine's speculative side: ask the drafter for drafts, cut them to planned depths, and
feed verdicts back to the drafter, the acceptance estimator and the telemetry.

Per step, before scheduling, `prepare(running)` leaves on each decoding sequence the drafts it will
verify (`seq.draft`), within its caps (the engine's K, the request's `num_drafts`, the room left
under `max_tokens` and the context a sequence reaches). After the verify, `observe(...)` records
the verdicts (`observing.Observing`). A drafter that raises fails only the sequences it was
drafting for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from metrale.config import SpecConfig
from metrale.engine.device_tokens import DeviceDrafts, DeviceRow
from metrale.engine.held_verify import StepState
from metrale.engine.sequence import Sequence
from metrale.knobs import knobs
from metrale.speculative.draft_shapes import checked_draft, draft_caps, grammar_drafts
from metrale.speculative.drafter import Drafter
from metrale.speculative.estimator import AcceptanceEstimator
from metrale.speculative.host_cost import HostCost
from metrale.speculative.observing import Observing
from metrale.speculative.planning import DepthPlanning
from metrale.speculative.row_table import RowTable
from metrale.speculative.verify_cost import VerifyCostModel
from metrale.speculative.verify_key import (
    canonical_assignment,
    verify_batch_order,
    verify_graph_key,
)
from metrale.telemetry import SpecTelemetry

log = logging.getLogger(__name__)

# Verify steps' shapes (slots and depths) whose telemetry `_record_verify` keeps worked out.
SHAPES_REMEMBERED = 1024


class SpeculativeDecoder(DepthPlanning, Observing):
    def __init__(
        self,
        cfg: SpecConfig,
        drafter: Drafter,
        telemetry: SpecTelemetry,
        context_len: int,
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
        self.context_len = context_len  # the tokens a sequence can reach (the engine's)
        self.vocab_size = vocab_size
        self.cost = cost or VerifyCostModel()
        self.write_on_accept = write_on_accept
        self.any_depths = any_depths
        self.estimator = AcceptanceEstimator(
            max_positions=max(cfg.num_drafts, 1), prior=cfg.dcut_prior, pooled_prior=True
        )
        self._debug = knobs().mtp_accept_debug
        self._own_tokens = getattr(drafter, "own_tokens", False) is True
        # seq_id -> (real drafts verified this step, the drafts proposed): padding is kept out of
        # the estimates, and a sequence cut to depth 0 still learns from its first draft.
        self._proposed: dict[int, tuple[int, list[int] | DeviceRow | None]] = {}
        # the device drafts of the step in flight: their device time is drafting's cost too
        self._sources: set[DeviceDrafts] = set()
        self._asked = 0
        self._steps = 0
        # (slots, depths, canonical arm) of a verify step -> its verify key and row table
        self._shapes: dict[tuple, tuple[tuple, RowTable]] = {}
        self._init_planning()
        self._waited = 0.0  # seconds of `prepare` spent in `before_drafting`
        # whether this step's verdicts go to `observe` (False: nothing drafted, and the drafter
        # is `stateless`, so the step is a plain decode step end to end)
        self.observing = False
        # Whether an unfinished sequence may draft (`drafter.may_draft`), for a drafter that
        # `observes_drafting_only`: the engine sets it (True: every step is observed)
        self.drafting_pending: Callable[[], bool] = lambda: True
        # What drafting costs the step on the host (the seconds of `prepare` and `observe`).
        # Priced for a `stateless` drafter only: its drafting is host work a depth-0 step skips
        # whole. A stateful one (MTP) catches up every step whatever the plan and chains its
        # drafts inside that catch-up when most sequences draft, so its marginal cost is small
        # and its probe steps (few drafting, the slow path) would misprice it: on the H200 the
        # shipped model's MTP at batch 64 fell from 0.94x to 0.59x when priced.
        priced = getattr(drafter, "stateless", False) and not knobs().no_dcut_host_cost
        # (whole steps scaled between widths by the calibrated forward, looked up when asked:
        # the engine calibrates `cost` after this)
        self.host = HostCost(bool(priced), forward=lambda width: self.cost.plain_seconds(width))

    def _observes_every_step(self) -> bool:
        """Whether the drafter is shown a step it drafted nothing for: not a `stateless` one;
        one that `observes_drafting_only` while a sequence that may draft is unfinished."""
        if getattr(self.drafter, "stateless", False):
            return False
        return not getattr(self.drafter, "observes_drafting_only", False) or self.drafting_pending()

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

    def while_forward(self, entries: list, running: list[Sequence]) -> Callable[[], None] | None:
        """The speculative side's host work that may run while a step's forward runs on the
        device (`ModelRunner.while_forward_runs`), or None:
        - the drafter's optional `catch_up(seqs, width)` over the step's prompt chunks (a new
          prompt, or a recompute after a preemption) of sequences that may speculate, so their
          n-grams are indexed behind the forward, not at their first draft (decode and verify
          rows are a few tokens that `propose` indexes anyway); `width`: the running batch;
          also, with no prompt chunk, while the drafter says its indexes lag (`lagging`);
        - in a verify step, D-Cut's choice for the next step where it plans afresh
          (`DepthPlanning.plan_ahead`), and the telemetry of the step's verify shape;
        - the acceptance estimates take the verdicts a held verify deferred
          (`AcceptanceEstimator.defer`), if nothing read them since."""
        catch_up = getattr(self.drafter, "catch_up", None)
        seqs, verified = [], []
        for e in entries:
            if e.drafts:
                verified.append(e)
            elif (
                catch_up is not None
                and e.num_rows > 1
                and e.seq.params.speculative
                and e.seq.params.num_drafts != 0
            ):
                seqs.append(e.seq)
        ahead = bool(verified) and self.cfg.dcut
        # (a drafter's host indexes that lag its device table: `NgramDrafter.lagging`)
        lagging = catch_up is not None and getattr(self.drafter, "lagging", False)
        estimator = self.estimator
        if not seqs and not verified and not lagging and not estimator.pending:
            return None

        def work() -> None:
            if verified:  # first: nothing else records it if a later part raises
                self._record_verify(verified)
            estimator.flush()
            if seqs or lagging:
                catch_up(seqs, len(running))
            if ahead:
                self.plan_ahead(running)

        return work

    def _record_verify(self, verified: list) -> None:
        """The telemetry of a verify step's shape, from its entries with drafts: its verify
        key (`verify_key`) and the runs of its row table. Work of the overlap window: about
        0.05 ms at batch 64, which `observe` paid after the host sync of every verify step."""
        slots = tuple(e.seq.slot for e in verified)
        ks = tuple(len(e.drafts) for e in verified)
        canonical = canonical_assignment(len(verified), self.any_depths)  # as `plan` dispatched
        # A plan stands for a few steps, and with it the step's shape: worked out once.
        found = self._shapes.get((slots, ks, canonical))
        if found is None:
            order, depths = verify_batch_order(slots, ks, canonical)
            pairs = [(slots[i], d + 1) for i, d in zip(order, depths, strict=True)]
            table = RowTable.from_dispatch([s for s, _ in pairs], [rows for _, rows in pairs])
            # Verify never uses WY tables here (the recurrent form runs the verify rows).
            key = verify_graph_key(pairs, True, self.write_on_accept)
            if len(self._shapes) >= SHAPES_REMEMBERED:
                self._shapes.clear()
            found = self._shapes[slots, ks, canonical] = (key, table)
        self.telemetry.record_key(*found)

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
        self._probing = False  # (`_planned` says; an engine step may plan nothing)
        self._steps += 1
        if self.cfg.dcut and self._stays_quiet(running):
            # planned at depth 0 everywhere, as the step before: a plain step, nothing priced
            # per sequence (the caps of 64 sequences cost about 0.05 ms a step)
            for seq in running:
                seq.draft = None
            self._proposed, self._sources, self._asked = {}, set(), 0
            self._planned_width, self._planned_drafted, self._ahead = len(running), 0, None
            self.observing = self._observes_every_step()
            return []
        seqs, caps = [], []
        for seq in running:
            seq.draft = None
            cap = draft_caps(seq, self.cfg, self.context_len)
            if cap > 0:
                seqs.append(seq)
                caps.append(cap)
        self._proposed, self._sources = {}, set()
        self._asked = 0  # sequences the drafter is asked for (what its host work scales with)
        self._planned_width = len(seqs)  # what D-Cut plans over (`timed_step` files under it)
        planned = False  # caps are depths D-Cut already chose
        if self.cfg.dcut and seqs:
            seqs, caps, planned = self._planned(seqs, caps)
        self._ahead = None  # (a choice made ahead is for the step after it alone)
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
        self.observing = bool(seqs) or self._observes_every_step()
        if not seqs:
            return []
        self._asked = len(seqs)
        drafts, failed = self._propose(seqs, caps)
        # (one pass per sequence: this runs for every drafting sequence every step)
        live, sources, short = [], set(), False
        for seq, draft, cap in zip(seqs, drafts, caps, strict=True):
            if draft is None:
                continue
            if seq.grammar is not None:
                try:
                    draft = grammar_drafts(seq, draft, cap)
                except Exception as e:  # noqa: BLE001 (its grammar's failure: it alone ends)
                    log.exception("the grammar of %s failed on its drafts", seq.request_id)
                    failed.append((seq, f"grammar: {type(e).__name__}: {e}"))
                    continue
            tokens = draft.tokens
            if not tokens:
                continue
            live.append((seq, draft))
            short = short or len(tokens) != cap
            if draft.probs is not None:
                seq.fresh_noise = True  # from now on, for good: see `SamplingRow.fresh_noise`
            if isinstance(tokens, DeviceRow):
                sources.add(tokens.source)
        if planned and (self.any_depths or not short):
            # Every sequence drafted as deep as planned, or not at all (it decodes plainly, as
            # it would at depth 0; dropping it keeps the others' depths in the deal's order):
            # the plan stands, no second planning; with `any_depths`, whatever they drafted (a
            # second plan, 0.15 ms a step at batch 8 on the H200's host, could only cut rows).
            for seq, draft in live:
                seq.draft = draft
        elif self.cfg.dcut and live:
            self._cut(live, {s.seq_id: c for s, c in zip(seqs, caps, strict=True)})
        else:
            for seq, draft in live:
                seq.draft = draft
        # (the proposed tokens, not their first: drafts on the device are read at the verdicts)
        self._proposed = {
            s.seq_id: (min(len(d.tokens), len(s.draft.tokens) if s.draft else 0), d.tokens)
            for s, d in live
        }
        self._sources = sources
        return failed

    def _propose(self, seqs: list[Sequence], caps: list[int]):
        try:
            drafts = self.drafter.propose(seqs, caps)
            vocab, own = self.vocab_size, self._own_tokens
            checked = [
                checked_draft(d, c, seq, vocab, own)
                for d, c, seq in zip(drafts, caps, seqs, strict=True)
            ]
            return checked, []
        except Exception as e:  # noqa: BLE001 (isolate: find the sequence(s) that make it fail)
            if len(seqs) == 1:  # that one sequence: it ends, the others go on
                log.exception("drafter %s failed for %s", self.drafter.name, seqs[0].request_id)
                return [None], [(seqs[0], f"drafter {self.drafter.name}: {type(e).__name__}: {e}")]
        drafts, failed = [], []
        for seq, cap in zip(seqs, caps, strict=True):
            try:
                draft = self.drafter.propose([seq], [cap])[0]
                drafts.append(checked_draft(draft, cap, seq, self.vocab_size, self._own_tokens))
            except Exception as e:  # noqa: BLE001
                log.exception("drafter %s failed for %s", self.drafter.name, seq.request_id)
                drafts.append(None)
                failed.append((seq, f"drafter {self.drafter.name}: {type(e).__name__}: {e}"))
        return drafts, failed

    def step_state(self) -> StepState:
        """This step's state that `observe` reads, for a step observed after the next one is
        prepared (a held verify, `engine/held_verify.py`): `prepare` resets it."""
        return StepState(self.observing, self._proposed, self._sources)

    def release(self, seq: Sequence) -> None:
        seq.draft = None
        self.estimator.forget(seq.seq_id)
        try:
            self.drafter.release(seq)
        except Exception:  # noqa: BLE001 (the sequence is leaving anyway: never lose its output)
            log.exception("drafter %s release failed for %s", self.drafter.name, seq.request_id)
