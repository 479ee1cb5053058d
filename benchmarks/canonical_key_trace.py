"""Measure where the canonical verify-key arm should start (`verify_key.CANONICAL_KEY_MIN_WIDTH`).

Simulates a mixed serving trace: sequences arrive and finish so the batch width wanders over
1..64, state slots come from a free list and are reused, each sequence has its own acceptance rate
(Beta(2, 2)) decaying with draft position, and up to K = 4 drafts are available per step. Every step
is planned by D-Cut (`spec.dcut.plan`, width cap 32 as in `SpecConfig`) from per-sequence
acceptance estimates, under each arm: canonical at every width, never, and canonical from widths
2, 4, 8, 16, 32. With `--deal`, depths are planned freely and the canonical arm deals them to the
slots, as the reference system does, instead of D-Cut planning for the deal.

Per arm: distinct verify graph keys (and the hit rate of a 256-entry LRU, the graph cache's size),
the same for the dense runner's program keys (bucketed sequence counts per depth; `dense hit` is
its LRU hit rate after the first 10% of each trace's steps, the warm-up),
expected emitted tokens per step under the true acceptance rates, also per unit of verify time
(`E/cost`; plain decode scores the mean width there, `speedup` is the ratio), padded rows, and the
share of sequences in multi-sequence equal-depth runs whose slots are consecutive (what the
batched GDN path needs).

Each trace (arrivals, lifetimes, slots, draft counts, match draws) is drawn once per seed and
replayed for every arm; seeds are independent runs whose counts add up. With `--observe drafted`
(default) the estimator sees the match of every drafted position, verified or not, so estimates
are the same in every arm and arms differ only by planning; `--observe verified` feeds back only
verified positions, as the engine does, so each arm's plans steer its own estimates.

Run from the repository root: `PYTHONPATH=. python benchmarks/canonical_key_trace.py`; a table
goes to stderr and one JSON document is the last line of stdout. About 30 s on two CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

from metrale.engine.program_shapes import decode_bucket
from metrale.knobs import knobs
from metrale.speculative.dcut import (
    PlanInput,
    choose_depths,
    plan,
)
from metrale.speculative.estimator import AcceptanceEstimator
from metrale.speculative.verify_cost import VerifyCostModel
from metrale.speculative.verify_key import (
    canonical_assignment,
    verify_batch_order,
    verify_graph_key,
)

K = 4
MAX_WIDTH = 64
GRAPH_CACHE = 256
WARMUP_SHARE = 0.1  # of each trace's steps, before the dense runner's hit rate is counted
BUCKET_FN = decode_bucket  # the padded count of one depth's sequences
THRESHOLDS = (2, 4, 8, 16, 32)
BUCKETS = (1, 2, 4, 8, 16, 32)  # width buckets [1, 2), [2, 4), ..., [32, 64]
ENV = ("METRALE_NO_CANONICAL_VERIFY_KEY", "METRALE_CANONICAL_KEY_MIN_WIDTH")

# ARCHITECTURE.md's H200 calibration: step time at q rows per sequence over q = 1, per batch size.
H200_POINTS = {(1, 4): 1.15, (16, 4): 1.53, (64, 4): 2.74, (64, 16): 4.90}


@dataclass(frozen=True)
class Member:
    """One sequence in one step of the trace: identity, slot, drafts and this step's draws."""

    seq_id: int
    slot: int
    max_depth: int
    accept: tuple[float, ...]  # true P(draft j+1 matches), independent across positions
    draws: tuple[float, ...]  # uniforms: draft j+1 matches when draws[j] < accept[j]


def make_trace(args: argparse.Namespace, seed: int) -> list[list[Member]]:
    rng = random.Random(seed)
    free = list(range(MAX_WIDTH - 1, -1, -1))  # a fresh pool hands out slots 0, 1, 2, ...
    live: dict[int, tuple[int, int, tuple[float, ...]]] = {}  # seq -> (slot, end step, accept)
    next_id, target, trace = 0, 1, []
    for step in range(args.steps):
        for sid in [s for s, (_, end, _) in live.items() if end <= step]:
            free.append(live.pop(sid)[0])
        if step % 150 == 0:
            # Load phases: a log-uniform target width, so narrow and wide batches both get time.
            target = round(2 ** rng.uniform(0, 6))
        for _ in range(min(target - len(live), rng.randint(0, 4))):
            # The free list reuses the slot freed last; random picks model a fragmented pool.
            slot = free.pop(rng.randrange(len(free)) if args.random_slots else -1)
            alpha, decay = rng.betavariate(args.beta, args.beta), rng.uniform(0.75, 1.0)
            accept = tuple(alpha * decay**j for j in range(K))
            live[next_id] = (slot, step + 1 + int(rng.expovariate(1 / args.lifetime)), accept)
            next_id += 1
        members = []
        for sid, (slot, _, accept) in live.items():
            short = rng.random() < args.short_drafts
            max_depth = rng.randint(0, K - 1) if short else K
            draws = tuple(rng.random() for _ in range(K))
            members.append(Member(sid, slot, max_depth, accept, draws))
        trace.append(members)
    return trace


def set_arm(min_width: int | None) -> None:
    """Select the arm through the real knobs: None = never canonical, else canonical from width."""
    for name in ENV:
        os.environ.pop(name, None)
    if min_width is None:
        os.environ["METRALE_NO_CANONICAL_VERIFY_KEY"] = "1"
    else:
        os.environ["METRALE_CANONICAL_KEY_MIN_WIDTH"] = str(min_width)
    knobs.cache_clear()


def _bucket(width: int) -> int:
    return max(b for b in BUCKETS if b <= width)


def run_slots(slots: list[int], depths: list[int]) -> tuple[int, int]:
    """(sequences in runs of >= 2 equal depths, those of them in runs on consecutive slots)."""
    batched = contiguous = start = 0
    for end in range(1, len(depths) + 1):
        if end < len(depths) and depths[end] == depths[start]:
            continue
        if end - start > 1:
            batched += end - start
            if all(slots[j + 1] == slots[j] + 1 for j in range(start, end - 1)):
                contiguous += end - start
        start = end
    return batched, contiguous


def dispatch(
    inputs: list[PlanInput], cost: VerifyCostModel, width_cap: int, deal: bool
) -> tuple[list[int], list[int]]:
    """(order, depths) of one step: D-Cut's plan, or with `deal` the reference system's way of
    planning each depth freely and letting the canonical arm deal the multiset to the slots."""
    if not deal:
        p = plan(inputs, cost, width_cap)
        return p.order, p.depths
    depths = choose_depths(inputs, cost, width_cap)
    canonical = canonical_assignment(len(inputs))
    return verify_batch_order([x.slot for x in inputs], depths, canonical)


def run_arm(
    trace: list[list[Member]], cost: VerifyCostModel, args: argparse.Namespace
) -> Counter[str]:
    """Sums over one trace: counts, tokens and step time, per width bucket where it matters."""
    est = AcceptanceEstimator(max_positions=K)
    keys: dict[int, set[tuple[int, ...]]] = {b: set() for b in BUCKETS}
    lru: OrderedDict[tuple[int, ...], None] = OrderedDict()
    # The dense runner's program key: bucketed sequence counts per depth (runner._replay).
    dense_lru: OrderedDict[tuple[tuple[int, int], ...], None] = OrderedDict()
    dense_keys: set[tuple[tuple[int, int], ...]] = set()
    warm_after = len(trace) * WARMUP_SHARE
    tally: Counter[str] = Counter()
    seen: set[int] = set()
    for step, members in enumerate(trace):
        ids = {m.seq_id for m in members}
        for sid in seen - ids:
            est.forget(sid)
        seen = ids
        if not members:
            continue
        n = len(members)
        inputs = [
            PlanInput(m.slot, m.max_depth, est.estimate(m.seq_id, m.max_depth)) for m in members
        ]
        order, depths = dispatch(inputs, cost, args.width_cap, args.deal)
        rows = n + sum(depths)
        tally["steps"] += 1
        tally["width"] += n
        tally["time"] += cost.step_time(rows, n)
        for i, d in zip(order, depths):
            m = members[i]
            real = min(d, m.max_depth)  # the rest is padding, which never matches
            tally["padded"] += d - real
            g = 1.0
            tally[f"tokens>={_bucket(n)}"] += 1.0
            for a in m.accept[:real]:
                g *= a
                tally[f"tokens>={_bucket(n)}"] += g
            observed = m.max_depth if args.observe == "drafted" else real
            if observed:
                est.observe(m.seq_id, [u < a for u, a in zip(m.draws[:observed], m.accept)])
        if rows == n:
            continue  # all plain decode: a decode graph, no verify key
        tally["verify_steps"] += 1
        key = verify_graph_key(
            [(members[i].slot, d + 1) for i, d in zip(order, depths)], False, False
        )
        keys[_bucket(n)].add(key)
        batched, contiguous = run_slots([members[i].slot for i in order], depths)
        tally["batched"] += batched
        tally["contiguous"] += contiguous
        counts = Counter(d + 1 for d in depths)
        dense = tuple((q, BUCKET_FN(c)) for q, c in sorted(counts.items(), reverse=True))
        dense_keys.add(dense)
        warm = step >= warm_after
        tally["warm_verify_steps"] += warm
        if dense in dense_lru:
            tally["dense_hits"] += 1
            tally["dense_warm_hits"] += warm
            dense_lru.move_to_end(dense)
        else:
            dense_lru[dense] = None
            if len(dense_lru) > GRAPH_CACHE:
                dense_lru.popitem(last=False)
        if key in lru:
            tally["hits"] += 1
            lru.move_to_end(key)
        else:
            lru[key] = None
            if len(lru) > GRAPH_CACHE:
                lru.popitem(last=False)
    tally.update({f"keys>={b}": len(k) for b, k in keys.items()})
    tally["dense_keys"] = len(dense_keys)
    return tally


def summarise(t: Counter[str], never: Counter[str]) -> dict[str, object]:
    def tokens(c: Counter[str]) -> float:
        return sum(c[f"tokens>={b}"] for b in BUCKETS)

    def n_keys(c: Counter[str]) -> int:
        return sum(c[f"keys>={b}"] for b in BUCKETS)

    return {
        "distinct_keys": n_keys(t),
        "keys_vs_never": n_keys(t) / n_keys(never),
        "lru256_hit_rate": t["hits"] / max(t["verify_steps"], 1),
        "dense_keys": t["dense_keys"],
        "dense_lru256_hit_rate": t["dense_hits"] / max(t["verify_steps"], 1),
        "dense_warm_hit_rate": t["dense_warm_hits"] / max(t["warm_verify_steps"], 1),
        "mean_expected_tokens": tokens(t) / t["steps"],
        "tokens_vs_never": tokens(t) / tokens(never),
        "expected_tokens_per_cost": tokens(t) / t["time"],
        "speedup_vs_plain_decode": tokens(t) / t["time"] / (t["width"] / t["steps"]),
        "padded_rows_per_step": t["padded"] / t["steps"],
        "contiguous_run_share": t["contiguous"] / max(t["batched"], 1),
        # Keys of different widths never collide, so the buckets add up to the total.
        "by_width": {
            f">={b}": {"keys": t[f"keys>={b}"], "tokens": round(t[f"tokens>={b}"], 3)}
            for b in BUCKETS
        },
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--cost", choices=("h200", "default"), default="h200")
    ap.add_argument("--observe", choices=("drafted", "verified"), default="drafted")
    ap.add_argument("--lifetime", type=float, default=120.0, help="mean sequence life in steps")
    ap.add_argument("--random-slots", action="store_true")
    ap.add_argument("--beta", type=float, default=2.0, help="acceptance ~ Beta(beta, beta)")
    ap.add_argument("--short-drafts", type=float, default=0.2, help="P(fewer than K drafts)")
    ap.add_argument("--width-cap", type=int, default=32, help="SpecConfig.dcut_width_cap")
    ap.add_argument("--deal", action="store_true", help="plan freely, then deal (reference)")
    args = ap.parse_args(argv)

    cost = VerifyCostModel.from_points(H200_POINTS) if args.cost == "h200" else VerifyCostModel()
    traces = [make_trace(args, seed) for seed in range(args.seeds)]
    arms: dict[str, int | None] = {"always": 0, "never": None}
    arms.update({f"from_{t}": t for t in THRESHOLDS})
    saved = {name: os.environ.get(name) for name in ENV}
    tallies: dict[str, Counter[str]] = {}
    start = time.perf_counter()
    try:
        for name, min_width in arms.items():
            set_arm(min_width)
            tallies[name] = sum((run_arm(tr, cost, args) for tr in traces), Counter())
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
        knobs.cache_clear()

    results = {name: summarise(t, tallies["never"]) for name, t in tallies.items()}
    cols = {
        "keys": "distinct_keys",
        "keys/nev": "keys_vs_never",
        "lru hit": "lru256_hit_rate",
        "dense": "dense_keys",
        "dense hit": "dense_warm_hit_rate",
        "E/step": "mean_expected_tokens",
        "E/never": "tokens_vs_never",
        "E/cost": "expected_tokens_per_cost",
        "speedup": "speedup_vs_plain_decode",
        "pad/step": "padded_rows_per_step",
        "contig": "contiguous_run_share",
    }
    print(f"{'arm':>9}" + "".join(f"{c:>9}" for c in cols), file=sys.stderr)
    for name, r in results.items():
        cells = "".join(f"{r[k]:>9.4g}" for k in cols.values())
        print(f"{name:>9}{cells}", file=sys.stderr)
    steps = sum(len(tr) for tr in traces)
    doc = {
        "config": {**vars(args), "K": K, "max_width": MAX_WIDTH, "graph_cache": GRAPH_CACHE},
        "trace": {"steps": steps, "mean_width": tallies["never"]["width"] / steps},
        "arms": results,
        "seconds": round(time.perf_counter() - start, 2),
    }
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
