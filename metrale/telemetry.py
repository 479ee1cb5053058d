"""Engine counters and histograms. Host-side only: recording never touches the GPU, so it adds no
synchronisation to a step. Prometheus export comes with the server."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from metrale.speculative.row_table import RowTable

# Step-time histogram bucket upper bounds, in seconds.
STEP_TIME_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    float("inf"),
)


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float, times: int = 1) -> None:
        """Record `value` `times` times (one bucket search for all of them)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times
        self.count += times

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


# Request latency buckets (seconds): first token, whole request, queue, prefill, decode.
REQUEST_TIME_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    float("inf"),
)
# Per-output-token gaps (seconds).
TOKEN_TIME_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    float("inf"),
)
# Prompt / generation lengths (tokens).
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, float("inf"))


@dataclass
class RequestTelemetry:
    """Per-request latencies, recorded by the engine as tokens are emitted (vLLM's request
    metrics): time to first token, the gap per output token after it, and at the end the whole
    request split into queue, prefill and decode time, with its lengths."""

    ttft: Histogram = field(default_factory=lambda: Histogram(REQUEST_TIME_BUCKETS))
    inter_token: Histogram = field(default_factory=lambda: Histogram(TOKEN_TIME_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_TIME_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(REQUEST_TIME_BUCKETS))
    prefill: Histogram = field(default_factory=lambda: Histogram(REQUEST_TIME_BUCKETS))
    decode: Histogram = field(default_factory=lambda: Histogram(REQUEST_TIME_BUCKETS))
    prompt_tokens: Histogram = field(default_factory=lambda: Histogram(LENGTH_BUCKETS))
    generation_tokens: Histogram = field(default_factory=lambda: Histogram(LENGTH_BUCKETS))

    def emitted(self, seq, count: int, now: float) -> None:
        """`count` tokens of `seq` emitted at `now` (one observation per token after the
        first: a verify emitting several tokens spreads its gap over them)."""
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.ttft.observe(now - seq.arrival_time)
            count -= 1
        elif count > 0:
            self.inter_token.observe((now - seq.last_token_time) / count, count)
        seq.last_token_time = now

    def finished(self, seq, now: float) -> None:
        """The request's split into queue, prefill and decode time, at the engine's clock: its
        prefill ends with the step that made its first token (the caller may get that token a
        step later, with deferred text: `ttft` is the caller's view)."""
        self.e2e.observe(now - seq.arrival_time)
        scheduled = seq.first_scheduled_time
        if scheduled is not None:
            self.queue.observe(scheduled - seq.arrival_time)
            if seq.first_commit_time is not None:
                self.prefill.observe(seq.first_commit_time - scheduled)
                self.decode.observe(now - seq.first_commit_time)
        self.prompt_tokens.observe(len(seq.prompt_token_ids))
        self.generation_tokens.observe(len(seq.output_token_ids))


# Lower bounds of the verify-batch width buckets (sequences verified together).
WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Distinct verify keys remembered; past this the count saturates (memory stays bounded).
MAX_TRACKED_KEYS = 4096


def width_bucket(width: int) -> int:
    return WIDTH_BUCKETS[bisect.bisect_right(WIDTH_BUCKETS, width) - 1]


@dataclass
class SpecTelemetry:
    """Speculative-decoding counters, named after vLLM's `spec_decode_*` metrics."""

    num_drafts: int = 0  # sequence-verifies with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted prefix covers pos j
    matched_per_pos: list[int] = field(default_factory=list)  # draft j matched (any prefix)
    drafted_per_pos: list[int] = field(default_factory=list)
    # width bucket -> [sequence-verifies, draft tokens, accepted tokens]
    by_width: dict[int, list[int]] = field(default_factory=dict)
    verify_keys: set = field(default_factory=set)
    verify_steps: int = 0
    host_gated_plans: int = 0  # plans D-Cut dropped: the drafter's host work outweighed them
    # runs of several sequences of equal depth in verify dispatch order, and how many of them sat
    # on consecutive state slots (`RowTable`'s batched mark)
    multi_seq_runs: int = 0
    contiguous_runs: int = 0

    def record(self, width: int, matches: list[bool], num_accepted: int) -> None:
        """One sequence-verify of a step of `width` verifying sequences."""
        self.record_verifies(width, [(matches, num_accepted)])

    def record_verifies(self, width: int, verifies: list[tuple[list[bool], int]]) -> None:
        """A step's sequence-verifies, (matches, accepted drafts) each, `width` of them
        verifying. NOTE: one call a step, not one a sequence (a share of a batch-64 step)."""
        drafted, matched = self.drafted_per_pos, self.matched_per_pos
        accepted = self.accepted_per_pos
        count = drafts = accepts = 0
        for matches, num_accepted in verifies:
            k = len(matches)
            if k == 0:
                continue
            count += 1
            drafts += k
            accepts += num_accepted
            if k > len(drafted):
                for counts in (accepted, matched, drafted):
                    counts.extend([0] * (k - len(counts)))
            for j in range(k):
                drafted[j] += 1
                if matches[j]:
                    matched[j] += 1
            for j in range(min(num_accepted, k)):
                accepted[j] += 1
        if not count:
            return
        self.num_drafts += count
        self.num_draft_tokens += drafts
        self.num_accepted_tokens += accepts
        bucket = self.by_width.setdefault(width_bucket(width), [0, 0, 0])
        bucket[0] += count
        bucket[1] += drafts
        bucket[2] += accepts

    def record_key(self, key: tuple, table: RowTable | None = None) -> None:
        self.verify_steps += 1
        if len(self.verify_keys) < MAX_TRACKED_KEYS:
            self.verify_keys.add(key)
        if table is not None:
            runs = [run for run in table.runs if run.count > 1]
            self.multi_seq_runs += len(runs)
            self.contiguous_runs += sum(run.batched for run in runs)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per sequence-verify: accepted drafts plus the bonus token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_by_position(self) -> list[float]:
        """P(draft j accepted) over the verifies that drafted position j."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    def width_lines(self) -> list[str]:
        return [
            f"width>={w}: verifies={n} drafted={d} accepted={a} rate={a / d if d else 0:.3f}"
            for w, (n, d, a) in sorted(self.by_width.items())
        ]

    def snapshot(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "matched_per_pos": list(self.matched_per_pos),
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_by_position": self.acceptance_by_position(),
            "distinct_verify_keys": len(self.verify_keys),
            "verify_steps": self.verify_steps,
            "host_gated_plans": self.host_gated_plans,
        }


@dataclass
class PrefixCacheTelemetry:
    """Prefix caching, counted in tokens as vLLM's `prefix_cache_queries` / `prefix_cache_hits`:
    every admission (a recompute after preemption too) queries its tokens, and hits the ones its
    cached pages cover."""

    queries: int = 0
    hits: int = 0
    requests: int = 0  # admissions that queried the cache
    evicted_pages: int = 0  # idle cached pages reclaimed for other use
    snapshots_saved: int = 0  # hybrid targets: recurrent-state snapshots taken
    snapshots_restored: int = 0  # and resumed from

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def snapshot(self) -> dict:
        return {
            "queries": self.queries,
            "hits": self.hits,
            "hit_rate": self.hit_rate,
            "requests": self.requests,
            "evicted_pages": self.evicted_pages,
            "snapshots_saved": self.snapshots_saved,
            "snapshots_restored": self.snapshots_restored,
        }


@dataclass
class Telemetry:
    prefill_tokens: int = 0  # rows at prompt positions run (recompute after preemption included)
    decode_tokens: int = 0  # tokens emitted
    steps: int = 0
    preemptions: int = 0
    steps_by_phase: Counter = field(default_factory=Counter)  # Phase.value -> steps
    requests_finished: Counter = field(default_factory=Counter)  # by finish reason
    step_time: Histogram = field(default_factory=lambda: Histogram(STEP_TIME_BUCKETS))
    spec: SpecTelemetry = field(default_factory=SpecTelemetry)
    request: RequestTelemetry = field(default_factory=RequestTelemetry)
    prefix_cache: PrefixCacheTelemetry = field(default_factory=PrefixCacheTelemetry)

    def record_step(self, phase: str, prompt_rows: int, emitted: int, seconds: float) -> None:
        self.steps += 1
        self.steps_by_phase[phase] += 1
        self.prefill_tokens += prompt_rows
        self.decode_tokens += emitted
        self.step_time.observe(seconds)

    def snapshot(self) -> dict:
        return {
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "steps": self.steps,
            "preemptions": self.preemptions,
            "steps_by_phase": dict(self.steps_by_phase),
            "requests_finished": dict(self.requests_finished),
            "step_time_mean_s": self.step_time.mean,
            "tokens_per_step": self.decode_tokens / self.steps if self.steps else 0.0,
            "spec": self.spec.snapshot(),
            "prefix_cache": self.prefix_cache.snapshot(),
        }
