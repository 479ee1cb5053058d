"""Load HF safetensors checkpoints (single file or sharded with an index) into a model.

Weights are streamed tensor by tensor into parameters by HF name; fused parameters (see a model's
`packed_modules`) receive their shards at the right row offsets. Every parameter must be filled
exactly once: a missing tensor, a wrong shape or an unreadable file fails with an error that names
the tensor and the file.

`renames` loads a sub-model stored under other names beside the target (the MTP heads, see
`metrale.models.mtp`): checkpoint prefix -> parameter prefix, everything else skipped unread.

Routed experts stacked into one parameter per projection (`...experts.gate_up_proj` [E, 2I, H],
`...experts.down_proj` [E, H, I], as in `metrale.models.qwen3_next_moe`) are filled from the
per-expert tensors `...experts.{e}.{gate,up,down}_proj.weight`, or from stacked tensors of the
same name and shape.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

log = logging.getLogger(__name__)

# Checkpoint tensors that are not the target's, skipped unread: the Qwen3-Next MTP heads (loaded by
# `metrale.models.mtp`). DeepSeek-layout MTP blocks (`model.layers.{L >= num_hidden_layers}`)
# name no target parameter, so they are skipped unread like any unknown tensor (`load_weights`).
IGNORED_PREFIXES = ("mtp.",)


# A per-expert tensor: (the experts module, expert index, projection).
_EXPERT_TENSOR = re.compile(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
# projection -> (stacked parameter, shard: gate rows first, then up rows)
_EXPERT_PIECES = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the tensor or file."""


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: those the index names, else every *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: names shard {f.name}, which does not exist")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights found")
    return files


# checkpoint name -> the parts to read along one dim, concatenated (a tensor-parallel rank's
# shard): a list of (dim, start, stop), or None for the whole tensor
Select = Callable[[str], "list[tuple[int, int, int]] | None"]


def iter_tensors(
    files: list[Path], keep: Callable[[str], bool] | None = None, select: Select | None = None
) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """(name, tensor, file) of every tensor; `keep` filters by name before a tensor is read;
    `select` names the slice of a tensor to read (only that slice is read from the file)."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                    if keep is not None and not keep(name):
                        continue
                    parts = None if select is None else select(name)
                    if parts is None:
                        yield name, f.get_tensor(name), path
                        continue
                    piece = f.get_slice(name)
                    dim = parts[0][0]
                    read = [piece[(slice(None),) * d + (slice(a, b),)] for d, a, b in parts]
                    yield name, read[0] if len(read) == 1 else torch.cat(read, dim), path
        except Exception as e:  # safetensors raises its own error types
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from e


def _rename(name: str, renames: Mapping[str, str] | None) -> str | None:
    """Checkpoint name -> parameter name (HF spelling, before fusing); None skips the tensor."""
    if renames is None:
        return None if name.startswith(IGNORED_PREFIXES) else name
    for src, dst in renames.items():
        if name.startswith(src):
            return dst + name[len(src) :]
    return None


def _checkpoint_name(name: str, renames: Mapping[str, str] | None) -> str:
    """The inverse of `_rename`, so that a missing tensor is named as the checkpoint spells it."""
    for src, dst in (renames or {}).items():
        if name.startswith(dst):
            return src + name[len(dst) :]
    return name


def _target_of(name: str, packed: dict[str, list[tuple[str, int]]]) -> tuple[str, int | None]:
    """HF tensor name -> (metrale parameter name, shard index within a fused parameter)."""
    for fused, shards in packed.items():
        for hf_suffix, shard in shards:
            key = f".{hf_suffix}."
            if key in name:
                return name.replace(key, f".{fused}."), shard
    return name, None


def _shard_rows(param: nn.Parameter, fused: str, shard: int, model: nn.Module, name: str):
    """Row range of one shard inside a fused parameter [sum(rows), in]."""
    owner = model.get_submodule(name.rsplit(".", 2)[0])
    if fused == "qkv_proj":
        sizes = [owner.q_size, owner.kv_size, owner.kv_size]
    else:  # gate_up_proj: two equal halves
        sizes = [param.shape[0] // 2] * 2
    start = sum(sizes[:shard])
    return start, sizes[shard]


def _expert_target(name: str) -> tuple[str, int, str, int] | None:
    """A per-expert tensor's name -> (the stacked parameter it would fill, expert, stacked
    projection, shard); None for any other name."""
    m = _EXPERT_TENSOR.fullmatch(name)
    if m is None:
        return None
    stacked, shard = _EXPERT_PIECES[m.group(3)]
    return f"{m.group(1)}.{stacked}", int(m.group(2)), stacked, shard


def _stacked_expert(
    name: str, params: dict[str, nn.Parameter], path: Path
) -> tuple[str, torch.Tensor, tuple[int, int]] | None:
    """A per-expert tensor bound for a stacked parameter -> (parameter name, destination view,
    (expert, shard)); None when the model keeps no stacked parameter for it."""
    found = _expert_target(name)
    if found is None:
        return None
    target, expert, stacked, shard = found
    param = params.get(target)
    if param is None or param.dim() != 3:
        return None
    if expert >= param.shape[0]:
        raise CheckpointError(
            f"{path.name}: tensor {name} names expert {expert} of {param.shape[0]}"
        )
    rows = param.shape[1] // 2 if stacked == "gate_up_proj" else param.shape[1]
    return target, param[expert, shard * rows : (shard + 1) * rows], (expert, shard)


def _missing_expert(name: str, param: nn.Parameter, got: set) -> str | None:
    """The first per-expert tensor a stacked parameter still lacks (None: complete, or not a
    stacked expert parameter)."""
    head, _, stacked = name.rpartition(".")
    if not head.endswith(".experts") or param.dim() != 3 or None in got:
        return None
    pieces = [p for p, (s, _) in _EXPERT_PIECES.items() if s == stacked]
    for expert in range(param.shape[0]):
        for piece in pieces:
            if (expert, _EXPERT_PIECES[piece][1]) not in got:
                return f"{head}.{expert}.{piece}.weight"
    return None


@torch.no_grad()
def load_weights(
    model: nn.Module,
    model_dir: str | Path,
    renames: Mapping[str, str] | None = None,
    select: Select | None = None,
    rename: Callable[[str], str | None] | None = None,
) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`.

    Without `renames`, parameter names are the checkpoint's (minus `IGNORED_PREFIXES`). With it,
    only tensors under one of its checkpoint prefixes are read, each loaded into the parameter
    whose name swaps that prefix for the mapped one; prefixes must not overlap. `select`: read
    only a slice of some tensors (a tensor-parallel rank's shard, `distributed/parallel.py`);
    `rename`: checkpoint name -> the name to load it as, or None to skip it unread (a rank's
    experts, renumbered from 0).
    """
    packed: dict[str, list[tuple[str, int]]] = getattr(model, "packed_modules", {})
    params = dict(model.named_parameters())
    # parameter name -> set of shards filled (None for unfused)
    filled: dict[str, set[int | None]] = {}
    files = checkpoint_files(model_dir)

    def keep(name: str) -> bool:
        """Whether the tensor fills a parameter: anything else is skipped unread (DeepSeek-layout
        MTP blocks, whose head is a whole [V, H] matrix; other ranks' experts)."""
        local = name if rename is None else rename(name)
        hf = None if local is None else _rename(local, renames)
        if hf is None:
            return False
        expert = _expert_target(hf)
        if expert is not None and expert[0] in params:
            return True
        return _target_of(hf, packed)[0] in params

    for hf_name, tensor, path in iter_tensors(files, keep, select):
        if rename is not None:
            hf_name = rename(hf_name)
        expert = _stacked_expert(_rename(hf_name, renames), params, path)
        if expert is not None:
            target, dest, key = expert
            if not tensor.dtype.is_floating_point:
                raise CheckpointError(f"{path.name}: tensor {hf_name} has dtype {tensor.dtype}")
            if tuple(tensor.shape) != tuple(dest.shape):
                raise CheckpointError(
                    f"{path.name}: tensor {hf_name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            filled.setdefault(target, set()).add(key)
            continue
        target, shard = _target_of(_rename(hf_name, renames), packed)
        param = params.get(target)
        if param is None:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            log.debug("ignoring checkpoint tensor %s (no such parameter)", hf_name)
            continue
        if not tensor.dtype.is_floating_point:
            raise CheckpointError(f"{path.name}: tensor {hf_name} has dtype {tensor.dtype}")
        if shard is None:
            dest = param
        else:
            fused = target.rsplit(".", 2)[-2]
            start, rows = _shard_rows(param, fused, shard, model, target)
            dest = param[start : start + rows]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise CheckpointError(
                f"{path.name}: tensor {hf_name} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        filled.setdefault(target, set()).add(shard)

    if params and not filled:
        # (rather than the first tensor's name: a folder of another model's weights, or of its
        # drafter's alone, such as a snapshot holding only mtp.safetensors)
        names = ", ".join(f.name for f in files)
        raise CheckpointError(
            f"{model_dir}: its weights ({names}) hold none of the model's tensors (the first "
            f"it needs: {_checkpoint_name(next(iter(params)), renames)}): the model's weights "
            "are missing, or these are another model's"
        )
    for name, param in params.items():
        got = filled.get(name, set())
        fused = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if (missing_expert := _missing_expert(name, param, got)) is not None:
            raise CheckpointError(
                f"{model_dir}: missing tensor {_checkpoint_name(missing_expert, renames)}"
            )
        if fused in packed:
            need = {s for _, s in packed[fused]}
            missing = sorted(need - got)
            if missing:
                hf = name.replace(f".{fused}.", f".{packed[fused][missing[0]][0]}.")
                raise CheckpointError(
                    f"{model_dir}: missing tensor {_checkpoint_name(hf, renames)}"
                )
        elif not got:
            raise CheckpointError(f"{model_dir}: missing tensor {_checkpoint_name(name, renames)}")


def like_written(path: Path) -> None:
    """Give `path` the permissions a file written as usual gets (0666 less the umask):
    safetensors writes its files 0600, which another account (a server's) cannot read (found
    in review). (Not those of a file beside it: a read-only config.json copied from a snapshot
    made the weights read-only, and the next run could not write them.)"""
    mask = os.umask(0o022)  # (reading the umask sets it: put back at once)
    os.umask(mask)
    path.chmod(0o666 & ~mask)
