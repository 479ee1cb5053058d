"""cProfile of `metrale bench`'s end-to-end runs at one batch size: where the host time of a
plain and a speculative generation goes. A random-weight shape runs with the replay drafter; a
checkpoint (`--model`) with its own drafter (`--drafter mtp|ngram`) on held-out prompts.

    python -m metrale.bench.profile_e2e --shape qwen3-8b --batch 1 --max-tokens 48
    python -m metrale.bench.profile_e2e --model metrale/assets/default-model --drafter mtp --batch 8
    python -m metrale.bench.profile_e2e --shape qwen3-8b --batch 64 --alpha 0.5 --forced --dcut
    python -m metrale.bench.profile_e2e --shape qwen3-8b --batch 64 --forced \
        --no-async-scheduling --phases
    python -m metrale.bench.profile_e2e --shape qwen3-8b --batch 64 --forced --dcut --syncs
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sysconfig
import time
from pathlib import Path

import torch

from metrale.api import LLM
from metrale.bench.acceptance import heldout_prompts
from metrale.bench.drafter import concurrency
from metrale.bench.e2e import random_prompts, replay_engine
from metrale.bench.forced import ForcedAcceptance
from metrale.bench.sync_audit import SyncAudit
from metrale.config import SamplingParams
from metrale.engine.calibrate import sync
from metrale.engine.heap import freeze_startup_heap


def graph_targets() -> list[tuple[object, str]]:
    """A replayed step's host path, piece by piece (`PhaseTimer` on CUDA graphs): its inputs'
    flattening and send (`engine/graph_inputs.py`), the graph's launch and the verdicts' read;
    and the eager and drafters' packing, its staging copy, and the workspace load of the MTP
    catch-up."""
    import metrale.engine.runner as runner_mod
    import metrale.engine.step_metadata as metadata_mod
    import metrale.engine.step_output as verdicts_mod
    from metrale.engine.graph_inputs import GraphInputs
    from metrale.engine.graphs import GraphRunner

    return [
        (GraphInputs, "flatten"),
        (GraphInputs, "send"),
        (runner_mod, "pack_spans"),
        (metadata_mod, "to_device_packed"),
        (GraphRunner, "load"),
        (torch.cuda.CUDAGraph, "replay"),
        (verdicts_mod, "to_host"),
        (runner_mod, "to_host"),
    ]


class PhaseTimer:
    """Wall time per engine phase (inclusive, host side: a phase that syncs includes the wait),
    by wrapping the phases' functions for the duration of a `with` block; far lighter than
    cProfile, so the proportions are the engine's own.

    It also times a verify step's critical window, as `benchmarks/verify_window.py` does on the
    simulated device: from the return of a verify step's verdicts' read (`to_host`, greedy or
    sampled; not a plain step's) to the start of the next forward (a program's
    `CUDAGraph.replay`; on a CPU, `ModelRunner._forward`), when the device has nothing queued;
    and, per phase, its time inside those windows (a window still open at the end counts for
    neither)."""

    def __init__(self, llm: LLM) -> None:
        import metrale.engine.held_verify as held_verify
        import metrale.engine.runner as runner_mod
        import metrale.engine.step_output as verdicts_mod
        from metrale.engine.sampler import SamplingBatch

        engine = llm.engine
        self.targets = [
            (llm, "_take"),  # (a generation's loop: what runs between two engine steps)
            (engine, "step"),
            (engine.scheduler, "schedule"),
            (engine.runner, "execute"),
            (runner_mod, "replay_decode"),
            (runner_mod, "replay_prefill"),
            (engine.runner, "_metadata"),
            (engine.runner, "_forward"),
            (verdicts_mod, "accept"),
            (verdicts_mod, "build_layout"),
            (SamplingBatch, "build"),
            (verdicts_mod, "verdicts_of"),
            (runner_mod, "greedy_verdicts"),
            (runner_mod, "sampled_verdicts"),
            (engine, "_commit"),
            (engine, "_outputs"),
            (engine.emitter, "emit"),
        ]
        if engine.runner.graphs is not None:
            self.targets += graph_targets()
            self.closes = "CUDAGraph.replay"
        else:
            self.targets += [(runner_mod, "to_host"), (verdicts_mod, "to_host")]
            self.closes = "ModelRunner._forward"
        if engine._ahead is not None:  # async scheduling: its launches, waits and sync steps
            self.targets += [(engine._ahead, n) for n in ("_launch", "_settle", "_run_now")]
        if engine.spec is not None:
            self.targets += [
                (held_verify, "hold"),
                (engine.spec, "learn_held"),
                (engine.spec, "timed_step"),
                (engine.spec, "prepare"),
                (engine.spec, "_planned"),
                (engine.spec, "_propose"),
                (engine.spec, "_cut"),
                (engine.spec.drafter, "propose"),
                (engine.spec, "observe"),
                (engine.spec.drafter, "observe"),
            ]
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.longest: dict[str, float] = {}
        self.opened: float | None = None  # when the open window opened
        self.active: list[tuple[str, float]] = []  # (label, start) of the calls running
        self.verifying = False  # the step running drafts (its verdicts' read opens a window)
        self.windows: list[float] = []
        self.in_window: dict[str, float] = {}  # per phase: its seconds inside closed windows
        self.open_spent: dict[str, float] = {}  # and inside the open one (kept when it closes)

    def _wrap(self, obj, name: str):
        fn = getattr(obj, name)
        owner = obj.__name__ if isinstance(obj, type) else type(obj).__name__
        module = obj.__name__.rsplit(".", 1)[-1] if hasattr(obj, "__file__") else None
        label = f"{module or owner}.{name}"

        def timed(*a, **kw):
            start = time.perf_counter()
            if label == self.closes and self.opened is not None:
                self._close(start)
            if label == "ModelRunner.execute":
                batch = a[0] if a else kw["batch"]
                self.verifying = any(e.drafts for e in batch.entries)
            self.active.append((label, start))
            try:
                return fn(*a, **kw)
            finally:
                end = time.perf_counter()
                self.active.pop()
                took = end - start
                self.totals[label] = self.totals.get(label, 0.0) + took
                self.longest[label] = max(self.longest.get(label, 0.0), took)
                self.calls[label] = self.calls.get(label, 0) + 1
                if self.opened is not None:  # (the part after the window opened)
                    self._inside(label, start, end)
                if label.endswith(".to_host") and self.verifying and self.opened is None:
                    self.opened = end

        return timed

    def _inside(self, label: str, start: float, end: float) -> None:
        inside = end - max(start, self.opened)
        self.open_spent[label] = self.open_spent.get(label, 0.0) + inside

    def _close(self, now: float) -> None:
        """The next forward starts: the window ends, the calls still running (the step that
        launches it) are charged their part of it now, and its phases' times count."""
        for label, start in self.active:
            self._inside(label, start, now)
        for label, inside in self.open_spent.items():
            self.in_window[label] = self.in_window.get(label, 0.0) + inside
        self.open_spent = {}
        self.windows.append(now - self.opened)
        self.opened = None

    def __enter__(self):
        self.saved = [(obj, name, obj.__dict__.get(name)) for obj, name in self.targets]
        for obj, name in self.targets:
            setattr(obj, name, self._wrap(obj, name))
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, old in self.saved:
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)

    def report(self) -> str:
        steps = max(self.calls.get("LLMEngine.step", 1), 1)
        lines = [
            f"{'phase':28s} {'calls':>6s} {'total_ms':>9s} {'per_step_ms':>11s} {'max_ms':>8s}"
        ]
        for label, total in sorted(self.totals.items(), key=lambda kv: -kv[1]):
            lines.append(
                f"{label:28s} {self.calls[label]:6d} {total * 1e3:9.2f} "
                f"{total * 1e3 / steps:11.3f} {self.longest[label] * 1e3:8.2f}"
            )
        if self.windows:
            n = len(self.windows)
            lines.append(
                f"verify windows (verdicts read -> next forward): {n}, median "
                f"{statistics.median(self.windows) * 1e3:.3f} ms, mean "
                f"{sum(self.windows) / n * 1e3:.3f} ms; per phase, ms a window inside them:"
            )
            for label, inside in sorted(self.in_window.items(), key=lambda kv: -kv[1]):
                lines.append(f"  {label:28s} {inside * 1e3 / n:8.3f}")
        return "\n".join(lines)


def phased(llm: LLM, prompts, params, label: str) -> list:
    llm.generate(prompts, params, use_tqdm=False)  # warm: graphs captured
    sync(llm.engine.runner.device)
    with PhaseTimer(llm) as timer:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync(llm.engine.runner.device)
        elapsed = time.perf_counter() - start
    print(f"== {label}: {elapsed * 1e3:.1f} ms\n{timer.report()}", flush=True)
    return outs


def profiled(llm: LLM, prompts, params, label: str) -> list:
    llm.generate(prompts, params, use_tqdm=False)  # warm: graphs captured
    sync(llm.engine.runner.device)
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(llm.engine.runner.device)
    prof.disable()
    elapsed = time.perf_counter() - start
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(45)
    print(f"== {label}: {elapsed * 1e3:.1f} ms", flush=True)
    lines = [line for line in text.getvalue().splitlines() if "(" in line or "ncalls" in line]
    print("\n".join(line[:160] for line in lines), flush=True)
    return outs


def kernels(llm: LLM, prompts, params, label: str) -> list:
    """torch.profiler over one generation: the wall time against the device's busy time (the
    sum of kernel times), so a host-bound run shows as a low busy share; the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    llm.generate(prompts, params, use_tqdm=False)  # warm: graphs captured
    sync(llm.engine.runner.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync(llm.engine.runner.device)
        elapsed = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    busy = sum(e.self_device_time_total for e in events) / 1e3  # ms
    print(
        f"== {label}: {elapsed * 1e3:.1f} ms wall (profiled), device busy {busy:.1f} ms "
        f"({busy / (elapsed * 1e3):.0%})",
        flush=True,
    )
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:15]:
        print(f"{e.self_device_time_total / 1e3:9.2f} ms {e.count:7d}  {e.key[:100]}")
    return outs


def audited(llm: LLM, prompts, params, label: str) -> list:
    """The synchronizing CUDA calls of one generation, by where metrale made them
    (`sync_audit.SyncAudit`)."""
    llm.generate(prompts, params, use_tqdm=False)  # warm: graphs captured
    sync(llm.engine.runner.device)
    with SyncAudit(llm) as audit:
        outs = llm.generate(prompts, params, use_tqdm=False)
    sync(llm.engine.runner.device)  # (after the audit: the tool's own wait is not counted)
    print(f"== {label}: {audit.report()}", flush=True)
    return outs


def traced(llm: LLM, prompts, params, label: str) -> list:
    """torch.profiler timeline of one generation, Python stacks included, written as a gzipped
    Chrome trace (`<--trace>/<label>.json.gz`): where the device idles and what the host was
    doing meanwhile (`benchmarks/trace_gaps.py` summarises it)."""
    from torch.profiler import ProfilerActivity, profile

    llm.generate(prompts, params, use_tqdm=False)  # warm: graphs captured
    sync(llm.engine.runner.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync(llm.engine.runner.device)
    TRACE_DIR.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(TRACE_DIR / f"{label}.json.gz"))
    print(f"== {label}: trace written to {TRACE_DIR / label}.json.gz", flush=True)
    return outs


TRACE_DIR = Path("traces")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--model", default=None, help="a checkpoint: profile its own drafter")
    ap.add_argument("--drafter", default="mtp", choices=("mtp", "ngram", "dflash"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument(
        "--requests-per-slot",
        type=int,
        default=1,
        help="--model: stream this many requests per slot through --batch slots (steady state)",
    )
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--alpha", type=float, default=0.8)
    ap.add_argument(
        "--forced",
        action="store_true",
        help="--shape: forced acceptance at --alpha (as `metrale bench --forced-acceptance`)",
    )
    ap.add_argument("--dcut", action="store_true", help="--shape: D-Cut picks the depths")
    ap.add_argument(
        "--max-model-len", type=int, default=512, help="--shape: the engine's (bench: 1344)"
    )
    ap.add_argument(
        "--max-num-seqs", type=int, default=None, help="--shape: default max(--batch, 8)"
    )
    ap.add_argument("--phases", action="store_true", help="wall time per phase, not cProfile")
    ap.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the asynchronous engine (the default; --no-async-scheduling: the synchronous one)",
    )
    ap.add_argument(
        "--kernels", action="store_true", help="device busy time and top kernels (CUDA)"
    )
    ap.add_argument("--trace", default=None, help="a folder: Chrome traces of each run (CUDA)")
    ap.add_argument(
        "--syncs", action="store_true", help="where the steps wait for the device (CUDA)"
    )
    args = ap.parse_args()
    global profiled, TRACE_DIR
    if args.trace is not None:
        profiled, TRACE_DIR = traced, Path(args.trace)
    elif args.phases:
        profiled = phased
    elif args.kernels:
        profiled = kernels
    elif args.syncs:
        profiled = audited
    if args.model is not None:
        llm = LLM(
            args.model,
            max_model_len=128 + args.max_tokens + 64,
            max_num_seqs=max(args.batch, 8),
            kv_cache_memory_gb=8.0,
            spec={"method": args.drafter, "num_drafts": 3},
            async_scheduling=args.async_scheduling,
        )
        freeze_startup_heap()  # as `metrale bench`: no full collection mid-run
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        prompts = heldout_prompts(stdlib, llm.tokenizer, args.batch * args.requests_per_slot, 128)
        base = dict(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        with concurrency(llm, args.batch):
            profiled(llm, prompts, SamplingParams(**base, speculative=False), "plain")
            profiled(llm, prompts, SamplingParams(**base), "spec")
        return
    llm, drafter = replay_engine(
        args.shape,
        args.alpha,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs or max(args.batch, 8),
        kv_cache_memory_gb=8.0,
        spec={"num_drafts": 3, "dcut": args.dcut},
        async_scheduling=args.async_scheduling,
    )
    freeze_startup_heap()
    prompts = random_prompts(args.batch, min(1000, llm.engine.vocab_size), seed=0)
    base = dict(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    params = SamplingParams(**base)
    plain = profiled(llm, prompts, SamplingParams(**base, speculative=False), "plain")
    drafter.record({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)})
    if args.forced:
        llm.engine.runner.forced_acceptance = ForcedAcceptance(args.alpha, seed=args.batch)
    profiled(llm, prompts, params, "spec")


if __name__ == "__main__":
    main()
