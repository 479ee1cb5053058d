"""The engine measures its own verify cost curve: B synthetic sequences with `context` cached
tokens each run q rows per sequence (their last token plus q - 1 drafts) through the step, and
T(q) / T(1) per B is what D-Cut plans with (`VerifyCostModel`).

On CUDA the engine does this at start-up when D-Cut is on (about a second: a few batch sizes, a
few depths, graphs replayed), so the planner prices rows on the device it runs on rather than by a
constant; `metrale bench` measures the same curve at the context it is asked for.
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from metrale.config import SamplingParams
from metrale.engine.sequence import Batch, ScheduledSeq, Sequence
from metrale.speculative.verify_cost import VerifyCostModel


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device: torch.device, warmup: int = 2, reps: int = 7) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def synthetic_batch(engine, batch: int, context: int, q: int, rng: random.Random) -> Batch:
    """`batch` sequences with `context` computed tokens, each running q rows (last + drafts),
    on state slots 0..batch-1 (free: run before any request, or between runs)."""
    vocab = engine.vocab_size
    entries = []
    for i in range(batch):
        seq = Sequence(
            10**6 + i,
            f"calibrate-{i}",
            [rng.randrange(vocab) for _ in range(context)],
            SamplingParams(temperature=0.0),
            i,
            (),
            arrival=i,
            slot=i,
        )
        seq.num_computed_tokens = context - 1
        engine.allocator.reserve(seq, context + q)
        entries.append(ScheduledSeq(seq, q, [rng.randrange(vocab) for _ in range(q - 1)]))
    return Batch(entries)


def step_times(engine, batch_sizes, qs, context: int, reps: int = 7) -> dict[int, dict[int, float]]:
    """Seconds of one step of b sequences at q rows each, per b and q (median of `reps`)."""
    rng, out = random.Random(0), {}
    runner, device = engine.runner, engine.runner.device
    for b in batch_sizes:
        out[b] = {}
        for q in qs:
            batch = synthetic_batch(engine, b, context, q, rng)
            try:
                out[b][q] = median_time(
                    lambda batch=batch: runner.execute(batch), device, reps=reps
                )
            finally:
                release_synthetic(engine, batch)
    return out


def release_synthetic(engine, batch: Batch) -> None:
    """Give back what a `synthetic_batch` held: its pages, and whatever the drafter keeps for
    its sequences (a step run through the programs lets the drafter's after-verify hook see
    them: left there, the n-gram table would take a later sequence of the same id and slot
    for one whose row is written)."""
    for e in batch.entries:
        engine.allocator.free(e.seq)
        if engine.spec is not None:
            engine.spec.release(e.seq)


def measured_cost_model(engine, num_drafts: int, max_seqs: int, context: int) -> VerifyCostModel:
    """The verify cost curve at batch sizes 1, 4, 16, 64, ... up to `max_seqs` and q = 1, 2,
    1 + num_drafts (more rows are interpolated), as D-Cut reads it, with the plain step's
    seconds (what prices the drafter's host work)."""
    sizes, b = [], 1
    while b < max_seqs:
        sizes.append(b)
        b *= 4
    sizes.append(max_seqs)
    qs = sorted({1, 2, num_drafts + 1})
    times = step_times(engine, sizes, qs, context, reps=5)
    return VerifyCostModel.from_points(
        {(b, float(q)): times[b][q] / times[b][1] for b in sizes for q in qs if q > 1},
        {b: times[b][1] for b in sizes},
    )
