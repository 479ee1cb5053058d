"""The running sequences' block tables, kept on the device: a persistent [slots + 1, pages] tensor,
one row per scheduler slot (`Sequence.slot`) and a last row of dummy pages for a program's padding
sequences, updated incrementally.

Rebuilding every sequence's table on the host each step (pad to the widest, flatten, copy) cost
Python work and copy bytes in proportion to batch x context: at batch 64 and a 1k context, 4,160
ints a step, most of the step's metadata. A sequence's table changes rarely (a new page every
`page_size` tokens; a prefix-cache hit, a rollback, a retry's rewrite or a new sequence in the
slot), so the host keeps a copy of what each device row holds and sends only the entries that
differ: the step's metadata then grows with the rows it runs, not with the context.

The host copy is compared with `seq.block_table` in full each step (a C-level list comparison)
rather than tracked through the allocator's mutations: any change, by whatever path, is seen.
"""

from __future__ import annotations

import torch

from metrale.engine.kv_cache import DUMMY_PAGE

# Below this many table entries in a step (sequences x the widest table) the host's padded tables
# cost less than the device path's extra launches (an index_select, and a copy when a table
# changed): measured on the CPU, the two cross between 500 and 1,000 entries (batch 64 at a
# 256-token context); at batch 64 and a 1k context the device path saves 40% of the metadata.
MIN_ENTRIES = 1024


class DeviceBlockTables:
    """Block tables by slot on `device`; `dummy_row` is the padding sequences' row."""

    def __init__(self, num_slots: int, num_pages: int, device: torch.device) -> None:
        self.num_pages = num_pages  # columns: the longest table a sequence can hold
        self.min_entries = MIN_ENTRIES  # tests set 0: every step takes the device path
        self.dummy_row = num_slots
        self.table = torch.full(
            (num_slots + 1, num_pages), DUMMY_PAGE, dtype=torch.long, device=device
        )
        self._held: list[list[int]] = [[] for _ in range(num_slots)]  # what each row holds

    def serves(self, count: int, width: int) -> bool:
        """Whether a step of `count` tables, the widest `width` pages, should read them here."""
        return width <= self.num_pages and count * width >= self.min_entries

    def changes(self, rows: list[int], tables: list[list[int]]) -> tuple[list[int], list[int]]:
        """(flat indices into the table, pages): the entries that bring each row up to its
        table (padding rows, `dummy_row`, need none). The host copy takes them at once, so the
        caller must `apply` them before any read of these rows, or `forget` the rows."""
        where: list[int] = []
        pages: list[int] = []
        held, width = self._held, self.num_pages
        for row, table in zip(rows, tables, strict=True):
            if row == self.dummy_row:
                continue
            old = held[row]
            if table == old:
                continue
            if len(table) > width:
                raise ValueError(f"block table of {len(table)} pages: the device holds {width}")
            n, base = len(old), row * width
            # Grown at the end (the usual change): only the new pages. Else the whole row, and
            # the columns it no longer uses back to the dummy page.
            first = n if len(table) >= n and table[:n] == old else 0
            where += range(base + first, base + max(len(table), n))
            pages += table[first:]
            pages += [DUMMY_PAGE] * (n - len(table))
            held[row] = list(table)
        return where, pages

    def forget(self, rows: list[int]) -> None:
        """Rewrite `rows` in full next time (`changes` was called, but what it returned may not
        have reached the device)."""
        for row in rows:
            if row != self.dummy_row:
                self._held[row] = [-1] * self.num_pages

    def apply(self, where: torch.Tensor, pages: torch.Tensor) -> None:
        """Write `changes`' entries (int64 device tensors) into the table."""
        if where.numel():
            self.table.view(-1).index_copy_(0, where, pages)

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """[len(rows), width] block tables of `rows` (a device index tensor)."""
        return self.table[:, :width].index_select(0, rows)
