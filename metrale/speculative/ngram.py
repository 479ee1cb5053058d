"""Prompt-lookup (n-gram) drafter: find the longest recent suffix of the sequence that occurred
earlier in it, and propose the tokens that followed that earlier occurrence.

Model-free. The search covers at most the last `window` tokens. `lookup` is the reference scan;
on the host the drafter keeps an `NgramIndex` per sequence, grown by its new tokens, so a step
costs a few dictionary look-ups per sequence however long the sequence grows. On a GPU, batches of
`DEVICE_MIN_SEQS` sequences or more draft on the device instead (`ngram_device`): one launch for
the batch, the same drafts. With CUDA graphs such a batch's next drafts are made on the device
right after each verify program, behind its forward (`draft_ahead`), so its next `propose`
launches and waits for nothing. A new prompt is indexed, or written to the table, while its
prefill's forward runs (`catch_up`). Code and chat that quote their context (identifiers, repeated
lines, edits of a given text) are where it shines.
"""

from __future__ import annotations

import logging
from array import array

import numpy as np
import torch

from metrale.engine.sequence import Sequence
from metrale.kernels.ngram_lookup import device_lookup_supported
from metrale.speculative.drafter import Draft, Verdict
from metrale.speculative.ngram_device import DeviceNgramTable

log = logging.getLogger(__name__)

# Below this many sequences the host index is cheaper than a launch and a copy back. Measured on
# the H200 (`scripts/ngram_propose_timing.py`), ms per step host / device: batch 1 0.11 / 0.15,
# batch 8 0.20 / 0.22, batch 64 1.34 / 0.48.
DEVICE_MIN_SEQS = 16
# A sequence of a prompt chunk this many tokens behind its index (a new prompt, or a recompute
# after a preemption) is caught up while that step's forward runs (`catch_up`), not at its next
# draft: indexing a 4k-token prompt takes milliseconds of host time (about 6 ms on a CI core),
# which the first draft step of every new request paid in full.
CATCH_UP_MIN = 16
# Tokens by which a few sequences' host indexes may lag their rows in the device table before
# they draft there instead (`NgramDrafter._on_device`): indexing costs about 1 us a token on the
# H200's host, a launch and its copy back about 0.1 ms more than a few host look-ups.
HOST_LAG_MAX = 128
# Tokens of lagging host indexes (`NgramDrafter.lagging`) indexed in one overlap window, about
# 0.5 ms of host time on the H200 (1 us a token): about a narrow step's forward.
LAG_CATCH_UP_TOKENS = 512
# New n-gram starts of one n up to which `NgramIndex` slices each n-gram instead of zipping n
# shifted slices (the zip's set-up costs more for the few tokens of a decode step).
FEW_STARTS = 4


def lookup(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix of
    `tokens` of length n_max..n_min; [] when no suffix recurs."""
    length = len(tokens)
    if k <= 0 or length < 2:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # [length - n, n] every n-gram that starts early enough to be followed by a token.
        grams = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((grams == arr[length - n :]).all(axis=1))
        if hits.size:
            # The most recent occurrence best predicts what comes next, but in a repeating tail
            # it is followed by a single token; prefer the latest one followed by k tokens.
            full = hits[hits + n + k <= length]
            start = int(full[-1] if full.size else hits[-1]) + n
            return tokens[start : start + k]
    return []


class NgramIndex:
    """One sequence's n-grams (n_min..n_max) that some token follows: `lookup` from a dictionary
    instead of a scan.

    Per n, a hash chain (as an LZ77 match finder keeps one): `latest` maps an n-gram to the start
    of its latest occurrence, and `prev[i]` holds the start of the occurrence before the one at
    i. Grown by the tokens committed since the last call, so a step costs O(new tokens x n) per
    sequence, not O(window x n) plus a copy of the window. Proposes exactly what `lookup` over
    the last `window` tokens proposes (the tests hold it to that). Bounded by the window: once
    twice the window has gone by, the index is rebuilt from the last window's tokens (O(n) per
    token, amortised), so a long sequence keeps no n-gram it can no longer propose from.

    NOTE: the chains are int arrays and the dictionaries hold ints, not a list per n-gram: a
    batch of sequences would otherwise keep hundreds of thousands of small lists alive, and
    every full garbage collection walks them all (4x the drafter's time at batch 64, measured).
    """

    def __init__(self, n_min: int, n_max: int, window: int) -> None:
        self.n_min, self.n_max, self.window = n_min, n_max, window
        self.offset = 0  # absolute position of tokens[0]
        self.tokens: list[int] = []
        self._reset()

    def _reset(self) -> None:
        ns = range(self.n_min, self.n_max + 1)
        # per n (index n - n_min): n-gram -> absolute start of its latest occurrence
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in ns]
        # per n: prev[i - offset] = absolute start of the previous occurrence, -1 if none
        self.prev: list[array] = [array("q") for _ in ns]

    @property
    def length(self) -> int:
        """Tokens indexed so far (the sequence's positions 0..length-1)."""
        return self.offset + len(self.tokens)

    def reset_to(self, start: int) -> None:
        """Forget every token: the next `extend` brings the sequence's tokens from `start` (one
        that lookups need nothing before: what a rebuild in `extend` keeps starts there too)."""
        self.offset, self.tokens = start, []
        self._reset()

    def extend(self, new: list[int]) -> None:
        if len(self.tokens) + len(new) > 2 * self.window + self.n_max:
            # Keep what the window can still reach after these tokens, and index it afresh.
            kept = (self.tokens + list(new))[-(self.window + self.n_max) :]
            self.offset = self.length + len(new) - len(kept)
            self.tokens = []
            self._reset()
            self._register(kept)
        else:
            self._register(new)

    def _register(self, new: list[int]) -> None:
        tokens, base = self.tokens, self.offset
        tokens.extend(new)
        last = len(tokens) - 1  # an n-gram starting at i is followed once i + n <= last
        for n, latest, prev in zip(range(self.n_min, self.n_max + 1), self.latest, self.prev):
            first, stop = len(prev), last - n + 1  # starts first .. stop - 1 are new
            if stop - first <= FEW_STARTS:
                # a decode step's few tokens: a slice each costs less than setting up a zip
                for i in range(first, stop):
                    gram = tuple(tokens[i : i + n])
                    prev.append(latest.get(gram, -1))
                    latest[gram] = base + i
                continue
            # the n-grams as tuples, built in C by zipping n shifted slices
            grams = zip(*(tokens[first + j : stop + j] for j in range(n)))
            for i, gram in enumerate(grams, base + first):
                prev.append(latest.get(gram, -1))
                latest[gram] = i

    def lookup(self, k: int) -> list[int]:
        tokens, length, base = self.tokens, self.length, self.offset
        if k <= 0 or length < 2:
            return []
        first = max(0, length - self.window)  # n-grams wholly inside the window
        for n in range(min(self.n_max, length - 1, length - first - 1), self.n_min - 1, -1):
            at = self.latest[n - self.n_min].get(tuple(tokens[len(tokens) - n :]), -1)
            if at < first:
                continue
            # the latest occurrence followed by k tokens, else the latest (as `lookup` does)
            pick, prev = at, self.prev[n - self.n_min]
            while at >= first:
                if at + n + k <= length:
                    pick = at
                    break
                at = prev[at - base]
            return tokens[pick - base + n : pick - base + n + k]
        return []


class NgramDrafter:
    name = "ngram"
    needs_hidden = False
    stateless = True  # learns nothing from verdicts: steps that draft nothing skip `observe`
    own_tokens = True  # drafts are the sequence's own tokens: no vocabulary check

    def __init__(self, n_min: int = 1, n_max: int = 4, window: int = 4096) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"ngram: need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max, self.window = n_min, n_max, window
        self._indexes: dict[int, NgramIndex] = {}  # seq_id -> its n-grams
        self.device_table: DeviceNgramTable | None = None
        self.drafted_ahead = 0  # sequence-drafts `propose` took from `draft_ahead`
        # seq_id -> sequence: those that drafted on the device because their host indexes lag
        # the table (`_on_device`), to index on the host while a narrow batch's forward runs
        # (`catch_up`): otherwise each of their steps paid a launch and a copy back for good
        self._lagging: dict[int, Sequence] = {}

    def use_device(
        self, num_slots: int, capacity: int, device: torch.device, max_drafts: int
    ) -> bool:
        """Draft batches of `DEVICE_MIN_SEQS` or more on `device` (the engine's, where the kernel
        runs: CUDA) from a table of `num_slots` rows of `capacity` tokens, at most `max_drafts`
        each; returns whether it will."""
        if not device_lookup_supported(device):
            return False
        self.device_table = DeviceNgramTable(
            num_slots, capacity, device, self.n_min, self.n_max, self.window, max_drafts
        )
        return True

    def attach(self, runner) -> None:
        """Draft ahead after each verify program of `runner` (`draft_ahead`), on the device
        table; needs `use_device` first."""
        if self.device_table is None:
            raise ValueError("ngram: drafting ahead needs the device table (use_device)")

        def hook(entries, shape, tokens) -> None:
            self.draft_ahead(entries, shape, tokens, runner.replayed_ids)

        runner.after_verify = hook
        runner.after_verify_drafts_only = True  # a step without drafts may run ahead

    def draft_ahead(self, entries, shape, tokens: torch.Tensor, input_ids) -> None:
        """`ModelRunner.after_verify` of a verify step whose program just ran (`entries` in row
        order, `tokens` the target's pick at each sampled row, `input_ids` its real rows' ids in
        batch order: a ragged program, a dense target's prefill program or a hybrid's mixed
        one): the next drafts of its sequences, made on the device behind the forward
        (`DeviceNgramTable.draft_ahead`) when they are `DEVICE_MIN_SEQS` or more. A speed-up
        only: if it raises, `propose` drafts as usual."""
        table = self.device_table
        try:
            table.draft_ahead(entries, tokens, input_ids, DEVICE_MIN_SEQS)
        except Exception:  # noqa: BLE001 (never fail the verify step for it)
            table.drop_ahead()
            log.exception("n-gram drafting ahead failed; drafting in propose")

    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[Draft]:
        table = self.device_table
        device = table is not None and self._on_device(seqs)
        if table is not None and table.has_ahead:
            found = table.take_ahead(seqs, max_drafts)
            rest = [i for i, d in enumerate(found) if d is None]
            self.drafted_ahead += len(seqs) - len(rest)
            if rest:
                more = self._propose([seqs[i] for i in rest], [max_drafts[i] for i in rest], device)
                for i, draft in zip(rest, more, strict=True):
                    found[i] = draft
            return [Draft(t) for t in found]
        return [Draft(t) for t in self._propose(seqs, max_drafts, device)]

    def _on_device(self, seqs: list[Sequence]) -> bool:
        """Whether `seqs` draft from the device table: `DEVICE_MIN_SEQS` or more, or a few whose
        host indexes lag the table by `HOST_LAG_MAX` tokens or more. A few sequences of a wide
        batch (a D-Cut probe, a plan that drafts a handful) have rows in the table, which
        `catch_up` and the wide steps keep current, and host indexes that nothing grew: indexing
        their prompts and outputs at the probe cost about 1.8 ms at batch 64 on the H200's host
        (eight sequences of 190 tokens), against one launch and a copy back."""
        if len(seqs) >= DEVICE_MIN_SEQS:
            return True
        table, lag = self.device_table, 0
        for seq in seqs:
            index = self._indexes.get(seq.seq_id)
            total = seq.num_tokens
            # (never below 0: a sequence the host indexed and the table lacks costs the device
            # one packed copy, not the others' host indexing; found in review)
            lag += max(0, total - (0 if index is None else index.length) - table.behind(seq, total))
        return lag >= HOST_LAG_MAX

    @property
    def lagging(self) -> bool:
        """Whether sequences wait for their host indexes to be caught up (`catch_up`)."""
        return bool(self._lagging)

    def _propose(self, seqs: list[Sequence], max_drafts: list[int], device: bool):
        """Each sequence's drafts as a token list: from the device table (`device`, one
        launch), else from its host index."""
        if device:
            if len(seqs) < DEVICE_MIN_SEQS:  # on the device for their lag alone
                self._lagging.update((seq.seq_id, seq) for seq in seqs)
            return self.device_table.propose(seqs, max_drafts)
        drafts = []
        for seq, k in zip(seqs, max_drafts, strict=True):
            index = self._index(seq)
            if index.length < seq.num_tokens:
                index.extend(seq.tokens(index.length, seq.num_tokens))
            drafts.append(index.lookup(k))
        return drafts

    def _index(self, seq: Sequence) -> NgramIndex:
        index = self._indexes.get(seq.seq_id)
        if index is None:
            index = self._indexes[seq.seq_id] = NgramIndex(self.n_min, self.n_max, self.window)
        return index

    def catch_up(self, seqs: list[Sequence], width: int) -> None:
        """Index the tokens each sequence holds now, where it is `CATCH_UP_MIN` or more behind:
        the engine calls this while a step's forward runs on the device
        (`ModelRunner.while_forward_runs`), where the host would only wait. Only settled tokens:
        a placeholder for one still in flight (`Sequence.inflight`) is left to `propose`.
        `width`: the running batch, which picks what `propose` will draft from (the device
        table for `DEVICE_MIN_SEQS` or more).

        In a batch narrower than that, the host indexes of sequences that drafted on the device
        for their lag (`lagging`: the batch was wide until lately, or a probe) are caught up
        too, `LAG_CATCH_UP_TOKENS` a call: the tail of a wide closed batch otherwise drafted on
        the device to its end, a launch and a copy back a step (about 0.3 ms on the H200,
        half a plain step of the shipped model)."""
        device = self.device_table is not None and width >= DEVICE_MIN_SEQS
        late, totals = [], []
        for seq in seqs:
            if seq.is_finished:  # released already, or about to be: no index to grow
                continue
            total = seq.num_settled_tokens
            if device:
                if self.device_table.behind(seq, total) >= CATCH_UP_MIN:
                    late.append(seq)
                    totals.append(total)
                continue
            index = self._indexes.get(seq.seq_id)
            if total - (0 if index is None else index.length) >= CATCH_UP_MIN:
                index = self._index(seq)
                index.extend(seq.tokens(index.length, total))
        if late:
            self.device_table.write(late, totals)
        if self._lagging:
            if device:  # wide again: the table serves them
                self._lagging.clear()
            else:
                self._catch_up_lagging()

    def _catch_up_lagging(self) -> None:
        """Grow the lagging host indexes by up to `LAG_CATCH_UP_TOKENS` tokens in all, oldest
        first; a sequence leaves the set once its index holds its settled tokens."""
        budget = LAG_CATCH_UP_TOKENS
        for seq_id, seq in list(self._lagging.items()):
            if budget <= 0:
                break
            total = seq.num_settled_tokens
            index = None if seq.is_finished else self._index(seq)
            if index is not None and index.length < total:
                # (never past the window that `extend` keeps: older tokens are dropped anyway)
                start = max(index.length, total - self.window - self.n_max)
                stop = min(total, start + budget)
                if start > index.length:
                    index.reset_to(start)
                index.extend(seq.tokens(start, stop))
                budget -= stop - start
                if stop < total:
                    continue
            del self._lagging[seq_id]

    def observe(self, verdicts: list[Verdict]) -> None:
        pass  # the sequence's own tokens are the whole model; `propose` reads the new ones

    def release(self, seq: Sequence) -> None:
        self._indexes.pop(seq.seq_id, None)
        self._lagging.pop(seq.seq_id, None)
        if self.device_table is not None:
            self.device_table.release(seq)
