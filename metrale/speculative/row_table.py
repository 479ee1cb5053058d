"""RowTable: the shape of one batched verify, as runs of equal depth in dispatch order.

A batched verify's kernel plan depends on which sequences contribute how many rows and whether the
sequences of a run sit on consecutive state slots (the batched recurrent-state kernel path needs
that; other runs go sequence by sequence). The graph cache compiles one verify program per table,
so `RowTable` is its cache key: frozen, hashable and totally ordered.

Text form, one run per word, separated by single spaces: `{k}x{count}`, with a trailing `!` when
the run is dispatched per sequence rather than batched, e.g. `3x1! 2x4`. A one-sequence run is
never batched, so it always carries `!`. `parse` and `str` round-trip exactly.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

_RUN = re.compile(r"([0-9]+)x([0-9]+)(!?)")


class Run(NamedTuple):
    """`count` sequences of `k` rows each, adjacent in the dispatch."""

    k: int
    count: int
    batched: bool

    def __str__(self) -> str:
        return f"{self.k}x{self.count}{'' if self.batched else '!'}"


@dataclass(frozen=True, order=True)
class RowTable:
    """Runs in dispatch order; at least one, each with `k >= 1` and `count >= 1`."""

    runs: tuple[Run, ...]

    def __post_init__(self) -> None:
        # Plain tuples become `Run`s so that equal tables compare and hash equal however built.
        runs = tuple(Run(*run) for run in self.runs)
        object.__setattr__(self, "runs", runs)
        if not runs:
            raise ValueError("a row table needs at least one run")
        for run in runs:
            if run.k < 1 or run.count < 1:
                raise ValueError(f"run {run}: k and count must be at least 1")
            if run.count == 1 and run.batched:
                raise ValueError(f"run {run.k}x1: a one-sequence run is never batched")

    @classmethod
    def parse(cls, text: str) -> RowTable:
        """The table written as `text` (the `str` form); ValueError saying what is wrong."""
        if not text:
            raise ValueError("row table '': empty")
        return cls(tuple(_parse_run(text, word) for word in text.split(" ")))

    @classmethod
    def from_dispatch(cls, slots: Sequence[int], depths: Sequence[int]) -> RowTable:
        """The table of a batch dispatched in this order, `depths[j]` rows at slot `slots[j]`.

        Runs are maximal stretches of equal depth; a run is batched when it has several sequences
        on strictly consecutive slots (each one past the previous).
        """
        if len(slots) != len(depths):
            raise ValueError(f"{len(slots)} slots but {len(depths)} depths; they must pair up")
        if not slots:
            raise ValueError("an empty dispatch has no row table")
        runs = []
        start = 0
        for end in range(1, len(depths) + 1):
            if end < len(depths) and depths[end] == depths[start]:
                continue
            run_slots = slots[start:end]
            consecutive = all(b == a + 1 for a, b in zip(run_slots, run_slots[1:]))
            runs.append(Run(depths[start], end - start, end - start > 1 and consecutive))
            start = end
        return cls(tuple(runs))

    def rows(self) -> int:
        """Rows of the whole verify forward."""
        return sum(run.k * run.count for run in self.runs)

    @property
    def num_seqs(self) -> int:
        return sum(run.count for run in self.runs)

    def __str__(self) -> str:
        return " ".join(str(run) for run in self.runs)


def _parse_run(text: str, word: str) -> Run:
    if not word:
        raise ValueError(f"row table {text!r}: runs are separated by exactly one space")
    match = _RUN.fullmatch(word)
    if match is None:
        raise ValueError(f"row table {text!r}: {word!r} is not a run `{{k}}x{{count}}[!]`")
    k_text, count_text, bang = match.groups()
    # NOTE: leading zeros are refused so that every accepted text is the `str` of its table.
    if any(len(t) > 1 and t.startswith("0") for t in (k_text, count_text)):
        raise ValueError(f"row table {text!r}: {word!r} has a leading zero")
    k, count = int(k_text), int(count_text)
    if k == 0 or count == 0:
        raise ValueError(f"row table {text!r}: {word!r} needs k and count of at least 1")
    if count == 1 and not bang:
        raise ValueError(
            f"row table {text!r}: {word!r} is one sequence, which is never batched; write {k}x1!"
        )
    return Run(k, count, batched=not bang)


def sizing_tables(max_rows: int) -> list[RowTable]:
    """One table per row count 4..=max_rows, the set the verify workspace is sized over.

    Even counts are runs of 2 (`2x{r/2}`); odd counts lead with one 3-row sequence (`3x1! 2x...`).
    """
    tables = []
    for r in range(4, max_rows + 1):
        if r % 2 == 0:
            runs = [Run(2, r // 2, batched=True)]
        else:
            tail = (r - 3) // 2
            runs = [Run(3, 1, batched=False), Run(2, tail, batched=tail > 1)]
        tables.append(RowTable(tuple(runs)))
    return tables
