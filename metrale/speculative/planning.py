"""D-Cut's side of the speculative controller (`controller.SpeculativeDecoder`, which mixes it
in): which sequences draft this step and how deep, planned before drafting from the acceptance
estimates and the verify cost curve; the gate that drops a plan whose tokens do not pay for its
step (`host_cost.drafting_loses`); the probe steps that let a dropped plan come back
(`probes.ProbeSchedule`); the cut after drafting; and the step timings that price all of it.
"""

from __future__ import annotations

from metrale.engine.sequence import Batch, Phase, Sequence
from metrale.speculative.dcut import Plan, PlanInput, plan
from metrale.speculative.draft_shapes import draft_caps, pad_draft
from metrale.speculative.drafter import Draft
from metrale.speculative.host_cost import count_bucket, drafting_loses
from metrale.speculative.probes import ProbeSchedule


class DepthPlanning:
    """Planning state and methods of `SpeculativeDecoder` (its `cfg`, `estimator`, `cost`,
    `host`, `telemetry`, `vocab_size` and step count `_steps`)."""

    def _init_planning(self) -> None:
        self._probes = ProbeSchedule(self.cfg.dcut_probe_every)
        self._probing = False  # whether the step being prepared is a probe step
        # (width, seconds beside the drafter's host work) of the last probe step after steps
        # that did not verify, priced once the step after it is timed (`_price_probe`)
        self._probe_step: tuple[int, float] | None = None
        self._planned_width = 0  # sequences D-Cut planned over this step
        self._planned_drafted = 0  # and of those, the ones it planned to draft
        # the width buckets (`host_cost.count_bucket`) where the gate dropped the last plan with
        # drafts: there drafting must win outright to come back (`drafting_loses`'s `reopen`)
        self._gated: set[int] = set()
        self._verified_before = False  # whether the engine's last timed step verified
        # the running sequences of the last step D-Cut planned at depth 0 everywhere, while no
        # estimate has changed since and no probe step came (None: plan again)
        self._quiet: frozenset[int] | None = None
        # ((seq_id, slot) of the running sequences, seq_id -> planned depth, the step it was
        # planned at) of the last plan, reused while no sequence joins (`_plan_covers`), for
        # `dcut_replan_every` steps
        self._last_plan: tuple[tuple[tuple[int, int], ...], dict[int, int], int] | None = None
        # (depth, the step it was planned at) of the last plan wider than `dcut_width_cap`:
        # one depth for all, which stands for `dcut_replan_every` steps while the batch stays
        # that wide, whoever comes and goes (None: plan again)
        self._uniform: tuple[int, int] | None = None
        # ((seq_ids, caps), D-Cut's choice for them) made while the step before's forward ran
        # (`plan_ahead`), for this step's `_worth_drafting` to take if they are the same
        self._ahead: tuple[tuple[tuple[int, ...], tuple[int, ...]], Plan] | None = None
        # ((slots, caps), the cost model, D-Cut's plan for them with every draft accepted), the
        # last `_hopeless` made: it reads no estimate, and a closed batch asks it at every probe
        self._perfect: tuple[tuple[tuple[int, ...], tuple[int, ...]], object, Plan] | None = None

    def _planned(self, seqs: list[Sequence], caps: list[int]):
        """The sequences to draft this step, their caps, and whether the caps are depths D-Cut
        chose (D-Cut on).

        A step planned at depth 0 everywhere is remembered: until an estimate changes, the next
        probe step comes, none of the sequences it planned still runs, or the batch is half as
        wide (drafting pays more in a narrower batch), the next steps skip planning (a plain
        step does no D-Cut work). Arrivals and departures alone do not end it: at 64 slots
        the batch changes nearly every step, and re-planning each time put D-Cut's planning
        (about 0.3 ms a step at batch 64 on CPU) back into steps that draft nothing.
        Any other plan stands for `dcut_replan_every` steps while no sequence joins the running
        set and it stays more than half as wide (`_plan_covers`).
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
        if self._quiet_over(running):
            return [], [], False
        last = self._last_plan
        fresh = last is not None and self._steps - last[2] < self.cfg.dcut_replan_every
        placed = tuple((s.seq_id, s.slot) for s in seqs)
        if fresh and self._plan_covers(last, placed):
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
        self._last_plan = (placed, depth_of, self._steps)
        self._uniform = (max(depths), self._steps) if wide and keep else None
        return [seqs[i] for i in keep], depths, True

    @staticmethod
    def _plan_covers(last, placed: tuple[tuple[int, int], ...]) -> bool:
        """Whether the last plan (`_last_plan`) stands for the running sequences, `placed` as
        (seq_id, slot): the same ones on the same slots, or some of them left and none came, as
        long as the batch is more than half as wide (drafting pays more in a narrower one: plan
        again). Its depths, cut to those left, are still non-increasing along their slots: the
        canonical deal keeps them. A sequence preempted and back on another slot joins anew
        (its old depth at a lower slot broke that order: found in review). (Departures
        re-planned the tail of every closed batch: about 0.3 ms a plan at batch 8 on the
        H200's host, against a 0.6 ms plain step.)"""
        planned = last[0]
        if planned == placed:
            return True
        if 2 * len(placed) <= len(planned) or len(placed) >= len(planned):
            return False
        return set(planned).issuperset(placed)

    def _quiet_over(self, seq_ids) -> bool:
        """Whether the depth-0 plan of an earlier step still stands for these sequences: no
        estimate changed since, some of its sequences still run, and the batch is not half as
        wide (there drafting may pay where it did not: plan again)."""
        quiet = self._quiet
        return quiet is not None and 2 * len(seq_ids) > len(quiet) and not quiet.isdisjoint(seq_ids)

    def _stays_quiet(self, running: list[Sequence]) -> bool:
        """`_quiet_over` the running sequences that may draft, with no probe due: the step
        skips planning and the caps of its sequences alike (`SpeculativeDecoder._prepare`).
        Those that may draft are those `_planned` plans over (caps above 0), without working
        the caps out: prefilling or non-speculative ones never draft, and the caps that
        `max_tokens` or the context close last a sequence's final step. (Counted as
        running, they kept a batch that had halved from planning again: found in review.)"""
        if self._quiet is None or self._probes.is_due(self._steps):
            return False
        return self._quiet_over(
            [
                s.seq_id
                for s in running
                if s.params.speculative and s.params.num_drafts != 0 and not s.is_prefilling
            ]
        )

    def _hopeless(self, seqs: list[Sequence], caps: list[int]) -> bool:
        """Whether the drafter's measured host work costs more than the most tokens drafting
        could buy: D-Cut plans depth 0 everywhere even if every draft would be accepted."""
        if not self.host.enabled or self.cost.plain_seconds(len(seqs)) is None:
            return False
        key, last = (tuple(s.slot for s in seqs), tuple(caps)), self._perfect
        if last is not None and last[0] == key and last[1] is self.cost:
            chosen = last[2]  # (planning 8 sequences at K = 7: about 0.3 ms on the H200's host)
        else:
            perfect = [PlanInput(s.slot, c, [1.0] * c) for s, c in zip(seqs, caps, strict=True)]
            chosen = plan(perfect, self.cost, self.cfg.dcut_width_cap, any_depths=self.any_depths)
            self._perfect = (key, self.cost, chosen)
        # (the bar a plan must clear here: a probe that could not reopen the gate is wasted)
        reopen = count_bucket(len(seqs)) in self._gated
        return drafting_loses(chosen, self.cost, self.host, reopen)

    def plan_ahead(self, running: list[Sequence]) -> None:
        """While a verify step's forward runs on the device (`SpeculativeDecoder.while_forward`):
        when the next step plans afresh (the plan in use expires, or a probe is due), make its
        choice now from the running sequences' caps and estimates as they stand, for the next
        `_worth_drafting` to take where its sequences and caps are the same. The host waits for
        the forward anyway; the choice (about 0.3 ms at batch 8 on the H200's host) was on the
        critical path of every fourth verify step. Its estimates miss this step's verdicts: the
        plan in use, reused for `dcut_replan_every` steps, is older still. Not from a probe
        step, whose verdicts the next plan is for."""
        if self._probing:
            # a probe's verdicts are what the plan after it must see (they bring back the
            # sequences it cut to depth 0): that plan waits for them (found in review)
            return
        step = self._steps + 1
        last = self._last_plan
        expiring = last is None or step - last[2] >= self.cfg.dcut_replan_every
        if not (expiring or self._probes.is_due(step)):
            return
        seqs, caps = [], []
        for seq in running:
            cap = draft_caps(seq, self.cfg, self.context_len)
            if cap > 0:
                seqs.append(seq)
                caps.append(cap)
        # Above `dcut_width_cap` one depth stands for all, whoever comes and goes, and is
        # cheap to choose; a choice made ahead is then taken only if nobody came or went.
        if seqs and len(seqs) <= self.cfg.dcut_width_cap:
            key = (tuple(s.seq_id for s in seqs), tuple(caps))
            self._ahead = (key, self._choice(seqs, caps))

    def _choice(self, seqs: list[Sequence], caps: list[int]) -> Plan:
        """D-Cut's plan when every sequence drafts its cap at its estimated acceptance."""
        inputs = [
            PlanInput(slot=s.slot, max_depth=c, accept=self.estimator.estimate(s.seq_id, c))
            for s, c in zip(seqs, caps, strict=True)
        ]
        return plan(inputs, self.cost, self.cfg.dcut_width_cap, any_depths=self.any_depths)

    def _worth_drafting(self, seqs: list[Sequence], caps: list[int]):
        """(indices into `seqs`, depths) of the sequences D-Cut gives a depth when every one of
        them drafts its cap at its estimated acceptance; the others are not drafted."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == (tuple(s.seq_id for s in seqs), tuple(caps)):
            chosen = ahead[1]  # made while the step before's forward ran (`plan_ahead`)
        else:
            chosen = self._choice(seqs, caps)
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

    def _cut(self, live: list[tuple[Sequence, Draft]], cap_of: dict[int, int]) -> None:
        """D-Cut: per-sequence depths from the acceptance estimates and the verify cost.

        NOTE: the canonical deal, or one depth for a batch wider than `dcut_width_cap`, may give
        a sequence more rows than it drafted (padded rows); never more than its cap, or an
        accepted padded row would emit past `max_tokens` or write KV past the context.
        That sequence then breaks the canonical table: correct output first. Where the
        target's programs take any mix of depths (`any_depths`), nothing needs the padding:
        each sequence verifies no more than it drafted (found in review: a wide probe step
        padded every short n-gram draft to the batch's depth, rows that buy nothing)."""
        inputs = [
            PlanInput(
                slot=seq.slot,
                max_depth=len(draft.tokens),
                accept=self.estimator.estimate(seq.seq_id, len(draft.tokens)),
            )
            for seq, draft in live
        ]
        # The drafts are paid for by now: only their rows are priced.
        chosen = plan(inputs, self.cost, self.cfg.dcut_width_cap, any_depths=self.any_depths)
        for idx, depth in zip(chosen.order, chosen.depths, strict=True):
            seq, draft = live[idx]
            depth = min(depth, cap_of[seq.seq_id])
            if self.any_depths:
                depth = min(depth, len(draft.tokens))
            ends = seq.eos_token_ids if seq.grammar is not None else ()
            seq.draft = pad_draft(draft, depth, self.vocab_size, ends) if depth else None

    def timed_step(self, batch: Batch, seconds: float | None) -> None:
        """The engine's step of `batch` took `seconds`, start to end (None: no sample, a step
        whose batch failed and ran again one sequence at a time). Told of every step: a verify
        step following a verify step is what D-Cut's gate prices drafting with once measured
        (`HostCost.speculative`), filed under the width D-Cut planned over and the number it
        planned to draft, where the gate looks them up. The first after other steps is no such
        sample: it also catches up on what they emitted (a drafter's index) and, under async
        scheduling, waits for the step in flight; sampled, the probes of a closed gate would
        keep it closed. A probe step after other steps is what spaces the probes instead
        (`_price_probe`)."""
        verify = batch.phase is Phase.VERIFY
        steady, self._verified_before = self._verified_before, verify
        probing, self._probing = self._probing, False
        pending, self._probe_step = self._probe_step, None
        # a decode or verify step (a prefill's rows are no price of either), timed whole
        timed = (
            seconds is not None
            and self.cfg.dcut
            and bool(batch.entries)
            and batch.phase in (Phase.DECODE, Phase.VERIFY)
        )
        if pending is not None:
            # with the step after it where that is a plain decode step (a verify after the
            # probe reopened the gate costs drafting, no probe's price)
            if timed and not probing and batch.phase is Phase.DECODE and not self.host.captured:
                self._price_probe(pending[0], pending[1] + seconds, 2)
            else:
                self._price_probe(*pending, 1)
        if not timed:
            return
        if probing and not steady and not self.host.captured:
            # priced with the step after it (`_price_probe`), the drafter's own host work left
            # out: a probe catches its sequences up on every token since their last probe (the
            # n-gram index), work that grows with the interval and that spacing saves nothing of
            # (not a step during which a program was captured: tens of milliseconds)
            self._probe_step = (len(batch.entries), seconds - self.host.drafting_seconds)
        if not verify or not steady:
            return
        relative = self.cost.step_time(batch.num_rows, len(batch.entries))
        self.host.speculative(self._planned_width, self._planned_drafted, seconds, relative)

    def _price_probe(self, width: int, seconds: float, steps: int) -> None:
        """A probe step after steps that did not verify, and the `steps` - 1 after it, took
        `seconds` beside the drafter's host work: what they cost beyond as many plain steps
        spaces the probes (`ProbeSchedule.priced`). With the step after it: under async
        scheduling a probe waits for the step in flight (its drafter reads tokens) and, where
        it cannot be launched ahead (`held_verify.probes_ahead`), runs synchronously, so the
        step after it has none to wait for and is that much shorter; launched ahead, the step
        after it waits for it. Neither is a step during which a program was captured
        (`timed_step` checks)."""
        plain = self.host.plain_seconds(width) or self.host.plain_near(width, self.cost)
        if plain:
            self._probes.priced(seconds / plain - steps, self._steps)
