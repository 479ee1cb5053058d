"""Which drafter and controller an engine gets: the drafter `spec.method` names (or the caller's
own object), wrapped in the `SpeculativeDecoder` that plans, cuts and observes for it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from metrale.config import EngineConfig, SpecConfig
from metrale.hub import is_hub_id, resolve_model
from metrale.knobs import knobs
from metrale.models.dflash import DFlashConfig
from metrale.spec_config import DEFAULT_NUM_DRAFTS
from metrale.speculative.controller import SpeculativeDecoder
from metrale.speculative.dflash import DFlashDrafter
from metrale.speculative.drafter import Drafter
from metrale.speculative.mtp import MTPDrafter
from metrale.speculative.ngram import NgramDrafter
from metrale.telemetry import SpecTelemetry


def dflash_dir(spec: SpecConfig, model_dir: Path) -> Path | None:
    """The DFlash checkpoint for `spec.method="dflash"`: `spec.model`, else `dflash/` beside
    the target's weights."""
    if spec.method != "dflash":
        return None
    path, missing = model_dir / "dflash", None
    if spec.model:  # a directory, or a Hub id in the local HF cache, as `model` (review)
        try:
            path = resolve_model(spec.model)
        except FileNotFoundError as e:
            path, missing = Path(spec.model).expanduser(), e
    if spec.model and not (path / "config.json").is_file() and (path / "dflash").is_dir():
        path = path / "dflash"  # `train dflash --out DIR` writes DIR/dflash (review)
    if not (path / "config.json").is_file():
        if missing is not None and is_hub_id(spec.model):
            # what the Hub lookup found (not in the cache, offline, ...), not "no drafter at
            # acme/x" as if it were a folder of the working directory
            raise ValueError(f"spec.model: {missing}")
        raise ValueError(
            f"spec.model: no DFlash drafter at {path} (give spec=dict(method='dflash', "
            "model=DIR), or put one in the target's dflash/ folder)"
        )
    return path


def resolve_num_drafts(config: EngineConfig, model_dir: Path, drafter) -> EngineConfig:
    """`config` with K given: a DFlash drafter's default is its block's B - 1 drafts (its one
    forward proposes that many; SGLang reads it from the drafter's config too), not the other
    drafters' `DEFAULT_NUM_DRAFTS`, which a block of 4 or less cannot give."""
    spec = config.spec
    if spec.num_drafts is not None:
        return config
    k = DEFAULT_NUM_DRAFTS
    if drafter is None:  # (with a drafter of the caller's too, `speculative_decoder` refuses)
        path = dflash_dir(spec, model_dir)
        block = DFlashConfig.from_dir(path).block_size
        if block < 2:
            raise ValueError(
                f"spec.model: the DFlash drafter at {path} has block_size {block}: it proposes "
                "no drafts (a block holds the last token and B - 1 drafts)"
            )
        k = block - 1
    return dataclasses.replace(config, spec=dataclasses.replace(spec, num_drafts=k))


def speculative_decoder(
    config: EngineConfig,
    runner,
    drafter: Drafter | None,
    telemetry: SpecTelemetry,
    context_len: int,
) -> SpeculativeDecoder | None:
    """The engine's speculative side, or None when it does not speculate. `context_len`: the
    tokens a sequence can reach (`max_model_len`, or less where the KV pool holds less)."""
    spec = config.spec
    if drafter is not None:
        # (a string or a class was taken and failed at the first step: found in review)
        methods = [getattr(drafter, m, None) for m in ("propose", "observe")]
        if isinstance(drafter, type) or not all(callable(m) for m in methods):
            raise ValueError(
                f"drafter must be a Drafter object (propose, observe: speculative/drafter.py), "
                f"got {drafter!r:.80}"
            )
        if spec.method is not None:
            raise ValueError(
                f"drafter: given with spec.method={spec.method!r}; give one drafter, not both"
            )
    if drafter is None:
        if spec.method is None:
            return None
        if spec.method == "ngram":
            drafter = NgramDrafter(spec.ngram_min, spec.ngram_max, spec.ngram_window)
            # a scheduler slot per running sequence, at most context_len tokens each
            on_device = drafter.use_device(
                config.max_num_seqs, context_len, runner.device, spec.num_drafts
            )
            if on_device and runner.graphs is not None and not knobs().no_ngram_ahead:
                drafter.attach(runner)  # its next drafts right after each verify program
        elif spec.method == "dflash":
            block = runner.dflash.config.block_size
            if spec.num_drafts > block - 1:
                raise ValueError(
                    f"spec.num_drafts={spec.num_drafts}: the DFlash drafter's block of {block} "
                    f"proposes at most {block - 1}"
                )
            drafter = DFlashDrafter(runner, config.max_num_seqs)
        else:  # "mtp": the runner loaded the checkpoint's heads (or refused)
            drafter = MTPDrafter(
                runner, spec.mtp_max_seqs or config.max_num_seqs, config.max_num_seqs
            )
    return SpeculativeDecoder(
        spec,
        drafter,
        telemetry,
        context_len,
        runner.model_cfg.vocab_size,
        write_on_accept=runner.hybrid and config.hybrid_verify_state == "write_on_accept",
        any_depths=runner.graphs is None or runner.graphs.ragged,
    )
