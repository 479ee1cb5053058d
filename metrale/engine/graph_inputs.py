"""The captured programs' integer inputs (input ids, positions, KV slots, row offsets, sequence
lengths, block tables), sent from the host in one copy.

Every program reads them from static device buffers. A step used to pack its metadata into a
fresh pinned tensor (`staging.to_device_packed`), copy it into a fresh device tensor, then copy
each piece into the static buffers (`GraphRunner.load`: five copies, a fill, a table copy):
nine launches and two allocations between a verify's verdicts and the next forward, about
0.27 ms a step on the H100's host (`benchmarks/results/session78-h100/`). Here the five row and
sequence inputs are views of one flat device buffer, and the host writes a step's values into a
pinned buffer laid out the same way, so one copy moves them all (a hybrid target's state
entries and a prefill program's sampled rows too), with the device block tables' changes, a
per-row-slot verify's state slots and the indices of drafts still on the device behind them (its
tail). Block tables come
from the device tables by one `index_select` into the static buffer, or, below
`DeviceBlockTables.serves`, from the tail (the host's rows, padded to full width where they fit).

The host buffers are a ring (`PinnedRing`): a buffer is written again only once the copy that
last read it has run (its event), since with asynchronous scheduling the host packs a step while
the copy of the one before may still wait behind a forward. The eager forward and the drafters'
forwards keep `step_metadata.pack_spans`; the CPU reference of what a program sees is that
function's output, which the tests compare with these buffers (`tests/test_graph_inputs.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from metrale.engine.block_tables import DeviceBlockTables
from metrale.engine.device_tokens import Fills, pending_fills, record_now
from metrale.engine.kv_cache import DUMMY_PAGE
from metrale.engine.staging import to_device_packed
from metrale.engine.step_metadata import flatten_spans, padded_tables

# Host buffers in the ring: a step and the one launched ahead of it, with room to spare.
RING = 4
# Entries of the tail past a steady step's needs (`GraphInputs`): a few new sequences' tables.
TAIL_SPARE = 4096


class PinnedRing:
    """`count` host int64 buffers of `size` (pinned on CUDA), handed out in turn; each is
    returned to the host only once the device has run the copy that last read it."""

    def __init__(self, size: int, device: torch.device, count: int = RING) -> None:
        cuda = device.type == "cuda"
        self._tensors = [torch.zeros(size, dtype=torch.long, pin_memory=cuda) for _ in range(count)]
        self._arrays = [t.numpy() for t in self._tensors]
        self._events = [torch.cuda.Event() if cuda else None for _ in range(count)]
        self._recorded = [False] * count
        self._next = 0

    def take(self) -> tuple[int, np.ndarray, torch.Tensor]:
        """(index, numpy view, tensor) of the next buffer, free to write."""
        i = self._next
        self._next = (i + 1) % len(self._tensors)
        if self._recorded[i]:
            self._events[i].synchronize()  # (done long ago, but for a device far behind)
        return i, self._arrays[i], self._tensors[i]

    def sent(self, i: int) -> None:
        """Buffer `i`'s copies are queued: mark where the device is done with it."""
        event = self._events[i]
        if event is not None:
            record_now(event)
            self._recorded[i] = True


@dataclass
class Flat:
    """A step's host-side inputs (`step_metadata.flatten_spans`) and what they need."""

    spans: list
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    starts: list[int]
    seq_lens: list[int]
    fills: Fills
    max_seq_len: int
    width: int  # the widest block table


class GraphInputs:
    """The static integer inputs of programs of up to `rows` rows and `seqs` sequences whose
    block tables hold `pages` pages, on `device`, with the host ring that fills them."""

    def __init__(self, rows: int, seqs: int, pages: int, device: torch.device) -> None:
        self.rows, self.seqs, self.pages, self.device = rows, seqs, pages, device
        r, s = rows, seqs
        # ids, positions, slots, starts, lens, a hybrid's state entries read, sampled rows
        self._offsets = (0, r, 2 * r, 3 * r, 3 * r + s + 1, 3 * r + 2 * s + 1, 3 * r + 3 * s + 1)
        self._meta = 4 * r + 3 * s + 1
        # The tail holds a steady step's extras: two fill indices a row, a new page a sequence
        # (index and page) and its row, per-row state slots of up to 8 rows a sequence, a few
        # full tables. A step with more (new sequences' long tables) sends the rest by a second
        # copy: sized for the worst case, the ring would pin hundreds of MB at a 128k context.
        self._size = self._meta + 2 * r + 11 * s + 4 * pages + TAIL_SPARE
        self.flat = torch.zeros(self._size, dtype=torch.long, device=device)
        a, b, c, d, e, f, g = self._offsets
        self.input_ids, self.positions = self.flat[a:b], self.flat[b:c]
        self.slots, self.query_start_loc = self.flat[c:d], self.flat[d : d + s + 1]
        self.seq_lens, self.state_read = self.flat[e : e + s], self.flat[f : f + s]
        self.sample_rows = self.flat[g : g + r]
        self.block_tables = torch.zeros(s, pages, dtype=torch.long, device=device)
        # a per-row-slot verify's state entries: from the tail, too wide to copy every step
        self.state_rows = torch.zeros(s * r, dtype=torch.long, device=device)
        self._ring = PinnedRing(self._size, device)

    def flatten(self, spans: list[tuple[list[int], int, list[int]]], page: int) -> Flat:
        """The host-side work of a step over `spans` (padding included), before its program is
        known to exist: nothing is sent yet."""
        ids, positions, slots, starts, lens, pending = flatten_spans(spans, page)
        fills = pending_fills(pending, ids)
        return Flat(
            spans,
            ids,
            positions,
            slots,
            starts,
            lens,
            fills,
            max(lens),
            max(len(table) for table, _, _ in spans),
        )

    def send(
        self,
        flat: Flat,
        device_tables: DeviceBlockTables | None,
        rows: list[int] | None,
        state_read: list[int] | None = None,
        state_rows: list[int] | None = None,
        sample_rows: list[int] | None = None,
    ) -> None:
        """Write `flat` into the static buffers: one copy (two for a step whose extras
        overflow the tail), and the tables' gather or copy. `rows`: each span's row of
        `device_tables` (as `step_metadata.pack_spans` takes it). A hybrid target's state
        entries (`StateSlots.plan_addresses`: each sequence's read, the per-row slots) and a
        prefill program's sampled rows go with them."""
        spans, n, s = flat.spans, len(flat.input_ids), len(flat.seq_lens)
        if n > self.rows or s > self.seqs or flat.width > self.pages:
            raise ValueError(
                f"a step of {n} rows, {s} sequences and {flat.width} pages is past the "
                f"workspace ({self.rows}, {self.seqs}, {self.pages})"
            )
        if (state_read is not None and len(state_read) != s) or (
            sample_rows is not None and len(sample_rows) > self.rows
        ):
            # (a short list would leave an older step's entries where the program reads)
            raise RuntimeError(
                f"state entries / sampled rows of lengths "
                f"{_lens(state_read, state_rows, sample_rows)} for a step of {s} sequences"
            )
        if (
            rows is None
            or device_tables is None
            or device_tables.num_pages != self.pages
            or not device_tables.serves(s, flat.width)
        ):
            device_tables = None
        i, host, host_t = self._ring.take()
        a, b, c, d, e, f, g = self._offsets
        host[a : a + n] = flat.input_ids
        host[b : b + n] = flat.positions
        host[c : c + n] = flat.slots
        host[d : d + s + 1] = flat.starts
        host[e : e + s] = flat.seq_lens
        if state_read is not None:
            host[f : f + len(state_read)] = state_read
        if sample_rows is not None:
            host[g : g + len(sample_rows)] = sample_rows
        extra = [] if state_rows is None else [state_rows]
        room = self._size - self._meta - sum(map(len, extra + flat.fills.indices))
        try:  # (from `changes` on: what it took must reach the table, or be forgotten)
            if device_tables is not None:
                tables = [table for table, _, _ in spans]
                pieces = [*device_tables.changes(rows, tables), rows]
                width = 0
            else:
                # rows as wide as the workspace's where they fit (no fill), else the step's
                width = self.pages if s * self.pages <= room else flat.width
                pieces = [padded_tables(spans, width)]
            pieces += extra + flat.fills.indices
            end = self._meta + sum(map(len, pieces))
            if end <= self._size:
                at, bounds = self._meta, []
                for piece in pieces:
                    host[at : at + len(piece)] = piece
                    bounds.append((at, at + len(piece)))
                    at += len(piece)
                self.flat[:end].copy_(host_t[:end], non_blocking=True)
                self._ring.sent(i)
                tail = [self.flat[lo:hi] for lo, hi in bounds]
            else:
                self.flat[: self._meta].copy_(host_t[: self._meta], non_blocking=True)
                self._ring.sent(i)  # (before anything that may raise: the copy is queued)
                tail = to_device_packed(pieces, self.device)
            if device_tables is not None:
                where, pages, rows_t = tail[:3]
                device_tables.apply(where, pages)
                torch.index_select(device_tables.table, 0, rows_t, out=self.block_tables[:s])
                tail = tail[3:]
            else:
                if width < self.pages:
                    self.block_tables[:s].fill_(DUMMY_PAGE)
                self.block_tables[:s, :width].copy_(tail[0].view(s, width))
                tail = tail[1:]
        except BaseException:
            if device_tables is not None:
                device_tables.forget(rows)
            raise
        if state_rows is not None:
            self.state_rows[: len(state_rows)].copy_(tail[0])
            tail = tail[1:]
        flat.fills.write(self.input_ids[:n], tail)


def _lens(*lists) -> list[int | None]:
    return [None if x is None else len(x) for x in lists]
