"""The device-independent half of the graph runner: a bounded LRU cache of captured programs laid
out in one workspace sized at start-up (`ProgramCache`), the KV bucket a program's key carries
where the attention gathers keys, and `capture` itself.

`ProgramCache` (seed 001): a program is built the first time its table is met, at most
`CACHE_CAP` are kept (least recently used evicted), and the workspace is sized for the widest
table admitted (`max_rows`) over `sizing_tables(max_rows)`. A wider table, or one that needs more
workspace than was sized, is refused with an error naming both numbers; the runner then runs that
step eagerly. `graphs.py` re-exports all of it (the drafters' graphs import `capture` from there,
and tests patch `graphs.capture`).
"""

from __future__ import annotations

import gc
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from metrale.speculative.row_table import RowTable, sizing_tables

CACHE_CAP = 256
P = TypeVar("P")


@dataclass(frozen=True)
class Workspace:
    rows: int
    seqs: int

    @staticmethod
    def of(table: RowTable) -> Workspace:
        return Workspace(table.rows(), table.num_seqs)


class ProgramCache(Generic[P]):
    """Programs keyed by (row table, extra key), built by `build` on a miss."""

    def __init__(
        self,
        build: Callable[[RowTable, Hashable], P],
        max_rows: int,
        cap: int = CACHE_CAP,
        min_seqs: int = 0,
    ) -> None:
        """`min_seqs`: workspace sequences at least (ragged programs' padding sequences)."""
        if max_rows < 1 or cap < 1:
            raise ValueError(f"max_rows and cap must be >= 1, got {max_rows}, {cap}")
        self.build, self.max_rows, self.cap = build, max_rows, cap
        tables = sizing_tables(max_rows) or [
            RowTable.from_dispatch(range(max_rows), [1] * max_rows)
        ]
        # NOTE: every program lays its rows and sequences out from the workspace base, so the
        # workspace must hold the widest sizing table in both dimensions.
        self.workspace = Workspace(
            max(t.rows() for t in tables), max(min_seqs, *(t.num_seqs for t in tables))
        )
        self._programs: OrderedDict[tuple[RowTable, Hashable], P] = OrderedDict()
        self.hits = self.misses = self.evictions = 0

    def get(self, table: RowTable, extra: Hashable = None) -> P:
        rows = table.rows()
        if rows > self.max_rows:
            raise ValueError(
                f"a batched verify of {rows} rows is past the {self.max_rows} this cache was "
                f"sized for"
            )
        key = (table, extra)
        program = self._programs.get(key)
        if program is not None:
            self.hits += 1
            self._programs.move_to_end(key)
            return program
        need = Workspace.of(table)
        if need.rows > self.workspace.rows or need.seqs > self.workspace.seqs:
            raise ValueError(
                f"the batched verify of `{table}` needs {need.rows} rows and {need.seqs} "
                f"sequences of workspace; the build sized {self.workspace.rows} and "
                f"{self.workspace.seqs}"
            )
        self.misses += 1
        program = self.build(table, extra)
        self._programs[key] = program
        if len(self._programs) > self.cap:
            self._programs.popitem(last=False)
            self.evictions += 1
        return program

    def cached(self) -> int:
        return len(self._programs)

    def __contains__(self, key: tuple[RowTable, Hashable]) -> bool:
        return key in self._programs

    def stats(self) -> dict:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "cached": self.cached(),
        }


def kv_bucket(max_seq_len: int, limit: int) -> int:
    """Keys gathered per sequence inside a graph: the next power of two >= the longest sequence
    (at least 128), capped at the model length."""
    bucket = 128
    while bucket < max_seq_len:
        bucket *= 2
    return min(bucket, limit)


# Programs captured in this process so far (`capture`): a host-time measurement that saw one
# being captured (tens of milliseconds) is not a sample of the steady state.
_captures = 0
_capture_seconds = 0.0  # their wall time, warm-up runs included (`metrale bench` reports it)


def captures() -> int:
    """How many programs this process has captured."""
    return _captures


def capture_seconds() -> float:
    """Seconds this process has spent capturing programs (the target's, the drafters')."""
    return _capture_seconds


def capture(fn, pool, device: torch.device):
    """(graph, outputs) of `fn()` captured into `pool`, after one warm-up run on a side stream
    (lazy initialisation and Triton autotuning must not land inside the capture).

    The garbage collector is off during the capture: a collection there may free tensors of
    objects already dropped (another engine's, in one process), and the allocator's event
    queries for them invalidate the capture (on the H200, the hybrid GPU tests, which build
    several engines in one process, failed with cudaErrorStreamCaptureInvalidated in 2 of 3
    runs; with the collector off, in none of 4)."""
    start = time.perf_counter()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            outputs = fn()
    finally:
        if collecting:
            gc.enable()
    global _captures, _capture_seconds
    _captures += 1
    _capture_seconds += time.perf_counter() - start
    return graph, outputs
