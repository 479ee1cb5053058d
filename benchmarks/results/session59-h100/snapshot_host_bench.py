"""Host time of saving 8 snapshots of a 36-GDN-layer pool (tiny tensors: dispatch cost only)."""

import time

import torch

from metrale.engine.staging import to_device_packed
from metrale.engine.state_cache import StateSlots
from metrale.models.gdn_state import GDNState


class M:
    def make_state(self, n, ssm_dtype=torch.float32):
        return GDNState.zeros(36, n, (8, 3), (2, 4, 4), torch.float32, "cpu", ssm_dtype)


s = StateSlots(M(), 64, "write_on_accept", 4)
s.add_snapshots(128)


def old():
    for i in range(8):
        dst, src = to_device_packed([[i], [s.entry_of(i)]], s.device)
        s.snapshots.copy_entries(dst, s.pool, src)


def new():
    for i in range(8):
        s.save_snapshot(i, i)
    s.flush_snapshots()


for f in (old, new, old, new):
    t = time.perf_counter()
    for _ in range(50):
        f()
    print(f.__name__, f"{(time.perf_counter() - t) / 50 * 1e3:.2f} ms per step of 8 snapshots")
