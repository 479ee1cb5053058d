"""Recurrent-state slots of a hybrid (Gated DeltaNet) target: which pool entry each running
sequence's state lives in, and how a verify's acceptance is committed to it.

The scheduler gives every running sequence a state slot (`Sequence.slot`, bounded by
`max_num_seqs`); entry 0 of the `GDNState` pool is a dummy that graph padding reads and writes.
A sequence starting from its first token (a new request, or a recompute after preemption) has its
entry zeroed before the forward; a finished or preempted sequence simply gives its slot back.
Prefill chunks and decode steps advance the entry in place.

A sequence resuming from a prefix-cache hit has its entry loaded from a snapshot instead
(`Sequence.state_restore`): snapshots live in a pool of their own (`add_snapshots`), taken from a
slot's committed state between steps (`save_snapshot`). The snapshot pool costs
`snapshot_bytes()` per entry (every GDN layer's conv window and delta-rule state).

Verify comes in the two variants of `EngineConfig.hybrid_verify_state`:
  - write_on_accept: slot s owns entry s + 1. The verify writes nothing; `commit` then advances
    the entry over the accepted rows only (the DEFER mode of `GDNState`).
  - per_row_slots: slot s owns the `width` = K+1 entries from 1 + s * width, one of them current.
    The verify writes the state after row t into the t-th entry after the current one (row 0
    overwrites the current entry, which is always accepted); `commit` moves the current entry
    to the last accepted row's, on the host, with no device work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from metrale.engine.sequence import ScheduledSeq
from metrale.engine.staging import to_device_packed
from metrale.models.gdn_state import GDNState, SplitState, StateMode

DUMMY_ENTRY = 0


class StateSlots:
    def __init__(
        self,
        model,
        max_num_seqs: int,
        variant: str,
        max_verify_rows: int,
        ssm_dtype: torch.dtype = torch.float32,
    ) -> None:
        """`variant`: "write_on_accept" or "per_row_slots"; `max_verify_rows`: the most rows a
        verify gives one sequence (K+1), the entries each slot needs with per-row slots;
        `ssm_dtype`: the delta-rule state's storage type."""
        self.per_row = variant == "per_row_slots"
        self.width = max(max_verify_rows, 1) if self.per_row else 1
        self.verify_mode = StateMode.ROWS if self.per_row else StateMode.DEFER
        self.pool: GDNState = model.make_state(
            self.entries_for(max_num_seqs, variant, max_verify_rows), ssm_dtype
        )
        self.device = self.pool.ssm[0].device if self.pool.ssm else torch.device("cpu")
        self._current = [0] * max_num_seqs  # per slot: its current entry among its `width`
        self.snapshots: GDNState | None = None
        self._saves: list[tuple[int, int]] = []  # queued snapshots: (snapshot, pool entry)

    @staticmethod
    def entries_for(max_num_seqs: int, variant: str, max_verify_rows: int) -> int:
        """Pool entries: the dummy, then each slot's (K + 1 of them with per-row slots)."""
        width = max(max_verify_rows, 1) if variant == "per_row_slots" else 1
        return 1 + max_num_seqs * width

    def nbytes(self) -> int:
        """Bytes of the state pool (what the variant costs in memory)."""
        return self.pool.nbytes()

    def add_snapshots(self, count: int) -> None:
        """A pool of `count` recurrent-state snapshots (prefix caching on a hybrid target)."""
        self.snapshots = self.pool.zeros_like(count)

    def snapshot_bytes(self) -> int:
        """Bytes of one snapshot (and of one state entry)."""
        return self.pool.entry_bytes()

    def save_snapshot(self, slot: int, snapshot: int) -> None:
        """Copy `slot`'s committed state into snapshot entry `snapshot` (between steps): queued,
        and copied with the step's other snapshots by `flush_snapshots`. One at a time, each
        took two indexed copies per GDN layer and tensor (144 launches at the Qwen3-Next
        shapes): on the H200 a step admitting 5-12 prompts spent about 6 ms of host time there."""
        self._saves.append((snapshot, self.entry_of(slot)))

    def flush_snapshots(self) -> None:
        """Make the queued snapshots (`save_snapshot`), all at once; before anything reads a
        snapshot or changes a state entry (`_plan`), and at the end of each commit."""
        if not self._saves:
            return
        # an entry saved twice (its snapshot dropped and the entry taken again) keeps the last
        latest = dict(self._saves)
        self._saves = []
        dst, src = to_device_packed([list(latest), list(latest.values())], self.device)
        self.snapshots.copy_entries(dst, self.pool, src)

    def entry_of(self, slot: int) -> int:
        """The pool entry holding a slot's committed state."""
        return 1 + slot * self.width + self._current[slot]

    def _plan(
        self, entries: list[ScheduledSeq | None], verify: bool, width: int | None = None
    ) -> tuple[list[int], list[int] | None]:
        """Entries for one forward over `entries` in packed order (None: a padding sequence of
        a graph, on the dummy entry): (the entry each sequence starts from, and for a per-row-slot
        verify the entry after each of its rows, [B * T] flattened, T = `width` or else the most
        rows). Zeroes the entries of sequences that start from their first token, loads those
        resuming from a snapshot."""
        self.flush_snapshots()  # (a fresh sequence's slot may be a queued snapshot's source)
        fresh, loads, snapshots = [], [], []
        for e in entries:
            if e is None:
                continue
            if e.seq.state_restore >= 0:  # a prefix-cache hit: its state resumes from a snapshot
                self._current[self._slot(e)] = 0
                loads.append(self.entry_of(e.seq.slot))
                snapshots.append(e.seq.state_restore)
                e.seq.state_restore = -1
            elif e.seq.num_computed_tokens == 0:
                self._current[self._slot(e)] = 0
                fresh.append(self.entry_of(e.seq.slot))
        if fresh:
            (fresh_t,) = to_device_packed([fresh], self.device)
            self.pool.reset(fresh_t)
        if loads:
            loads_t, snapshots_t = to_device_packed([loads, snapshots], self.device)
            self.pool.copy_entries(loads_t, self.snapshots, snapshots_t)
        read = [DUMMY_ENTRY if e is None else self.entry_of(self._slot(e)) for e in entries]
        if not (verify and self.per_row):
            return read, None
        t = width or max(1 if e is None else e.num_rows for e in entries)
        rows = []
        for e in entries:
            if e is None:
                rows += [DUMMY_ENTRY] * t
                continue
            if e.num_rows > self.width:
                raise RuntimeError(
                    f"a verify of {e.num_rows} rows on per-row state slots sized for {self.width}"
                )
            base, cur = 1 + e.seq.slot * self.width, self._current[e.seq.slot]
            rows += [base + (cur + r) % self.width for r in range(e.num_rows)]
            rows += [DUMMY_ENTRY] * (t - e.num_rows)
        return read, rows

    @staticmethod
    def _slot(e: ScheduledSeq) -> int:
        if e.seq.slot < 0:
            raise RuntimeError("a sequence without a state slot reached the hybrid runner")
        return e.seq.slot

    def addresses(
        self, entries: list[ScheduledSeq | None], verify: bool, width: int | None = None
    ) -> tuple[StateMode, torch.Tensor, torch.Tensor | None]:
        """How one forward over `entries` (packed order; None: a graph's padding sequence)
        addresses the pool: (mode, the entry each sequence reads [B], for a per-row-slot verify
        the entry after each of its rows [B, T], else None), on the device. `verify`: a forward
        with drafts, in the configured variant. `width`: T, the rows the forward pads each
        sequence to (a ragged program's; default the most rows). Zeroes the entries of fresh
        sequences."""
        mode, read, rows = self.plan_addresses(entries, verify, width)
        if rows is None:
            (read_t,) = to_device_packed([read], self.device)
            return mode, read_t, None
        read_t, rows_t = to_device_packed([read, rows], self.device)
        return mode, read_t, rows_t.view(len(read), -1)

    def plan_addresses(
        self, entries: list[ScheduledSeq | None], verify: bool, width: int | None = None
    ) -> tuple[StateMode, list[int], list[int] | None]:
        """`addresses` as host lists, the per-row entries flattened: what a program's inputs
        take in their one copy (`engine/graph_inputs.py`)."""
        read, rows = self._plan(entries, verify, width)
        return self.verify_mode if verify else StateMode.WRITE, read, rows

    def bind(self, entries: list[ScheduledSeq], verify: bool) -> GDNState:
        """The state an eager forward over `entries` (packed order) takes."""
        mode, read, rows = self.addresses(list(entries), verify)
        return self.pool.view(read, mode, rows)

    def split_addresses(
        self, head: list[ScheduledSeq | None], tail: list[ScheduledSeq | None], width: int
    ) -> tuple[StateMode, torch.Tensor, torch.Tensor | None]:
        """`addresses` of a mixed program (`GDNMixedShape`): the head's sequences (prompt
        chunks, WRITE) then the tail's (the verify's, padded to `width` rows), their entries
        read [B] in one, and the tail's per-row slots [tail B, width] (or None)."""
        _, read, rows = self.plan_split(head, tail, width)
        packed = to_device_packed([read] + ([] if rows is None else [rows]), self.device)
        rows_t = None if rows is None else packed[1].view(len(tail), width)
        return self.verify_mode, packed[0], rows_t

    def plan_split(
        self, head: list[ScheduledSeq | None], tail: list[ScheduledSeq | None], width: int
    ) -> tuple[StateMode, list[int], list[int] | None]:
        """`split_addresses` as host lists (`plan_addresses`)."""
        head_read, _ = self._plan(head, False)
        tail_read, rows = self._plan(tail, True, width)
        return self.verify_mode, head_read + tail_read, rows

    def bind_split(self, entries: list[ScheduledSeq], head_seqs: int) -> SplitState:
        """The state an eager forward over `entries` takes whose first `head_seqs` (prompt
        chunks) advance in place and the rest verify (`gdn_state.SplitState`)."""
        head, tail = entries[:head_seqs], entries[head_seqs:]
        width = max(e.num_rows for e in tail)
        mode, read, rows = self.split_addresses(list(head), list(tail), width)
        head_rows, head_width = sum(e.num_rows for e in head), max(e.num_rows for e in head)
        return SplitState.of(self.pool, read, mode, rows, head_seqs, head_rows, head_width, width)

    def commit(
        self,
        state: GDNState | SplitState,
        entries: list[ScheduledSeq | None],
        last_rows: list[int],
        apply: Callable[[GDNState, torch.Tensor], None] | None = None,
    ) -> None:
        """After a verify forward over `entries` that ran on `state`: each sequence's committed
        state becomes its state after row last_rows[b] (0-based: its last token plus the
        accepted drafts; ignored for padding). `apply(state, num_rows)` runs a write-on-accept
        commit (default `state.commit`; the graph runner's for a replayed program)."""
        if isinstance(state, SplitState):  # the prompt chunks' rows were written in place
            p = state.head_seqs
            self.commit(state.tail, entries[p:], last_rows[p:], apply)
            return
        if self.per_row:
            for e, row in zip(entries, last_rows, strict=True):
                if e is not None:
                    self._current[e.seq.slot] = (self._current[e.seq.slot] + row) % self.width
            return
        (num_rows,) = to_device_packed([[r + 1 for r in last_rows]], self.device)
        if apply is None:
            state.commit(num_rows)
        else:
            apply(state, num_rows)

    def entry(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv window, delta-rule state) of a slot's committed state in one GDN layer."""
        index = self.entry_of(slot)
        return self.pool.conv[layer][index], self.pool.ssm[layer][index]
