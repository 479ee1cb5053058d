"""A training run's state file, and the checks around it: written atomically (`save_state`),
read back with a ValueError naming a file that is not one (`load_state`), and a `--resume` of a
run that completed refused (`refuse_finished_resume`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def summary_stage(path: Path) -> str | None:
    """The stage a summary file says completed, if it is one."""
    try:
        return json.loads(path.read_text()).get("stage")
    except (OSError, ValueError, AttributeError):
        return None


def save_state(path: Path, state: dict) -> None:
    # Write, then rename: a run killed mid-save leaves the previous state intact.
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def unreadable(path: Path, e: BaseException) -> ValueError:
    return ValueError(f"state file {path} is unreadable ({e!r}); remove it to start over")


def load_state(path: Path) -> dict:
    """The saved state, or a ValueError naming the file: a truncated or foreign file makes
    torch.load raise any of RuntimeError, EOFError, UnpicklingError, BadZipFile ..."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load has no single error type
        raise unreadable(path, e) from None
    if not isinstance(state, dict) or not isinstance(state.get("identity"), dict):
        raise unreadable(path, TypeError("not a metrale training state"))
    return state


def refuse_finished_resume(out_dir: Path, state_name: str, stage: str) -> None:
    """`--resume` where the stage's run completed (its summary, no state left): nothing to
    continue. (Started over, it overwrote the finished run's checkpoint: found in review; a
    stage that writes into `out_dir` before training checks this first.)"""
    out_dir = Path(out_dir)
    summary = out_dir / state_name.replace("_state.pt", "_summary.json")
    if not (out_dir / state_name).is_file() and summary_stage(summary) == stage:
        raise ValueError(
            f"resume: the {stage} run in {out_dir} completed ({summary.name}); nothing to "
            "continue: drop --resume to train again"
        )
