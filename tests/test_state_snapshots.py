"""A hybrid target's prefix-cache snapshots are queued and copied together (`StateSlots.
flush_snapshots`): one indexed copy per layer and tensor for a whole step's snapshots, not per
snapshot. Each snapshot holds its slot's committed state as of the save, a snapshot entry saved
twice keeps the later save, and a queued save lands before anything reads or rewrites an entry
(the next forward's `_plan`)."""

from __future__ import annotations

import torch

from metrale.config import SamplingParams
from metrale.engine.sequence import ScheduledSeq, Sequence
from metrale.engine.state_cache import StateSlots
from metrale.models.gdn_state import GDNState


class _Model:
    def make_state(self, num_entries: int, ssm_dtype=torch.float32) -> GDNState:
        return GDNState.zeros(2, num_entries, (3, 2), (2, 2, 2), torch.float32, "cpu", ssm_dtype)


def _slots() -> StateSlots:
    slots = StateSlots(_Model(), max_num_seqs=3, variant="write_on_accept", max_verify_rows=4)
    slots.add_snapshots(4)
    for i, t in enumerate(slots.pool.conv + slots.pool.ssm):
        t.copy_(torch.arange(t.numel(), dtype=t.dtype).view_as(t) + 100 * i)
    return slots


def _entry(pool: GDNState, index: int) -> list[torch.Tensor]:
    return [t[index].clone() for t in pool.conv + pool.ssm]


def test_queued_snapshots_land_together_and_the_last_save_of_an_entry_wins(monkeypatch):
    slots = _slots()
    copies = []
    copy = GDNState.copy_entries
    monkeypatch.setattr(
        GDNState, "copy_entries", lambda self, *a: (copies.append(a), copy(self, *a))[1]
    )
    slots.save_snapshot(0, 1)
    slots.save_snapshot(2, 3)
    slots.save_snapshot(1, 1)  # snapshot entry 1 taken again: slot 1's state wins
    assert copies == [] and torch.count_nonzero(slots.snapshots.ssm[0]) == 0
    slots.flush_snapshots()
    assert len(copies) == 1
    for snap, slot in ((1, 1), (3, 2)):
        for a, b in zip(_entry(slots.snapshots, snap), _entry(slots.pool, slots.entry_of(slot))):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    slots.flush_snapshots()  # nothing queued: nothing copied
    assert len(copies) == 1


def test_a_queued_snapshot_lands_before_the_next_forward_rewrites_its_slot():
    slots = _slots()
    before = _entry(slots.pool, slots.entry_of(0))
    slots.save_snapshot(0, 2)
    # slot 0's next sequence starts from its first token: its entry is zeroed for the forward
    seq = Sequence(7, "r", [1, 2, 3], SamplingParams(), seed=0, eos_token_ids=(), arrival=0)
    seq.slot = 0
    slots.addresses([ScheduledSeq(seq, 3)], verify=False)
    assert torch.count_nonzero(slots.pool.ssm[0][slots.entry_of(0)]) == 0
    for a, b in zip(_entry(slots.snapshots, 2), before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
