"""cProfile of `metrale bench`'s end-to-end runs at one batch size: where the host time of a
plain and a speculative (replay drafter) generation goes, with per-phase step counts and times.

    python -m metrale.bench.profile_e2e --shape qwen3-8b --batch 1 --max-tokens 48
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import tempfile
import time
from pathlib import Path

import torch

from metrale.api import LLM
from metrale.bench.shapes import write_shape
from metrale.config import SamplingParams
from metrale.speculative.replay import ReplayDrafter


def profiled(llm: LLM, prompts, params, label: str) -> list:
    llm.generate(prompts, params, use_tqdm=False)  # warm: graphs captured
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    prof.disable()
    elapsed = time.perf_counter() - start
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
    print(f"== {label}: {elapsed * 1e3:.1f} ms", flush=True)
    print("\n".join(line[:160] for line in text.getvalue().splitlines()[6:60]), flush=True)
    return outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--alpha", type=float, default=0.8)
    args = ap.parse_args()
    drafter = ReplayDrafter({}, args.alpha, vocab_size=2)
    llm = LLM(
        write_shape(args.shape, Path(tempfile.mkdtemp()) / "shape"),
        drafter=drafter,
        load_format="dummy",
        max_model_len=512,
        max_num_seqs=max(args.batch, 8),
        kv_cache_memory_gb=8.0,
        spec={"num_drafts": 3, "dcut": False},
    )
    drafter.vocab_size = llm.engine.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(32)] for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    plain = profiled(llm, prompts, params, "plain")
    drafter.record({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)})
    profiled(llm, prompts, params, "spec")


if __name__ == "__main__":
    main()
