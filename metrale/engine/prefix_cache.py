"""Automatic prefix caching: full KV pages named by their content, kept after their sequence ends
and mapped into the block table of any later sequence whose tokens start the same way; on hybrid
targets, snapshots of the recurrent state at page boundaries of cached prefixes.

Names. Page i of a sequence is named by sha256(name of page i - 1, its `page_size` token ids,
`extra`), page 0's parent being a fixed root: a name stands for the whole prefix up to the end of
its page (vLLM's hash chain). `extra` is where anything else that changes KV would go (a LoRA, a
cache salt); one engine serves one model, so there is nothing there yet. A sequence hashes each
of its pages once (`Sequence.page_hashes`): at admission for its prompt, then as pages fill.

Which pages. A page is offered to the cache once every row in it is committed: the rows of a
sequence's last, partial page and every draft row past `num_computed_tokens` are never cached, so
a cached page is never written again (its owner only writes positions past its committed rows,
and a sequence that maps it starts past it). A page whose name is already cached (the same
prefix computed twice at once) stays private to its sequence.

Lifetime. Pages are reference counted by the block tables that hold them (`PageAllocator`); a
cached page that no block table holds is idle: still found by its name, and reclaimed least
recently used first when the pool needs a page (never-cached free pages go first). A sequence
releases its pages last page first, so a prefix's tail is reclaimed before its head.

A hit. The longest run of cached pages the sequence's tokens name, short of its last token (a
row must run to sample from) is mapped into its block table and its prefill starts after it.

Drafter K/V. A drafter that keeps K/V rows in the target's pages (MTP's layer) reads them on a
hit too, and a page holds them only if its writer drafted with that drafter: a non-speculative
request leaves them unwritten. (DFlash's context rows are written by the target's forward
itself, for every row, so every page holds them and DFlash declares no `page_kv`.) So a page is
cached with a mark saying its drafter rows are whole (`DraftKV.wrote` its writer's), and a
sequence that drafts takes a hit only as far as the marked pages go. MTP's row at a position is
fed the next token too, so its mark is the token that followed the page in its writer, and the
page serves only sequences where the same token follows. A marked page computed later under an
unmarked page's name takes the name over.

Hybrid targets. A GDN layer's state after a prefix is one tensor per sequence, so a hit must
also resume the recurrent state: `SnapshotIndex` keeps copies of it (`StateSlots` snapshots), by
page name, in a pool of `2 * max_num_seqs` entries, least recently used first out. A hit is then
the longest cached prefix that ends where a snapshot does. Snapshots are taken at two boundaries
of a sequence, where its prefill chunk is made to end (`Sequence.snapshot_at`): its last page
boundary before its last token (a later turn that extends this prompt resumes there), and, when
its cached pages ran further than the snapshots did, the end of those pages (where prompts that
share a system prompt part ways; the next such prompt resumes there).
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

from metrale.engine.sequence import Sequence
from metrale.telemetry import PrefixCacheTelemetry

log = logging.getLogger(__name__)

ROOT = b"metrale-prefix-cache-v1"


def page_hash(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    """The name of a page: its parent's name, its token ids, `extra` (sha256, 32 bytes)."""
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())
    if extra:
        h.update(extra)
    return h.digest()


class DraftKV(NamedTuple):
    """A drafter's K/V rows in the target's pages (see the module docstring): which sequences
    read them (they draft); which wrote them for every committed row so far; whether a row
    depends on the token after it.

    A page's rows are what its writer's drafter wrote: for MTP, at accepted drafts, the rows its
    chain wrote (from the drafter's own hidden state, not the target's), which that drafter keeps
    rather than feeding again; a sequence computing the same tokens afresh may write others
    there. Either is a valid context: drafts and acceptance may differ, never the output."""

    reads: Callable[[Sequence], bool]
    wrote: Callable[[Sequence], bool]
    next_token: bool


class Hit(NamedTuple):
    """What the cache holds of a waiting sequence's tokens."""

    pages: list[int]  # cached pages for its first len(pages) pages
    tokens: int  # rows they cover (len(pages) * page_size): its prefill starts there
    idle: int  # how many of those pages no block table holds (taking them uses free pages)
    snapshot: int  # hybrid: the snapshot its state resumes from (-1: none, from zero)
    branch: int  # hybrid: tokens cached beyond the last snapshot (0: none): save one there


class SnapshotIndex:
    """Hybrid targets: recurrent-state snapshots by page name, in a bounded pool (`StateSlots`
    holds the tensors). Pinned entries (a running sequence resumed from them and may have to
    rebuild its state from there) are never reused; the others go least recently used first."""

    def __init__(self, states, capacity: int, stats: PrefixCacheTelemetry) -> None:
        self.states = states
        states.add_snapshots(capacity)
        self.capacity = capacity
        self.stats = stats
        self._entry: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._name: list[bytes | None] = [None] * capacity
        self._pins = [0] * capacity
        self._free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._entry)

    def peek(self, name: bytes) -> int:
        return self._entry.get(name, -1)

    def pin(self, entry: int) -> None:
        self._pins[entry] += 1
        name = self._name[entry]
        if name is not None:
            self._entry.move_to_end(name)

    def unpin(self, entry: int) -> None:
        self._pins[entry] -= 1
        if self._pins[entry] == 0 and self._name[entry] is None:
            self._free.append(entry)  # dropped while pinned: free now

    def save(self, name: bytes, slot: int) -> None:
        """Copy state slot `slot`'s committed state in as the snapshot after page `name`."""
        if name in self._entry:
            self._entry.move_to_end(name)
            return
        entry = self._take()
        if entry < 0:
            return  # every entry pinned: a cache, so this one is simply not kept
        self.states.save_snapshot(slot, entry)
        self._entry[name] = entry
        self._name[entry] = name
        self.stats.snapshots_saved += 1

    def drop(self, name: bytes) -> None:
        """The page `name` left the cache: a snapshot after it can never be reached again."""
        entry = self._entry.pop(name, None)
        if entry is None:
            return
        self._name[entry] = None
        if self._pins[entry] == 0:
            self._free.append(entry)

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        for name, entry in self._entry.items():
            if self._pins[entry] == 0:
                del self._entry[name]
                self._name[entry] = None
                return entry
        return -1


class PrefixCache:
    """Cached pages by name (see the module docstring); `PageAllocator` owns the free list and the
    reference counts and asks this for idle cached pages when it runs out."""

    def __init__(
        self,
        page_size: int,
        stats: PrefixCacheTelemetry,
        snapshots: SnapshotIndex | None = None,
        extra: bytes = b"",
    ) -> None:
        self.page_size = page_size
        self.stats = stats
        self.snapshots = snapshots
        self.extra = extra
        self._root = hashlib.sha256(ROOT + extra).digest()
        self._page_of: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently used first
        # Set by the engine when its drafter keeps K/V in the pages; then, per cached page whose
        # drafter rows are whole, the token after it in its writer (-1: not needed).
        self.draft_kv: DraftKV | None = None
        self._draft_mark: dict[int, int] = {}
        # takes back an idle page whose name went to a better copy (the allocator's free list)
        self.on_orphan: Callable[[int], None] | None = None

    # ---- names ----------------------------------------------------------------------------

    def hashes(self, seq: Sequence, num_pages: int) -> list[bytes]:
        """The names of `seq`'s first `num_pages` pages (full pages of known tokens), hashing
        only the ones not named yet; returns all it has named."""
        names, size = seq.page_hashes, self.page_size
        parent = names[-1] if names else self._root
        for i in range(len(names), num_pages):
            parent = page_hash(parent, seq.tokens(i * size, (i + 1) * size), self.extra)
            names.append(parent)
        return names

    # ---- admission ------------------------------------------------------------------------

    def match(self, seq: Sequence) -> Hit:
        """The cached prefix of a sequence about to be admitted (it has no pages yet)."""
        size = self.page_size
        limit = (seq.num_tokens - 1) // size  # its last token always runs
        names = self.hashes(seq, limit)
        pages = []
        for name in names[:limit]:
            page = self._page_of.get(name)
            if page is None:
                break
            pages.append(page)
        if self.draft_kv is not None and self.draft_kv.reads(seq):
            pages = pages[: self._drafter_whole(seq, pages)]
        snapshot, branch = -1, 0
        if self.snapshots is not None:
            # the state must resume too: only as far as the last snapshot along the pages
            found = len(pages)
            while found and (snapshot := self.snapshots.peek(names[found - 1])) < 0:
                found -= 1
            if found < len(pages):
                branch = len(pages) * size
            pages = pages[:found]
        idle = sum(1 for page in pages if page in self._idle)
        return Hit(pages, len(pages) * size, idle, snapshot if pages else -1, branch)

    def _drafter_whole(self, seq: Sequence, pages: list[int]) -> int:
        """How many of the leading `pages` hold drafter K/V rows that `seq` can read."""
        size = self.page_size
        for i, page in enumerate(pages):
            mark = self._draft_mark.get(page)
            if mark is None:
                return i
            end = (i + 1) * size
            if self.draft_kv.next_token and mark != seq.tokens(end, end + 1)[0]:
                return i
        return len(pages)

    def _mark(self, seq: Sequence, index: int) -> int | None:
        """Page `index` of `seq`'s mark (None: its drafter rows are not known whole)."""
        # a sequence's last step is not shown to its drafter (it has nothing left to draft)
        if self.draft_kv is None or seq.finish_reason is not None or not self.draft_kv.wrote(seq):
            return None
        if not self.draft_kv.next_token:
            return -1
        end = (index + 1) * self.page_size
        # past its last token (a stop inside a verify) its row was fed a dropped draft
        return seq.tokens(end, end + 1)[0] if end < seq.num_tokens else None

    def admit(self, seq: Sequence, hit: Hit) -> None:
        """`seq` was admitted with `hit.pages` mapped (`PageAllocator.share`): it starts after
        them; count the query; on a hybrid target, its state resumes from the hit's snapshot."""
        seq.num_computed_tokens = seq.num_cached_tokens = hit.tokens
        if seq.num_preemptions == 0:
            # What its request reports (`RequestOutput.num_cached_tokens`) is its first
            # admission's hit, as vLLM keeps it: a recompute after a preemption (which may find
            # its own pages) counts in the hit counters below but does not change it.
            seq.num_prompt_cached_tokens = hit.tokens
        seq.num_registered_pages = len(hit.pages)
        self.stats.queries += seq.num_tokens
        self.stats.hits += hit.tokens
        self.stats.requests += 1
        if self.snapshots is None:
            return
        if hit.snapshot >= 0:
            self.snapshots.pin(hit.snapshot)
            seq.state_restore = seq.state_pin = hit.snapshot
            self.stats.snapshots_restored += 1

    def snapshot_targets(self, seq: Sequence, hit: Hit) -> list[int]:
        """Hybrid targets: the boundaries (token counts, ascending) at which a sequence admitted
        with `hit` saves its state: where the cached pages ran past the snapshots (`branch`),
        and its last page boundary before its last token, unless a snapshot is there already."""
        if self.snapshots is None:
            return []
        size = self.page_size
        end = (seq.num_tokens - 1) // size * size
        targets = {hit.branch}
        if end > hit.tokens and self.snapshots.peek(seq.page_hashes[end // size - 1]) < 0:
            targets.add(end)
        return sorted(t for t in targets if t > hit.tokens)

    # ---- as rows commit -------------------------------------------------------------------

    def next_full(self, seq: Sequence) -> int:
        """The committed-row count at which `seq` fills its next page (`commit` is due)."""
        return (seq.num_registered_pages + 1) * self.page_size

    def commit(self, seq: Sequence) -> None:
        """Offer the pages `seq`'s committed rows have filled; save its state as a snapshot
        when its rows end at one of its snapshot boundaries."""
        # a stop inside a verify drops the accepted drafts after it: their rows were computed
        # but hold no token of the sequence
        done = min(seq.num_computed_tokens, seq.num_tokens)
        full = done // self.page_size
        names = self.hashes(seq, full)
        for i in range(seq.num_registered_pages, full):
            page, name = seq.block_table[i], names[i]
            if page in self._name_of:
                continue  # already cached
            mark, old = self._mark(seq, i), self._page_of.get(name)
            if old is not None:
                # the same prefix cached from another sequence: this copy takes the name
                # only if its drafter rows are whole and the cached one's are not
                if mark is None or old in self._draft_mark:
                    continue
                self._forget(old)
            self._page_of[name] = page
            self._name_of[page] = name
            if mark is not None:
                self._draft_mark[page] = mark
        seq.num_registered_pages = full
        while seq.snapshot_at and seq.snapshot_at[0] <= done:
            if seq.snapshot_at.pop(0) == done and self.snapshots is not None:
                self.snapshots.save(names[full - 1], seq.slot)

    def withdraw(self, seq: Sequence, first: int) -> None:
        """Take back the names of the pages `seq` offered from its page `first` on (their rows
        came from a forward whose output was not finite: `commit.commit_rows`), and any
        snapshot saved with them. `first`: the first page it computed (those its first
        admission found cached hold no row of its own)."""
        for i in range(first, seq.num_registered_pages):
            name = self._name_of.pop(seq.block_table[i], None)
            if name is None:
                continue
            del self._page_of[name]
            self._draft_mark.pop(seq.block_table[i], None)
            if self.snapshots is not None:
                self.snapshots.drop(name)
        seq.num_registered_pages = min(seq.num_registered_pages, first)

    def release(self, seq: Sequence) -> None:
        """`seq` gave its pages back (finished, preempted, failed)."""
        if seq.state_pin >= 0 and self.snapshots is not None:
            self.snapshots.unpin(seq.state_pin)
        seq.state_pin = seq.state_restore = -1
        seq.snapshot_at = []
        seq.num_registered_pages = 0

    # ---- idle pages (the allocator's side) ------------------------------------------------

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._name_of)

    def holds(self, page: int) -> bool:
        return page in self._name_of

    def park(self, page: int) -> None:
        """No block table holds `page` any more: idle, most recently used."""
        self._idle[page] = None

    def unpark(self, page: int) -> None:
        del self._idle[page]

    def _forget(self, page: int) -> None:
        """`page` loses its name (to another copy): private to the block tables holding it,
        or, idle, back to the allocator's free list."""
        del self._name_of[page]
        self._draft_mark.pop(page, None)
        if page in self._idle:
            del self._idle[page]
            self.on_orphan(page)

    def evict(self) -> int:
        """Reclaim the least recently used idle page: it leaves the cache (and so does the
        snapshot after it)."""
        page, _ = self._idle.popitem(last=False)
        name = self._name_of.pop(page)
        del self._page_of[name]
        self._draft_mark.pop(page, None)
        if self.snapshots is not None:
            self.snapshots.drop(name)
        self.stats.evicted_pages += 1
        return page


def build_prefix_cache(cfg, runner, stats: PrefixCacheTelemetry) -> PrefixCache | None:
    """The engine's prefix cache, or None when `cfg.prefix_caching` is off. A hybrid target
    gets a snapshot pool of `cfg.prefix_cache_snapshots` entries, by default `2 * max_num_seqs`
    (each running sequence's next turn can find its last prompt's snapshot while as many new
    ones are taken); with none it caches nothing (a hit needs a state to resume from)."""
    if not cfg.prefix_caching:
        return None
    snapshots = None
    if runner.states is not None:
        if cfg.tensor_parallel_size > 1:
            # the recurrent state lives on every rank; snapshots would have to follow it there
            log.warning("prefix caching is off: hybrid targets under tensor parallelism")
            return None
        count = cfg.prefix_cache_snapshots
        if count is None:
            count = 2 * cfg.max_num_seqs
        if count == 0:
            log.info("prefix caching is off: a hybrid target without state snapshots")
            return None
        snapshots = SnapshotIndex(runner.states, count, stats)
        log.info(
            "prefix caching: %d state snapshots of %.1f MiB",
            count,
            runner.states.snapshot_bytes() / 2**20,
        )
    return PrefixCache(cfg.page_size, stats, snapshots)
