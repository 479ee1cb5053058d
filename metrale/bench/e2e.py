"""End-to-end runs at a replayed acceptance: generate without speculation and record the
continuations, then replay them as drafts corrupted with probability 1 - alpha, timing the second
of two runs of each (graphs captured, caches warm)."""

from __future__ import annotations

import random
import time

from metrale.api import LLM
from metrale.bench.timing import sync
from metrale.config import SamplingParams
from metrale.speculative.replay import ReplayDrafter


def timed_generate(llm: LLM, prompts, params) -> tuple[list, float]:
    """(outputs, seconds) of the second of two identical runs: graphs captured, caches warm."""
    device = llm.engine.runner.device
    llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    return outs, time.perf_counter() - start


def end_to_end(llm: LLM, drafter: ReplayDrafter, batch: int, max_tokens: int, alpha: float):
    rng = random.Random(batch)
    prompts = [[rng.randrange(llm.engine.vocab_size) for _ in range(32)] for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    drafter.continuations, drafter.alpha = {}, alpha  # no drafts: plain decoding
    device = llm.engine.runner.device

    plain, t_plain = timed_generate(llm, prompts, params)
    drafter.continuations = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)}
    spec_tel = llm.engine.telemetry.spec
    llm.generate(prompts, params, use_tqdm=False)  # warm-up, outside the counters below
    before = (
        spec_tel.num_drafts,
        spec_tel.num_accepted_tokens,
        spec_tel.verify_steps,
        spec_tel.multi_seq_runs,
        spec_tel.contiguous_runs,
    )
    sync(device)
    start = time.perf_counter()
    spec = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    t_spec = time.perf_counter() - start
    # NOTE: in float32 the two runs match token for token (the tests pin it); in bf16 a verify
    # of q rows rounds differently from a 1-row decode, so near-tied argmaxes of a random-weight
    # model can flip. Report how often, rather than hide it.
    same = sum(
        a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(plain, spec, strict=True)
    )
    tokens = batch * max_tokens
    drafts = spec_tel.num_drafts - before[0]
    return {
        "batch": batch,
        "tokens_per_s_plain": tokens / t_plain,
        "tokens_per_s_spec": tokens / t_spec,
        "speedup": t_plain / t_spec,
        "identical_outputs": same / batch,
        "mean_acceptance_length": 1 + (spec_tel.num_accepted_tokens - before[1]) / max(drafts, 1),
        "verify_steps": spec_tel.verify_steps - before[2],
        # of the runs of several equal-depth sequences in dispatch order, the share on
        # consecutive state slots (what a kernel batching by slot range would need)
        "contiguous_run_share": (spec_tel.contiguous_runs - before[4])
        / max(spec_tel.multi_seq_runs - before[3], 1),
        # over the engine's life so far (every end-to-end run of this bench)
        "distinct_verify_keys": len(spec_tel.verify_keys),
        "graphs": llm.engine.runner.graphs.cache.stats() if llm.engine.runner.graphs else None,
    }
