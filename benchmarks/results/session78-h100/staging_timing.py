"""Session 78: host microseconds of a step's staging on this machine's CUDA host: the packed copy
(`staging.to_device_packed`) as it is, and variants; the workspace load (7 copies + fill) against
one copy into a flat workspace."""
import itertools, time
import numpy as np
import torch
from metrale.engine.staging import to_device_packed

dev = torch.device("cuda")

def arrays(seqs, q, width):
    rows = seqs * q
    return [list(range(rows)), list(range(rows)), list(range(rows)), list(range(seqs + 1)), list(range(seqs)), list(range(seqs * width))]

pinned = torch.empty(1 << 20, dtype=torch.int64, pin_memory=True)
pin_np = pinned.numpy()
dbuf = torch.empty(1 << 20, dtype=torch.int64, device=dev)

def fromiter_only(arrs):
    lens = [len(a) for a in arrs]
    return np.fromiter(itertools.chain.from_iterable(arrs), dtype=np.int64, count=sum(lens))

def pinned_ring(arrs):
    lens = [len(a) for a in arrs]
    n = sum(lens)
    pin_np[:n] = np.fromiter(itertools.chain.from_iterable(arrs), dtype=np.int64, count=n)
    out = torch.empty(n, dtype=torch.int64, device=dev)
    out.copy_(pinned[:n], non_blocking=True)
    return list(out.split_with_sizes(lens))

def pin_only(arrs):
    lens = [len(a) for a in arrs]
    flat = np.fromiter(itertools.chain.from_iterable(arrs), dtype=np.int64, count=sum(lens))
    return torch.from_numpy(flat).pin_memory()

ws = {k: torch.zeros(4096, dtype=torch.long, device=dev) for k in ("ids", "pos", "slots", "qsl", "lens")}
tables_ws = torch.zeros(64, 90, dtype=torch.long, device=dev)
flat_ws = torch.zeros(1 << 16, dtype=torch.long, device=dev)

def load7(packed, seqs, width):
    ids, pos, slots, starts, lens, tables = packed
    rows = ids.shape[0]
    ws["ids"][:rows].copy_(ids, non_blocking=True)
    ws["pos"][:rows].copy_(pos, non_blocking=True)
    ws["slots"][:rows].copy_(slots, non_blocking=True)
    ws["qsl"][: seqs + 1].copy_(starts, non_blocking=True)
    ws["lens"][:seqs].copy_(lens, non_blocking=True)
    tables_ws[:seqs].fill_(0)
    tables_ws[:seqs, :width].copy_(tables.view(seqs, width), non_blocking=True)

def flat_copy(arrs):
    n = sum(len(a) for a in arrs)
    pin_np[:n] = np.fromiter(itertools.chain.from_iterable(arrs), dtype=np.int64, count=n)
    flat_ws[:n].copy_(pinned[:n], non_blocking=True)

def timeit(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(n):
        fn()
        if i % 50 == 49:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6

for seqs, q, width in ((1, 4, 8), (8, 4, 8), (64, 4, 84), (64, 1, 84)):
    a = arrays(seqs, q, width)
    packed = to_device_packed(a, dev)
    print(f"seqs {seqs} q {q} width {width}:",
          f"to_device_packed {timeit(lambda: to_device_packed(a, dev)):.1f} us;",
          f"fromiter {timeit(lambda: fromiter_only(a)):.1f};",
          f"fromiter+pin_memory {timeit(lambda: pin_only(a)):.1f};",
          f"pinned buffer + empty + copy + split {timeit(lambda: pinned_ring(a)):.1f};",
          f"load (7 copies + fill) {timeit(lambda: load7(packed, seqs, width)):.1f};",
          f"one flat copy into workspace {timeit(lambda: flat_copy(a)):.1f}", flush=True)
x = torch.zeros(256, 384, device=dev, dtype=torch.bfloat16)
print(f"clone [256,384] {timeit(lambda: x[:4].clone()):.1f} us; torch.empty {timeit(lambda: torch.empty(100, dtype=torch.long, device=dev)):.1f} us")
