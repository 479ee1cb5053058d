"""Asynchronous scheduling (`EngineConfig.async_scheduling`): the host schedules and launches step
N+1 while the device still runs step N, as vLLM's async scheduling does.

In the synchronous engine the device idles while the host commits step N (emission, stop checks,
bookkeeping) and then schedules and packs step N+1; on the H200 that host work is a large part of
a decode step (about 1.7 of 7.3 ms at batch 64 on the qwen3-8b shape, most of a step of the
shipped model). Here a step is launched with its verdicts left on the device
(`ModelRunner.execute(defer=True)`): each sampling sequence's token stays there, and its
`output_token_ids` end with a placeholder for it (`Sequence.inflight`, a `DeviceRow`). The next
`step()` schedules and launches step N+1 at once, its input ids taking those tokens on the device
(`PendingIds`), and only then settles step N: reads its host copy (long done, or done as soon as
the device is), emits, checks stop conditions. So the host's commit of one step overlaps the
device's next forward. `step()` returns each step's outputs one call later.

A sequence that step N ends (EOS, a stop string) has a row in step N+1 already: that row is
computed and thrown away, and its KV lands past the sequence's end in pages it frees (stream order
keeps any later reuse after it). Counters move when a step is launched (`_advance`: the rows it
computes, a placeholder for its token), tokens when it is settled.

Where the engine stays synchronous (the step waits for the one before it):
- a step that drafts: D-Cut plans it from counts (the placeholders keep them right), and a plan
  that drafts settles the step in flight before the drafter reads any token (not a held
  verify's: its tokens are on the host); the verify's forward and verdicts then run
  synchronously, its commit while the next step's forward runs where it may be held
  (`engine/held_verify.py`). A step whose drafts were all cut (a probe) runs ahead as a plain
  step where its drafter allows (`held_verify.probes_ahead`): its verdicts, which teach D-Cut
  each probed sequence's first draft, are observed at its settle, after the next step's plan.
  A step D-Cut plans at depth 0 everywhere runs ahead like a plain one. A drafter that learns
  from every step (MTP, not `stateless`) keeps the whole engine synchronous while a sequence
  it learns from is unfinished (`runs_ahead`: MTP `observes_drafting_only`, so an engine
  serving only requests with `speculative=False` runs ahead);
- any unfinished sequence that follows a grammar (the mask needs its last token),
  `may_run_ahead` (penalties do not: their counts take a launched step's tokens on the device,
  `penalty_state.py`);
- a step that would preempt or fail a running sequence (`Scheduler.schedule(hold=True)` refuses);
- a step whose launch raises: it runs again through `isolation.run_batch`, after the step before
  (one sequence at a time, a hybrid target's state rebuilt first: the failed launch may have
  advanced it);
- every step of a hybrid target with prefix caching and a drafter that keeps K/V rows in the
  pages (MTP): its state snapshots are saved with those pages, at the commit (`LLMEngine`).
A hybrid target's prefix-cache snapshots are otherwise saved as their step is launched
(`_advance`), with its pages, before the next step advances the state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from metrale.distributed.parallel import DistributedError
from metrale.engine.commit import offer_pages
from metrale.engine.device_tokens import DeviceRow
from metrale.engine.held_verify import (
    StepState,
    can_hold,
    probes_ahead,
    rows_moved,
    run_held,
)
from metrale.engine.isolation import rebuild_state, recompute_later, run_batch, still_running
from metrale.engine.sequence import Batch, Phase, ScheduledSeq, Sequence, SequenceStatus
from metrale.engine.step_output import StepOutput
from metrale.outputs import RequestOutput
from metrale.speculative.drafter import learns_from_every_step

FINISHED = SequenceStatus.FINISHED
log = logging.getLogger(__name__)


def runs_ahead(seq: Sequence, spec) -> bool:
    """Whether a sequence's steps may be launched before the one before them is settled (those
    its drafter drafts for never are: `AheadStepper.step` settles first). Not one a drafter
    learns from every step of (MTP catches up from its hidden states): a drafter that is not
    `stateless` and sees every sequence's steps, or one that `observes_drafting_only` and a
    sequence that may draft; nor one under a grammar (its mask needs its last token)."""
    if spec is not None and learns_from_every_step(spec.drafter, seq):
        return False
    return seq.grammar is None


@dataclass
class Launched:
    """A step on the device whose verdicts are not read yet."""

    batch: Batch
    out: StepOutput
    start: float  # perf_counter when the step began
    prompt_rows: int
    # the controller's state to observe it with (a held verify, a probe launched ahead)
    state: StepState | None = None
    held: bool = False  # a held verify (`engine/held_verify.py`): its tokens are on the host
    emitted: int = 0  # tokens it emitted already (a held verify's sequences it ended)

    @property
    def tokens(self):
        """Its sampled tokens on the device (what its sequences' placeholders read), or None."""
        return self.out.pending.tokens if self.out.pending is not None else None


class AheadStepper:
    """`LLMEngine.step` one step ahead (see the module's docstring)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.launched: Launched | None = None
        # steps launched, those launched while the step before was unread, verify steps held
        # (`engine/held_verify.py`), probe steps launched ahead (`held_verify.probes_ahead`)
        self.launches = self.launches_ahead = self.held_verifies = self.probes_ahead = 0
        self._waited = 0.0
        self._failed = False  # the last `_launch` raised (not: it did not defer)
        # launched steps whose placeholders are out and not yet committed, with the device
        # tokens they read (`_withdraw`)
        self._open: list[tuple[Launched, object]] = []
        # a step whose forward ran (launched) and whose counters have not moved yet: on a
        # hybrid target its sequences' state is past their counters until `_advance`
        self._launching: Launched | None = None

    def may_run_ahead(self) -> bool:
        return self.engine.sync_seqs == 0

    def step(self) -> list[RequestOutput]:
        changed = self.engine._carrying()
        try:
            return self._step(changed)
        except BaseException as e:
            # (no forward runs again after a rank is gone, nor on an interrupt)
            self._withdraw(rebuild=isinstance(e, Exception) and not isinstance(e, DistributedError))
            self.engine._carry(changed)
            raise

    def settle_ended(self) -> None:
        """Settle now a launched step none of whose sequences is unfinished any more (their
        requests were aborted). Kept, it waited for the next request and was counted as a step
        lasting the idle gap (ba239c4); settled now, it is counted as the synchronous engine
        counts the step before an abort. A failure to read it is logged: the abort is done."""
        launched = self.launched
        if launched is None or any(not e.seq.is_finished for e in launched.batch.entries):
            return
        self.launched = None
        try:
            self._settle(launched, {})
        except Exception:  # noqa: BLE001 (the next step meets a device that failed anyway)
            log.warning("settling a step whose requests were all aborted failed", exc_info=True)
        finally:
            self._open = []

    def _withdraw(self, rebuild: bool = True) -> None:
        """An exception escaped `step` (the server's engine loop goes on after one): every step
        launched and not committed takes its placeholders and its sequences' counters back, so
        that their rows run again, as the synchronous engine's of a step it did not commit
        (without this a placeholder stayed in other requests' output as token 0)."""
        opened, self._open = self._open, []
        launching, self._launching = self._launching, None
        self.launched = None
        ran = [launched.batch for launched, _ in opened]
        if launching is not None:
            ran.append(launching.batch)
        for launched, tokens in opened:
            for entry in launched.batch.entries:
                seq = entry.seq
                row = seq.inflight
                if row is None or tokens is None or row.source is not tokens:
                    continue
                seq.num_computed_tokens -= rows_moved(seq, entry)
                seq.drop_inflight()
                seq.noise_epoch -= 1
        if not rebuild:  # (an interrupt, a rank gone: no forward runs here)
            recompute_later(self.engine, ran)
        elif self.engine.runner.hybrid:
            # A launched forward advanced its sequences' recurrent state past where their
            # counters now stand (moved back above, or never moved): rebuilt to match them, as
            # a failed step's are (`isolation.rebuild_state`); run again on the advanced state,
            # their rows gave other tokens than the synchronous engine's (found in review).
            for seq in still_running(ran):
                rebuild_state(self.engine, ScheduledSeq(seq, 0))

    def _step(self, changed: dict[str, dict[int, tuple[str, list[int]]]]) -> list[RequestOutput]:
        engine = self.engine
        start, retried = time.perf_counter(), engine.retried_batches
        self._waited = 0.0  # seconds this step waits for the device (reading verdicts)
        prev, self.launched = self.launched, None
        if prev is not None and not self.may_run_ahead():
            self._settle(prev, changed)
            prev = None
        if engine.spec is not None:
            # D-Cut plans from counts, which the placeholders keep right; a plan that drafts
            # settles the step in flight first (drafters read tokens; a held verify's are here)
            in_flight = [prev]

            def settle_first() -> None:
                if in_flight[0] is not None and not in_flight[0].held:
                    self._settle(in_flight[0], changed)
                    in_flight[0] = None

            failed = engine.spec.prepare(engine.scheduler.running, settle_first)
            if failed and in_flight[0] is not None and in_flight[0].held:
                # a failing sequence's held tokens are committed first (found in review)
                self._settle(in_flight[0], changed)
                in_flight[0] = None
            for seq, message in failed:
                if not seq.is_finished:
                    engine._fail(seq, message)
                    changed.setdefault(seq.request_id, {}).setdefault(seq.seq_id, ("", []))
            prev = in_flight[0]
        batch = engine.scheduler.schedule(hold=prev is not None)
        if batch is None:  # it would preempt or fail a sequence whose token is in flight
            self._settle(prev, changed)
            prev = None
            batch = engine.scheduler.schedule()
        engine._scheduled(batch, changed)
        launched = ran_now = None
        ahead = prev is not None
        verifies = any(e.drafts for e in batch.entries)
        # a probe whose drafts were all cut runs ahead as a plain step, observed at its settle
        # (`probes_ahead`), or else synchronously
        learns = not verifies and engine.spec is not None and engine.spec.needs_verdicts
        if verifies or (learns and not probes_ahead(engine)):
            # a verify, or a step whose verdicts the drafter and D-Cut learn from: its verdicts
            # are read now (the step before is settled: drafting waited for it, or it is a held
            # verify), and a verify's commit runs while the next step's forward does where it
            # may be held
            holds = verifies and can_hold(engine)
            if prev is not None and not (holds and prev.held):
                self._settle(prev, changed)
                prev = None
            if holds:
                self.launched = run_held(self, batch, start, changed, prev)
                self.held_verifies += self.launched is not None
                prev = None
            else:
                self._run_now(batch, start, changed)
            ran_now = batch
        elif batch.entries:
            launched = self._launch(batch, start)
            self._launching = launched
            if launched is not None and learns:
                launched.state = engine.spec.step_state()
                self.probes_ahead += 1
            if launched is None:  # its launch raised: after the step before, synchronously
                if prev is not None:
                    self._settle(prev, changed)
                    prev = None
                self._run_now(batch, start, changed, self._failed)
                ran_now = batch
        if prev is not None:
            self._settle(prev, changed)
        outputs = engine._outputs(changed)
        timed = ran_now if ran_now is not None else launched and launched.batch
        spec = engine.spec
        if spec is not None and timed is not None:
            # (not a step whose batch failed and ran again one sequence at a time)
            seconds = time.perf_counter() - start if engine.retried_batches == retried else None
            synchronous_plain = ran_now is not None and ran_now.phase is Phase.DECODE
            if synchronous_plain and seconds is not None and not spec.asked:
                # a plain step run synchronously (a grammar in the batch, a failed
                # launch): priced as the synchronous engine prices its plain steps
                spec.host.plain(len(ran_now.entries), seconds)
            # every step: a verify step after a verify step is what drafting costs, whole
            spec.timed_step(timed, seconds)
        if launched is not None:
            self.launches += 1
            self.launches_ahead += ahead
            # after the step before is settled: one placeholder a sequence at most; open
            # before its placeholders go out, so that an exception while they do takes back
            # those already out (found in review: a prefix-cache commit raising left token 0
            # in every output)
            self._open = [(launched, launched.tokens)]
            self._advance(launched)
            self._launching = None
            # (a step whose sequences the step before all ended is thrown away now: kept, it
            # was settled by the next call, whenever a request came, and counted as a step
            # whose time was the idle time between them; found in review)
            if any(not e.seq.is_finished for e in launched.batch.entries):
                self.launched = launched
            else:
                self._open = []
            spec = engine.spec
            if (
                ahead
                and spec is not None
                and launched.batch.phase is Phase.DECODE
                and not spec.asked
            ):
                # D-Cut prices drafting against a whole plain step, as this engine runs one: the
                # launch and the wait for the step before (after a step that ran synchronously
                # there is no wait, and the launch alone is no step's cost); and the host work
                # it hid behind the device, which a verify step, synchronous, pays on top
                # (on the CPU the launch computes the forward: nothing is hidden, as in the
                # synchronous engine)
                seconds = time.perf_counter() - start
                hidden = seconds - self._waited if engine.runner.device.type == "cuda" else None
                spec.host.plain(len(launched.batch.entries), seconds, hidden)
        return outputs

    def _launch(self, batch: Batch, start: float) -> Launched | None:
        engine = self.engine
        self._failed = False
        if not self.may_run_ahead():  # the step after waits for this one anyway: no deferral
            return None
        runner = engine.runner
        runner.while_forward_runs = engine.while_forward(batch)
        try:
            out = runner.execute(batch, defer=True)
        except DistributedError:
            raise
        except Exception:  # noqa: BLE001 (run again synchronously, which isolates it)
            # said, not swallowed: a launch that always failed would silently make the engine
            # synchronous (found in review: tests whose wrappers refused `defer` did)
            log.warning("a step launched ahead failed; it runs again synchronously", exc_info=True)
            self._failed = True
            return None
        finally:
            runner.while_forward_runs = None
        return Launched(batch, out, start, batch.num_prompt_rows)

    def _run_now(self, batch: Batch, start: float, changed: dict, failed: bool = False) -> None:
        """A step the synchronous way (`isolation.run_batch`), without the sequences that the
        step before ended meanwhile. `failed`: its launch raised, perhaps after a hybrid
        target's layers advanced some sequences' state: each runs alone after its state is
        rebuilt, as a failed synchronous step does (run again whole, a failure that did not
        recur ran on the advanced state)."""
        engine = self.engine
        batch = Batch([e for e in batch.entries if not e.seq.is_finished])
        prompt_rows = batch.num_prompt_rows  # before the commit moves the counters
        # the text the steps before deferred is made while this forward runs, as when the
        # synchronous engine runs a step (a verify step ran it after the forward before)
        runner = engine.runner
        runner.while_forward_runs = engine.while_forward(batch)
        try:
            out = run_batch(engine, batch, rebuild=failed and engine.runner.hybrid)
        finally:
            runner.while_forward_runs = None
        emitted = engine._commit(out, changed)
        engine._mark_errors(batch, changed)
        engine._record_step(batch, prompt_rows, emitted, start)

    def _advance(self, launched: Launched) -> None:
        """Move the counters of a launched step's sequences past its rows, and give each
        sampling one a placeholder for the token still on the device.

        The pages its rows fill are offered to the prefix cache now, as vLLM caches a block
        when it is scheduled: a request admitted by the next step, scheduled before this one is
        settled, then hits them as it would in the synchronous engine (its forward runs after
        this one on the stream). Their tokens are all known: the one placeholder a sequence
        holds is past its computed rows. Not where a drafter keeps K/V rows in the pages: their
        marks need tokens the placeholder stands for; those are offered at the commit."""
        out = launched.out
        tokens = launched.tokens
        cache = self.engine.allocator.cache
        # (0: nothing offered here)
        page = cache.page_size if cache is not None and cache.draft_kv is None else 0
        row = 0
        penalties = self.engine.runner.penalties
        # the sequences given a placeholder and their rows of `tokens`, for the penalties'
        # counts: only while some sequence holds a row (the launch gave this step's its row)
        sampled, at = [], []
        penalised = penalties.holds_rows
        for entry in out.entries:
            seq = entry.seq
            if entry.samples:
                row += 1
            if seq.status is FINISHED:  # the step before ended it: this row is thrown away
                continue
            # (made first: a sequence moves all at once or not at all, so that `_withdraw` can
            # take back every one that moved)
            inflight = DeviceRow(tokens, row - 1, 1) if entry.samples else None
            seq.num_computed_tokens += entry.num_rows
            if inflight is not None:
                seq.noise_epoch += 1
                seq.output_token_ids.append(0)
                seq.inflight = inflight
                if penalised:
                    sampled.append(seq)
                    at.append(row - 1)
            if page and seq.num_computed_tokens >= (seq.num_registered_pages + 1) * page:
                offer_pages(cache, seq)
        if sampled:  # the penalties' counts take those tokens on the device
            penalties.launched(sampled, at, tokens.tensor)
        states = self.engine.runner.states
        if page and states is not None:  # a hybrid's snapshots, all at once
            states.flush_snapshots()

    def _settle(self, launched: Launched, changed: dict) -> None:
        """Read a launched step's verdicts and commit them (the counters moved already)."""
        engine = self.engine
        out = launched.out
        if engine.emitter.has_pending:
            # the text the steps before left, made while this one still runs on the device
            # (its commit would make it first, after the wait)
            engine.emitter.drain()
        waited = time.perf_counter()
        out.settle()
        self._waited += time.perf_counter() - waited
        emitted = launched.emitted + engine._commit(
            out, changed, advanced=True, state=launched.state
        )
        self._open = [o for o in self._open if o[0] is not launched]
        engine._mark_errors(launched.batch, changed)
        engine._record_step(launched.batch, launched.prompt_rows, emitted, launched.start)
