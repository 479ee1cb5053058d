"""The decode step and verify cost curves: B synthetic sequences with `context` cached tokens each
run q rows per sequence (their last token plus q - 1 drafts) through the engine's step; the
verify cost curve is T(q) / T(1) per B, in the JSON shape `VerifyCostModel.from_json` reads."""

from __future__ import annotations

import random

from metrale.api import LLM
from metrale.bench.timing import median_time
from metrale.config import SamplingParams
from metrale.engine.sequence import Batch, ScheduledSeq, Sequence


def synthetic_batch(llm: LLM, batch: int, context: int, q: int, rng: random.Random) -> Batch:
    """`batch` sequences with `context` computed tokens, each running q rows (last + drafts)."""
    engine, vocab = llm.engine, llm.engine.vocab_size
    entries = []
    for i in range(batch):
        seq = Sequence(
            10**6 + i,
            f"bench-{i}",
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


def step_times(llm: LLM, batch_sizes, qs, context: int) -> dict[int, dict[int, float]]:
    rng, out = random.Random(0), {}
    runner, device = llm.engine.runner, llm.engine.runner.device
    for b in batch_sizes:
        out[b] = {}
        for q in qs:
            batch = synthetic_batch(llm, b, context, q, rng)
            out[b][q] = median_time(lambda batch=batch: runner.execute(batch), device)
            for e in batch.entries:
                llm.engine.allocator.free(e.seq)
    return out
