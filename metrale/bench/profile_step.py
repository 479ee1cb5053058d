"""Where a decode step's time goes: the whole engine step against the graph replay alone, the
host-side pieces of the step, and the eager forward's kernels (count and time by name).

    python -m metrale.bench.profile_step --shape qwen3-8b --batch-sizes 1,16,64 --out prof

Run it twice with METRALE_NO_FUSED_KERNELS=1 unset and set for an A/B of the fused kernels.
Writes profile.json and kernels-B{b}.txt under --out.

`step_launches` (what `metrale bench` reports) counts the kernels of one decode step's forward
and logits: with the CUDA profiler on CUDA, and on CPU with `count_launches`, which counts what
would launch on a GPU (aten ops other than views and allocations, and Triton launches: run the
fused paths under the interpreter, `METRALE_FORCE_FUSED_KERNELS=1`) to estimate it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from metrale.api import LLM
from metrale.bench.shapes import write_shape
from metrale.bench.timing import weight_bytes
from metrale.engine.calibrate import median_time, release_synthetic, synthetic_batch
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
    if runner.graphs.ragged:  # the program of b one-row sequences (a hybrid's: width 1)
        table = ragged_shape(b, b, 1 if runner.states is not None else runner.graphs.max_q)
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


# aten ops that launch nothing on a GPU: allocations, views and metadata
_NO_KERNEL = {
    "empty", "empty_strided", "empty_like", "view", "_unsafe_view", "alias", "as_strided",
    "t", "transpose", "permute", "expand", "slice", "select", "split", "split_with_sizes",
    "unsqueeze", "squeeze", "detach", "unbind", "chunk", "narrow", "lift_fresh",
    "_local_scalar_dense", "is_same_size", "sym_size", "sym_stride", "sym_numel", "dim",
    "size", "stride", "unfold", "view_as_real", "view_as_complex", "_reshape_alias",
    "resize_", "set_", "record_stream",
}  # fmt: skip


class _AtenCounter(TorchDispatchMode):
    """Counts aten ops that would launch a kernel: not allocations or metadata, not an op whose
    result is a view of its input (a reshape or `to` that copies nothing), not the interpreter's
    own copies while a Triton kernel runs (`paused`)."""

    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.paused or name in _NO_KERNEL:
            return out
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if (
            not name.endswith("_")
            and first is not None
            and isinstance(out, torch.Tensor)
            and out.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        ):
            return out  # a view
        self.counts["aten." + name] += 1
        return out


@contextlib.contextmanager
def _triton_counter(counts: Counter, aten: _AtenCounter):
    """Count Triton launches (compiled or interpreted) by kernel name; the interpreter's copies
    of the arguments are not launches."""
    import triton.runtime.interpreter as interp
    import triton.runtime.jit as jit

    saved = []
    for cls in (jit.JITFunction, interp.InterpretedFunction):
        real = cls.run

        def run(self, *args, _real=real, **kwargs):
            if not kwargs.get("warmup"):
                counts["triton." + getattr(self.fn, "__name__", "?")] += 1
            aten.paused = True
            try:
                return _real(self, *args, **kwargs)
            finally:
                aten.paused = False

        saved.append((cls, real))
        cls.run = run
    try:
        yield
    finally:
        for cls, real in saved:
            cls.run = real


def count_launches(fn) -> Counter:
    """What `fn()` would launch on a GPU, by op or kernel name (its CPU estimate)."""
    counts: Counter = Counter()
    aten = _AtenCounter(counts)
    with _triton_counter(counts, aten), aten:
        fn()
    return counts


def step_launches(llm: LLM, batch_size: int = 1, context: int = 64) -> dict:
    """Kernels of one decode step (forward and logits, eager: the kernels its graph replays) of
    `batch_size` synthetic sequences: {"kernels": n, "by_name": {name: count}}."""
    runner = llm.engine.runner
    batch = synthetic_batch(llm.engine, batch_size, context, 1, random.Random(0))
    try:
        input_ids, positions, meta = runner._metadata(batch)

        def fwd():
            hidden = runner._forward(batch, input_ids, positions, meta)[0]
            return runner.model.compute_logits(hidden)

        with torch.inference_mode():
            fwd()  # warm-up: compiles, packs weights
            if runner.device.type != "cuda":
                counts = count_launches(fwd)
            else:
                torch.cuda.synchronize()
                acts = [torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=acts) as prof:
                    fwd()
                    torch.cuda.synchronize()
                counts = Counter()
                for e in prof.key_averages():
                    if e.device_type == torch.autograd.DeviceType.CUDA:
                        counts[e.key] += e.count
    finally:
        release_synthetic(llm.engine, batch)
    return {"kernels": sum(counts.values()), "by_name": dict(counts.most_common())}


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
        release_synthetic(llm.engine, batch)
    (out / "profile.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
