"""The n-gram drafter's device side: the running sequences' tokens in a device table, kept up to
date incrementally, and one kernel launch (`kernels.ngram_lookup`) that drafts for the whole batch.

On the host, the drafter's per-sequence Python (growing each sequence's index, then a dictionary
look-up per n) cost about 0.9 ms per step at batch 64 on the H200, half a plain step of the
shipped model. Here a step costs one packed copy of the new tokens and the batch's
(slot, length, cap), one launch, and one copy back of the drafts: the Python left per sequence is
a comparison of counters and the slicing of its drafts.

A row of the table belongs to a scheduler slot (`Sequence.slot`); a sequence's tokens are written
once, the first time it drafts after they exist (a new prompt, or the tokens of its last steps),
and only the last `window + n_max` of them: the search never reaches further back. A sequence
that comes back on another slot (a preemption) is written again from its tokens.
"""

from __future__ import annotations

import torch

from metrale.engine.sequence import Sequence
from metrale.engine.staging import to_device_packed
from metrale.kernels.ngram_lookup import ngram_lookup


class DeviceNgramTable:
    def __init__(
        self,
        num_slots: int,
        capacity: int,
        device: torch.device,
        n_min: int,
        n_max: int,
        window: int,
        max_drafts: int,
    ) -> None:
        """`num_slots`: the scheduler's slots (`max_num_seqs`); `capacity`: the most tokens a
        sequence holds (`max_model_len`); `max_drafts`: the most a sequence is asked for (K).
        Compiles the kernel now (one variant: every launch has the same constants)."""
        self.capacity, self.max_drafts = capacity, max(max_drafts, 1)
        self.n_min, self.n_max, self.window = n_min, n_max, window
        self.table = torch.zeros(num_slots, capacity, dtype=torch.int32, device=device)
        self.device = device
        # seq_id -> (slot, tokens written): its row holds positions up to there
        self._written: dict[int, tuple[int, int]] = {}
        self._lookup(torch.zeros(3, dtype=torch.int64, device=device))

    def _lookup(self, meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ngram_lookup(self.table, meta, self.n_min, self.n_max, self.window, self.max_drafts)

    def _stage(
        self, seq: Sequence, total: int, where: list[int], tokens: list[int], staged: dict
    ) -> int:
        """Queue `seq`'s tokens up to `total` that its row lacks onto `where` / `tokens`;
        returns its slot, or -1 where it has no row (cannot happen to a running sequence
        under its length limit: it drafts nothing, which only costs this step's
        speculation)."""
        if not (0 <= seq.slot < self.table.shape[0] and total <= self.capacity):
            return -1
        slot, done = self._written.get(seq.seq_id, (-1, 0))
        if slot != seq.slot:
            slot, done = seq.slot, 0
        if done < total:
            start = max(done, total - (self.window + self.n_max))  # the furthest a lookup reads
            base = slot * self.capacity
            where.extend(range(base + start, base + total))
            tokens.extend(seq.tokens(start, total))
            staged[seq.seq_id] = (slot, total)  # recorded once the copy is queued
        return slot

    def _write(self, where_t: torch.Tensor, tokens_t: torch.Tensor) -> None:
        self.table.view(-1).index_copy_(0, where_t, tokens_t.to(torch.int32))

    def write(self, seqs: list[Sequence], totals: list[int]) -> None:
        """Write each sequence's tokens up to totals[i] that its row lacks (a new prompt),
        ahead of its next `propose`: one packed copy, queued on the stream."""
        where: list[int] = []
        tokens: list[int] = []
        staged: dict = {}
        for seq, total in zip(seqs, totals, strict=True):
            self._stage(seq, total, where, tokens, staged)
        if where:
            self._write(*to_device_packed([where, tokens], self.device))
        self._written.update(staged)

    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[list[int]]:
        """Up to max_drafts[i] tokens for seqs[i], exactly as `ngram.lookup` over its last
        `window` tokens proposes."""
        where: list[int] = []
        tokens: list[int] = []
        slots, lengths = [], []
        staged: dict = {}
        for seq in seqs:
            total = seq.num_tokens
            slot = self._stage(seq, total, where, tokens, staged)
            slots.append(max(slot, 0))
            lengths.append(total if slot >= 0 else 0)  # length 0 drafts nothing
        ks = [min(k, self.max_drafts) for k in max_drafts]
        # the kernel's arrays first: the packed buffer's start is aligned
        meta, where_t, tokens_t = to_device_packed(
            [slots + lengths + ks, where, tokens], self.device
        )
        if where:
            self._write(where_t, tokens_t)
        self._written.update(staged)
        drafts, counts = self._lookup(meta)
        # one copy back: each row's count, then its drafts
        rows = torch.cat([counts[:, None], drafts], dim=1).tolist()
        return [row[1 : 1 + row[0]] for row in rows]

    def behind(self, seq: Sequence, total: int) -> int:
        """How many of `seq`'s first `total` tokens its row still lacks."""
        slot, done = self._written.get(seq.seq_id, (-1, 0))
        return total - done if slot == seq.slot else total

    def release(self, seq: Sequence) -> None:
        self._written.pop(seq.seq_id, None)
