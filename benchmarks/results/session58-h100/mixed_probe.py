"""Session 58 probe: device time of single program replays on the qwen3-8b shape (K=3):
a ragged verify program (64 x 4 rows) against prefill programs holding the same verify rows
plus a 16-row prompt (the steady state's mixed step), padded to 320 and 512 rows, and a
prefill program of exactly the verify rows. Every sequence sits on the dummy page."""

import sys

import torch

from metrale.bench.e2e import replay_engine
from metrale.engine.kv_cache import DUMMY_PAGE
from metrale.engine.program_shapes import PrefillShape, ragged_shape

llm, _ = replay_engine(
    "qwen3-8b",
    0.0,
    max_model_len=512,
    max_num_seqs=64,
    kv_cache_memory_gb=8.0,
    spec={"num_drafts": 3, "dcut": True},
)
runner = llm.engine.runner
g = runner.graphs
dev = runner.device
page = g.page_size


def setup(shape, rows_per_seq, ctx):
    g.fill_dummy(shape)
    starts, pos, lens = [0], [], []
    for k in rows_per_seq:
        starts.append(starts[-1] + k)
        if k <= 4:
            pos += list(range(ctx - k, ctx))
            lens.append(ctx)
        else:
            pos += list(range(k))
            lens.append(max(k, 1))
    n = len(rows_per_seq)
    g.query_start_loc[: n + 1] = torch.tensor(starts, device=dev)
    g.seq_lens[:n] = torch.tensor(lens, device=dev)
    g.positions[: len(pos)] = torch.tensor(pos, device=dev)
    g.slots[: len(pos)] = DUMMY_PAGE * page + g.positions[: len(pos)] % page
    if isinstance(shape, PrefillShape):
        g.sample_rows[: shape.samples] = torch.arange(shape.samples, device=dev)


def time_it(shape, rows_per_seq, ctx=100, n=40):
    graph, *_ = g.cache.get(shape, (g.max_model_len, None))
    setup(shape, rows_per_seq, ctx)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


R = ragged_shape(64, 256, 4)
verify = [4] * 64 + [0] * (R.num_seqs - 64)
print("ragged", R, f"{time_it(R, verify):.3f} ms")
R1 = ragged_shape(64, 64, 4)
print("ragged", R1, f"{time_it(R1, [1] * 64 + [0] * (R1.num_seqs - 64)):.3f} ms")
for rows in (256, 288, 320, 512):
    shape = PrefillShape(rows, 65, 256)
    if rows == 256:
        layout = [4] * 64 + [0]
        label = "64x4"
    else:
        layout = [4] * 63 + [16, rows - 268]
        label = "63x4 + 16 prompt"
    print("prefill", shape, label, f"{time_it(shape, layout):.3f} ms")
# the prompt alone beside nothing: how much of a prefill program is its padding rows
for rows in (256, 320, 512):
    shape = PrefillShape(rows, 65, 256)
    ms = time_it(shape, [16, rows - 16] + [0] * 63)
    print("prefill", shape, "one 16-row prompt + padding", f"{ms:.3f} ms")
sys.stdout.flush()
