"""The one place where metrale reads its `METRALE_*` environment variables.

Everything else asks `knobs()` for a typed, frozen `Knobs`. Keeping the reads here means a value is
parsed once, a bad value fails with an error that names the variable (or, for the speculative
knobs, falls back exactly as the reference system does), and the start-up log can show every
resolved setting with `knobs().describe()`.

`knobs()` is cached for the life of the process, which is what makes every knob "read once per
process"; tests that change the environment call `knobs.cache_clear()` afterwards.

Besides the knobs themselves this module holds the few switches derived from a knob and an engine
setting (the MTP catch-up and re-feed are off when the drafter serves several sequences at once),
and `hidden_fingerprint`, the debug hash that `METRALE_MTP_REFEED_DEBUG` logs.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

_PREFIX = "METRALE_"

# The speculative knobs parse integers as the reference system does: ASCII digits with at most one
# sign (`+` only for unsigned), no spaces or underscores, and a value outside the 64-bit range is
# unparseable (so it falls back to the default instead of saturating).
_UNSIGNED = re.compile(r"\+?[0-9]+")
_SIGNED = re.compile(r"[+-]?[0-9]+")
_USIZE_MAX = 2**64 - 1
_ISIZE_MIN, _ISIZE_MAX = -(2**63), 2**63 - 1

SHADOW_TOPK_MAX = 8
REFEED_SHIFT_LIMIT = 4


def _parse_path(value: str) -> Path:
    # Made absolute at read time so a later chdir cannot move the cache under our feet.
    return Path(value).expanduser().absolute()


def _default_home() -> Path:
    return _parse_path("~/.cache/metrale")


def _usize(raw: str) -> int | None:
    if _UNSIGNED.fullmatch(raw) is None:
        return None
    value = int(raw)
    return value if value <= _USIZE_MAX else None


def _isize(raw: str) -> int | None:
    if _SIGNED.fullmatch(raw) is None:
        return None
    value = int(raw)
    return value if _ISIZE_MIN <= value <= _ISIZE_MAX else None


def _parse_shadow_topk(raw: str) -> int:
    return min(_usize(raw) or 0, SHADOW_TOPK_MAX)


def _parse_refeed_shift(raw: str) -> int:
    return max(-REFEED_SHIFT_LIMIT, min(REFEED_SHIFT_LIMIT, _isize(raw) or 0))


def _is_one(raw: str) -> bool:
    return raw == "1"


def _present(_raw: str) -> bool:
    return True


def _knob(
    env: str,
    parse: Callable[[str], Any],
    default: Callable[[], Any],
    doc: str,
    *,
    empty_is_unset: bool = True,
) -> Any:
    """A dataclass field bound to one environment variable.

    `empty_is_unset=False` is for presence-only flags, where `VAR=` counts as set.
    """
    metadata = {"env": env, "parse": parse, "doc": doc, "empty_is_unset": empty_is_unset}
    return field(default_factory=default, metadata=metadata)


@dataclass(frozen=True)
class Knobs:
    """Resolved values of every `METRALE_*` environment variable.

    Adding a knob is one `_knob(...)` field: its variable name, a parser from the raw string (which
    raises ValueError on bad input, unless the knob's rule is to fall back), a default factory and
    a one-line description. Fields keep the variable's polarity (`no_*` for `METRALE_NO_*`) so
    that `describe()` prints what was set; the positive reading is a property.
    """

    home: Path = _knob(
        "METRALE_HOME",
        _parse_path,
        _default_home,
        "where generated artefacts (such as the default model) live",
    )
    mtp_shadow_topk: int = _knob(
        "METRALE_MTP_SHADOW_TOPK",
        _parse_shadow_topk,
        int,
        "log the drafter's top-k per draft position and the verify's targets; 0 is off, at most 8",
    )
    mtp_accept_debug: bool = _knob(
        "METRALE_MTP_ACCEPT_DEBUG",
        _present,
        bool,
        "MTP acceptance logs (per batch width, verify-graph outcomes, drafter coverage)",
        empty_is_unset=False,
    )
    mtp_catchup: bool = _knob(
        "METRALE_MTP_CATCHUP",
        _is_one,
        bool,
        "=1: feed the MTP drafter the target hiddens it missed; see mtp_catchup_enabled()",
    )
    mtp_refeed_accepted: bool = _knob(
        "METRALE_MTP_REFEED_ACCEPTED",
        _is_one,
        bool,
        "=1: ring the target's hiddens of accepted rows for the catch-up feed; see "
        "mtp_refeed_accepted_enabled()",
    )
    mtp_refeed_shift: int = _knob(
        "METRALE_MTP_REFEED_SHIFT",
        _parse_refeed_shift,
        int,
        "offset added to every re-fed ring label, clamped to [-4, 4]; tests the label mapping",
    )
    mtp_refeed_debug: bool = _knob(
        "METRALE_MTP_REFEED_DEBUG",
        _is_one,
        bool,
        "=1: log hidden_fingerprint() of each hidden written to or fed from the catch-up ring",
    )
    no_mtp_ep_propose: bool = _knob(
        "METRALE_NO_MTP_EP_PROPOSE",
        _is_one,
        bool,
        "=1: the reference system's MTP drafter then ran on rank 0 alone; metrale's always does "
        "(a whole-vocabulary copy there, no collective a draft step), so this changes nothing",
    )
    no_dcut_host_cost: bool = _knob(
        "METRALE_NO_DCUT_HOST_COST",
        _is_one,
        bool,
        "=1: D-Cut prices verify rows only, not the drafter's measured host work (A/B runs)",
    )
    no_held_verify: bool = _knob(
        "METRALE_NO_HELD_VERIFY",
        _is_one,
        bool,
        "=1: commit each verify step before the next step is launched, not while its forward "
        "runs (A/B runs; `engine/held_verify.py`)",
    )
    no_deferred_text: bool = _knob(
        "METRALE_NO_DEFERRED_TEXT",
        _is_one,
        bool,
        "=1: detokenize every sequence inside its step, not while the next forward runs (A/B)",
    )
    canonical_key_min_width: int | None = _knob(
        "METRALE_CANONICAL_KEY_MIN_WIDTH",
        _usize,
        lambda: None,
        "batch width from which verify batches get the canonical depth assignment (0: always); "
        "unset or unparseable: spec.verify_key.CANONICAL_KEY_MIN_WIDTH",
    )
    no_canonical_verify_key: bool = _knob(
        "METRALE_NO_CANONICAL_VERIFY_KEY",
        _present,
        bool,
        "present with any value: never use the canonical verify depth assignment",
        empty_is_unset=False,
    )
    no_fused_kernels: bool = _knob(
        "METRALE_NO_FUSED_KERNELS",
        _is_one,
        bool,
        "=1: run RMSNorm, QK-norm + rotary and SwiGLU as plain torch ops on CUDA too (A/B runs)",
    )
    no_pdl: bool = _knob(
        "METRALE_NO_PDL",
        _is_one,
        bool,
        "=1: launch the decode step's Triton kernels without programmatic dependent launch "
        "(A/B runs; `kernels/pdl.py`)",
    )
    no_gemv: bool = _knob(
        "METRALE_NO_GEMV",
        _is_one,
        bool,
        "=1: run projections of up to 8 rows as cuBLAS GEMMs, not the PDL GEMV and tensor-core "
        "kernels (A/B runs; `kernels/gemv.py`; METRALE_NO_FUSED_KERNELS leaves them on)",
    )
    no_mtp_chain_graphs: bool = _knob(
        "METRALE_NO_MTP_CHAIN_GRAPHS",
        _is_one,
        bool,
        "=1: run the MTP drafter's chained steps eagerly on CUDA too (A/B runs)",
    )
    no_dflash_graphs: bool = _knob(
        "METRALE_NO_DFLASH_GRAPHS",
        _is_one,
        bool,
        "=1: run the DFlash drafter's forward eagerly on CUDA too (A/B runs)",
    )
    dflash_ahead: bool = _knob(
        "METRALE_DFLASH_AHEAD",
        _is_one,
        bool,
        "=1: DFlash drafts ahead, right after each verify program (off: slower on the H200 so far)",
    )
    no_ngram_ahead: bool = _knob(
        "METRALE_NO_NGRAM_AHEAD",
        _is_one,
        bool,
        "=1: the n-gram drafter drafts in `propose` only, not right after each verify program",
    )
    no_gdn_triton: bool = _knob(
        "METRALE_NO_GDN_TRITON",
        _is_one,
        bool,
        "=1: run the hybrid target's recurrent delta rule as torch ops on CUDA too (A/B runs)",
    )
    force_fused_kernels: bool = _knob(
        "METRALE_FORCE_FUSED_KERNELS",
        _is_one,
        bool,
        "=1 with TRITON_INTERPRET=1: run the hybrid target's Triton paths (MoE routing and grouped "
        "experts, GDN kernels) on CPU tensors too, under the interpreter (tests)",
    )
    # `METRALE_*` names that no knob reads: almost always a typo worth a line in the log.
    unrecognised: tuple[str, ...] = field(default=(), compare=False)

    @property
    def mtp_ep_propose_enabled(self) -> bool:
        """The reference system's switch for its MTP drafter on every rank (`EP_CMD_MTP_PROPOSE`),
        parsed as it parses it. metrale's MTP drafter runs on rank 0 alone whatever it says
        (`distributed/shard.py`: `WholeVocab`), so nothing reads it to decide."""
        return not self.no_mtp_ep_propose

    @property
    def canonical_verify_key_enabled(self) -> bool:
        return not self.no_canonical_verify_key

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Knobs:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        known = set()
        for f in _knob_fields():
            name = f.metadata["env"]
            known.add(name)
            raw = env.get(name)
            # An empty value counts as unset, as with most Unix tools (`METRALE_HOME= cmd`), except
            # for presence-only flags, where the reference system treats `VAR=` as set.
            if raw is None or (raw == "" and f.metadata["empty_is_unset"]):
                continue
            try:
                values[f.name] = f.metadata["parse"](raw)
            except ValueError as e:
                raise ValueError(f"environment variable {name}={raw!r}: {e}") from None
        unrecognised = tuple(sorted(k for k in env if k.startswith(_PREFIX) and k not in known))
        return cls(**values, unrecognised=unrecognised)

    def describe(self) -> str:
        """One line listing every knob's resolved value, for the start-up log."""
        parts = [f"{f.metadata['env']}={getattr(self, f.name)}" for f in _knob_fields()]
        line = "knobs: " + ", ".join(parts)
        if self.unrecognised:
            line += f" (unrecognised, ignored: {', '.join(self.unrecognised)})"
        return line


def _knob_fields() -> list[Any]:
    return [f for f in fields(Knobs) if "env" in f.metadata]


@functools.cache
def knobs() -> Knobs:
    """The process-wide knobs, read from `os.environ` on first use."""
    return Knobs.from_env()


# --- switches that combine a knob with the engine configuration --------------------------------


def mtp_multi_seq_mode(mtp_max_seqs: int) -> bool:
    """Whether the MTP drafter drafts for more than one sequence per dispatch.

    `mtp_max_seqs` comes from the engine config. The catch-up ring and the re-feed labels hold one
    sequence's data each, so both are off in this mode.
    """
    return mtp_max_seqs > 1


def mtp_catchup_enabled(mtp_max_seqs: int, k: Knobs | None = None) -> bool:
    """`METRALE_MTP_CATCHUP=1` and the drafter serves one sequence at a time."""
    k = knobs() if k is None else k
    return k.mtp_catchup and not mtp_multi_seq_mode(mtp_max_seqs)


def mtp_refeed_accepted_enabled(mtp_max_seqs: int, k: Knobs | None = None) -> bool:
    """`METRALE_MTP_REFEED_ACCEPTED=1` and the drafter serves one sequence at a time.

    It writes into the catch-up ring, which the drafter allocates only under `mtp_catchup_enabled`.
    """
    k = knobs() if k is None else k
    return k.mtp_refeed_accepted and not mtp_multi_seq_mode(mtp_max_seqs)


# --- debug fingerprint of a hidden state -------------------------------------------------------

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_U64_MASK = 2**64 - 1


def hidden_fingerprint(h: torch.Tensor) -> int:
    """FNV-1a 64 over the bf16 little-endian bytes of `h` (row-major); 0 when the copy fails.

    A hidden of H values hashes 2H bytes whatever its dtype, so a fingerprint logged from the
    ring and one logged from the drafter's input compare equal exactly when their bf16 values do.
    It copies `h` to the host, so it is for `METRALE_MTP_REFEED_DEBUG` only.
    """
    try:
        host = h.detach().to(torch.bfloat16).reshape(-1).cpu()
    except RuntimeError:  # NotImplementedError and CUDA errors are RuntimeErrors too
        return 0
    # bf16 has no numpy dtype; its 16 bits go through int16 to pin the byte order.
    data = host.view(torch.int16).numpy().astype("<i2").tobytes()
    digest = _FNV_OFFSET
    for byte in data:
        digest = ((digest ^ byte) * _FNV_PRIME) & _U64_MASK
    return digest
