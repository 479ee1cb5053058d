"""Where a decode step's time goes: the whole engine step against the graph replay alone, the
host-side pieces of the step, and the eager forward's kernels (count and time by name).

    python -m metrale.bench.profile_step --shape qwen3-8b --batch-sizes 1,16,64 --out prof

Run it twice with METRALE_NO_FUSED_KERNELS=1 unset and set for an A/B of the fused kernels.
Writes profile.json and kernels-B{b}.txt under --out.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from metrale.api import LLM
from metrale.bench.shapes import write_shape
from metrale.bench.timing import weight_bytes
from metrale.engine.calibrate import median_time, synthetic_batch
from metrale.engine.program_shapes import decode_bucket, ragged_shape
from metrale.engine.replay import replay_decode
from metrale.knobs import knobs
from metrale.models.gdn_state import StateMode
from metrale.speculative.row_table import RowTable


def host_pieces(llm: LLM, batch) -> dict[str, float]:
    """Wall time of each stage of `ModelRunner.execute`, synchronising after each one."""
    runner = llm.engine.runner
    sync = torch.cuda.synchronize
    out, t = {}, time.perf_counter
    sync()
    start = t()
    input_ids, positions, meta = runner._metadata(batch)
    sync()
    out["metadata_ms"] = (t() - start) * 1e3
    start = t()
    replay_decode(runner, batch)
    sync()
    out["replay_ms"] = (t() - start) * 1e3
    start = t()
    runner.execute(batch)
    sync()
    out["whole_step_ms"] = (t() - start) * 1e3
    return out


def replay_only(llm: LLM, batch) -> float:
    runner = llm.engine.runner
    b = len(batch.entries)
    if runner.graphs.ragged:  # dense targets: the program of b one-row sequences
        table = ragged_shape(b, b, runner.graphs.max_q)
    else:
        pad = decode_bucket(b) - b
        table = RowTable.from_dispatch(range(b + pad), [1] * (b + pad))
    mode = None if runner.states is None else StateMode.WRITE  # a hybrid's decode program
    graph = runner.graphs.cache.get(table, (runner.graphs.max_model_len, mode))[0]
    return median_time(graph.replay, runner.device, reps=20)


def kernel_table(llm: LLM, batch, path: Path) -> dict:
    runner = llm.engine.runner
    input_ids, positions, meta = runner._metadata(batch)
    fwd = lambda: runner.model.compute_logits(runner._forward(batch, input_ids, positions, meta)[0])  # noqa: E731
    with torch.inference_mode():
        fwd()
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            fwd()
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    path.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
    total = sum(e.self_device_time_total for e in events)
    return {"kernels": sum(e.count for e in events), "kernel_time_ms": total / 1e3}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default="prof")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(
        write_shape(args.shape, Path(tempfile.mkdtemp()) / "shape"),
        load_format="dummy",
        max_model_len=args.context + 256,
        max_num_seqs=max(sizes),
        kv_cache_memory_gb=24.0,
    )
    runner = llm.engine.runner
    copy = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(copy)
    bw = 2 * copy.numel() / median_time(lambda: dst.copy_(copy), runner.device, reps=10)
    roofline_ms = weight_bytes(runner.model) / bw * 1e3
    fused = not knobs().no_fused_kernels
    result = {"shape": args.shape, "roofline_ms": roofline_ms, "fused": fused, "batches": []}
    rng = random.Random(0)
    for b in sizes:
        batch = synthetic_batch(llm.engine, b, args.context, 1, rng)
        step = median_time(lambda batch=batch: runner.execute(batch), runner.device, reps=20)
        row = {
            "batch": b,
            "step_ms": step * 1e3,
            "step_x_roofline": step * 1e3 / roofline_ms,
            "replay_ms": replay_only(llm, batch) * 1e3,
            **host_pieces(llm, batch),
            **kernel_table(llm, batch, out / f"kernels-B{b}.txt"),
        }
        result["batches"].append(row)
        print(json.dumps(row), flush=True)
        for e in batch.entries:
            llm.engine.allocator.free(e.seq)
    (out / "profile.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
