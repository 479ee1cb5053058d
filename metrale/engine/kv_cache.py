"""The paged KV pool: one tensor per layer of fixed-size pages, a free list, block tables.

Page 0 is the dummy page (never allocated): CUDA-graph padding and padded block-table entries
point at it, so padding can never write into a live sequence's pages. A sequence's block table
covers its computed rows plus the rows the next step will write, plus `lookahead` rows that a
verify step may write and then roll back (rejected rows are simply overwritten later).

With prefix caching (`prefix_cache.PrefixCache`) a page may sit in several block tables at once:
pages are reference counted, and a cached page whose count falls to zero stays findable (idle)
until the pool needs it; `num_free` counts idle pages as free, since taking one costs nothing.
"""

from __future__ import annotations

from collections import deque

import torch

from metrale.config import ModelConfig
from metrale.engine.prefix_cache import PrefixCache
from metrale.engine.sequence import Sequence

DUMMY_PAGE = 0


class PageAllocator:
    """Free list of page ids 1..num_pages-1, their reference counts, and the block tables of
    live sequences; the prefix cache's idle pages are reclaimed after the free list runs dry."""

    def __init__(self, num_pages: int, page_size: int, cache: PrefixCache | None = None) -> None:
        if num_pages < 2:
            raise ValueError(f"num_kv_pages must be >= 2 (one is the dummy page), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.cache = cache
        self._free: deque[int] = deque(range(1, num_pages))
        self._refs = [0] * num_pages  # block tables holding each page
        if cache is not None:
            cache.on_orphan = self._free.append

    @property
    def num_free(self) -> int:
        """Pages a reservation may take: never-cached free ones and idle cached ones."""
        return len(self._free) + (0 if self.cache is None else self.cache.num_idle)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def refs(self, page: int) -> int:
        return self._refs[page]

    def pages_for(self, num_rows: int) -> int:
        return -(-num_rows // self.page_size)

    def extra_pages(self, seq: Sequence, num_rows: int) -> int:
        """Pages `seq` still lacks to hold `num_rows` rows."""
        return max(0, self.pages_for(num_rows) - len(seq.block_table))

    def can_fit(self, seq: Sequence, num_rows: int) -> bool:
        return self.extra_pages(seq, num_rows) <= self.num_free

    def _take(self) -> int:
        # NOTE: a never-cached page first; else the least recently used idle cached page,
        # which leaves the cache as it is taken (nobody holds it, so nobody reads it).
        page = self._free.popleft() if self._free else self.cache.evict()
        self._refs[page] = 1
        return page

    def reserve(self, seq: Sequence, num_rows: int) -> None:
        """Grow `seq.block_table` to hold `num_rows` rows. Raises MemoryError when pages run out
        (the scheduler checks `can_fit` first and preempts instead)."""
        need = self.extra_pages(seq, num_rows)
        if need > self.num_free:
            raise MemoryError(f"KV pool exhausted: need {need} pages, {self.num_free} free")
        seq.block_table.extend(self._take() for _ in range(need))

    def share(self, seq: Sequence, pages: list[int]) -> None:
        """Map cached `pages` (a prefix cache hit) as the start of `seq`'s empty block table."""
        if seq.block_table:
            raise RuntimeError("cached pages can only start a block table")
        for page in pages:
            if self._refs[page] == 0:
                self.cache.unpark(page)
            self._refs[page] += 1
        seq.block_table.extend(pages)

    def _drop(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if self.cache is not None and self.cache.holds(page):
                self.cache.park(page)
            else:
                self._free.append(page)

    def take_scratch(self, count: int) -> list[int]:
        """`count` pages outside any block table (a state rebuild's throwaway KV rows)."""
        if count > self.num_free:
            raise MemoryError(f"KV pool exhausted: need {count} pages, {self.num_free} free")
        return [self._take() for _ in range(count)]

    def free_scratch(self, pages: list[int]) -> None:
        for page in pages:
            self._drop(page)

    def trim(self, seq: Sequence, num_rows: int) -> None:
        """Return pages past the first `num_rows` rows (after a rollback shrinks a reservation)."""
        keep = self.pages_for(num_rows)
        while len(seq.block_table) > keep:
            self._drop(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        # Last page first: an idle prefix is then reclaimed tail first, head last.
        for page in reversed(seq.block_table):
            self._drop(page)
        seq.block_table.clear()
        if self.cache is not None:
            self.cache.release(seq)


def slots_of(table: list[int], start: int, end: int, page_size: int) -> list[int]:
    """The flat KV slots of positions start .. end - 1 of a sequence with block table `table`
    (what every writer of paged KV rows indexes by): one run of consecutive slots per page,
    so a step's metadata pays per page a span touches, not per row (a batch-64 verify step
    packed its 192 rows in a Python generator: a third of `pack_spans`)."""
    slots: list[int] = []
    pos = start
    while pos < end:
        page = pos // page_size
        stop = min(end, (page + 1) * page_size)
        # slot = table[page] * page_size + pos % page_size, for pos in [pos, stop)
        base = (table[page] - page) * page_size
        slots += range(base + pos, base + stop)
        pos = stop
    return slots


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
