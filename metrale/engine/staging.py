"""One host-to-device copy for a step's small integer tensors.

A step's metadata is a handful of short int64 lists (input ids, positions, slots, row offsets,
sequence lengths, block tables, the verify layout). Copied one `torch.tensor(..., device=cuda)` at
a time, each is a synchronous copy from pageable memory, tens of microseconds apiece on the
step's critical path. Packed into one pinned buffer they cost one asynchronous copy; the device
views are slices of it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch


def to_device_packed(arrays: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """int64 device tensors [len(a)] of each list, made with a single copy."""
    lens = [len(a) for a in arrays]
    flat = np.fromiter(itertools.chain.from_iterable(arrays), dtype=np.int64, count=sum(lens))
    host = torch.from_numpy(flat)
    if device.type == "cuda":
        # The caching host allocator keeps the pinned block alive until the copy has run.
        packed = host.pin_memory().to(device, non_blocking=True)
    else:
        packed = host.to(device)
    # (the method itself: `Tensor.split`'s Python wrapper cost more than the split, per step)
    return list(packed.split_with_sizes(lens))
