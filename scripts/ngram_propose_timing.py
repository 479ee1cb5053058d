"""Host seconds per step of the n-gram drafter's `propose`, on the host index and on the device,
over a simulated running batch (128-token prompts of a code-like token stream, 1-4 new tokens per
sequence per step, an arrival every other step), at several batch sizes.

    python scripts/ngram_propose_timing.py --batch-sizes 1,8,64 --steps 200
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from metrale.config import SamplingParams
from metrale.engine.sequence import Sequence
from metrale.speculative.ngram import NgramDrafter


def seq(seq_id: int, slot: int, prompt: list[int]) -> Sequence:
    """A running sequence as the engine holds it (the drafter reads its tokens and slot)."""
    return Sequence(seq_id, str(seq_id), prompt, SamplingParams(), 0, (), seq_id, slot=slot)


def stream(rng: random.Random, n: int) -> list[int]:
    """Code-like tokens: phrases of a small lexicon, so n-grams recur."""
    lexicon = [[rng.randrange(2000) for _ in range(rng.randrange(1, 6))] for _ in range(60)]
    out: list[int] = []
    while len(out) < n:
        out += rng.choice(lexicon)
    return out[:n]


def run(drafter: NgramDrafter, batch: int, steps: int, device: bool) -> float:
    rng = random.Random(batch)
    seqs = [seq(i, i, stream(rng, 128)) for i in range(batch)]
    next_id, times = batch, []
    for step in range(steps):
        start = time.perf_counter()
        if device:
            drafter.device_table.propose(seqs, [3] * batch)
        else:
            drafter.propose(seqs, [3] * batch)
        times.append(time.perf_counter() - start)
        for s in seqs:
            s.output_token_ids += stream(rng, rng.randrange(1, 5))
        if step % 2 == 1:
            gone = seqs.pop(rng.randrange(len(seqs)))
            drafter.release(gone)
            seqs.append(seq(next_id, gone.slot, stream(rng, 128)))
            next_id += 1
    return statistics.median(times[steps // 10 :]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    rows = []
    for batch in map(int, args.batch_sizes.split(",")):
        host = NgramDrafter(1, 4, 4096)
        dev = NgramDrafter(1, 4, 4096)
        dev.use_device(batch, 1024, device, 3)
        row = {
            "batch": batch,
            "host_ms": run(host, batch, args.steps, False),
            "device_ms": run(dev, batch, args.steps, True),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
