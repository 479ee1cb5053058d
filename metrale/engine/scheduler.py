"""Continuous batching: FCFS admission, chunked prefill, decode, preemption by recompute, abort.

Each step spends a token budget (`max_num_batched_tokens` rows): running sequences first, oldest
first (a decode costs one row, an unfinished prefill the rest of its chunk), then waiting
sequences in arrival order while rows, `max_num_seqs` and free pages last. When a running
sequence cannot get the pages its rows need, the newest running sequence is preempted: its pages
are freed and it goes back to the waiting queue to be recomputed from its tokens later. Pages are
reserved for every row a step will write, plus `lookahead` rows for sequences that sample, cut
to the rows the sequence can ever write and the pool holds (`_reach`): speculation never makes a
sequence need more pages than plain decoding does, it drafts fewer (or none) instead.

With prefix caching, a sequence being admitted first maps the cached pages its tokens start with
(`PrefixCache.match`) and prefills only the rest; on a hybrid target its prefill chunks are cut
to end at its snapshot boundaries (`Sequence.snapshot_at`), where its state is saved.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterable

from metrale.engine.kv_cache import PageAllocator
from metrale.engine.prefix_cache import Hit
from metrale.engine.sequence import Batch, ScheduledSeq, Sequence, SequenceStatus
from metrale.engine.stop import reaches_length

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        lookahead: int = 0,
    ) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookahead = lookahead
        # Where lookahead rows stop for every sequence: the pool's rows.
        self._row_limit = allocator.num_usable * allocator.page_size
        # The most tokens a sequence holds (the engine's context length): one whose tokens in
        # flight reach it, or its `max_tokens`, ends when they are committed (`_ends_in_flight`)
        self.context_len = self._row_limit
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []  # in admission order; the last is the newest
        self.num_preemptions = 0
        # Slots of running sequences: bounded by max_num_seqs, lowest first (canonical verify
        # order walks slots ascending, so low, dense slots keep runs contiguous).
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _rows_needed(self, seq: Sequence, num_rows: int) -> int:
        """Rows the block table must cover after this step, plus the lookahead when the
        sequence can draft next step: when it samples now, and also when this chunk stops one
        token short of the prompt's end (the next step is then a decode, and a drafter writes
        its own rows past that token before the scheduler runs again)."""
        return self._reach(seq, seq.num_computed_tokens + num_rows)

    def _reach(self, seq: Sequence, end: int) -> int:
        """Rows reserved when a step's rows end at `end`: the lookahead only as far as the
        sequence can ever write (with `max_tokens`, its last verify row is one short of its
        last token, as plain decoding's last row is) and the pool holds. Never below `end`:
        the step's own rows (a draft row past the pool is dropped by `schedule`, and a row
        past `max_tokens` of a step launched ahead is written all the same)."""
        if not self.lookahead or end < seq.num_tokens - 1:
            return end
        limit = self._row_limit
        max_tokens = seq.params.max_tokens
        if max_tokens is not None:
            limit = min(limit, seq.num_prompt_tokens + max_tokens - 1)
        return max(end, min(end + self.lookahead, limit))

    @staticmethod
    def _chunk(seq: Sequence, start: int, budget: int) -> int:
        """Prompt rows from `start` this step: the rest, cut to the budget and, on a hybrid
        target with prefix caching, to its next snapshot boundary."""
        rows = min(seq.num_tokens - start, budget)
        if rows > 1 and seq.snapshot_at and seq.snapshot_at[0] > start:
            rows = min(rows, seq.snapshot_at[0] - start)
        return rows

    def _drafts_for(self, seq: Sequence, budget: int) -> list[int]:
        """The drafts a decoding sequence verifies this step, cut to the row budget."""
        if seq.draft is None or seq.num_tokens - seq.num_computed_tokens != 1 or budget < 2:
            # (a budget of one row leaves no draft: a device drafter's row cut to length 0 made
            # an empty fill that failed the step's packing; found in review)
            return []
        return seq.draft.tokens[: budget - 1]

    def _ends_in_flight(self, seq: Sequence) -> bool:
        """Whether the tokens a sequence has in flight (asynchronous scheduling: placeholders,
        `Sequence.inflight`) bring it to its `max_tokens` or the context length: it ends when
        they are committed, whatever they are (`stop.token_stop`), so it is not scheduled
        again. Scheduled, its rows were computed and thrown away (a whole step at the end of
        every closed batch) and their pages reserved, evicting cached ones (found in review)."""
        return reaches_length(seq, len(seq.output_token_ids), seq.num_tokens, self.context_len)

    def _release_slot(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            self._free_slots.append(seq.slot)
            seq.slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self._release_slot(seq)
        seq.draft = None
        self.allocator.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def preempt(self, seq: Sequence) -> None:
        """Send running `seq` back to the waiting queue, to be recomputed later (a failed
        batch's state rebuild that the pool cannot lend scratch pages to:
        `isolation.rebuild_state`)."""
        self.running.remove(seq)
        self._preempt(seq)

    def _never_fits(self, seq: Sequence, need: int) -> bool:
        """A sequence whose rows exceed the whole pool can never run: it fails, alone."""
        pages = self.allocator.pages_for(need)
        if pages <= self.allocator.num_usable:
            return False
        self.allocator.free(seq)
        self._release_slot(seq)
        seq.error = f"sequence needs {pages} KV pages, the pool has {self.allocator.num_usable}"
        seq.error_by_request = True
        return True

    def schedule(self, hold: bool = False) -> Batch | None:
        """The step's batch. `hold`: tokens of running sequences are still being sampled (the
        asynchronous engine, `engine/ahead.py`), so no sequence may be preempted or failed now
        (its recompute would need them): None instead, and the engine schedules again once it
        has them (the pages reserved so far stay reserved, as that call wants them too)."""
        budget = self.max_num_batched_tokens
        batch = Batch(entries=[])
        alloc = self.allocator
        free = alloc.num_free  # what reservations may take, kept in step as the loop reserves
        idx = 0
        while idx < len(self.running) and budget > 0:
            seq = self.running[idx]
            if seq.inflight is not None and self._ends_in_flight(seq):
                idx += 1
                continue
            drafts = self._drafts_for(seq, budget)
            num_rows = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_rows > 1 and seq.snapshot_at:  # a prompt chunk (never a decode's one row)
                num_rows = self._chunk(seq, seq.num_computed_tokens, budget)
            num_rows += len(drafts)
            need = self._rows_needed(seq, num_rows)
            extra = alloc.extra_pages(seq, need)
            if extra <= free:
                # The common case: its rows fit the free pages (so the pool too), drafts and
                # all; the checks below, a few calls a sequence, were most of a step's
                # scheduling at batch 64.
                if extra:
                    alloc.reserve(seq, need)
                    free -= extra
            else:
                if hold:
                    return None
                if drafts and not alloc.can_fit(seq, need):
                    # Drafts are optional: drop them before evicting anyone for their rows.
                    num_rows -= len(drafts)
                    drafts, seq.draft = [], None
                    need = self._rows_needed(seq, num_rows)
                if self._never_fits(seq, need):
                    self.running.pop(idx)
                    batch.failed.append(seq)
                    continue
                while not alloc.can_fit(seq, need) and len(self.running) > idx + 1:
                    victim = self.running.pop()
                    self._preempt(victim)
                    batch.preempted.append(victim)
                if not alloc.can_fit(seq, need):
                    # Even with every newer sequence evicted it does not fit: it waits its turn.
                    self._preempt(self.running.pop(idx))
                    batch.preempted.append(seq)
                    break
                alloc.reserve(seq, need)
                free = alloc.num_free
            probs = None if not drafts else seq.draft.probs
            batch.entries.append(
                ScheduledSeq(seq, num_rows, drafts, None if probs is None else probs[: len(drafts)])
            )
            budget -= num_rows
            idx += 1

        # Admit new work only when nothing was preempted: admitting now would just evict again.
        while (
            self.waiting
            and budget > 0
            and not batch.preempted
            and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            try:
                hit = self._match(seq)
                start = seq.num_computed_tokens if hit is None else hit.tokens
                num_rows = self._chunk(seq, start, budget)
                need = self._reach(seq, start + num_rows)
                if self._never_fits(seq, need):
                    self.waiting.pop(0)
                    batch.failed.append(seq)
                    continue
                cached = [] if hit is None else hit.pages
                taken = 0 if hit is None else hit.idle  # idle cached pages it maps stop being free
                if self.allocator.pages_for(need) - len(cached) > self.allocator.num_free - taken:
                    break
                self.waiting.pop(0)
                if hit is not None:
                    self.allocator.share(seq, hit.pages)
                    self.allocator.cache.admit(seq, hit)
                self.allocator.reserve(seq, need)
            except Exception as e:  # noqa: BLE001 (its admission's failure: it alone ends)
                # Out of `schedule`, it failed every request of the step, again each step; or,
                # past `pop`, the sequence was lost: neither waiting nor running, its request
                # never answered (found in review). Its pages go back as it fails.
                log.exception("admitting %s failed", seq.request_id)
                if self.waiting and self.waiting[0] is seq:
                    self.waiting.pop(0)
                seq.error = f"admission failed: {type(e).__name__}: {e}"
                batch.failed.append(seq)
                continue
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:  # queue time ends (a re-admission keeps it)
                seq.first_scheduled_time = time.perf_counter()
            seq.slot = self._free_slots.pop()
            self.running.append(seq)
            batch.entries.append(ScheduledSeq(seq, num_rows))
            budget -= num_rows
        return batch

    def _match(self, seq: Sequence) -> Hit | None:
        """The cached prefix of a sequence about to be admitted (None: prefix caching is off).
        On a hybrid target it also sets where the sequence's state will be saved."""
        cache = self.allocator.cache
        if cache is None or seq.block_table:
            return None
        hit = cache.match(seq)
        seq.snapshot_at = cache.snapshot_targets(seq, hit)
        return hit

    def finish(self, seqs: Iterable[Sequence]) -> None:
        """Release finished (or aborted/failed) sequences: their pages return to the pool."""
        for seq in seqs:
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            self._release_slot(seq)
            self.allocator.free(seq)
            seq.draft = None
            seq.status = SequenceStatus.FINISHED
