"""The engine's host work against a simulated device, on a CPU: how much of a speculative step the
host costs once the target's forward takes a chosen time, without a GPU.

The target's forward is replaced by one that returns at once but keeps a simulated device busy
for `--plain-ms` plus `--row-ms` for each extra row per sequence (a verify's cost); where the
engine reads a step's results (a verify's verdicts, a plain step's tokens copied back) the host
sleeps until that step is done on the simulated device. Everything else is the engine's own host
work, run as it runs on a GPU: a step launched ahead (asynchronous scheduling) overlaps the
forward before it, a held verify's commit overlaps the next forward (`engine/held_verify.py`).
A random-weight `--shape` decodes with the replay drafter at forced acceptance `--alpha` (K = 3),
each timed run with a fresh draw (`--seeds` of them), as `metrale bench --forced-acceptance`.

    PYTHONPATH=. python benchmarks/simulated_device.py --batch 8 --plain-ms 0.2 --row-ms 0.1
    PYTHONPATH=. python benchmarks/simulated_device.py --batch 64 --alpha 0.5 --dcut

Besides the speedup it prints how long the device waited for the host between forwards, a step on
average (`*_idle_ms_per_step`): a speculative step's bubble, which a plain step launched ahead
does not have while its forward takes longer than the host's work.

Figures from this CPU are slower than a GPU machine's host, and the forward's device time is a
model: use it for A/B runs of host-side changes (`METRALE_NO_HELD_VERIFY=1` and the like) and
for where host work stops hiding, not as a benchmark (`results/session72-h100/`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import metrale.engine.device_tokens as device_tokens
import metrale.engine.runner as runner_mod
from metrale.bench.e2e import random_prompts, replay_engine
from metrale.bench.forced import ForcedAcceptance
from metrale.config import SamplingParams
from metrale.engine.heap import freeze_startup_heap
from metrale.speculative.verify_cost import VerifyCostModel


class SimulatedDevice:
    """A device clock: forwards queue on it, reads of their results wait for it."""

    def __init__(self, plain_ms: float, row_ms: float, hidden: int) -> None:
        self.plain, self.row, self.hidden = plain_ms / 1e3, row_ms / 1e3, hidden
        self.free_at = 0.0  # when the last queued forward is done
        self.busy = 0.0
        self.idle = 0.0  # the device waiting for the host: each launch after the device drained
        self.steps = self.rows = 0

    def forward(self, batch, input_ids, positions, meta, verify=False, head_seqs=0):
        rows, seqs = input_ids.shape[0], max(len(batch.entries), 1)
        seconds = self.plain + self.row * max(rows - seqs, 0) / seqs
        now = time.perf_counter()
        if self.steps:  # (not before the run's first forward)
            self.idle += max(now - self.free_at, 0.0)
        self.free_at = max(now, self.free_at) + seconds
        self.busy += seconds
        self.steps, self.rows = self.steps + 1, self.rows + rows
        return torch.zeros(rows, self.hidden), None

    def cost_model(self, max_batch: int) -> VerifyCostModel:
        """The verify cost curve of this device (the same at every width) and its plain step."""
        batches = sorted({1 << i for i in range(max_batch.bit_length())} | {max_batch})
        ratio = {
            (b, q): (self.plain + self.row * (q - 1)) / self.plain
            for b in batches
            for q in (2, 4, 8)
        }
        return VerifyCostModel.from_points(ratio, {b: self.plain for b in batches})

    def wait(self, until: float) -> None:
        left = until - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def attach(self, runner) -> None:
        """Route `runner`'s forwards here, and make the reads of their results wait."""
        runner._forward = self.forward
        host, init, rows = (
            runner_mod.to_host,
            device_tokens.HostCopy.__init__,
            device_tokens.HostCopy.rows,
        )
        device = self

        def to_host(*args, **kwargs):  # a verify's verdicts' read: its own forward's
            device.wait(device.free_at)
            return host(*args, **kwargs)

        def copy_init(self, *args, **kwargs):  # a copy queued behind the forward just launched
            init(self, *args, **kwargs)
            self._simulated_done = device.free_at

        def copy_rows(self):
            if self._rows is None:
                device.wait(getattr(self, "_simulated_done", 0.0))
            return rows(self)

        runner_mod.to_host = to_host
        device_tokens.HostCopy.__init__ = copy_init
        device_tokens.HostCopy.rows = copy_rows


def add_arguments(ap: argparse.ArgumentParser, batch: int, plain_ms: float, row_ms: float) -> None:
    """The simulated run's options (this script's and `verify_window.py`'s), with defaults."""
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--alpha", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dcut", action="store_true", help="D-Cut picks the depths")
    ap.add_argument("--plain-ms", type=float, default=plain_ms, help="a plain step's device time")
    ap.add_argument("--row-ms", type=float, default=row_ms, help="per extra row per sequence")


def simulated(args: argparse.Namespace) -> tuple:
    """(llm, prompts, sampling options, device): a random-weight `--shape` engine whose replay
    drafter knows the plain continuations of `--batch` prompts, its forwards on a simulated
    device (`add_arguments`' options)."""
    torch.set_num_threads(1)
    llm, drafter = replay_engine(
        args.shape,
        args.alpha,
        max_model_len=512,
        max_num_seqs=max(args.batch, 8),
        kv_cache_memory_gb=1.0,
        spec={"num_drafts": 3, "dcut": args.dcut},
    )
    freeze_startup_heap()  # as `metrale bench`: no full collection mid-run
    engine = llm.engine
    prompts = random_prompts(args.batch, min(1000, engine.vocab_size), seed=0)
    base = dict(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    plain = llm.generate(prompts, SamplingParams(**base, speculative=False), use_tqdm=False)
    drafter.record({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)})
    embed = next(m for m in engine.runner.model.modules() if isinstance(m, torch.nn.Embedding))
    device = SimulatedDevice(args.plain_ms, args.row_ms, embed.embedding_dim)
    device.attach(engine.runner)
    if engine.spec is not None:
        # D-Cut prices rows as the simulated device charges them, as the engine's start-up
        # calibration makes it price them on a GPU (on a CPU nothing is calibrated: the default
        # curve priced a verify of 4 rows a sequence at 2.5x plain at batch 64, so D-Cut rarely
        # drafted where the simulated device charged 1.5x)
        engine.spec.cost = device.cost_model(max(args.batch, 8))
    return llm, prompts, base, device


def main() -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap, batch=8, plain_ms=6.7, row_ms=1.0)
    ap.add_argument("--seeds", type=int, default=10, help="speculative runs, one draw each")
    args = ap.parse_args()
    llm, prompts, base, device = simulated(args)
    engine = llm.engine

    def run(speculative: bool, seed: int = 0) -> dict:
        engine.runner.forced_acceptance = ForcedAcceptance(args.alpha, seed=seed)
        device.busy, device.idle, device.steps, device.rows = 0.0, 0.0, 0, 0
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(**base, speculative=speculative), use_tqdm=False)
        device.wait(device.free_at)
        wall = time.perf_counter() - start
        idle = device.idle * 1e3 / max(device.steps - 1, 1)
        return {"ms": wall * 1e3, "busy_ms": device.busy * 1e3, "steps": device.steps, "idle": idle}

    run(False), run(True)  # warm
    plain_runs = [run(False) for _ in range(3)]
    spec_runs = [run(True, seed) for seed in range(args.seeds)]
    plain_ms = statistics.median(r["ms"] for r in plain_runs)
    spec_ms = statistics.mean(r["ms"] for r in spec_runs)
    print(
        json.dumps(
            {
                "batch": args.batch,
                "alpha": args.alpha,
                "plain_ms": round(plain_ms, 2),
                "plain_steps": plain_runs[0]["steps"],
                "spec_ms": round(spec_ms, 2),
                "spec_steps": statistics.mean(r["steps"] for r in spec_runs),
                "spec_device_busy": round(statistics.mean(r["busy_ms"] for r in spec_runs), 2),
                "speedup": round(plain_ms / spec_ms, 3),
                # ms a step the device waited for the host between forwards (a verify's:
                # its verdicts read, the next step drafted, planned, packed and launched)
                "plain_idle_ms_per_step": round(statistics.mean(r["idle"] for r in plain_runs), 3),
                "spec_idle_ms_per_step": round(statistics.mean(r["idle"] for r in spec_runs), 3),
                "held_verifies": engine._ahead.held_verifies if engine._ahead else 0,
            }
        )
    )


if __name__ == "__main__":
    main()
