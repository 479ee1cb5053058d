"""Every step of a closed batch of the shipped model, plain then speculative: how many sequences
run and draft, the step's wall time, and the host phases inside it (schedule, prepare with D-Cut's
planning and the drafter's propose, execute, commit with observe). Of the third of three runs;
one JSON per drafter and batch, the totals printed. Where a speculative step's time goes, step by
step: a closed batch's tail, the probes, the re-plans.

    python benchmarks/step_trace.py ngram 8 trace-ngram-b8.json
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

from metrale.api import LLM
from metrale.bench.acceptance import heldout_prompts
from metrale.bench.drafter import concurrency
from metrale.config import SamplingParams


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
    ap.add_argument("drafter", choices=("ngram", "mtp", "dflash"))
    ap.add_argument("batch", type=int)
    ap.add_argument("out")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    llm = LLM(
        "metrale/assets/default-model",
        max_model_len=128 + 2 * args.max_tokens,
        max_num_seqs=max(args.batch, 8),
        kv_cache_memory_gb=8.0,
        spec={"method": args.drafter, "num_drafts": 7 if args.drafter == "dflash" else 3},
    )
    engine = llm.engine
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = heldout_prompts(stdlib, llm.tokenizer, args.batch, 128)
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
    step = engine.step

    def traced():
        times.clear()
        running = list(engine.scheduler.running)
        start = time.perf_counter()
        out = step()
        record = {"width": len(running), "drafted": sum(s.draft is not None for s in running)}
        record["ms"] = (time.perf_counter() - start) * 1e3
        steps.append(record | times)
        return out

    engine.step = traced
    result = {}
    with concurrency(llm, args.batch):
        for label, speculative in (("plain", False), ("spec", True)):
            params = SamplingParams(
                temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                speculative=speculative,
            )  # fmt: skip
            for _ in range(3):
                steps.clear()
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                total = (time.perf_counter() - start) * 1e3
            result[label] = {"total_ms": total, "steps": list(steps)}
            print(f"{label}: {total:.2f} ms, {len(steps)} steps")
    Path(args.out).write_text(json.dumps(result, indent=0))


if __name__ == "__main__":
    main()
