"""Few-row projections as they run in a decode step, on a GPU: each after a norm kernel launched
with PDL (the step's chain), under cuBLAS against the PDL weight-streaming GEMV
(`metrale/kernels/gemv.py`) at several strip sizes and warps, and at 3 rows or more its
tensor-core kernel at several tiles.

Each case is a CUDA graph of 8 (add + RMSNorm, projection) pairs over 8 distinct weights (more
bytes than the L2 holds), replayed; the figure is microseconds a pair, the norm's included (the
same in every column), and the projection's GB/s of weight read at that time.

    python benchmarks/gemv_chain.py --rows 1,4,8 > gemv_chain.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from metrale.kernels import fused, gemv

SHAPES = {  # name: (K, N)
    "next.in_proj": (2048, 12352),
    "next.qkv": (2048, 9216),
    "next.out_proj": (4096, 2048),
    "8b.qkv": (4096, 6144),
    "8b.o_proj": (4096, 4096),
    "8b.gate_up": (4096, 24576),
    "8b.down_proj": (12288, 4096),
}
WEIGHTS = 8


def timed(fn, reps: int = 20) -> float:
    """Microseconds a pair: a graph of WEIGHTS pairs, replayed `reps` times (median of 5)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
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


def tile(t: dict) -> str:
    """A tried kernel's tile, in words."""
    if t.get("dot"):
        return f"dot bn {t['bn']} bk {t['bk']} stages {t['stages']} warps {t['warps']}"
    return f"strip {t['strip']} bn {t['bn']} warps {t['warps']}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--strips", default="2048,4096,8192,16384")
    # the tensor-core kernel's tiles tried at 3 rows or more (each list's product)
    ap.add_argument("--dot-bn", default="16,32,64")
    ap.add_argument("--dot-bk", default="128,256")
    ap.add_argument("--dot-stages", default="3,4,5")
    ap.add_argument("--dot-warps", default="4")
    args = ap.parse_args()
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    dot_tiles = list(
        itertools.product(
            ints(args.dot_bn), ints(args.dot_bk), ints(args.dot_stages), ints(args.dot_warps)
        )
    )
    dev = torch.device("cuda")
    dt = torch.bfloat16
    results = []
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(WEIGHTS)]
        norm_w = torch.ones(k, device=dev, dtype=dt)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=dt)
            res = torch.randn(m, k, device=dev, dtype=dt)
            out = torch.empty(m, n, device=dev, dtype=dt)
            ref = torch.nn.functional.linear(x, ws[0])

            def cublas(x=x, res=res, ws=ws, out=out, norm_w=norm_w):
                for w in ws:
                    h, _ = fused.add_rmsnorm(x, res, norm_w, 1e-6)
                    torch.mm(h, w.t(), out=out)

            row = {"shape": name, "k": k, "n": n, "rows": m, "cublas_us": timed(cublas)}
            row["tried"] = []
            for strip in (int(s) for s in args.strips.split(",") if m <= 2):
                bn, warps0 = gemv.strip_of(n, k, strip)
                for warps in sorted({warps0, 4, 8}):

                    def mine(x=x, res=res, ws=ws, out=out, norm_w=norm_w, cfg=(bn, warps)):
                        for w in ws:
                            h, _ = fused.add_rmsnorm(x, res, norm_w, 1e-6)
                            gemv.launch_strip(h, w, None, out, *cfg)

                    got = torch.empty_like(out)
                    gemv.launch_strip(x, ws[0], None, got, bn, warps)
                    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                    row["tried"].append(
                        {
                            "strip": strip,
                            "bn": bn,
                            "warps": warps,
                            "us": timed(mine),
                            "rel_err": err,
                        }
                    )
            for bn, bk, stages, warps in dot_tiles:
                if m <= 2:
                    break

                def dot(x=x, res=res, ws=ws, out=out, norm_w=norm_w, cfg=(bn, bk, warps, stages)):
                    for w in ws:
                        h, _ = fused.add_rmsnorm(x, res, norm_w, 1e-6)
                        gemv.launch_tiles(h, w, None, out, *cfg)

                got = torch.empty_like(out)
                try:
                    gemv.launch_tiles(x, ws[0], None, got, bn, bk, warps, stages)
                except Exception as e:  # noqa: BLE001 (a tile past the shared memory: skipped)
                    print(f"{name} rows {m}: dot {bn}/{bk}/{stages}/{warps}: {type(e).__name__}")
                    continue
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                row["tried"].append(
                    {"dot": True, "bn": bn, "bk": bk, "stages": stages, "strip": 0,
                     "warps": warps, "us": timed(dot), "rel_err": err}
                )  # fmt: skip
            if not row["tried"]:  # (every tile tried failed to launch)
                print(f"{name:14s} rows {m}: cublas {row['cublas_us']:7.2f} us, no kernel ran")
                continue
            best = min(row["tried"], key=lambda t: t["us"])
            default_bn, default_warps = gemv.strip_of(n, k, gemv.STRIP * m)
            default = [
                t
                for t in row["tried"]
                if not t.get("dot") and (t["bn"], t["warps"]) == (default_bn, default_warps)
            ]
            row["best"] = best
            row["default_us"] = default[0]["us"] if default else None
            row["cublas_gbps"] = n * k * 2 / row["cublas_us"] / 1e3
            row["best_gbps"] = n * k * 2 / best["us"] / 1e3
            results.append(row)
            print(
                f"{name:14s} rows {m}: cublas {row['cublas_us']:7.2f} us  default "
                f"{row['default_us'] or float('nan'):7.2f}  best {best['us']:7.2f} "
                f"({tile(best)})",
                flush=True,
            )
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
