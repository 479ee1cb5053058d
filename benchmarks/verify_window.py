"""The host's critical window of a speculative step, on a CPU against the simulated device
(`simulated_device.py`): from the moment a verify's verdicts can be read to the next forward's
launch, the device has nothing to run. This prints that window's median and, per engine function,
the milliseconds of it spent there (`profile_e2e.PhaseTimer`'s windows, as on a GPU).

    PYTHONPATH=. python benchmarks/verify_window.py --batch 64 --alpha 0.5 --dcut

The window is where a verify step loses to a plain one launched ahead (`engine/ahead.py`,
`engine/held_verify.py`): each millisecond taken off it is a millisecond off every verify step.
Absolute figures depend on this machine's CPU and its load (alternate A/B runs: a second process
on a 2-core machine moved them by half); the split between functions is what to read.
"""

from __future__ import annotations

import argparse
import json
import statistics

from benchmarks.simulated_device import add_arguments, simulated
from metrale.bench.forced import ForcedAcceptance
from metrale.bench.profile_e2e import PhaseTimer
from metrale.config import SamplingParams


def short_names(labels) -> dict[str, str]:
    """Each `PhaseTimer` label (owner.function) -> its function's name where no other label
    shares it (`prepare`, `hold`), else the label itself (`SpeculativeDecoder.observe` beside
    `ReplayDrafter.observe`)."""
    names = [label.rsplit(".", 1)[-1] for label in labels]
    return {
        label: name if names.count(name) == 1 else label
        for label, name in zip(labels, names, strict=True)
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap, batch=64, plain_ms=7.1, row_ms=0.55)
    ap.add_argument("--runs", type=int, default=3, help="timed generations (after two warm)")
    args = ap.parse_args()
    llm, prompts, base, _ = simulated(args)
    engine = llm.engine

    def run(seed: int) -> None:
        engine.runner.forced_acceptance = ForcedAcceptance(args.alpha, seed=seed)
        llm.generate(prompts, SamplingParams(**base), use_tqdm=False)

    run(0), run(1)  # warm
    # (the window opens when the verdicts' read returns: the simulated device waits there)
    with PhaseTimer(llm) as timer:
        for seed in range(2, 2 + args.runs):
            run(seed)
    windows = timer.windows
    n = max(len(windows), 1)
    name = short_names(list(timer.in_window))
    print(
        json.dumps(
            {
                "batch": args.batch,
                "alpha": args.alpha,
                "windows": len(windows),
                "window_median_ms": round(statistics.median(windows or [0.0]) * 1e3, 3),
                "window_mean_ms": round(statistics.mean(windows or [0.0]) * 1e3, 3),
                "ms_per_window": {
                    name[k]: round(v * 1e3 / n, 3)
                    for k, v in sorted(timer.in_window.items(), key=lambda kv: -kv[1])
                },
            }
        )
    )


if __name__ == "__main__":
    main()
