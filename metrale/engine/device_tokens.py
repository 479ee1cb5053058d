"""Drafts that stay on the device until the verdicts: no host read between drafting and verifying.

A drafter that computes its drafts on the device (DFlash's block forward) used to read them back
with `.tolist()`, a blocking sync: the host waited for the drafter's forward before it could
schedule the step and build the verify's metadata, so the drafter's device time and that host work
ran one after the other. `DeviceDrafts` wraps the drafter's [S, D] token tensor instead: its copy
to pinned host memory is queued behind the drafter's work (an event marks its end), and each
sequence's draft is a `DeviceRow`, a lazy sequence of ints. The verify's input ids take the
drafts' values on the device (`span_metadata` writes them from the tensor), so the host first
reads them at the step's one host sync, when the copy is long done. Any earlier reader (a grammar,
the sampled path's layout) waits for the drafter's event alone, never for later work.

The tensor must keep its values until the verify's forward has been queued: nothing may
rewrite it in between, a drafter retried one sequence at a time included (DFlash hands over a
copy of its program's output buffer). After that a drafter may rewrite it: the host copy is
queued at once, and the device values are read once, by the first verify that takes them; a
step retried after a failure (`engine/isolation.py`) takes the host copy.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

_STREAMS: dict[tuple, torch.cuda.Stream] = {}
# (absent from a torch built without CUDA, where no event is recorded)
_current_stream = getattr(torch._C, "_cuda_getCurrentStream", None)


def record_now(event: torch.cuda.Event) -> None:
    """`event.record()` on the current stream, without `torch.cuda.current_stream()`'s Python
    (device-index lookups and a new Stream object a call: microseconds each, two or three a
    verify step, several percent of a batch-1 step of the shipped model): the current stream
    is read in C and its Stream object kept."""
    if _current_stream is None:
        event.record()
        return
    data = _current_stream(torch._C._cuda_getDevice())  # (stream id, device index, type)
    stream = _STREAMS.get(data)
    if stream is None:
        stream = _STREAMS[data] = torch.cuda.Stream(
            stream_id=data[0], device_index=data[1], device_type=data[2]
        )
    event.record(stream)


class DeviceClock:
    """A point on the device's stream and the host's clock at once (CUDA only)."""

    def __init__(self) -> None:
        self.event = torch.cuda.Event(enable_timing=True)
        record_now(self.event)
        self.host = time.perf_counter()

    @staticmethod
    def now(device: torch.device) -> DeviceClock | None:
        """None off CUDA, where device work is host time already."""
        return DeviceClock() if device.type == "cuda" else None


class HostCopy:
    """A device tensor's copy to the host, queued behind the work that makes it: a pinned
    buffer and an event on CUDA, so that reading it (`rows`) waits for that work alone."""

    def __init__(
        self, tensor: torch.Tensor, timed: bool = False, shown: torch.Tensor | None = None
    ) -> None:
        """`shown`: what the host copy holds instead of `tensor`'s values (the same shape)."""
        self.tensor = tensor
        self._rows: list | None = None
        self._done = None
        source = tensor if shown is None else shown
        if tensor.device.type == "cuda":
            self._host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
            self._host.copy_(source, non_blocking=True)
            self._done = torch.cuda.Event(enable_timing=timed)
            record_now(self._done)
        else:
            self._host = source.clone()

    def rows(self) -> list:
        """The values as host lists (waits for the work before the copy alone, once)."""
        if self._rows is None:
            if self._done is not None:
                self._done.synchronize()
            self._rows = self._host.tolist()
        return self._rows


class DeviceDrafts(HostCopy):
    """A drafter's [S, D] int64 drafts on the device, copied to the host behind its work (or
    any tokens a later step's input ids take from the device: the asynchronous engine's
    sampled tokens, `engine/ahead.py`)."""

    def __init__(
        self,
        tokens: torch.Tensor,
        started: DeviceClock | None = None,
        shown: torch.Tensor | None = None,
    ) -> None:
        """`started`: taken before the drafter's device work, so `stall_seconds` can say what
        that work cost the step; `shown`: what the host reads instead (`HostCopy`)."""
        if not tokens.is_contiguous():
            raise ValueError("device drafts must be a contiguous [sequences, drafts] tensor")
        super().__init__(tokens, timed=started is not None, shown=shown)
        self.width = self.tensor.shape[1]
        self._started, self._used = started, None

    def row(self, index: int, length: int) -> DeviceRow:
        """The first `length` drafts of sequence `index`."""
        if not 0 <= length <= self.width:
            raise ValueError(f"a draft of {length} tokens from rows of {self.width}")
        return DeviceRow(self, index, length)

    @property
    def in_use(self) -> bool:
        """Whether a verify took the drafts from the device already (`use`)."""
        return self._used is not None

    def use(self) -> None:
        """The verify takes the drafts from the device now (`ModelRunner.span_metadata`):
        marks the point `stall_seconds` measures to. Only once: a drafter may rewrite the
        tensor once the verify's forward is queued, so a step retried after a failure takes the
        host copy instead (`pending_fills`)."""
        self._used = DeviceClock() if self._started is not None else True

    def stall_seconds(self) -> float:
        """What the drafter's device work cost the step (0 without a clock): how much later
        than the host the device reached the verify's inputs, the host's own time between
        the two points being paid anyway (that much of the drafter's work overlapped it); the
        whole of that work if no verify took the drafts. Waits for the drafter's work."""
        if self._started is None or self._done is None:
            return 0.0
        self._done.synchronize()
        if not isinstance(self._used, DeviceClock):
            return self._started.event.elapsed_time(self._done) / 1000.0
        self._used.event.synchronize()
        device = self._started.event.elapsed_time(self._used.event) / 1000.0
        return max(device - (self._used.host - self._started.host), 0.0)


class DeviceRow(Sequence):
    """One sequence's drafts in a `DeviceDrafts`: its length is known on the host, its values
    once read (`DeviceDrafts.rows`). A prefix slice stays lazy; anything else reads them."""

    __slots__ = ("source", "at", "length")

    def __init__(self, source: DeviceDrafts, at: int, length: int) -> None:
        """The first `length` drafts of row `at` of `source`."""
        self.source, self.at, self.length = source, at, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, item):
        # a prefix (`[:k]`, what cutting a draft to a depth does) stays lazy: itself when it
        # keeps every draft; any other item or slice reads the values
        if type(item) is slice and not item.start and item.step is None:
            stop = item.stop
            if stop is None or stop >= self.length:
                return self
            if stop >= 0:
                return DeviceRow(self.source, self.at, stop)
        return self.tolist()[item]

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def tolist(self) -> list[int]:
        return self.source.rows()[self.at][: self.length]

    def same_values(self, other) -> bool:
        """Whether `other` is a prefix of the same row or this one of it (equal where both
        reach, with nothing read)."""
        return isinstance(other, DeviceRow) and other.source is self.source and other.at == self.at

    def __eq__(self, other) -> bool:
        if isinstance(other, DeviceRow):
            other = other.tolist()
        if isinstance(other, list):  # equal to the list of its values, as a list would be
            return self.tolist() == other
        return NotImplemented

    __hash__ = None  # a sequence compared by value, like a list

    def __add__(self, other) -> list[int]:
        return self.tolist() + list(other)

    def __radd__(self, other) -> list[int]:
        return list(other) + self.tolist()

    def __repr__(self) -> str:
        return f"DeviceRow({self.tolist()})"


class PendingIds(list):
    """A span's token ids whose last `len(row)` entries stand for drafts still on the device
    (placeholders, 0): `ModelRunner.span_metadata` writes the row's values into those rows of
    the step's input ids on the device. Nothing else reads a span's token ids."""

    __slots__ = ("row",)

    @classmethod
    def of(cls, head: list[int], row: DeviceRow) -> PendingIds:
        ids = cls(head)
        ids.extend([0] * row.length)
        ids.row = row
        return ids


class Fills:
    """Where a step's device-held ids go: per source tensor, rows of the packed input ids and
    flat indices into the source. A run of rows taking a run of the source (a decode batch in
    the order of the step before, under asynchronous scheduling) is one slice copy, with no
    index to pack; the others are two index kernels, their indices packed in the step's one
    host-to-device copy (`indices`)."""

    def __init__(self, fills: list[tuple[DeviceDrafts, list[int], list[int]]]) -> None:
        self.runs, self.indexed = [], []
        for fill in fills:
            (self.runs if _is_run(fill[1]) and _is_run(fill[2]) else self.indexed).append(fill)
        self.indices = [index for _, dst, src in self.indexed for index in (dst, src)]

    def write(self, ids: torch.Tensor, indices: list[torch.Tensor]) -> None:
        """Write the values into the step's input ids `ids` on the device (`indices`: the
        device copies of `self.indices`, in order)."""
        for source, dst, src in self.runs:
            source.use()
            ids[dst[0] : dst[-1] + 1].copy_(source.tensor.view(-1)[src[0] : src[-1] + 1])
        for (source, _, _), dst, src in zip(self.indexed, indices[::2], indices[1::2], strict=True):
            source.use()
            ids.index_copy_(0, dst, source.tensor.view(-1).index_select(0, src))


def _is_run(indices: list[int]) -> bool:
    """Whether `indices` are consecutive ascending integers."""
    first = indices[0]
    return indices[-1] - first == len(indices) - 1 and indices == list(
        range(first, first + len(indices))
    )


def pending_fills(pending: list[tuple[int, DeviceRow]], input_ids: list[int]) -> Fills:
    """For drafts on the device ending before row `end` of the packed `input_ids`, (end, row)
    each: per source tensor, (source, rows of `input_ids`, flat indices into the source) to
    write them there (`Fills`). Drafts a verify took already (a retried step) go into
    `input_ids` from the host copy instead."""
    fills: dict[DeviceDrafts, tuple[list[int], list[int]]] = {}
    for end, row in pending:
        source, k = row.source, row.length
        if source._used is not None:  # `in_use`, read without a property call
            # (-1: a token whose logits were not finite, `step_output.shown_tokens`; its
            # sequence fails at that step's commit, any id serves its row meanwhile)
            input_ids[end - k : end] = [max(t, 0) for t in row.tolist()]
            continue
        entry = fills.get(source)
        if entry is None:
            entry = fills[source] = ([], [])
        first = row.at * source.width
        if k == 1:  # a last token (asynchronous scheduling): one a sequence, at batch 64
            entry[0].append(end - 1)
            entry[1].append(first)
        else:
            entry[0].extend(range(end - k, end))
            entry[1].extend(range(first, first + k))
    return Fills([(source, dst, src) for source, (dst, src) in fills.items()])
