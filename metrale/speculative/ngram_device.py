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

Drafting ahead (`draft_ahead`, on CUDA graphs): right after a verify step's program, before the
host waits for its verdicts (`ModelRunner.after_verify`), the step's committed tokens (the
accepted drafts and the bonus token, which the target's picks imply; a prompt's first token)
are written into the rows on the device and the next step's drafts looked up there, in one
launch queued behind the forward (`kernels.ngram_lookup.ngram_commit_lookup`), their copy back
with them. The host's part (staging any token a row lacks, one packed copy, the launch) runs
while the forward does; the next `propose` reads the drafts of every sequence still where they
were drafted from (`take_ahead`) and launches nothing for them: the sync and the launches that
were on the critical path of every verify step are gone from it. Each is the lookup of the
sequence's K drafts (its `num_drafts` cap), cut to the step's depth.
"""

from __future__ import annotations

import torch

from metrale.engine.device_tokens import HostCopy
from metrale.engine.sequence import Sequence
from metrale.engine.staging import to_device_packed
from metrale.kernels.ngram_lookup import ngram_commit_lookup, ngram_lookup


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
        Compiles the kernels now (one variant each: every launch has the same constants)."""
        self.capacity, self.max_drafts = capacity, max(max_drafts, 1)
        self.n_min, self.n_max, self.window = n_min, n_max, window
        self.table = torch.zeros(num_slots, capacity, dtype=torch.int32, device=device)
        self.device = device
        # seq_id -> (slot, tokens written): its row holds positions up to there
        self._written: dict[int, tuple[int, int]] = {}
        # the drafts made ahead by the last verify (`draft_ahead`): (their host copy: per
        # sequence its count, its token count on the device, its drafts; seq_id -> (its row
        # there, the sequence, its slot))
        self._ahead: tuple[HostCopy, dict[int, tuple[int, Sequence, int]]] | None = None
        self._lookup(torch.zeros(3, dtype=torch.int64, device=device))
        # and `draft_ahead`'s variant (it writes a 0 into an empty table's first cell)
        zeros = torch.zeros(6, dtype=torch.int64, device=device)
        self._commit_lookup(zeros, zeros, zeros)

    def _lookup(self, meta: torch.Tensor) -> torch.Tensor:
        return ngram_lookup(self.table, meta, self.n_min, self.n_max, self.window, self.max_drafts)

    def _commit_lookup(self, meta, input_ids, picks) -> torch.Tensor:
        n_min, n_max, window = self.n_min, self.n_max, self.window
        return ngram_commit_lookup(
            self.table, meta, input_ids, picks, n_min, n_max, window, self.max_drafts
        )

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
        # one copy back: each row's count, its length, then its drafts
        rows = self._lookup(meta).tolist()
        return [row[2 : 2 + row[0]] for row in rows]

    def draft_ahead(
        self, entries: list, picks: torch.Tensor, input_ids: torch.Tensor, min_seqs: int
    ) -> bool:
        """The next drafts of a step's sequences, queued on the device behind its forward (see
        the module's docstring). `entries` in packed row order, their rows in `input_ids`; the
        target's pick after each sampled row (a sampling entry's last 1 + k: its last token, or
        its prompt chunk's last row, then each draft) in `picks`, in order. Every sampling
        sequence that may speculate is drafted for: a decode, a verify, a prompt's last chunk;
        the whole step only with `min_seqs` of them. Returns whether it drafted."""
        self._ahead = None
        if len(entries) < min_seqs:  # before staging: a narrow batch drafts on the host
            return False
        where: list[int] = []
        tokens: list[int] = []
        staged: dict = {}
        slots, draft_rows, pick_rows, ks, totals, wants = [], [], [], [], [], []
        index: dict[int, tuple[int, Sequence, int]] = {}
        row = pick_row = 0
        room = self.table.shape[0]
        for e in entries:
            n = e.num_rows
            if e.samples:
                seq = e.seq
                k = len(e.drafts)
                total = seq.num_tokens
                params = seq.params
                if (
                    params.speculative
                    and params.num_drafts != 0
                    and seq.inflight is None
                    and seq.num_computed_tokens + n == total + k
                    and 0 <= seq.slot < room
                    and total + k < self.capacity
                ):
                    slot = self._stage(seq, total, where, tokens, staged)
                    index[seq.seq_id] = (len(slots), seq, slot)
                    slots.append(slot)
                    draft_rows.append(row + n - k)
                    pick_rows.append(pick_row)
                    ks.append(k)
                    totals.append(total)
                    want = params.num_drafts
                    wants.append(self.max_drafts if want is None else min(want, self.max_drafts))
                pick_row += 1 + len(e.drafts)
            row += n
        if len(slots) < max(min_seqs, 1):
            return False
        meta, where_t, tokens_t = to_device_packed(
            [slots + draft_rows + pick_rows + ks + totals + wants, where, tokens], self.device
        )
        if where:
            self._write(where_t, tokens_t)
        self._written.update(staged)
        self._ahead = (HostCopy(self._commit_lookup(meta, input_ids, picks)), index)
        return True

    @property
    def has_ahead(self) -> bool:
        """Whether the last verify drafted ahead (`take_ahead` has drafts to give)."""
        return self._ahead is not None

    def drop_ahead(self) -> None:
        self._ahead = None

    def take_ahead(self, seqs: list[Sequence], max_drafts: list[int]) -> list[list[int] | None]:
        """The drafts made ahead by the last verify for each of `seqs` still where they were
        drafted from (the same slot, every token of that step committed, none since), cut to
        max_drafts[i]; None for the others. Every sequence drafted ahead that is still there
        counts its row as written up to its tokens, drafting now or not."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return [None] * len(seqs)
        copy, index = ahead
        rows = copy.rows()  # long done: the verdicts waited for the step
        still: dict[int, list[int]] = {}  # seq_id -> its row, where it is still there
        for n, seq, slot in index.values():
            if seq.slot == slot and seq.num_tokens == rows[n][1]:
                self._written[seq.seq_id] = (slot, rows[n][1])
                still[seq.seq_id] = rows[n]
        out: list[list[int] | None] = []
        for seq, k in zip(seqs, max_drafts, strict=True):
            row = still.get(seq.seq_id)
            out.append(None if row is None else row[2 : 2 + min(row[0], k)])
        return out

    def behind(self, seq: Sequence, total: int) -> int:
        """How many of `seq`'s first `total` tokens its row still lacks."""
        slot, done = self._written.get(seq.seq_id, (-1, 0))
        return total - done if slot == seq.slot else total

    def release(self, seq: Sequence) -> None:
        self._written.pop(seq.seq_id, None)
        if self._ahead is not None:
            self._ahead[1].pop(seq.seq_id, None)
