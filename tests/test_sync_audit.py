"""`python -m metrale.bench.profile_e2e --syncs` (`bench/sync_audit.py`): every synchronizing
call is counted at the place in metrale that made it, those made inside a step's overlap window
apart; other warnings still reach their handler, and the engine comes back as it was. On CPU no
call synchronizes, so the tests raise PyTorch's warning where a sync would be."""

from __future__ import annotations

import warnings

import pytest
import torch

import metrale.engine.step_metadata as step_metadata
from metrale import LLM, SamplingParams
from metrale.bench.sync_audit import SYNC_WARNING, SyncAudit


def _sync() -> None:
    warnings.warn(f"{SYNC_WARNING} (test)", UserWarning, stacklevel=2)


class _Runner:
    def _overlap(self) -> None:
        _sync()


class _Engine:
    def __init__(self) -> None:
        self.runner = _Runner()

    def step(self) -> None:
        _sync()
        self.runner._overlap()
        _sync()


class _LLM:
    def __init__(self) -> None:
        self.engine = _Engine()


def test_counts_steps_and_the_window_and_restores_what_it_wrapped():
    llm = _LLM()
    with SyncAudit(llm) as audit:
        llm.engine.step()
        llm.engine.step()
        with pytest.warns(DeprecationWarning):  # not a sync: its handler still sees it
            warnings.warn("something else", DeprecationWarning, stacklevel=1)
    assert audit.steps == 2
    assert sum(audit.sites.values()) == 6
    assert sum(audit.in_window.values()) == 2
    assert audit.sites == {"(outside metrale)": 6}
    assert "step" not in llm.engine.__dict__ and "_overlap" not in llm.engine.runner.__dict__
    assert "6 syncs over 2 steps (3.00 a step), 2 inside an overlap window" in audit.report()


@pytest.fixture(scope="module")
def shipped_ngram():
    return LLM(device="cpu", spec={"method": "ngram", "num_drafts": 3}, max_num_seqs=4)


def test_names_the_engine_frame_that_synced_and_keeps_the_tokens(shipped_ngram, monkeypatch):
    llm = shipped_ngram
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["def fibonacci(n):", "for i in range(10):"]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    packed = step_metadata.to_device_packed

    def syncing(*args, **kwargs):  # as a blocking copy of a step's metadata would
        _sync()
        return packed(*args, **kwargs)

    monkeypatch.setattr(step_metadata, "to_device_packed", syncing)
    with SyncAudit(llm) as audit:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert audit.steps > 0
    (site,) = audit.sites
    assert site.startswith("engine/step_metadata.py:") and " pack_spans < " in site
    assert audit.sites[site] >= audit.steps - 1  # (every step packs its rows; prefill too)
    assert not audit.in_window  # (packing is on the critical path, never in the window)


class _Event:
    def __init__(self, done: bool) -> None:
        self.done, self.waited = done, 0

    def query(self) -> bool:
        return self.done


def test_counts_event_waits_and_which_blocked(monkeypatch):
    def synchronize(event) -> None:  # (the real one needs CUDA)
        event.waited += 1

    monkeypatch.setattr(torch.cuda.Event, "synchronize", synchronize)
    llm = _LLM()
    done, pending = _Event(True), _Event(False)
    llm.engine.runner._overlap = lambda: torch.cuda.Event.synchronize(pending)
    with SyncAudit(llm) as audit:
        torch.cuda.Event.synchronize(done)
        torch.cuda.Event.synchronize(pending)
        llm.engine.runner._overlap()
    assert (done.waited, pending.waited) == (1, 2)  # every wait still waits
    assert audit.waits == {"(outside metrale)": 3}
    assert audit.blocked == {"(outside metrale)": 2}
    assert audit.waits_in_window == {"(outside metrale)": 1}
    assert torch.cuda.Event.synchronize is synchronize
    assert "3 event waits (3.00 a step), 2 blocked (2.00 a step), 1 inside" in audit.report()


def test_profile_e2e_syncs_runs_both_generations(monkeypatch, capsys):
    """`profile_e2e --syncs` wires the audit around the plain and the speculative generation
    (on CPU nothing synchronizes: every count is zero)."""
    from metrale.bench import profile_e2e

    argv = ["profile_e2e", "--shape", "tiny", "--batch", "2", "--max-tokens", "6", "--syncs"]
    monkeypatch.setattr("sys.argv", argv)
    monkeypatch.setattr(profile_e2e, "profiled", profile_e2e.profiled)  # (main rebinds it)
    profile_e2e.main()
    out = capsys.readouterr().out
    assert "== plain: 0 syncs over" in out and "== spec: 0 syncs over" in out
    assert "0 event waits" in out
