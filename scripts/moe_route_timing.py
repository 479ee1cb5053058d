"""Device time of MoE routing at the qwen3-next-a3b-64e shape (H 2048, 64 experts, top 10), with
the router product made in the routing kernel (`route(hidden=, router=)`) against the router
GEMM (cuBLAS) followed by `route(logits)`: the median of 20 replays of a CUDA graph of 48
layers' worth (`bench.timing.graph_time_us`), so launch gaps count as they do in a decode step.

    python scripts/moe_route_timing.py [--rows 1,16,64] [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

from metrale.bench.timing import graph_time_us
from metrale.kernels.moe_routing import route


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
        inside = graph_time_us(
            lambda x=x: route(None, top_k, shared=True, hidden=x, router=router), 48, 20
        )
        gemm = graph_time_us(
            lambda x=x: route(torch.nn.functional.linear(x, router), top_k, shared=True), 48, 20
        )
        rows.append({"rows": n, "us_in_kernel": inside, "us_gemm_then_route": gemm})
        print(f"rows {n:4d}: in-kernel {inside:6.2f} us, GEMM + route {gemm:6.2f} us", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": "qwen3-next-a3b-64e router", "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
