"""Decode-step projections (a few rows against a large weight) under cuBLAS against a Triton
weight-streaming kernel, on a GPU: which tiles stream the weight nearest the memory bandwidth.

Each case is a CUDA graph of calls over 8 distinct weights in turn (more bytes than the L2 holds,
so every call reads its weight from memory), replayed; the figure is microseconds a call, and
GB/s of weight read. Shapes: the qwen3-next-a3b-64e shape's GDN out_proj / attention o_proj
(4096 -> 2048), GDN in_proj (2048 -> 12352) and attention qkv (2048 -> 9216); the qwen3-8b
shape's o_proj (4096 -> 4096) and down_proj (12288 -> 4096).

    python benchmarks/skinny_gemm.py --rows 1,16,64 > skinny.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl

SHAPES = {
    "next.out_proj": (4096, 2048),
    "next.in_proj": (2048, 12352),
    "next.qkv": (2048, 9216),
    "8b.o_proj": (4096, 4096),
    "8b.down_proj": (12288, 4096),
}
WEIGHTS = 8


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """out[M, N] (or float32 partials [SPLIT, M, N]) = x[M, K] @ w[N, K]^T, a BN-column strip
    per program, K in SPLIT parts (program axis 1)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    kk = tl.arange(0, BK)
    part = K // SPLIT
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(pid_k * part, (pid_k + 1) * part, BK):
        k = k0 + kk
        x = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=m[:, None] < M, other=0.0)
        w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=n[:, None] < N, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    ok = (m[:, None] < M) & (n[None, :] < N)
    if SPLIT == 1:
        tl.store(out_ptr + m[:, None] * stride_o + n[None, :], acc.to(tl.bfloat16), mask=ok)
    else:
        off = (pid_k * M + m[:, None]) * N + n[None, :]
        tl.store(out_ptr + off, acc, mask=ok)


@triton.jit
def _reduce_kernel(part_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * MN + i, mask=ok, other=0.0)
    tl.store(out_ptr + i, acc.to(tl.bfloat16), mask=ok)


def skinny(x, w, out, part, bn, bk, split, warps, stages):
    m, k = x.shape
    n = w.shape[0]
    bm = max(16, triton.next_power_of_2(m))
    grid = (triton.cdiv(n, bn), split)
    dest = out if split == 1 else part
    _skinny_kernel[grid](
        x, w, dest, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BM=bm, BN=bn, BK=bk, SPLIT=split, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if split > 1:
        _reduce_kernel[(triton.cdiv(m * n, 1024),)](part, out, m * n, SPLIT=split, BLOCK=1024)


def timed(fn, reps: int = 20) -> float:
    """Microseconds a call: a graph of WEIGHTS calls, replayed `reps` times."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile, warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps / WEIGHTS)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    dev = torch.device("cuda")
    results = []
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(WEIGHTS)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            part = torch.empty(8, m, n, device=dev, dtype=torch.float32)
            ref = torch.nn.functional.linear(x, ws[0])

            def cublas(x=x, ws=ws, out=out):
                for w in ws:
                    torch.mm(x, w.t(), out=out)

            best = {"us": timed(cublas), "cfg": "cublas"}
            row = {"shape": name, "k": k, "n": n, "rows": m, "cublas_us": best["us"], "tried": []}
            for bn, bk, split, warps, stages in itertools.product(
                (16, 32, 64), (128, 256), (1, 2, 4), (4,), (3, 5)
            ):
                if k % (split * bk) or (n // bn) * split < 32:
                    continue

                cfg = (bn, bk, split, warps, stages)

                def mine(x=x, ws=ws, out=out, part=part, cfg=cfg):
                    for w in ws:
                        skinny(x, w, out, part, *cfg)

                try:
                    skinny(x, ws[0], out, part, bn, bk, split, warps, stages)
                    err = (out.float() - ref.float()).abs().max().item()
                    us = timed(mine)
                except Exception as e:  # noqa: BLE001 (out of resources: skip)
                    row["tried"].append({"cfg": list(cfg), "error": str(e)[:80]})
                    continue
                row["tried"].append({"cfg": list(cfg), "us": us, "err": err})
                if us < best["us"]:
                    best = {"us": us, "cfg": list(cfg)}
            row["best"] = best
            row["best_GBps"] = n * k * 2 / best["us"] / 1e3
            row["cublas_GBps"] = n * k * 2 / row["cublas_us"] / 1e3
            print(
                f"{name:14s} M={m:3d} cublas {row['cublas_us']:7.2f} us "
                f"({row['cublas_GBps']:5.0f} GB/s)  best {best['us']:7.2f} us "
                f"({row['best_GBps']:5.0f} GB/s) {best['cfg']}",
                flush=True,
            )
            results.append(row)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
