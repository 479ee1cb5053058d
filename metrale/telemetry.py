"""Engine counters and histograms. Host-side only: recording never touches the GPU, so it adds no
synchronisation to a step. Later issues add speculative counters and Prometheus export."""

from __future__ import annotations

import bisect
import time
from collections import Counter
from dataclasses import dataclass, field

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

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


@dataclass
class Telemetry:
    prefill_tokens: int = 0  # rows at prompt positions run (recompute after preemption included)
    decode_tokens: int = 0  # tokens emitted
    steps: int = 0
    preemptions: int = 0
    steps_by_phase: Counter = field(default_factory=Counter)  # Phase.value -> steps
    requests_finished: Counter = field(default_factory=Counter)  # by finish reason
    step_time: Histogram = field(default_factory=lambda: Histogram(STEP_TIME_BUCKETS))

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
        }


class StepTimer:
    """`with StepTimer() as t: ...; t.seconds` (host wall time of the step)."""

    def __enter__(self) -> StepTimer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start
