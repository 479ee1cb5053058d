"""The training loop every stage shares: AdamW, warmup + cosine schedule, clipping, held-out
evaluation, progress, and exact resumption.

A stage hands over the module to train, a `loss_fn(batch) -> (loss, metrics)` closure and the
tokenised corpus. The loop owns everything else. Its state file (model, optimizer, scheduler,
step, the data generator's state, the loss history) is written every `save_every` steps and
whenever a run stops early (`stop_at`, `time_limit`), and a run with `resume` continues from it
to the same weights, bit for bit on CPU, as an uninterrupted run: the data windows come from a
`torch.Generator` whose state is part of the file, and nothing else in a step is random.

Precision: float32 master weights; on CUDA the forward runs under bf16 autocast, on CPU in plain
float32 (deterministic for a fixed thread count).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from metrale.config import resolve_device
from metrale.train.corpus import TokenData
from metrale.train.state import (
    load_state,
    refuse_finished_resume,
    save_state,
    unreadable,
)

LossFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
STATE_VERSION = 1
# Steps averaged into the reported final training loss: one step's loss is too noisy to quote.
FINAL_LOSS_STEPS = 10
# Training losses are copied to the host (one device sync) this often.
LOG_EVERY = 10


@dataclass(frozen=True)
class TrainOptions:
    """Optimisation and bookkeeping options of one stage; validated on construction."""

    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 512
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1  # matrices and embeddings only, never norms or biases
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    seed: int = 0
    device: str = "auto"
    compile: bool = False
    eval_every: int = 200  # 0 = only at the end
    eval_batches: int = 8
    save_every: int = 200  # 0 = only when stopping early
    resume: bool = False
    stop_at: int | None = None  # stop (and save) after this step, to split a run into sessions
    time_limit: float | None = None  # seconds; stop (and save) once a step ends past it
    # seconds; the run ends once a step ends past it as if its steps were done (checkpoint
    # written, summary `truncated`): a bound for a machine lent by the minute
    max_seconds: float | None = None
    keep_state: bool = False  # keep the state file after the run completes
    progress: bool = True

    def __post_init__(self) -> None:
        positive = ("steps", "batch_size", "seq_len", "eval_batches")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "save_every", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        # inf or nan would train NaN weights and still report success
        floats = ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip")
        for name in (*floats, "time_limit", "max_seconds"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not -(2**63) <= self.seed < 2**64:  # (torch's range: past it, an unnamed overflow)
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.stop_at is not None and self.stop_at < 1:
            raise ValueError(f"stop_at must be >= 1, got {self.stop_at}")
        for name in ("time_limit", "max_seconds"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")

    def trajectory(self) -> dict:
        """The options that decide the weights; a resumed run must repeat them exactly."""
        keys = ("steps", "batch_size", "seq_len", "lr", "min_lr_ratio", "warmup_steps")
        keys += ("weight_decay", "beta1", "beta2", "grad_clip", "seed")
        return {k: getattr(self, k) for k in keys}


def lr_factor(step: int, opts: TrainOptions) -> float:
    """Multiplier of `lr` for optimizer step `step` (0-based): linear warmup to 1, then a cosine
    down to `min_lr_ratio` at the last step."""
    if step < opts.warmup_steps:
        return (step + 1) / opts.warmup_steps
    span = max(opts.steps - opts.warmup_steps, 1)
    progress = min((step - opts.warmup_steps) / span, 1.0)
    return opts.min_lr_ratio + (1 - opts.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def autocast(device: torch.device):
    """bf16 autocast on CUDA (float32 master weights stay untouched); nothing on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _optimizer(module: nn.Module, opts: TrainOptions, device: torch.device):
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": opts.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        groups, lr=opts.lr, betas=(opts.beta1, opts.beta2), fused=device.type == "cuda"
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, opts))
    return params, optimizer, scheduler


# Past this projected wall time, a run without --max-seconds is warned about.
LONG_RUN_SECONDS = 3600.0


def _warn_if_long(stage: str, opts: TrainOptions, done: int, start: float, device) -> None:
    """After the first steps, project the run's wall time at the measured pace, and say so
    when it means hours (the defaults are sized for a GPU, not a laptop's CPU)."""
    pace = (time.perf_counter() - start) / done
    projected = pace * (opts.steps - done)
    if projected > LONG_RUN_SECONDS and opts.max_seconds is None:
        _log(
            f"{stage}: at {1 / pace:.2f} steps/s on {device}, the remaining {opts.steps - done} "
            f"steps take about {projected / 3600:.1f} h; pass --max-seconds or fewer --steps "
            "(a GPU is far faster)"
        )


def _log(message: str) -> None:
    # stderr, through tqdm so a live bar is redrawn below the line; stdout stays for results.
    tqdm.write(message, file=sys.stderr)


@torch.no_grad()
def evaluate(
    module: nn.Module, loss_fn: LossFn, batches: list[torch.Tensor], device: torch.device
) -> dict[str, float]:
    """Loss and metrics averaged over the held-out batches (weighted by batch size)."""
    was_training = module.training
    module.eval()
    totals: dict[str, float] = {}
    rows = 0
    for batch in batches:
        with autocast(device):
            loss, metrics = loss_fn(batch.to(device))
        for name, value in {"loss": loss, **metrics}.items():
            totals[name] = totals.get(name, 0.0) + float(value) * batch.shape[0]
        rows += batch.shape[0]
    module.train(was_training)
    return {name: round(total / rows, 6) for name, total in totals.items()}


def run_training(
    module: nn.Module,
    loss_fn: LossFn,
    data: TokenData,
    opts: TrainOptions,
    out_dir: str | Path,
    state_name: str,
    fingerprint: dict,
    stage: str,
    on_complete: Callable[[], None] | None = None,
) -> dict:
    """Train `module`'s parameters that require grad; returns the loop's facts (steps, tokens,
    losses, held-out evaluations, wall time, whether the run completed). `fingerprint` (model
    shape, corpus, ...) joins the options' trajectory in the state file, and a resumed run whose
    values differ is refused, naming them. `on_complete` (writing the stage's checkpoint) runs
    after the last step and before the state file is removed, so a crash in it loses nothing."""
    if data.window != opts.seq_len + 1:
        raise ValueError(f"data windows are {data.window} tokens, expected seq_len + 1")
    device = resolve_device(opts.device)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(opts.seed)
    module.to(device).train()
    params, optimizer, scheduler = _optimizer(module, opts, device)
    # A CPU generator draws the window starts: one seed, the same windows on every device.
    gen = torch.Generator().manual_seed(opts.seed)
    # Through JSON, so tuples and lists compare equal after a save/load round trip.
    identity = json.loads(
        json.dumps({"version": STATE_VERSION, **opts.trajectory(), **fingerprint})
    )
    step, tokens, wall, history, evals = 0, 0, 0.0, [], []
    state_path = out_dir / state_name
    if state_path.is_file():
        if not opts.resume:
            raise ValueError(
                f"{state_path} holds an earlier run's state; pass --resume to continue it, or "
                "remove it to start over"
            )
        state = load_state(state_path)
        saved = state["identity"]
        if isinstance(saved.get("corpus"), dict) and "files" not in saved["corpus"]:
            # a state saved before the corpus identity had the files' digest: its options
            # alone are what it can be checked against
            identity = {**identity, "corpus": {**identity["corpus"]}}
            identity["corpus"].pop("files", None)
        if "target_weights_sha256" not in saved and "target_weights_sha256" in identity:
            # a DFlash state saved before its target's digest was recorded: not checked
            _log(f"{state_path}: saved before the target's weights were fingerprinted")
            identity = {k: v for k, v in identity.items() if k != "target_weights_sha256"}
        differ = sorted(
            k for k in identity.keys() | saved.keys() if identity.get(k) != saved.get(k)
        )
        if differ:
            detail = ", ".join(
                f"{k}: saved {state['identity'].get(k)!r}, now {identity.get(k)!r}" for k in differ
            )
            raise ValueError(f"{state_path}: cannot resume with different settings ({detail})")
        try:
            module.load_state_dict(state["module"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            gen.set_state(state["generator"])
            step, tokens, wall = state["step"], state["tokens"], state["wall_time"]
            history, evals = state["history"], state["evals"]
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise unreadable(state_path, e) from None
        _log(f"{stage}: resuming from step {step} of {opts.steps} ({state_path})")
    elif opts.resume:
        refuse_finished_resume(out_dir, state_name, stage)
        # a run killed before its first save: a script that always passes --resume restarts
        _log(f"{stage}: no {state_name} in {out_dir}; starting at step 0")

    def check_weights() -> None:
        # weights an update made non-finite with no loss saying so yet (the last step's)
        if any(not bool(torch.isfinite(p).all()) for p in params):
            diverged(float("nan"))

    def save() -> None:
        flush()
        check_weights()
        save_state(
            state_path,
            {
                "identity": identity,
                "module": module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "generator": gen.get_state(),
                "step": step,
                "tokens": tokens,
                "wall_time": wall + time.perf_counter() - session_start,
                "history": history,
                "evals": evals,
            },
        )

    def run_eval() -> None:
        if heldout:
            result = evaluate(module, loss_fn, heldout, device)
            diverged(None if math.isfinite(result["loss"]) else result["loss"])
            evals.append({"step": step, **result})
            shown = " ".join(f"{k} {v:.4f}" for k, v in result.items())
            _log(f"{stage} step {step}: held-out {shown}")

    heldout = data.heldout_batches(opts.batch_size, opts.eval_batches)
    data = data.to(device)
    step_fn = torch.compile(loss_fn) if opts.compile else loss_fn
    session_start = time.perf_counter()
    session_tokens = 0
    pending: list[torch.Tensor] = []  # losses not yet copied to the host

    def flush() -> None:
        # One device sync per LOG_EVERY steps instead of one per step.
        if pending:
            losses = torch.stack(pending).tolist()
            pending.clear()
            diverged(next((v for v in losses if not math.isfinite(v)), None))
            history.extend(losses)
            elapsed = time.perf_counter() - session_start
            bar.set_postfix(loss=f"{history[-1]:.4f}", tok_s=f"{session_tokens / elapsed:.0f}")

    def diverged(loss: float | None) -> None:
        # NaN weights trained on, saved and reported as a completed run (review)
        if loss is not None:
            raise ValueError(
                f"{stage}: training diverged (loss {loss} by step {step}); nothing more is "
                f"written: try a lower lr than {opts.lr:g}"
            )

    bar = tqdm(
        total=opts.steps, initial=step, desc=stage, disable=not opts.progress, dynamic_ncols=True
    )
    stopped_early = truncated = False
    first_step = step
    while step < opts.steps:
        batch = data.sample(opts.batch_size, gen)
        with autocast(device):
            loss, _ = step_fn(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if opts.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, opts.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        tokens += opts.batch_size * opts.seq_len
        session_tokens += opts.batch_size * opts.seq_len
        pending.append(loss.detach())
        bar.update(1)
        if step % LOG_EVERY == 0:
            flush()
            if step - first_step == LOG_EVERY:
                _warn_if_long(stage, opts, step - first_step, session_start, device)
        if opts.eval_every and step % opts.eval_every == 0 and step < opts.steps:
            run_eval()
        out_of_time = (
            opts.time_limit is not None and time.perf_counter() - session_start >= opts.time_limit
        )
        if step < opts.steps and ((opts.stop_at and step >= opts.stop_at) or out_of_time):
            stopped_early = True
            break
        over_budget = (
            opts.max_seconds is not None and time.perf_counter() - session_start >= opts.max_seconds
        )
        if step < opts.steps and over_budget:
            truncated = True
            _log(f"{stage}: max_seconds reached at step {step} of {opts.steps}; finishing")
            break
        if opts.save_every and step % opts.save_every == 0 and step < opts.steps:
            save()
    flush()
    bar.close()
    completed = not stopped_early
    check_weights()
    if completed:
        if not evals or evals[-1]["step"] != step:
            run_eval()
        if opts.keep_state:
            save()
        if on_complete is not None:
            on_complete()
        if not opts.keep_state:
            state_path.unlink(missing_ok=True)
    else:
        save()
        _log(f"{stage}: stopped at step {step} of {opts.steps}; state saved to {state_path}")
    last = history[-FINAL_LOSS_STEPS:]
    return {
        "completed": completed,
        "truncated": truncated,
        "steps": step,
        "tokens_seen": tokens,
        "initial_train_loss": round(history[0], 6) if history else None,
        "final_train_loss": round(sum(last) / len(last), 6) if last else None,
        "heldout": evals[-1] if evals else None,
        "heldout_history": evals,
        "wall_time_s": round(wall + time.perf_counter() - session_start, 3),
        "device": str(device),
        "options": dataclasses.asdict(opts),
    }
