"""The paged KV pool: one tensor per layer of fixed-size pages, a free list, block tables.

Page 0 is the dummy page (never allocated): CUDA-graph padding and padded block-table entries
point at it, so padding can never write into a live sequence's pages. A sequence's block table
covers its computed rows plus the rows the next step will write, plus `lookahead` rows that a
verify step may write and then roll back (rejected rows are simply overwritten later).
"""

from __future__ import annotations

from collections import deque

import torch

from metrale.config import ModelConfig
from metrale.engine.sequence import Sequence

DUMMY_PAGE = 0


class PageAllocator:
    """Free list of page ids 1..num_pages-1 and the block tables of live sequences."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_kv_pages must be >= 2 (one is the dummy page), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(1, num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def pages_for(self, num_rows: int) -> int:
        return -(-num_rows // self.page_size)

    def extra_pages(self, seq: Sequence, num_rows: int) -> int:
        """Pages `seq` still lacks to hold `num_rows` rows."""
        return max(0, self.pages_for(num_rows) - len(seq.block_table))

    def can_fit(self, seq: Sequence, num_rows: int) -> bool:
        return self.extra_pages(seq, num_rows) <= len(self._free)

    def reserve(self, seq: Sequence, num_rows: int) -> None:
        """Grow `seq.block_table` to hold `num_rows` rows. Raises MemoryError when pages run out
        (the scheduler checks `can_fit` first and preempts instead)."""
        need = self.extra_pages(seq, num_rows)
        if need > len(self._free):
            raise MemoryError(f"KV pool exhausted: need {need} pages, {len(self._free)} free")
        seq.block_table.extend(self._free.popleft() for _ in range(need))

    def trim(self, seq: Sequence, num_rows: int) -> None:
        """Return pages past the first `num_rows` rows (after a rollback shrinks a reservation)."""
        keep = self.pages_for(num_rows)
        while len(seq.block_table) > keep:
            self._free.append(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table.clear()


def slots_of(table: list[int], start: int, end: int, page_size: int):
    """The flat KV slots of positions start .. end - 1 of a sequence with block table `table`
    (what every writer of paged KV rows indexes by)."""
    return (table[p // page_size] * page_size + p % page_size for p in range(start, end))


def kv_page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype, num_layers: int) -> int:
    """Bytes of one page across `num_layers` attention layers (K and V)."""
    per_row = 2 * cfg.num_key_value_heads * cfg.head_dim * torch.finfo(dtype).bits // 8
    return per_row * page_size * num_layers


def allocate_kv_cache(
    cfg: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_layers: int,
) -> torch.Tensor:
    """[layers, 2, num_pages, page_size, Hkv, D], zeroed: the dummy page must hold finite values."""
    shape = (num_layers, 2, num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)
