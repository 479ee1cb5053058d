"""Tile configurations of the batch-invariant GEMM at the row counts of batched decode and verify
(issue 13): the best per qwen3-8b weight against cuBLAS, and the per-step total weighted by how
often each weight runs (36 layers, one head)."""

import itertools

import torch
import triton

from metrale.kernels.batch_invariant import config_for, invariant_linear

SHAPES = {"qkv": (6144, 4096, 36), "o": (4096, 4096, 36), "gate_up": (24576, 4096, 36),
          "down": (4096, 12288, 36), "lm_head": (151936, 4096, 1)}  # fmt: skip
CONFIGS = [
    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
    for bm, bn, bk, w, s in itertools.product(
        (32, 64, 128), (32, 64, 128), (64, 128), (4, 8), (3, 4, 5)
    )
    if not (bm == 128 and bn == 128 and bk == 128)
    and bm * bn <= 128 * 64
    or (bm, bn, bk) == (128, 128, 64)
]


def t(fn):
    return triton.testing.do_bench(fn, warmup=3, rep=15, return_mode="median")


for m in (64, 256):
    tot_best = tot_cur = tot_ref = 0.0
    for name, (n, k, times) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = t(lambda x=x, w=w: torch.nn.functional.linear(x, w))
        cur = t(lambda x=x, w=w: invariant_linear(x, w))
        best, best_cfg = float("inf"), None
        for c in CONFIGS:
            try:
                v = t(lambda x=x, w=w, c=c: invariant_linear(x, w, config=c))
            except Exception:  # noqa: BLE001 (out of shared memory)
                continue
            if v < best:
                best, best_cfg = v, c
        tot_best += best * times
        tot_cur += cur * times
        tot_ref += ref * times
        print(
            f"M={m} {name}: cuBLAS {ref:.4f} current {cur / ref:.2f}x ({config_for(m, n)}) "
            f"best {best / ref:.2f}x {best_cfg}",
            flush=True,
        )
    print(
        f"M={m} step: current {tot_cur / tot_ref:.3f}x, best {tot_best / tot_ref:.3f}x", flush=True
    )
