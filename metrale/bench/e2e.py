"""End-to-end runs at a replayed or forced acceptance: generate without speculation and record
the continuations, then replay them as drafts (corrupted with probability 1 - alpha, or every
draft "accepted" at rate alpha under `forced`, see `bench/forced.py`). Each is timed as the
median of `REPEATS` runs after a warm-up run (graphs captured, caches warm): a single run of a
few hundred milliseconds moves by tens of percent with the host's noise.

The decode phase is timed apart from the prefill: a run of the same prompts with one output token
(the prefill and its first sample) is subtracted from each run, so time per output token and the
decode speedup do not mix in the prefill's cost.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

from metrale.api import LLM
from metrale.bench.forced import forcing
from metrale.bench.shapes import write_shape
from metrale.config import SamplingParams
from metrale.engine.calibrate import sync
from metrale.speculative.replay import ReplayDrafter

REPEATS = 3  # timed runs per measurement; the median is reported


def replay_engine(shape: str, alpha: float, **kwargs) -> tuple[LLM, ReplayDrafter]:
    """An engine on random weights of the named `shape` (not loaded: `load_format="dummy"`)
    with a replay drafter at acceptance `alpha`, sized to the engine's vocabulary; `kwargs` go
    to `LLM`. The drafter replays nothing until its continuations are `record`ed."""
    drafter = ReplayDrafter({}, alpha, vocab_size=2)
    llm = LLM(
        write_shape(shape, Path(tempfile.mkdtemp()) / "shape"),
        drafter=drafter,
        load_format="dummy",
        **kwargs,
    )
    drafter.vocab_size = llm.engine.vocab_size
    return llm, drafter


def random_prompts(batch: int, vocab: int, seed: int, length: int = 32) -> list[list[int]]:
    """`batch` prompts of `length` token ids drawn uniformly below `vocab`."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(batch)]


def timed_generate(llm: LLM, prompts, params, warm: bool = True) -> tuple[list, float]:
    """(outputs of the last run, median seconds) of `REPEATS` identical runs, after a warm-up
    run (graphs captured, caches warm) unless `warm` is False."""
    device = llm.engine.runner.device
    if warm:
        llm.generate(prompts, params, use_tqdm=False)
    times = []
    for _ in range(REPEATS):
        sync(device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync(device)
        times.append(time.perf_counter() - start)
    return outs, statistics.median(times)


def prefill_seconds(llm: LLM, prompts) -> float:
    """The time of the prefill and first token of `prompts`, with nothing to draft."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, speculative=False)
    return timed_generate(llm, prompts, params)[1]


def _counters(llm: LLM) -> tuple:
    tel = llm.engine.telemetry.spec
    return (
        tel.num_drafts,
        tel.num_accepted_tokens,
        tel.verify_steps,
        tel.multi_seq_runs,
        tel.contiguous_runs,
        llm.engine.runner.graph_refusals,
        # verifies that drafted a first token, and those that accepted it
        tel.drafted_per_pos[0] if tel.drafted_per_pos else 0,
        tel.accepted_per_pos[0] if tel.accepted_per_pos else 0,
    )


def end_to_end(
    llm: LLM,
    drafter: ReplayDrafter,
    batch: int,
    max_tokens: int,
    alpha: float,
    forced: bool = False,
) -> dict:
    prompts = random_prompts(batch, llm.engine.vocab_size, seed=batch)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    runner = llm.engine.runner
    # plain decoding: the requests opt out of speculation, so no speculative work runs at all
    plain_params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, speculative=False
    )
    plain, t_plain = timed_generate(llm, prompts, plain_params)
    t_prefill = prefill_seconds(llm, prompts)
    drafter.record({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)}, alpha)
    with forcing(runner, alpha, seed=batch, on=forced):
        llm.generate(prompts, params, use_tqdm=False)  # warm-up, outside the counters below
        before = _counters(llm)
        graphs_before = runner.graphs.cache.stats() if runner.graphs else None
        spec, t_spec = timed_generate(llm, prompts, params, warm=False)
    after = _counters(llm)
    # over all timed runs (ratios from the totals; verify steps per run, a mean)
    delta = [a - b for a, b in zip(after, before, strict=True)]
    tokens = batch * max_tokens
    decode_tokens = batch * (max_tokens - 1)
    decode_plain, decode_spec = t_plain - t_prefill, t_spec - t_prefill
    row = {
        "batch": batch,
        "alpha": alpha,
        "acceptance": "forced" if forced else "replayed",
        "tokens_per_s_plain": tokens / t_plain,
        "tokens_per_s_spec": tokens / t_spec,
        "speedup": t_plain / t_spec,
        # the decode phase alone: the prefill and first token subtracted from both runs
        "prefill_ms": t_prefill * 1e3,
        "tpot_ms_plain": decode_plain / max(max_tokens - 1, 1) * 1e3,
        "tpot_ms_spec": decode_spec / max(max_tokens - 1, 1) * 1e3,
        "decode_tokens_per_s_plain": decode_tokens / decode_plain,
        "decode_tokens_per_s_spec": decode_tokens / decode_spec,
        "decode_speedup": decode_plain / decode_spec,
        "mean_acceptance_length": 1 + delta[1] / max(delta[0], 1),
        # a first draft's acceptance rate (None: nothing verified), alpha's own where the
        # replayed drafts match the target, whatever depths D-Cut picked
        "first_draft_acceptance": delta[7] / delta[6] if delta[6] else None,
        "verify_steps": delta[2] / REPEATS,
        # of the runs of several equal-depth sequences in dispatch order, the share on
        # consecutive state slots (what a kernel batching by slot range would need)
        "contiguous_run_share": delta[4] / max(delta[3], 1),
        "graph_refusals": delta[5],  # all timed runs together: any refusal shows
        # over the engine's life so far (every end-to-end run of this bench)
        "distinct_verify_keys": len(llm.engine.telemetry.spec.verify_keys),
    }
    if graphs_before is not None:
        stats = runner.graphs.cache.stats()
        row["graphs"] = stats
        # steps of the timed run that replayed a program already captured
        hits, misses = (stats[k] - graphs_before[k] for k in ("hits", "misses"))
        row["graph_hit_rate"] = hits / max(hits + misses, 1)
    if not forced:
        # NOTE: in float32 the two runs match token for token (the tests pin it); in bf16 a
        # verify of q rows rounds differently from a 1-row decode, so near-tied argmaxes of a
        # random-weight model can flip. Report how often, rather than hide it.
        same = sum(
            a.outputs[0].token_ids == b.outputs[0].token_ids
            for a, b in zip(plain, spec, strict=True)
        )
        row["identical_outputs"] = same / batch
    return row
