"""A/B of the device block tables (`engine/block_tables.py`) in one process: a decode step's
metadata and the whole step, with the tables padded and copied from the host each step
(`min_entries` past any step) against read on the device (`min_entries` 0), at two contexts.

    python scripts/block_tables_ab.py --shape qwen3-8b
"""

import argparse
import random
import tempfile
from pathlib import Path

import torch

from metrale.api import LLM
from metrale.bench.shapes import write_shape
from metrale.engine.calibrate import median_time, synthetic_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--contexts", default="1024,4000")
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(
        write_shape(args.shape, Path(tempfile.mkdtemp()) / "shape"),
        load_format="dummy",
        max_num_seqs=max(sizes),
        kv_cache_memory_gb=40 if torch.cuda.is_available() else 1,
        max_model_len=4096,
    )
    engine = llm.engine
    runner = engine.runner
    for context in (int(c) for c in args.contexts.split(",")):
        for b in sizes:
            batch = synthetic_batch(engine, b, context, 1, random.Random(0))
            best: dict[str, tuple[float, float]] = {}
            for _ in range(3):  # alternated, the best of three each
                for name, least in (("host", 10**9), ("device", 0)):
                    runner.block_tables.min_entries = least
                    meta = median_time(lambda b=batch: runner._metadata(b), runner.device, reps=30)
                    step = median_time(lambda b=batch: runner.execute(b), runner.device, reps=15)
                    old = best.get(name, (meta, step))
                    best[name] = (min(old[0], meta), min(old[1], step))
            for e in batch.entries:
                engine.allocator.free(e.seq)
            print(
                f"ctx {context} batch {b}: "
                + "  ".join(
                    f"{k}: metadata {m * 1e3:.3f} ms step {s * 1e3:.3f} ms"
                    for k, (m, s) in best.items()
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
