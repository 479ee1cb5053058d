"""Trace D-Cut's gate over closed batches, as `metrale bench` runs them: one JSON line per event,
for every gate decision (`host_cost.drafting_loses`: the plan's width, drafted count, rows,
expected tokens, the calibrated forward, the measured plain and verify steps, the verdict), every
step sample the gate takes (`HostCost.plain`, `HostCost.speculative`), and every engine step
(its wall milliseconds and the verify-step count so far). Runs alternate plain and speculative,
as the bench's do.

    python scripts/dcut_gate_trace.py --batch 64 --alpha 0.5 --no-async-scheduling   # qwen3-8b
    python scripts/dcut_gate_trace.py --batch 64 --drafter ngram   # the shipped model, held out
"""

import argparse
import json
import sysconfig
import time
from pathlib import Path

import metrale.speculative.host_cost as host_cost
import metrale.speculative.planning as planning
from metrale.api import LLM
from metrale.bench.acceptance import heldout_prompts
from metrale.bench.e2e import random_prompts, replay_engine
from metrale.bench.forced import ForcedAcceptance
from metrale.config import SamplingParams
from metrale.default_model import default_model_dir

EVENTS: list[dict] = []


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 4)


def trace_gate() -> None:
    gate = host_cost.drafting_loses

    def traced(plan, cost, host, reopen=False):
        width, drafted = len(plan.depths), sum(d > 0 for d in plan.depths)
        loses = gate(plan, cost, host, reopen)
        EVENTS.append(
            dict(
                ev="gate",
                width=width,
                drafted=drafted,
                rows=plan.rows,
                tokens=round(plan.expected_tokens, 2),
                forward_ms=_ms(cost.plain_seconds(width)),
                plain_ms=_ms(host.plain_seconds(width)),
                plain_near_ms=_ms(host.plain_near(width, cost)),
                verify_ms=_ms(host.verify_seconds(width, drafted)),
                relative=cost.step_time(plan.rows, width),
                reopen=reopen,
                loses=loses,
            )
        )
        return loses

    planning.drafting_loses = traced
    for name in ("plain", "speculative"):
        sample = getattr(host_cost.HostCost, name)

        def wrapped(self, *args, _sample=sample, _name=name):
            EVENTS.append(dict(ev=_name, args=list(args)))
            return _sample(self, *args)

        setattr(host_cost.HostCost, name, wrapped)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--alpha", type=float, default=0.5, help="forced acceptance (a --shape)")
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument(
        "--drafter",
        default=None,
        choices=("ngram", "mtp", "dflash"),
        help="the shipped model with this drafter instead of --shape",
    )
    ap.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine's default; --no-async-scheduling: the synchronous engine",
    )
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args()
    trace_gate()
    forced = None
    if args.drafter is not None:
        k = 7 if args.drafter == "dflash" else 3
        llm = LLM(
            str(default_model_dir()),
            max_model_len=256,
            max_num_seqs=max(args.batch, 8),
            kv_cache_memory_gb=8.0,
            spec={"method": args.drafter, "num_drafts": k},
            async_scheduling=args.async_scheduling,
        )
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        prompts = heldout_prompts(stdlib, llm.tokenizer, args.batch, 128)
        max_tokens = 64
    else:
        llm, drafter = replay_engine(
            args.shape,
            args.alpha,
            max_model_len=512,
            max_num_seqs=max(args.batch, 8),
            kv_cache_memory_gb=40.0,
            spec={"num_drafts": 3, "dcut": True},
            async_scheduling=args.async_scheduling,
        )
        prompts = random_prompts(args.batch, llm.engine.vocab_size, seed=args.batch)
        max_tokens = 32
        forced = ForcedAcceptance(args.alpha, seed=args.batch)
    engine = llm.engine
    step = engine.step

    def timed_step():
        start = time.perf_counter()
        out = step()
        EVENTS.append(
            dict(
                ev="step",
                ms=_ms(time.perf_counter() - start),
                verify=engine.telemetry.spec.verify_steps,
            )
        )
        return out

    engine.step = timed_step
    base = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain = SamplingParams(**base, speculative=False)
    outs = llm.generate(prompts, plain, use_tqdm=False)
    if forced is not None:
        drafter.record({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)})
    for run in range(args.runs):
        EVENTS.append(dict(ev="run", plain=True, n=run))
        llm.generate(prompts, plain, use_tqdm=False)
        EVENTS.append(dict(ev="run", plain=False, n=run))
        engine.runner.forced_acceptance = forced
        llm.generate(prompts, SamplingParams(**base), use_tqdm=False)
        engine.runner.forced_acceptance = None
    for event in EVENTS:
        print(json.dumps(event))


if __name__ == "__main__":
    main()
