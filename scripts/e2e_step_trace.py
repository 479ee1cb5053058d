"""Trace the slow steps of `metrale bench`'s end-to-end run: each step's wall time, rows, phase,
program captures and Triton compiles, so a step far above the median says why it was slow.

    python scripts/e2e_step_trace.py --shape qwen3-next-a3b-64e --batch 1 --forced
"""

from __future__ import annotations

import argparse
import statistics
import time

from metrale.api import LLM
from metrale.bench.e2e import random_prompts, replay_engine
from metrale.bench.forced import ForcedAcceptance
from metrale.config import SamplingParams
from metrale.engine.calibrate import sync

COMPILES: list[tuple[float, str]] = []


def watch_compiles() -> None:
    """Record every Triton compile (kernel name) through Triton's post-compile hook."""
    try:
        import triton.knobs
    except ImportError:
        return

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        name = getattr(getattr(fn, "fn", fn), "__name__", "?")
        COMPILES.append((0.0, name))
        return False

    triton.knobs.runtime.jit_post_compile_hook = hook


def trace(llm: LLM, prompts, params, label: str) -> None:
    runner = llm.engine.runner
    steps = []
    execute = runner.execute

    def timed(batch):
        misses = runner.graphs.cache.misses if runner.graphs else 0
        compiles = len(COMPILES)
        sync(runner.device)
        start = time.perf_counter()
        out = execute(batch)
        sync(runner.device)
        took = time.perf_counter() - start
        rows = sum(e.num_rows for e in batch.entries)
        new_misses = (runner.graphs.cache.misses if runner.graphs else 0) - misses
        names = [n for _, n in COMPILES[compiles:]]
        steps.append((took, len(batch.entries), rows, batch.phase.value, new_misses, names))
        return out

    runner.execute = timed
    try:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    finally:
        del runner.execute
    med = statistics.median(s[0] for s in steps)
    print(f"== {label}: {wall * 1e3:.1f} ms, {len(steps)} steps, median {med * 1e3:.2f} ms")
    for took, seqs, rows, phase, misses, names in steps:
        if took > 2 * med or misses or names:
            print(
                f"  {took * 1e3:8.2f} ms seqs={seqs} rows={rows} {phase} captures={misses} "
                f"compiles={len(names)} {sorted(set(names))[:6]}"
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-next-a3b-64e")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--alpha", type=float, default=0.8)
    ap.add_argument("--forced", action="store_true")
    ap.add_argument("--hybrid-verify-state", default="write_on_accept")
    args = ap.parse_args()
    watch_compiles()
    llm, drafter = replay_engine(
        args.shape,
        args.alpha,
        max_model_len=1024 + 2 * args.max_tokens + 64,
        max_num_seqs=max(args.batch, 16),
        kv_cache_memory_gb=16.0,
        spec={"num_drafts": 3, "dcut": False},
        hybrid_verify_state=args.hybrid_verify_state,
    )
    prompts = random_prompts(args.batch, llm.engine.vocab_size, seed=args.batch)
    base = dict(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    plain_params = SamplingParams(**base, speculative=False)
    plain = llm.generate(prompts, plain_params, use_tqdm=False)
    trace(llm, prompts, plain_params, "plain (warm)")
    drafter.record({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)}, args.alpha)
    if args.forced:
        llm.engine.runner.forced_acceptance = ForcedAcceptance(args.alpha, seed=args.batch)
    for i in range(3):
        trace(llm, prompts, SamplingParams(**base), f"spec run {i}")


if __name__ == "__main__":
    main()
