"""Host time per engine step, plain against n-gram speculation, on a tiny random model on the CPU:
the step's wall time minus the model's forward, so what is left is the engine's own Python (plan,
draft, schedule, pack, verdicts, commit, emit). The forward of a tiny model is short, so the host
work is most of the step, as on a GPU host with a small model.

A change to the step's host work is judged by running this once per checkout, in turns, and
comparing the speculative step's extra over the plain one (the CPU of a shared machine moves by
10-30% between runs; the plain step of the same run is the yardstick):

    PYTHONPATH=/path/to/old python scripts/spec_host_ab.py --batch 8 --reps 9
    PYTHONPATH=/path/to/new python scripts/spec_host_ab.py --batch 8 --reps 9
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch

from metrale.api import LLM
from metrale.config import SamplingParams
from metrale.default_model import build_random_qwen3
from metrale.engine.runner import ModelRunner

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16}


def repeating_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a short motif, so that the n-gram drafter finds drafts."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        motif = [rng.randrange(5, 500) for _ in range(rng.randrange(4, 12))]
        out.append((motif * (length // 4 + 1))[:length])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the forward's threads would compete with the host's Python
    model = build_random_qwen3(tempfile.mkdtemp(prefix="spec-host-ab-"), TINY)
    llm = LLM(
        str(model),
        device="cpu",
        max_model_len=512,
        max_num_seqs=max(args.batch, 8),
        spec={"method": "ngram", "num_drafts": 3},
    )
    prompts = repeating_prompts(args.batch, 96)
    forward = ModelRunner._forward
    spent = [0.0, 0]  # seconds in the forward, engine steps

    def timed_forward(self, *a, **kw):
        start = time.perf_counter()
        try:
            return forward(self, *a, **kw)
        finally:
            spent[0] += time.perf_counter() - start
            spent[1] += 1

    ModelRunner._forward = timed_forward
    host: dict[str, list[float]] = {"plain": [], "spec": []}
    for rep in range(args.reps + 1):
        for label in host:
            params = SamplingParams(
                temperature=0.0,
                max_tokens=args.max_tokens,
                ignore_eos=True,
                speculative=label == "spec",
            )
            spent[:] = [0.0, 0]
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            if rep:  # the first of each is a warm-up
                host[label].append((wall - spent[0]) / spent[1] * 1e3)
    med = {k: statistics.median(v) for k, v in host.items()}
    for label, values in host.items():
        print(f"{label}: host ms/step median {med[label]:.3f}, min {min(values):.3f}")
    print(f"spec extra over plain: {med['spec'] - med['plain']:.3f} ms/step")


if __name__ == "__main__":
    main()
