"""Device time of the paged attention kernels (the default split-KV one and the deterministic
mode's invariant one) on decode and verify steps, with the cache read rate they reach; a sweep
over the tile width (keys gathered per loop step), the launch options and the default kernel's
programs per multiprocessor. Each timing is the median of 5 replays of a CUDA graph of 20
calls (`bench.timing.graph_time_us`).

  python scripts/attention_kernel_bench.py --batch 1,8,64 --context 1024,4096 --q 1,4
"""

import argparse
import functools
import itertools
import json

import torch

from metrale.bench.timing import graph_time_us
from metrale.kernels import invariant_attention, kv_tiles, paged_attention
from metrale.models.attention import AttentionMetadata, TorchPagedAttention

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16  # qwen3-8b's attention


def step(batch, context, q_len, device, dtype=torch.bfloat16, seed=0):
    """A step of `batch` sequences with `context` cached keys and q_len new rows each, their
    pages scattered over a pool as a running engine's are."""
    g = torch.Generator().manual_seed(seed)
    seq_len = context + q_len
    per_seq = -(-seq_len // PAGE)
    pool = batch * per_seq + 1
    pages = (torch.randperm(pool - 1, generator=g) + 1)[: batch * per_seq].view(batch, per_seq)
    cache = torch.randn(2, pool, PAGE, KV_HEADS, DIM, generator=g).to(device, dtype)
    rows = batch * q_len
    q = torch.randn(rows, HEADS, DIM, generator=g).to(device, dtype)
    positions = torch.arange(context, seq_len).repeat(batch)
    seq = torch.arange(batch).repeat_interleave(q_len)
    slots = pages[seq, positions // PAGE] * PAGE + positions % PAGE

    def t(x):
        return torch.as_tensor(x, dtype=torch.int32, device=device)

    meta = AttentionMetadata(
        t(slots), t(positions), t(torch.arange(batch + 1) * q_len), t([seq_len] * batch),
        t(pages), q_len, seq_len, PAGE,
    )  # fmt: skip
    return q, cache, meta, batch * seq_len * KV_HEADS * DIM * 2 * cache.element_size()


def main():
    ap = argparse.ArgumentParser()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--batch", type=ints, default=[1, 8, 64])
    ap.add_argument("--context", type=ints, default=[1024, 4096])
    ap.add_argument("--q", type=ints, default=[1, 4])
    ap.add_argument("--tile-keys", type=ints, default=[16, 32, 64, 128])
    ap.add_argument("--warps", type=ints, default=[4])
    ap.add_argument("--stages", type=ints, default=[3])
    ap.add_argument("--programs-per-sm", type=ints, default=[2])
    ap.add_argument("--split-tokens", type=ints, default=[invariant_attention.SPLIT_TOKENS])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    multiprocessors = paged_attention._multiprocessors
    results = []
    for batch, context, q_len in itertools.product(args.batch, args.context, args.q):
        q, cache, meta, kv_bytes = step(batch, context, q_len, dev)
        ref = None
        if batch * context <= 8 * 1024:  # the reference's padded mask stays small
            ref_backend = TorchPagedAttention()
            ref = ref_backend.forward(
                q, q[:, :KV_HEADS], q[:, :KV_HEADS], cache.clone(), ref_backend.prepare(meta),
                DIM**-0.5, kv_written=True,
            ).float()  # fmt: skip
        for invariant in (False, True):
            backend = paged_attention.TritonPagedAttention(invariant=invariant)
            pps = args.programs_per_sm if not invariant else args.programs_per_sm[:1]
            splits = args.split_tokens if invariant else args.split_tokens[:1]
            # the invariant kernel's two decode paths (same bits), whatever the batch
            paths = (False, True) if invariant else (None,)
            for keys, warps, stages, programs, split, fused in itertools.product(
                args.tile_keys, args.warps, args.stages, pps, splits, paths
            ):
                kv_tiles.NUM_WARPS, kv_tiles.NUM_STAGES = warps, stages
                if invariant:
                    invariant_attention.TILE_KEYS = keys
                else:
                    kv_tiles.TILE_KEYS = keys
                paged_attention.PROGRAMS_PER_SM = programs
                invariant_attention.SPLIT_TOKENS = split
                paged_attention._multiprocessors = (
                    multiprocessors if fused is None else (lambda *a, f=fused: 1 if f else 1e6)
                )

                call = functools.partial(
                    backend.forward, q, q[:, :KV_HEADS], None, cache, meta, DIM**-0.5,
                    kv_written=True,
                )  # fmt: skip

                try:
                    out = call().float()
                    ms = graph_time_us(call) / 1e3
                except Exception as e:  # a tile that does not fit: say so, go on
                    print(f"B{batch} ctx{context} q{q_len} inv={invariant} keys={keys} "
                          f"w{warps} s{stages}: {type(e).__name__}: {str(e)[:120]}")  # fmt: skip
                    continue
                err = None if ref is None else ((out - ref).norm() / ref.norm()).item()
                row = dict(
                    batch=batch, context=context, q=q_len, invariant=invariant, tile_keys=keys,
                    warps=warps, stages=stages, programs_per_sm=programs, split_tokens=split,
                    fused=fused, us=ms * 1e3,
                    GBps=kv_bytes / ms / 1e6, rel_err=err,
                )  # fmt: skip
                results.append(row)
                print(
                    f"B{batch:3d} ctx{context:5d} q{q_len} {'inv' if invariant else 'def'} "
                    f"keys={keys:3d} w{warps} s{stages} pps={programs} split={split} "
                    f"fused={fused}: "
                    f"{ms * 1e3:8.1f} us "
                    f"{row['GBps']:7.0f} GB/s err={err}",
                    flush=True,
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


main()
