"""Session 78: the staging path's pieces timed inside the engine (qwen3-8b, forced, D-Cut, batch
1 alpha 0.8 unless argv says), against staging_timing.py's isolated figures."""
import itertools, sys, time, atexit
import numpy as np
import torch
import metrale.engine.step_metadata as md
from metrale.engine.graphs import GraphRunner
from metrale.engine.kv_cache import DUMMY_PAGE

acc = {}
def add(k, t):
    n, s = acc.get(k, (0, 0.0)); acc[k] = (n + 1, s + t)

def to_device_packed(arrays, device):
    t0 = time.perf_counter()
    lens = [len(a) for a in arrays]
    flat = np.fromiter(itertools.chain.from_iterable(arrays), dtype=np.int64, count=sum(lens))
    t1 = time.perf_counter()
    host = torch.from_numpy(flat)
    pinned = host.pin_memory()
    t2 = time.perf_counter()
    packed = pinned.to(device, non_blocking=True)
    t3 = time.perf_counter()
    out = list(packed.split_with_sizes(lens))
    t4 = time.perf_counter()
    add("stage.fromiter", t1 - t0); add("stage.pin_memory", t2 - t1); add("stage.to_device", t3 - t2); add("stage.split", t4 - t3)
    add("stage.elements", sum(lens) * 1e-6)
    return out
md.to_device_packed = to_device_packed

def load(self, input_ids, positions, slots, starts, seq_lens, tables):
    t = [time.perf_counter()]
    rows, seqs = input_ids.shape[0], seq_lens.shape[0]
    self.input_ids[:rows].copy_(input_ids, non_blocking=True); t.append(time.perf_counter())
    self.positions[:rows].copy_(positions, non_blocking=True); t.append(time.perf_counter())
    self.slots[:rows].copy_(slots, non_blocking=True); t.append(time.perf_counter())
    self.query_start_loc[: seqs + 1].copy_(starts, non_blocking=True); t.append(time.perf_counter())
    self.seq_lens[:seqs].copy_(seq_lens, non_blocking=True); t.append(time.perf_counter())
    self.block_tables[:seqs].fill_(DUMMY_PAGE); t.append(time.perf_counter())
    self.block_tables[:seqs, : tables.shape[1]].copy_(tables, non_blocking=True); t.append(time.perf_counter())
    for i, name in enumerate(("ids", "pos", "slots", "qsl", "lens", "fill", "tables")):
        add("load." + name, t[i + 1] - t[i])
GraphRunner.load = load

@atexit.register
def report():
    for k, (n, s) in sorted(acc.items()):
        unit = "M elements" if k.endswith("elements") else "us"
        print(f"{k:20s} calls {n:6d} mean {s / n * (1 if unit != 'us' else 1e6):10.3f} {unit}")

from metrale.bench import profile_e2e
sys.argv = ["profile_e2e", "--shape", "qwen3-8b", "--forced", "--dcut", "--max-tokens", "128", "--phases",
            "--max-model-len", "1344", "--max-num-seqs", "64", *sys.argv[1:]]
profile_e2e.main()
