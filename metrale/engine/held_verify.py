"""A verify step held one step (asynchronous scheduling, `engine/ahead.py`): its verdicts are read
as soon as its forward is done, as a synchronous verify's are, but its commit (emission, stop
checks, the drafter's and D-Cut's observation, the telemetry, the prefix cache's offers) runs
while the next step's forward runs on the device, not between the two forwards.

Why. A verify step cannot be launched before the step in flight is read (its inputs depend on
how many drafts that step accepted; issue 12's zero-bubble step is what removes that), so today
it runs synchronously: forward, wait, commit, then the next step's drafting, scheduling and
packing, with the device idle through all of that host work. The commit is the part that does not
decide the next step's inputs: on the H100 at batch 64 (qwen3-8b shape) it and the observation
were about 0.8 of the 2.8 ms of host work a verify step waited for (session 62's profile).

How. Once the verdicts are on the host each sequence is moved past its committed rows and its
tokens go into `output_token_ids` at once, as a placeholder (`HeldTokens`): their values are the
real ones, so drafters, D-Cut's caps and the scheduler see the sequence as the synchronous engine
would after the commit, and the next step is planned and drafted without waiting. That step's
commit work window (`ModelRunner.while_forward_runs`) then settles the held one: the placeholder
is dropped and the tokens emitted, in order, before that step's own verdicts are read. A sequence
the held step ends (EOS, a stop string, its length) has rows in the next step already: they are
computed and thrown away, as under asynchronous scheduling of plain steps.

The controller's per-step state (what was proposed, whether the step is observed) is taken with
the held step (`SpeculativeDecoder.step_state`), since the next `prepare` resets it before the
held step is observed: the drafter and the telemetry learn from every verify at its commit, one
step later. D-Cut's estimates take its verdicts when they are read (`learn_held`), so the next
step is planned from them as the synchronous engine's is (learned at the commit, the plans lagged
a step: 2% more steps a closed batch at batch 64, `benchmarks/simulated_device.py`).

A D-Cut probe step whose drafts were all cut is a plain decode step whose verdicts D-Cut learns
from (each probed sequence's first draft against the token it emitted): it is launched ahead like
a plain step and observed at its settle with its own state (`probes_ahead`); it used to run
synchronously and drain the pipeline twice (before it, for the drafter, which reads tokens, and
after it). The plan of the step after a probe is then made before the probe is observed, and
made again once it is (`Observing._learn`).

Where a verify is not held (`can_hold`), it runs synchronously as before:
- a hybrid target (its recurrent state commits inside the step and its snapshots with the pages);
- a drafter that is not `stateless` (MTP learns from every step's verdicts before it drafts) or
  that reads the step's hidden states (`needs_hidden`: a program's buffer, rewritten by the next
  step);
- penalties (their device counts take a step's tokens at its commit);
- `METRALE_NO_HELD_VERIFY=1` (A/B runs).
Grammars keep the whole engine synchronous already (`AheadStepper.may_run_ahead`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from metrale.distributed.parallel import DistributedError
from metrale.engine.isolation import run_batch
from metrale.engine.sequence import Batch, SequenceStatus
from metrale.engine.step_output import StepOutput
from metrale.engine.stop import reaches_length
from metrale.knobs import knobs

FINISHED = SequenceStatus.FINISHED
log = logging.getLogger(__name__)


class HeldTokens:
    """`Sequence.inflight` of a held verify: the last `length` of its `output_token_ids` are that
    step's tokens (their values, not emitted yet), and its counters moved by `rows` for them."""

    __slots__ = ("source", "length", "rows")

    def __init__(self, source: object, length: int, rows: int) -> None:
        """`source`: the held step (`AheadStepper._withdraw` matches placeholders by it)."""
        self.source, self.length, self.rows = source, length, rows

    def __len__(self) -> int:
        return self.length


def rows_moved(seq, entry) -> int:
    """The rows a launched step moved `seq` past (`entry`: its rows there): a held verify's
    placeholder says (its committed rows alone), else all the step ran for it."""
    held = seq.inflight
    return held.rows if type(held) is HeldTokens else entry.num_rows


@dataclass
class StepState:
    """What the controller knew of a step when it ran (`SpeculativeDecoder.step_state`): whether
    its verdicts are observed, and the drafts proposed (seq_id -> (real drafts verified, the
    proposed tokens)) and their device sources, which `observe` reads."""

    observing: bool
    proposed: dict
    sources: set
    # verdicts of its sequences committed before the others (those it ended, `run_held`),
    # observed with the others' as one step's (the telemetry files a verify by its width)
    early: list = field(default_factory=list)
    # whether D-Cut's estimates took its verdicts already (`SpeculativeDecoder.learn_held`)
    learned: bool = False


def can_hold(engine) -> bool:
    """Whether a verify step of `engine` may be held (the module's docstring)."""
    spec, runner = engine.spec, engine.runner
    return (
        spec is not None
        and runner.states is None
        and getattr(spec.drafter, "stateless", False) is True
        and not spec.drafter.needs_hidden
        and not runner.penalties.holds_rows
        and not knobs().no_held_verify
    )


def probes_ahead(engine) -> bool:
    """Whether a D-Cut probe step whose drafts were all cut (a plain decode step whose verdicts
    teach D-Cut each probed sequence's first draft) may be launched ahead like a plain step and
    observed at its settle, with its controller state: a drafter that is `stateless` (nothing
    else learns from it) and reads no hidden states (a program's buffer, rewritten by the next
    step), the knob unset. D-Cut's next plan is then made before it is observed."""
    spec = engine.spec
    return (
        spec is not None
        and getattr(spec.drafter, "stateless", False) is True
        and not spec.drafter.needs_hidden
        and not knobs().no_held_verify
    )


def ends_now(seq, ids: list[int], max_model_len: int) -> bool:
    """Whether emitting `ids` ends `seq` by a token alone (its length, EOS, a stop token id) or
    fails it (-1: logits that were not finite), as the commit would find token by token
    (`stop.token_stop`; a grammar's end aside: a sequence under one is never held). Worked out
    from the counts, not token by token: this runs for every sequence of every held verify."""
    if not ids:
        return False
    params = seq.params
    n = len(seq.output_token_ids)
    if seq.error is not None or min(ids) < 0:
        return True
    # (the lengths only grow: some token reaches a limit iff the last one does)
    if reaches_length(seq, n + len(ids), seq.num_tokens + len(ids), max_model_len):
        return True
    stops = params.stop_token_ids
    eos = () if params.ignore_eos else seq.eos_token_ids
    if stops or eos:
        first = max(params.min_tokens - n - 1, 0)  # token i counts once n + i + 1 >= min_tokens
        return any(t in stops or t in eos for t in ids[first:])
    return False


def hold(launched, out, cache, max_model_len: int) -> tuple[int, set[int]]:
    """Move each unfinished sequence of a verify step whose verdicts are read (`out`) past its
    committed rows and give it its tokens as a `HeldTokens` placeholder, but those its tokens
    end (`ends_now`, for the caller to commit now); returns how many hold one, and the ids of
    the entries of those they end. The pages the rows filled are offered to the prefix cache
    (`cache`) now, as a plain step's are at its launch (`AheadStepper._advance`): the next
    step admits requests before this one is committed (found in review: they missed those
    pages). Not where a drafter keeps K/V rows in the pages: the commit offers those."""
    from metrale.engine.commit import offer_pages

    page = cache.page_size if cache is not None and cache.draft_kv is None else 0
    verdict_of = {id(v.entry): v for v in out.verdicts}
    held, ending = 0, set()
    for entry in out.entries:
        seq = entry.seq
        if seq.status is FINISHED:  # the step before ended it: its rows are thrown away
            continue
        v = verdict_of.get(id(entry))
        if v is None:  # a prompt chunk: its rows are computed, nothing to emit
            seq.num_computed_tokens += entry.num_rows
        else:
            ids = v.token_ids
            if ends_now(seq, ids, max_model_len):
                ending.add(id(entry))
                continue
            _hold_tokens(launched, entry, v, ids)
            held += 1
        if page and seq.num_computed_tokens >= (seq.num_registered_pages + 1) * page:
            offer_pages(cache, seq)
    return held, ending


def _hold_tokens(launched, entry, v, ids: list[int]) -> None:
    """`hold`'s work for one sampling sequence (its verdict `v`, its tokens' `ids`)."""
    seq = entry.seq
    committed = entry.num_rows - len(entry.drafts) + v.num_accepted
    # (made first: a sequence moves all at once, so that `_withdraw` can take it back)
    row = HeldTokens(launched, len(ids), committed)
    seq.num_computed_tokens += committed
    seq.noise_epoch += 1  # (the commit counts it for a step not held)
    seq.output_token_ids.extend(ids)
    seq.inflight = row


def _split(out, ending: set[int]):
    """`out` as two `StepOutput`s: the entries whose ids are in `ending`, then the others."""
    parts = ([], [], []), ([], [], [])
    verdict_of = {id(v.entry): v for v in out.verdicts}
    for entry, end in zip(out.entries, out.row_ends, strict=True):
        entries, verdicts, ends = parts[0] if id(entry) in ending else parts[1]
        entries.append(entry)
        ends.append(end)
        if id(entry) in verdict_of:
            verdicts.append(verdict_of[id(entry)])
    return [StepOutput(e, v, out.hidden, r) for e, v, r in parts]


def run_held(stepper, batch, start: float, changed: dict, prev):
    """Run verify step `batch` of `stepper` (an `AheadStepper`) and hold it: its forward, the
    held step before it (`prev`, or None) committed while that forward runs, its verdicts read,
    its sequences moved (`hold`). Returns the held step (a `Launched`), or None where none of
    its sequences holds tokens.

    The sequences that the step's tokens end by a token alone (`ends_now`) are committed now,
    not held: held, they would run one more step for nothing (at every closed batch's end) and
    keep their slots and pages a step longer. What ends a sequence by its text (a stop string)
    is found at the commit: its next step's rows are thrown away. The sequences the step before
    ended run all the same: their rows are thrown away (filtered first, the batch's rows would
    no longer be the ones scheduled and reserved)."""
    from metrale.engine.ahead import Launched  # (ahead imports this module)

    engine = stepper.engine
    runner = engine.runner
    batch = Batch([e for e in batch.entries if not e.seq.is_finished])
    prompt_rows = batch.num_prompt_rows  # before the sequences move
    state = engine.spec.step_state()
    pending = [prev]  # the held step, until committed
    failed: list[BaseException] = []

    def window() -> None:
        # Its commit first (the text the steps before it deferred included), then this step's
        # own overlapped work. A failure of the commit is raised after the forward, not logged
        # and dropped as `ModelRunner._overlap` drops the work's.
        if pending[0] is not None:
            held, pending[0] = pending[0], None
            try:
                stepper._settle(held, changed)
            except BaseException as e:  # noqa: BLE001 (raised below)
                failed.append(e)
                return
        work = engine.while_forward(batch)
        if work is not None:
            work()

    runner.while_forward_runs = window
    try:
        try:
            out = runner.execute(batch)
        except DistributedError:
            raise
        except Exception as e:  # noqa: BLE001 (isolation: each alone, as `run_batch` does)
            if failed:
                raise failed[0] from e
            # Isolation fails the sequences whose forward fails alone: the held step is
            # committed first, so that none of them loses the tokens it holds (found in
            # review), and those its commit ends run no more
            if pending[0] is not None:
                held, pending[0] = pending[0], None
                stepper._settle(held, changed)
            batch = Batch([e for e in batch.entries if not e.seq.is_finished])
            log.warning("a verify batch failed (%s: %s); running each alone", type(e).__name__, e)
            out = run_batch(engine, batch, rebuild=True)
    finally:
        runner.while_forward_runs = None
    if failed:
        raise failed[0]
    if pending[0] is not None:  # (no forward reached its window)
        stepper._settle(pending[0], changed)
    launched = Launched(batch, out, start, prompt_rows, state=state, held=True)
    # D-Cut learns its verdicts now: the next step's plan is made before its commit
    engine.spec.learn_held(out.verdicts, state)
    # open before the placeholders go out (`AheadStepper._withdraw` takes back those that did)
    stepper._open = [(launched, launched)]
    held, ending = hold(launched, out, engine.allocator.cache, engine.emitter.max_model_len)
    if ending:
        # (their verdicts observed with the others', as one step's: `StepState.early`)
        now, launched.out = _split(out, ending)
        launched.emitted = engine._commit(now, changed, state=state, observe_later=True)
        engine._mark_errors(Batch(now.entries), changed)
    if not held:
        stepper._open = []
        # nothing to emit, but the step was one: its commit observes and counts it now
        stepper._settle(launched, changed)
        return None
    return launched
