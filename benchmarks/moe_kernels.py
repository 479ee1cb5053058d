"""The sparse MoE block's kernels at qwen3-next-a3b-64e's shape (H 2048, 64 experts, top-10,
I 512, a shared expert of 512, bf16) on one GPU, per layer, each timed as a replayed CUDA graph:

  route     routing + plan (`kernels/moe_routing.py`), one launch, from the router logits
  route_from_hidden   the same launch making the logits too; the router GEMM alone beside it
  split_router        the router product split across programs, the last routing
            (`kernels/moe_router.py`, as the block runs it up to 16 rows); the block without it
  experts   grouped gate/up + down + combine (`kernels/moe.py`), three launches
  block     the whole fused block (router GEMM, route, experts, the next norm folded)
  torch     the block's torch path (`METRALE_NO_FUSED_KERNELS=1` would give it on CUDA)

against the weight bytes the batch reads over the copy bandwidth (the block's roofline). `--sweep`
times the grouped kernels' block shapes (BN, BK, warps, stages; gate/up's, then down's, the other
kernel at its default; one shape serves every batch size, a row's rounding must not depend on
it: pick one). Run from the repository root:
`PYTHONPATH=. python benchmarks/moe_kernels.py [--sweep]`; one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton

from metrale.bench.shapes import experts_read
from metrale.config import ModelConfig
from metrale.kernels import moe, moe_routing
from metrale.models import qwen3_next_moe
from metrale.models.qwen3_next import ZeroCentredRMSNorm

H, E, K, INTER = 2048, 64, 10, 512


def _time(fn, reps: int = 50) -> float:
    """Microseconds per replay of `fn` captured as a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def _bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (_time(lambda: dst.copy_(src), reps=10) * 1e-6)


def _block():
    raw = dict(
        architectures=["Qwen3NextForCausalLM"], hidden_size=H, intermediate_size=5120,
        num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, num_experts=E, num_experts_per_tok=K,
        moe_intermediate_size=INTER, shared_expert_intermediate_size=INTER, vocab_size=64,
    )  # fmt: skip
    block = qwen3_next_moe.Qwen3NextSparseMoeBlock(ModelConfig.from_dict(raw))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 1 / math.sqrt(p.shape[-1]))
    return block.cuda().bfloat16()


# (BN, BK, warps, stages) of each grouped kernel near the chosen ones, swept one kernel at a time
# (the other at its default)
SWEEP = {
    "gate_up": [(bn, bk, 4, st) for bn in (32, 64) for bk in (128, 256) for st in (2, 3, 4, 5)],
    "down": [(bn, bk, 4, st) for bn in (64, 128) for bk in (64, 128) for st in (2, 3, 4, 5)],
}


def _measure(n: int, block, norm, bw: float, sweep: bool) -> dict:
    """One batch size's row of the report."""
    exp, se = block.experts, block.shared_expert
    shared = moe.SharedExpert(
        se.gate_up_proj.weight, se.down_proj.weight, block.shared_expert_gate.weight[0]
    )
    x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    logits = block.gate(x)
    plan = moe_routing.route(logits, K, shared=True, block_m=moe.BLOCK_M)
    # the experts the batch reads, the shared one and the router
    read = (experts_read(E, K, n) + 1) * 3 * H * INTER * 2 + E * H * 2
    row = {"batch": n, "roofline_us": read / bw * 1e6}
    row["route_us"] = _time(lambda: moe_routing.route(logits, K, shared=True))
    row["router_gemm_us"] = _time(lambda: block.gate(x))
    row["route_from_hidden_us"] = _time(
        lambda: moe_routing.route(None, K, shared=True, hidden=x, router=block.gate.weight)
    )
    if n <= moe_routing.route_block_rows(E):
        arrivals = block.router_arrivals
        row["split_router_us"] = _time(
            lambda: moe_routing.route(
                None, K, shared=True, hidden=x, router=block.gate.weight, arrivals=arrivals
            )
        )
        split = qwen3_next_moe.SPLIT_ROUTER
        qwen3_next_moe.SPLIT_ROUTER = False
        row["block_without_split_router_us"] = _time(lambda: block(x, residual, norm))
        qwen3_next_moe.SPLIT_ROUTER = split
    row["experts_us"] = _time(
        lambda: moe.grouped_experts(x, plan, exp.gate_up_proj, exp.down_proj, shared)
    )
    row["block_us"] = _time(lambda: block(x, residual, norm))
    fused = qwen3_next_moe.hybrid_kernels_enabled
    qwen3_next_moe.hybrid_kernels_enabled = lambda x: False
    row["torch_us"] = _time(lambda: block(x))
    qwen3_next_moe.hybrid_kernels_enabled = fused
    row["block_x_roofline"] = row["block_us"] / row["roofline_us"]
    if sweep:
        times = {}
        for kernel, shapes in SWEEP.items():
            name = "GATE_UP_BLOCKS" if kernel == "gate_up" else "DOWN_BLOCKS"
            default = getattr(moe, name)
            for bn, bk, warps, stages in shapes:
                setattr(moe, name, (bn, bk, warps, stages))
                try:
                    us = _time(
                        lambda: moe.grouped_experts(
                            x, plan, exp.gate_up_proj, exp.down_proj, shared
                        )
                    )
                except triton.runtime.errors.OutOfResources:  # shared memory: no such shape
                    us = None
                times[f"{kernel}-BN{bn}-BK{bk}-W{warps}-S{stages}"] = us
            setattr(moe, name, default)
        row["experts_sweep_us"] = times
    return row


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,16,64,256")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    bw = _bandwidth()
    block = _block()
    norm = ZeroCentredRMSNorm(H, 1e-6).cuda().bfloat16()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = [_measure(n, block, norm, bw, args.sweep) for n in sizes]
    print(json.dumps({"bandwidth_GBps": bw / 1e9, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
