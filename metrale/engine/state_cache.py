"""Recurrent-state slots of a hybrid (Gated DeltaNet) target, one per running sequence.

The scheduler gives every running sequence a state slot (`Sequence.slot`, bounded by
`max_num_seqs`); its GDN conv windows and float32 delta-rule states live in entry `slot + 1` of
a `GDNState` pool (entry 0 is the dummy entry that padding rows may use). A sequence starting
from its first token (a new request, or a recompute after preemption) has its entries zeroed
before the forward; a finished or preempted sequence simply gives its slot back.

Verify is write-on-accept: a forward with drafts keeps every row's state (`keep_rows`) and
leaves the entries alone; once the acceptance is known, `commit` writes each sequence's state
after its last committed row (its last token plus the accepted drafts), so rejected drafts leave
nothing behind. A step mixing prefill chunks with drafts is split by the runner, so per-row
states are only ever kept for a few rows per sequence.
"""

from __future__ import annotations

import torch

from metrale.engine.sequence import ScheduledSeq
from metrale.engine.staging import to_device_packed
from metrale.models.gdn import GDNState

DUMMY_ENTRY = 0


class StateSlots:
    def __init__(self, model, max_num_seqs: int) -> None:
        self.pool: GDNState = model.make_state(max_num_seqs + 1)
        self.device = self.pool.ssm[0].device if self.pool.ssm else torch.device("cpu")

    def bind(self, entries: list[ScheduledSeq], keep_rows: bool) -> GDNState:
        """Point the pool at this forward's sequences (in packed order), zeroing the entries of
        sequences that start from their first token; returns the state the model takes."""
        slots = [e.seq.slot + 1 for e in entries]
        if any(s <= DUMMY_ENTRY for s in slots):
            raise RuntimeError("a sequence without a state slot reached the hybrid runner")
        fresh = [s for s, e in zip(slots, entries, strict=True) if e.seq.num_computed_tokens == 0]
        slots_t, fresh_t = to_device_packed([slots, fresh], self.device)
        if fresh:
            self.pool.reset(fresh_t)
        self.pool.slots, self.pool.keep_rows = slots_t, keep_rows
        self.pool.conv_rows.clear()
        self.pool.ssm_rows.clear()
        return self.pool

    def commit(self, last_rows: list[int]) -> None:
        """After a `keep_rows` forward: each sequence's entries <- its state after row
        `last_rows[b]` (0-based, in packed order)."""
        (rows,) = to_device_packed([last_rows], self.device)
        self.pool.commit(rows)
        self.pool.conv_rows.clear()
        self.pool.ssm_rows.clear()

    def entry(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv window, delta-rule state) of a slot in one GDN layer (tests, debugging)."""
        return self.pool.conv[layer][slot + 1], self.pool.ssm[layer][slot + 1]
