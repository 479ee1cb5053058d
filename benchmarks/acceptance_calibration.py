"""How well D-Cut's acceptance estimates predict the drafts that are accepted.

Runs the shipped model on held-out prompts (closed batches, greedy) with a drafter, records every
sequence's verdicts as the estimator is shown them, then replays the records through estimator
variants (`AcceptanceEstimator` at other rates and pooled-prior rates). For each variant: the
drafts accepted over the drafts its estimates expected (sum over k of a_1 ... a_k, read before
each record), the first draft's Brier score, and per position the mean estimate against the
outcome; then the same with each sequence's records shuffled. A gap that shuffling closes is the
estimates lagging a rate that moves as sequences generate (what set `rate` to 0.3).

    python benchmarks/acceptance_calibration.py ngram 8 --rounds 4
"""

from __future__ import annotations

import argparse
import random
import sysconfig
from collections import defaultdict
from pathlib import Path

from metrale.api import LLM
from metrale.bench.acceptance import heldout_prompts
from metrale.config import SamplingParams
from metrale.speculative.estimator import AcceptanceEstimator

VARIANTS = [
    {"rate": 0.2, "pool_rate": 0.2},  # before session 51
    {"rate": 0.3, "pool_rate": 0.3},
    {"rate": 0.4, "pool_rate": 0.4},
    {"rate": 0.2, "pool_rate": 0.02},
    {"rate": 0.3, "pool_rate": 0.02},  # the default since
    {"rate": 0.4, "pool_rate": 0.02},
]


def record(drafter: str, batch: int, rounds: int) -> tuple[list[list[tuple[int, list[bool]]]], int]:
    """Every step's (seq_id, matches) records the engine's estimator observed, in order, and K."""
    k = 7 if drafter == "dflash" else 3
    llm = LLM(
        "metrale/assets/default-model",
        max_model_len=128 + 160,
        max_num_seqs=batch,
        kv_cache_memory_gb=1.0,
        spec={"method": drafter, "num_drafts": k},
    )
    est = llm.engine.spec.estimator
    log: list[list[tuple[int, list[bool]]]] = []
    # (`_observe`: what applies every observation, those a held verify deferred included)
    observe = est._observe

    def recorded(verifies):
        log.append([(seq_id, [bool(m) for m in matches]) for seq_id, matches in verifies])
        return observe(verifies)

    est._observe = recorded
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = heldout_prompts(stdlib, llm.tokenizer, batch * rounds, 128)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for r in range(rounds):
        llm.generate(prompts[r * batch : (r + 1) * batch], params, use_tqdm=False)
    return log, k


def replay(log, k: int, prior: float, rate: float, pool_rate: float) -> dict:
    est = AcceptanceEstimator(
        max_positions=k, prior=prior, rate=rate, pooled_prior=True, pool_rate=pool_rate
    )
    expected = accepted = brier = 0.0
    at = defaultdict(lambda: [0.0, 0.0, 0])  # position -> [estimate, outcome, count]
    records = 0
    for step in log:
        # a step's estimates are read before any of its verdicts, as the planner reads them
        read = [est.estimate(seq_id, len(matches)) for seq_id, matches in step]
        est.observe_many(step)
        records += len(step)
        for (_, matches), estimates in zip(step, read, strict=True):
            accepted, expected, brier = _score(matches, estimates, at, accepted, expected, brier)
    return {
        "accepted/expected": accepted / expected,
        "brier1": brier / records,
        "positions": [(round(e / n, 3), round(o / n, 3)) for e, o, n in at.values()][:4],
    }


def _score(matches, estimates, at, accepted: float, expected: float, brier: float):
    """One record's drafts accepted and expected, added to the running totals, and its
    estimates against its outcomes up to the first miss, in `at`."""
    run = 1.0
    for a in estimates:
        run *= a
        expected += run
    for j, a in enumerate(estimates):  # the positions up to the first miss
        cell = at[j]
        cell[0], cell[1], cell[2] = cell[0] + a, cell[1] + matches[j], cell[2] + 1
        if j == 0:
            brier += (a - matches[0]) ** 2
        if not matches[j]:
            break
        accepted += 1
    return accepted, expected, brier


def shuffled(log, seed: int = 0):
    """The steps with each sequence's verdicts in a random order (same places in the steps)."""
    rnd, by_seq = random.Random(seed), defaultdict(list)
    for step in log:
        for seq_id, matches in step:
            by_seq[seq_id].append(matches)
    for verdicts in by_seq.values():
        rnd.shuffle(verdicts)
    taken = defaultdict(int)
    out = []
    for step in log:
        out.append([])
        for seq_id, _ in step:
            out[-1].append((seq_id, by_seq[seq_id][taken[seq_id]]))
            taken[seq_id] += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafter", choices=("ngram", "mtp", "dflash"))
    ap.add_argument("batch", type=int)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prior", type=float, default=0.6)  # SpecConfig.dcut_prior
    args = ap.parse_args()
    log, k = record(args.drafter, args.batch, args.rounds)
    records = sum(len(step) for step in log)
    print(f"{args.drafter} K={k}, closed batches of {args.batch}: {records} records")
    for name, records in (("in order", log), ("shuffled within each sequence", shuffled(log))):
        print(name)
        for v in VARIANTS:
            r = replay(records, k, args.prior, **v)
            print(
                f"  rate {v['rate']:.2f} pool {v['pool_rate']:.2f}: accepted/expected "
                f"{r['accepted/expected']:.3f}, Brier (first draft) {r['brier1']:.4f}, "
                f"(estimate, outcome) by position {r['positions']}"
            )


if __name__ == "__main__":
    main()
