"""Where an engine's steps make the host wait for the device: every synchronizing CUDA call of one
generation (`torch.cuda.set_sync_debug_mode("warn")`: a blocking copy, `.item()`, `.tolist()`, a
stream or event synchronize), counted by the place in metrale that made it.

Waits on a CUDA event (`torch.cuda.Event.synchronize`: how the engine reads a copy queued behind
a step, `device_tokens.HostCopy`) are counted the same way, apart (`waits`), and marked as blocked
when the event had not happened yet: a wait on a finished copy costs nothing.

Each is also marked by whether it ran inside a step's overlap window
(`ModelRunner.while_forward_runs`: the host work meant to run while that step's forward does: the
held step's commit, the text, D-Cut's next choice). A sync there waits for the forward, and the
rest of the window then runs with the device idle: a cost the simulated device
(`benchmarks/simulated_device.py`) cannot show, since its forwards are not on a stream. By design
a plain step launched ahead makes none on its critical path and a verify step one, its verdicts.

    python -m metrale.bench.profile_e2e --shape qwen3-8b --batch 64 --forced --dcut --syncs
"""

from __future__ import annotations

import collections
import functools
import os
import time
import traceback
import warnings
from pathlib import Path

import torch

# The text of PyTorch's warning for a synchronizing call under the "warn" debug mode.
SYNC_WARNING = "called a synchronizing CUDA operation"
PACKAGE = str(Path(__file__).resolve().parents[1])  # the metrale package's folder
HERE = str(Path(__file__).resolve())  # (the audit's own wrappers name no site)
SITE_FRAMES = 3  # metrale frames named per site, innermost first


@functools.cache
def _own_path(filename: str) -> str | None:
    """`filename` relative to the metrale package, or None outside it (and for this module)."""
    path = os.path.realpath(filename)
    if path == HERE or not path.startswith(PACKAGE + os.sep):
        return None
    return Path(path).relative_to(PACKAGE).as_posix()


def _site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost `SITE_FRAMES` frames of metrale's own code in `stack` (outermost first),
    innermost first: where the sync was made and what called it."""
    own = [(path, f) for f in stack if (path := _own_path(f.filename)) is not None]
    if not own:
        return "(outside metrale)"
    return " < ".join(f"{path}:{f.lineno} {f.name}" for path, f in reversed(own[-SITE_FRAMES:]))


class SyncAudit:
    """`with SyncAudit(llm) as audit:` counts the synchronizing calls made in the block by site
    (`sites`), those inside an overlap window apart (`in_window`), and the engine's steps
    (`steps`). On a machine without CUDA nothing turns the debug mode on; the counting still
    works for warnings raised in the block (the tests raise them)."""

    def __init__(self, llm) -> None:
        self.engine = llm.engine
        self.sites: collections.Counter[str] = collections.Counter()
        self.in_window: collections.Counter[str] = collections.Counter()
        # event waits by site: (calls, of which blocked, of which inside a window)
        self.waits: collections.Counter[str] = collections.Counter()
        self.blocked: collections.Counter[str] = collections.Counter()
        self.waits_in_window: collections.Counter[str] = collections.Counter()
        self.waited: collections.Counter[str] = collections.Counter()  # seconds blocked
        self.steps = 0
        self._window_depth = 0

    def _overlap(self, original):
        def overlap() -> None:
            self._window_depth += 1
            try:
                original()
            finally:
                self._window_depth -= 1

        return overlap

    def _step(self, original):
        def step(*args, **kwargs):
            self.steps += 1
            return original(*args, **kwargs)

        return step

    def _event_wait(self, original):
        audit = self

        def synchronize(event) -> None:
            # (asked first: the stack walk below takes host time the device may finish in)
            done = event.query()
            start = time.perf_counter()
            original(event)
            waited = time.perf_counter() - start
            site = _site(traceback.extract_stack()[:-1])
            audit.waits[site] += 1
            if audit._window_depth:
                audit.waits_in_window[site] += 1
            if not done:
                audit.blocked[site] += 1
                audit.waited[site] += waited

        return synchronize

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_WARNING not in str(message):
            self._shown(message, category, filename, lineno, file, line)
            return
        site = _site(traceback.extract_stack()[:-1])
        self.sites[site] += 1
        if self._window_depth:
            self.in_window[site] += 1

    def __enter__(self) -> SyncAudit:
        runner = self.engine.runner
        self._patched = [(runner, "_overlap"), (self.engine, "step")]
        self._saved = [(obj, name, obj.__dict__.get(name)) for obj, name in self._patched]
        runner._overlap = self._overlap(runner._overlap)
        self.engine.step = self._step(self.engine.step)
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        self._shown, warnings.showwarning = warnings.showwarning, self._show
        self._cuda = torch.cuda.is_available()
        self._event_sync = torch.cuda.Event.synchronize
        torch.cuda.Event.synchronize = self._event_wait(self._event_sync)
        if self._cuda:
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self._cuda:
            torch.cuda.set_sync_debug_mode(self._mode)
        torch.cuda.Event.synchronize = self._event_sync
        warnings.showwarning = self._shown
        self._warnings.__exit__(*exc)
        for obj, name, old in self._saved:
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)

    def report(self, top: int = 20) -> str:
        total, windowed = sum(self.sites.values()), sum(self.in_window.values())
        steps = max(self.steps, 1)
        lines = [
            f"{total} syncs over {self.steps} steps ({total / steps:.2f} a step), "
            f"{windowed} inside an overlap window ({windowed / steps:.2f} a step)",
            f"{'syncs':>6s} {'window':>6s}  site (innermost first)",
        ]
        for site, count in self.sites.most_common(top):
            lines.append(f"{count:6d} {self.in_window.get(site, 0):6d}  {site}")
        waits, blocked = sum(self.waits.values()), sum(self.blocked.values())
        lines += [
            f"{waits} event waits ({waits / steps:.2f} a step), {blocked} blocked "
            f"({blocked / steps:.2f} a step), {sum(self.waits_in_window.values())} inside a window",
            f"{'waits':>6s} {'block':>6s} {'ms':>8s} {'window':>6s}  site (innermost first)",
        ]
        for site, count in self.waits.most_common(top):
            lines.append(
                f"{count:6d} {self.blocked.get(site, 0):6d} {self.waited.get(site, 0) * 1e3:8.2f} "
                f"{self.waits_in_window.get(site, 0):6d}  {site}"
            )
        return "\n".join(lines)
