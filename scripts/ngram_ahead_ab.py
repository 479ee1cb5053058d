"""In-process A/B of the n-gram drafter drafting ahead (`DeviceNgramTable.draft_ahead`): one
process, two engines of the shipped model (drafting ahead attached, and detached), plain decoding
from the first, the three runs interleaved, medians of `reps`; closed batches and steady state
(4 requests per slot, output lengths varying). One process because the H200's host speed moves
by tens of percent between processes.

    python scripts/ngram_ahead_ab.py --reps 9 --out ahead_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from pathlib import Path

from metrale.api import LLM
from metrale.bench.acceptance import heldout_prompts
from metrale.bench.drafter import concurrency
from metrale.config import SamplingParams
from metrale.default_model import default_model_dir
from metrale.engine.calibrate import sync

CELLS = ((64, 1), (64, 4), (8, 1), (8, 4))  # (slots, requests per slot)


def timed(llm: LLM, prompts, params, slots: int) -> float:
    with concurrency(llm, slots):
        sync(llm.engine.runner.device)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync(llm.engine.runner.device)
        return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="ahead_ab.json")
    args = ap.parse_args()
    kw = dict(
        max_model_len=256,
        max_num_seqs=64,
        kv_cache_memory_gb=8.0,
        spec={"method": "ngram", "num_drafts": 3},
    )
    ahead, without = LLM(default_model_dir(), **kw), LLM(default_model_dir(), **kw)
    without.engine.runner.after_verify = None
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    results = {}
    for slots, per_slot in CELLS:
        prompts = heldout_prompts(stdlib, ahead.tokenizer, slots * per_slot, 128)
        n = len(prompts)
        lens = [64] * n if per_slot == 1 else [32 + (i * 37) % 64 for i in range(n)]
        base = [dict(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lens]
        plain = [SamplingParams(**b, speculative=False) for b in base]
        spec = [SamplingParams(**b) for b in base]
        runs = {"plain": (ahead, plain), "ahead": (ahead, spec), "no_ahead": (without, spec)}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for rep in range(args.reps + 1):  # the first: warm-up
            for name, (llm, params) in runs.items():
                seconds = timed(llm, prompts, params, slots)
                if rep:
                    times[name].append(seconds)
        med = {name: statistics.median(t) for name, t in times.items()}
        cell = f"b{slots}-{'closed' if per_slot == 1 else 'steady'}"
        results[cell] = {
            "tokens_per_s": {name: sum(lens) / s for name, s in med.items()},
            "speedup_ahead": med["plain"] / med["ahead"],
            "speedup_no_ahead": med["plain"] / med["no_ahead"],
            "ahead_vs_no_ahead": med["no_ahead"] / med["ahead"],
            "seconds": times,
        }
        shown = {k: round(v, 3) for k, v in results[cell].items() if not isinstance(v, dict)}
        print(cell, shown, "drafted ahead", ahead.engine.spec.drafter.drafted_ahead, flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
