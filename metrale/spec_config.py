"""Speculative decoding's configuration (`EngineConfig.spec`): which drafter, how deep, how
D-Cut plans the depths. Validated here, once, with a ValueError that names the bad field."""

from __future__ import annotations

import math
from dataclasses import dataclass

SPEC_METHODS = ("ngram", "mtp", "dflash")
# K when none is given (DFlash: its block's B - 1, `speculative.setup.resolve_num_drafts`)
DEFAULT_NUM_DRAFTS = 4


def require_bools(obj, names: tuple[str, ...], prefix: str = "") -> None:
    """A flag must be a real bool: `"no"` or `0.5` are truthy, so they would silently switch a
    feature on."""
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, bool):
            raise ValueError(f"{prefix}{name} must be True or False, got {value!r}")


def is_real(value) -> bool:
    """A finite int or float that is not a bool (None, strings, inf and nan are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding for an engine: which drafter, how deep, how depths are planned.

    `method=None` turns speculation off. `num_drafts` (K) is the deepest a sequence is verified;
    each request may lower it or opt out (`SamplingParams.num_drafts` / `.speculative`). None:
    the drafter's own default, `DEFAULT_NUM_DRAFTS`, or for DFlash its block's B - 1 (as SGLang
    reads it from the drafter's config; the engine resolves it: `setup.resolve_num_drafts`). With
    `dcut`, the D-Cut planner picks each sequence's depth per step (0..K) from its observed
    acceptance and the verify cost; above `dcut_width_cap` sequences every depth is equal. The
    depths are planned before anything is drafted: only sequences given a depth are drafted
    (and a few others every `dcut_probe_every` steps, to re-measure their acceptance); a plan
    stands for `dcut_replan_every` steps while no sequence joins the running ones.
    """

    method: str | None = None
    num_drafts: int | None = None
    # a drafter checkpoint of its own (DFlash); None: `<target dir>/dflash`
    model: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    ngram_window: int = 4096  # tokens searched back from the end: bounds the host-side lookup
    dcut: bool = True
    dcut_width_cap: int = 32
    dcut_prior: float = 0.6  # acceptance assumed for a position never observed
    # Every this many steps a few sequences (in turn) that D-Cut would leave at depth 0 draft
    # anyway, so acceptance estimates can recover; on other steps they are not drafted at all.
    # While no plan drafts, the interval doubles after each probe, to 4x this
    # (`speculative/probes.py`).
    dcut_probe_every: int = 8
    # A plan is kept for up to this many steps while no sequence joins the running ones (the
    # estimates move slowly, and planning costs ~0.2 ms of host time per step at batch 8);
    # 1 plans every step.
    dcut_replan_every: int = 4
    # sequences the MTP drafter drafts for per step (None: all); 1 = single-sequence mode, where
    # the METRALE_MTP_CATCHUP / _REFEED_* knobs apply
    mtp_max_seqs: int | None = None
    # Judge greedy drafts on the raw argmax (no penalties, bias or bans). Faster, and lossless
    # only for requests without them: off unless asked for.
    verify_raw_argmax: bool = False

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPEC_METHODS:
            raise ValueError(
                f"spec.method must be one of {SPEC_METHODS} or None, got {self.method!r}"
            )
        # only DFlash loads a drafter checkpoint of its own; a model given to another drafter
        # would be ignored, so the run would not be the one asked for (vLLM refuses it too)
        if self.model is not None and self.method != "dflash":
            raise ValueError(
                f"spec.model: the {self.method!r} drafter takes no checkpoint of its own, "
                f"got {self.model!r}"
            )
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"spec.model must be a path string, got {self.model!r}")
        require_bools(self, ("dcut", "verify_raw_argmax"), prefix="spec.")
        if self.num_drafts is None and self.method != "dflash":
            object.__setattr__(self, "num_drafts", DEFAULT_NUM_DRAFTS)
        for name, lo in (
            ("num_drafts", 1),
            ("ngram_min", 1),
            ("ngram_window", 1),
            ("dcut_width_cap", 1),
            ("dcut_probe_every", 1),
            ("dcut_replan_every", 1),
        ):
            value = getattr(self, name)
            if name == "num_drafts" and value is None:  # DFlash's: its block's, resolved later
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"spec.{name} must be an integer >= {lo}, got {value!r}")
        if not isinstance(self.ngram_max, int) or self.ngram_max < self.ngram_min:
            raise ValueError(
                f"spec.ngram_max must be an integer >= ngram_min={self.ngram_min}, "
                f"got {self.ngram_max!r}"
            )
        if self.mtp_max_seqs is not None and (
            not isinstance(self.mtp_max_seqs, int) or self.mtp_max_seqs < 1
        ):
            raise ValueError(
                f"spec.mtp_max_seqs must be an integer >= 1, got {self.mtp_max_seqs!r}"
            )
        if not is_real(self.dcut_prior) or not 0.0 <= self.dcut_prior <= 1.0:
            raise ValueError(f"spec.dcut_prior must be in [0, 1], got {self.dcut_prior!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None
