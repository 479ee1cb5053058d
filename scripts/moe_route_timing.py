"""Device time of MoE routing at the qwen3-next-a3b-64e shape (H 2048, 64 experts, top 10), with
the router product made in the routing kernel (`route(hidden=, router=)`) against the router
GEMM (cuBLAS) followed by `route(logits)`: CUDA-graph replays of 48 layers' worth, so launch
gaps count as they do in a decode step.

    python scripts/moe_route_timing.py [--rows 1,16,64] [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

from metrale.kernels.moe_routing import route


def timed(fn, reps: int = 48, iters: int = 20) -> float:
    """Microseconds per call of fn, from a CUDA graph of `reps` calls replayed `iters` times."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hidden, experts, top_k = 2048, 64, 10
    gen = torch.Generator(device="cuda").manual_seed(0)
    router = torch.randn(experts, hidden, device="cuda", generator=gen).bfloat16() * 0.02
    rows = []
    for n in (int(r) for r in args.rows.split(",")):
        x = torch.randn(n, hidden, device="cuda", generator=gen).bfloat16()
        inside = timed(lambda x=x: route(None, top_k, shared=True, hidden=x, router=router))
        gemm = timed(lambda x=x: route(torch.nn.functional.linear(x, router), top_k, shared=True))
        rows.append({"rows": n, "us_in_kernel": inside, "us_gemm_then_route": gemm})
        print(f"rows {n:4d}: in-kernel {inside:6.2f} us, GEMM + route {gemm:6.2f} us", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": "qwen3-next-a3b-64e router", "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
