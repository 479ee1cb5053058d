"""Every step of a closed batch of the shipped model, plain then speculative: how many sequences
run and draft, the step's wall time, and the host phases inside it (schedule, prepare with D-Cut's
planning and the drafter's propose, execute, commit with observe). Of the third of three runs;
one JSON per drafter and batch, the totals printed. Each step also names the batches the runner
ran ("verify 8x20": 8 sequences, 20 rows; "ahead": launched before the step before was settled)
and what D-Cut's host-cost gate weighed (`gates`: each plan's expected tokens and priced step,
against the plain step) and dropped. Where a speculative step's time goes, step by
step: a closed batch's tail, the probes, the re-plans.

    python benchmarks/step_trace.py ngram 8 trace-ngram-b8.json
    python benchmarks/step_trace.py replay 64 trace.json --shape qwen3-8b --alpha 0.5 \
        --no-async-scheduling  # a random-weight shape, forced acceptance at alpha, D-Cut on
    python benchmarks/step_trace.py replay 64 trace.json --requests-per-slot 4  # steady state

`--requests-per-slot N`: N x batch requests of varied lengths (`max_tokens` / 2 to 3 / 2, as
`metrale bench`'s steady state) stream through `batch` slots instead of one closed batch.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

from metrale.api import LLM
from metrale.bench.acceptance import heldout_prompts
from metrale.bench.drafter import concurrency, steady_lengths
from metrale.bench.e2e import random_prompts, replay_engine
from metrale.bench.forced import ForcedAcceptance
from metrale.config import SamplingParams
from metrale.engine.heap import freeze_startup_heap
from metrale.speculative import planning


def _timed(obj, name: str, times: dict[str, float]) -> None:
    """Wrap `obj.name` to add its wall ms to `times[name]`."""
    fn = getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[name] = times.get(name, 0.0) + (time.perf_counter() - start) * 1e3

    setattr(obj, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafter", choices=("ngram", "mtp", "dflash", "replay"))
    ap.add_argument("batch", type=int)
    ap.add_argument("out")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--shape", default="qwen3-8b", help="replay: the random-weight shape")
    ap.add_argument("--alpha", type=float, default=0.8, help="replay: forced acceptance rate")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--requests-per-slot", type=int, default=1, help="N > 1: steady state")
    args = ap.parse_args()
    count = args.batch * args.requests_per_slot
    replay = args.drafter == "replay"
    if replay:
        llm, drafter = replay_engine(
            args.shape,
            args.alpha,
            max_model_len=512,
            max_num_seqs=max(args.batch, 8),
            kv_cache_memory_gb=8.0,
            spec={"num_drafts": 3, "dcut": True},
            async_scheduling=args.async_scheduling,
        )
        prompts = random_prompts(count, min(1000, llm.engine.vocab_size), seed=0)
    else:
        llm = LLM(
            "metrale/assets/default-model",
            max_model_len=128 + 2 * args.max_tokens,
            max_num_seqs=max(args.batch, 8),
            kv_cache_memory_gb=8.0,
            spec={"method": args.drafter, "num_drafts": 7 if args.drafter == "dflash" else 3},
            async_scheduling=args.async_scheduling,
        )
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        prompts = heldout_prompts(stdlib, llm.tokenizer, count, 128)
    freeze_startup_heap()  # as `metrale bench`: no full collection mid-run
    engine = llm.engine
    times: dict[str, float] = {}
    for obj, name in [
        (engine.scheduler, "schedule"),
        (engine.runner, "execute"),
        (engine, "_commit"),
    ]:
        _timed(obj, name, times)
    for obj, name in [
        (engine.spec, "prepare"),
        (engine.spec, "_planned"),
        (engine.spec.drafter, "propose"),
        (engine.spec, "observe"),
    ]:
        _timed(obj, name, times)
    steps: list[dict] = []
    step, execute = engine.step, engine.runner.execute
    batches: list[str] = []

    def executed(batch, *args, **kwargs):
        # the kind of each batch the runner ran: "verify 8x18" (sequences x rows), "decode 8"
        kind = batch.phase.name.lower()
        batches.append(f"{kind} {len(batch.entries)}x{batch.num_rows}" + " ahead" * bool(kwargs))
        return execute(batch, *args, **kwargs)

    engine.runner.execute = executed
    spec = engine.spec
    gates: list[dict] = []
    loses = planning.drafting_loses

    def gate(plan, cost, host, reopen=False):
        # what the host-cost gate weighed: the plan's expected tokens against its priced step
        width = len(plan.depths)
        drafted = sum(d > 0 for d in plan.depths)
        dropped = loses(plan, cost, host, reopen)
        verify = host.verify_seconds(width, drafted)
        plain = host.plain_seconds(width) or host.plain_near(width, cost)
        gates.append({
            "width": width, "drafted": drafted, "tokens": round(plan.expected_tokens, 1),
            "rows": plan.rows, "reopen": reopen, "dropped": dropped,
            "verify_ms": verify and round(verify * cost.step_time(plan.rows, width) * 1e3, 3),
            "plain_ms": plain and round(plain * 1e3, 3),
        })  # fmt: skip
        return dropped

    planning.drafting_loses = gate

    def traced():
        times.clear()
        batches.clear()
        gates.clear()
        gated = spec.telemetry.host_gated_plans
        running = list(engine.scheduler.running)
        start = time.perf_counter()
        out = step()
        record = {"width": len(running), "drafted": sum(s.draft is not None for s in running)}
        record["ms"] = (time.perf_counter() - start) * 1e3
        record["batches"] = list(batches)
        record["gated"] = spec.telemetry.host_gated_plans - gated
        record["gates"] = list(gates)
        steps.append(record | times)
        return out

    engine.step = traced
    result = {}
    outs: list = []  # the plain runs' outputs: what the replay drafter replays
    lengths = [args.max_tokens] * count
    if args.requests_per_slot > 1:  # as `bench.drafter.steady_state`
        lengths = steady_lengths(count, args.max_tokens, seed=args.batch)
    with concurrency(llm, args.batch):
        for label, speculative in (("plain", False), ("spec", True)):
            params = [
                SamplingParams(
                    temperature=0.0, max_tokens=n, ignore_eos=True, speculative=speculative
                )
                for n in lengths
            ]
            if replay and speculative:
                # the replay drafter proposes plain decoding's tokens; forced acceptance draws
                # how many of them a verify accepts
                drafter.record({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)})
                engine.runner.forced_acceptance = ForcedAcceptance(args.alpha, seed=args.batch)
            for _ in range(3):
                steps.clear()
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                total = (time.perf_counter() - start) * 1e3
            result[label] = {"total_ms": total, "steps": list(steps)}
            print(f"{label}: {total:.2f} ms, {len(steps)} steps")
    graphs = engine.runner.graphs
    if graphs is not None and graphs.mixed is not None:  # a hybrid's mixed programs, all runs
        result["spec"]["mixed_programs"] = graphs.mixed.stats()
        print(f"mixed programs: {graphs.mixed.stats()}")
    Path(args.out).write_text(json.dumps(result, indent=0))


if __name__ == "__main__":
    main()
