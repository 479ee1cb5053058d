"""The host's critical window of a speculative step, on a CPU against the simulated device
(`simulated_device.py`): from the moment a verify's verdicts can be read to the next forward's
launch, the device has nothing to run. This prints that window's median and, per engine function,
the milliseconds of it spent there (a function's time counts from when the window opened).

    PYTHONPATH=. python benchmarks/verify_window.py --batch 64 --alpha 0.5 --dcut

The window is where a verify step loses to a plain one launched ahead (`engine/ahead.py`,
`engine/held_verify.py`): each millisecond taken off it is a millisecond off every verify step.
Absolute figures depend on this machine's CPU and its load (alternate A/B runs: a second process
on a 2-core machine moved them by half); the split between functions is what to read.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import time

import metrale.engine.held_verify as held_verify
import metrale.engine.runner as runner_mod
from benchmarks.simulated_device import SimulatedDevice, add_arguments, simulated
from metrale.bench.forced import ForcedAcceptance
from metrale.config import SamplingParams


class Window:
    """Wall time from each verdict read (the simulated device's `wait`) to the next forward, and
    the part of it each wrapped function took."""

    def __init__(self, device: SimulatedDevice) -> None:
        self.opened: float | None = None
        self.windows: list[float] = []
        self.spent: dict[str, float] = collections.defaultdict(float)
        forward, wait = device.forward, device.wait

        def timed_forward(*args, **kwargs):
            if self.opened is not None:
                self.windows.append(time.perf_counter() - self.opened)
                self.opened = None
            return forward(*args, **kwargs)

        def timed_wait(until: float) -> None:
            wait(until)
            self.opened = time.perf_counter()

        device.forward, device.wait = timed_forward, timed_wait

    def time(self, owner, name: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.opened is not None:
                    self.spent[name] += time.perf_counter() - max(start, self.opened)

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.windows.clear()
        self.spent.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap, batch=64, plain_ms=7.1, row_ms=0.55)
    ap.add_argument("--runs", type=int, default=3, help="timed generations (after two warm)")
    args = ap.parse_args()
    llm, prompts, base, device = simulated(args)
    engine = llm.engine
    window = Window(device)
    engine.runner._forward = device.forward  # (the wrapped one)
    for owner, name in (
        (runner_mod, "greedy_verdicts"),
        (engine.spec, "learn_held"),
        (held_verify, "hold"),
        (engine, "_outputs"),
        (engine.spec, "timed_step"),
        (engine.spec, "prepare"),
        (engine.spec, "_planned"),  # (D-Cut's plan, inside prepare)
        (engine.spec, "_propose"),  # (the drafter and the drafts' checks, inside prepare)
        (engine.spec, "_cut"),  # (D-Cut's cut of what was drafted, inside prepare)
        (engine.scheduler, "schedule"),
        (engine.runner, "_metadata"),
    ):
        window.time(owner, name)

    def run(seed: int) -> None:
        engine.runner.forced_acceptance = ForcedAcceptance(args.alpha, seed=seed)
        llm.generate(prompts, SamplingParams(**base), use_tqdm=False)

    run(0), run(1)  # warm
    window.reset()
    for seed in range(2, 2 + args.runs):
        run(seed)
    n = max(len(window.windows), 1)
    print(
        json.dumps(
            {
                "batch": args.batch,
                "alpha": args.alpha,
                "windows": len(window.windows),
                "window_median_ms": round(statistics.median(window.windows or [0.0]) * 1e3, 3),
                "window_mean_ms": round(statistics.mean(window.windows or [0.0]) * 1e3, 3),
                "ms_per_window": {
                    k: round(v * 1e3 / n, 3)
                    for k, v in sorted(window.spent.items(), key=lambda kv: -kv[1])
                },
            }
        )
    )


if __name__ == "__main__":
    main()
