"""The roofline's two numbers: the memory bandwidth measured by a device copy, and the weight
bytes one batch-1 step reads; and the time of a kernel call replayed in a CUDA graph, for the
kernel scripts; what capturing the programs cost a bench run; the parallel options every bench
mode passes its engines. (Step timing is the engine's own:
`engine/calibrate.py`.)"""

from __future__ import annotations

import torch

from metrale.engine.calibrate import median_time
from metrale.engine.program_cache import capture_seconds, captures


def bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (bytes read plus bytes written)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / median_time(lambda: dst.copy_(src), device, reps=10)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one batch-1 step reads: every weight once (tied ones once), except that
    a sparse MoE block's routed experts count only `num_experts_per_tok` of `num_experts`."""
    hybrid = getattr(getattr(model, "config", None), "hybrid", None)
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        size = p.numel() * p.element_size()
        if hybrid is not None and ".experts." in name + "." and hybrid.num_experts:
            size = size * hybrid.num_experts_per_tok // hybrid.num_experts
        total += size
    return total


def graph_time_us(fn, calls: int = 20, replays: int = 5) -> float:
    """Microseconds per call of `fn` (CUDA work, no host sync): the median over `replays`
    replays of a CUDA graph of `calls` calls, after a warm-up on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[replays // 2]


def capture_report(runner) -> dict:
    """What capturing programs cost the run: the target's programs captured at start-up (their
    count, seconds and device memory), and every program this process captured by now (the
    start-up ones, the drafters' and those captured on first use, all outside the timed runs:
    each run is timed after a warm-up run of its own), with their seconds."""
    startup = runner.startup_capture
    return {
        "startup_programs": None if startup is None else startup[0],
        "startup_capture_s": None if startup is None else startup[1],
        "startup_capture_bytes": None if startup is None else startup[2],
        "programs_captured": captures(),
        "capture_s": capture_seconds(),
    }


def parallel_options(args) -> dict:
    """The engine's tensor/expert-parallel options from a bench namespace (every bench mode
    builds its engines with them; a missing field takes the engine's default)."""
    options = {
        "tensor_parallel_size": getattr(args, "tensor_parallel_size", 1),
        "expert_parallel": getattr(args, "expert_parallel", False),
    }
    timeout = getattr(args, "distributed_timeout_s", None)
    if timeout is not None:
        options["distributed_timeout_s"] = timeout
    return options


def scheduling_label(result: dict) -> str:
    """Which engine a bench ran (its ratios depend on it: an asynchronous plain step hides its
    host work behind the device, a verify step does not)."""
    return "async scheduling" if result.get("async_scheduling") else "synchronous"


def capture_line(report: dict) -> str | None:
    """`capture_report` as one line of the bench's table (None: nothing was captured)."""
    if not report["programs_captured"]:
        return None
    line = f"CUDA graphs: {report['programs_captured']} captured in {report['capture_s']:.1f} s"
    if report["startup_programs"] is not None:
        line += (
            f" ({report['startup_programs']} at start-up: {report['startup_capture_s']:.1f} s, "
            f"{report['startup_capture_bytes'] / 2**30:.2f} GiB)"
        )
    return line
