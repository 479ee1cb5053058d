"""Failure isolation for the engine's step: a batch whose forward raises is run again one sequence
at a time, so only the sequence that caused it ends (`finish_reason="error"`) and the others go
on. On a hybrid target the failed forward may have advanced some GDN layers' state, so each
sequence's state is rebuilt first, by re-running its computed rows from where its state started:
its first token, or the prefix-cache snapshot it resumed from. A sequence whose rebuild needs
scratch pages the pool cannot lend is preempted instead (recomputed later), never failed.
"""

from __future__ import annotations

import logging

import torch

from metrale.distributed.parallel import DistributedError
from metrale.engine.sequence import Batch, ScheduledSeq, Sequence, SequenceStatus
from metrale.engine.step_output import StepOutput

log = logging.getLogger(__name__)


def run_batch(engine, batch: Batch, rebuild: bool = False) -> StepOutput:
    """Run the batch; if the forward fails, isolate the failing sequence(s) by running each
    alone, so one bad sequence never takes the others down. `rebuild`: the batch's forward
    failed already (a step launched ahead, `engine/ahead.py`): each runs alone at once, a hybrid
    target's state rebuilt first."""
    if not batch.entries:
        return StepOutput([], [], torch.empty(0), [])
    if rebuild:
        engine.retried_batches += 1
    else:
        try:
            return engine.runner.execute(batch)
        except DistributedError:
            raise  # a rank is gone: no sequence can run, so none is retried alone
        except Exception as e:  # noqa: BLE001 (isolation: any error ends only its sequence)
            if len(batch.entries) == 1:
                log.exception("sequence %s failed", batch.entries[0].seq.request_id)
                engine._fail(batch.entries[0].seq, f"{type(e).__name__}: {e}")
                return StepOutput([], [], torch.empty(0), [])
            # said, so that a step that keeps failing (and running N times) is seen; counted,
            # so that a timing of this step (D-Cut's `timed_step`) is not taken as a step's cost
            engine.retried_batches += 1
            log.warning(
                "a batch of %d sequences failed (%s: %s); running each alone",
                len(batch.entries),
                type(e).__name__,
                e,
            )
    parts = []
    for entry in batch.entries:
        if engine.runner.hybrid and not rebuild_state(engine, entry):
            continue
        parts.append(run_batch(engine, Batch(entries=[entry])))
    return StepOutput.merge(parts)


def rebuild_state(engine, entry: ScheduledSeq) -> bool:
    """Rebuild a hybrid sequence's state by re-running its computed rows from where its state
    started, in chunks of the step budget. False when it does not run this step: its rebuild
    failed too (the sequence is then ended), or needs more scratch pages than are free (it is
    then preempted: the step's failure was not its own).

    NOTE: with prefix caching, rows it computed may sit in pages other sequences read (cached
    or shared ones): the re-run writes those rows into scratch pages instead, thrown away after,
    so a cached page is never written. Its private pages are rewritten in place, as without
    caching."""
    seq, done = entry.seq, entry.seq.num_computed_tokens
    start = seq.num_cached_tokens if seq.state_pin >= 0 else 0
    if done == start:  # nothing computed since: load (or zero) its state again before it runs
        seq.state_restore = seq.state_pin
        return True
    allocator, table, scratch = engine.allocator, seq.block_table, []
    chunk = engine.config.max_num_batched_tokens  # the step budget bounds each re-run
    rows, shared = [], []
    if allocator.cache is not None:
        # Pages others may read (cached, or mapped by another sequence) get scratch pages;
        # its private pages are rewritten in place, so a full pool rarely stops a rebuild.
        keep = start // allocator.page_size  # its snapshot sits on a page boundary
        need = allocator.pages_for(done)
        rows = table[keep:need]
        shared = [
            i for i, p in enumerate(rows) if allocator.cache.holds(p) or allocator.refs(p) > 1
        ]
        if len(shared) > allocator.num_free:
            # Recomputed from its tokens later, as a preemption is (its admission maps the
            # cached pages again and resumes from its snapshot): no scratch needed then.
            _preempt(engine, seq)
            return False
    try:
        if shared:
            scratch = allocator.take_scratch(len(shared))
            for i, page in zip(shared, scratch, strict=True):
                rows[i] = page
            seq.block_table = table[:keep] + rows + table[need:]
        for first in range(start, done, chunk):
            seq.num_computed_tokens = first
            seq.state_restore = seq.state_pin if first == start else -1
            engine.runner.execute(Batch(entries=[ScheduledSeq(seq, min(chunk, done - first))]))
    except Exception as e:  # noqa: BLE001 (isolation, as in run_batch)
        log.exception("sequence %s failed", seq.request_id)
        seq.num_computed_tokens, seq.block_table = done, table
        engine._fail(seq, f"{type(e).__name__}: {e}")
        return False
    finally:
        seq.state_restore = -1
        if seq.block_table is not table:
            seq.block_table = table
        allocator.free_scratch(scratch)
    seq.num_computed_tokens = done
    return True


def recompute_later(engine, batches: list[Batch]) -> None:
    """An exception escaped a step after its forward may have run (an interrupt, a failing
    commit) and nothing rebuilds now: on a hybrid target that forward advanced the GDN state
    of the batches' sequences past their counters, so each one still running is preempted,
    its state recomputed from its tokens when it is admitted again (found in review: the
    others' rows ran again on the advanced state and their output changed). A dense target's
    KV rows are rewritten as they run again: nothing to do."""
    if not engine.runner.hybrid:
        return
    for seq in still_running(batches):
        _preempt(engine, seq)


def still_running(batches: list[Batch]) -> list[Sequence]:
    """The distinct sequences of `batches` that are still running, in batch order."""
    seen: set[int] = set()
    found = []
    for batch in batches:
        for entry in batch.entries:
            seq = entry.seq
            if seq.seq_id not in seen and seq.status is SequenceStatus.RUNNING:
                seen.add(seq.seq_id)
                found.append(seq)
    return found


def _preempt(engine, seq: Sequence) -> None:
    """Preempt running `seq` as the scheduler's preemptions are (`LLMEngine._scheduled`: the
    count, and the drafter's state of it released)."""
    engine.scheduler.preempt(seq)
    engine._scheduled(Batch(entries=[], preempted=[seq]), {})
