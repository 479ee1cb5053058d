"""Model names to checkpoint directories: a local directory as given, or a Hugging Face Hub id
(`org/name`, or a bare `name`) through `huggingface_hub`: downloaded when online, resolved from
the local HF cache when offline (`HF_HUB_OFFLINE=1` is honoured, as transformers and vLLM
honour it)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

# What an engine reads from a checkpoint: configs, weights (top level: the index's shards, or
# every *.safetensors there), tokenizer, chat template, drafters. Only these: offline,
# huggingface_hub refuses a snapshot missing any file the patterns match in the repo's listing,
# so `*.txt` or a nested `*.safetensors` (merges.txt, onnx/) refused caches holding all of these.
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
    "model*.safetensors",
    "mtp.safetensors",
    "dflash/*",
]
log = logging.getLogger(__name__)
# `org/name`, or a bare `name` (`gpt2`: the Hub's older repos, which vLLM and transformers take)
_HUB_ID = re.compile(r"[\w.-]+(?:/[\w.-]+)?")


def is_hub_id(model: str | Path) -> bool:
    """`org/name` or `name` that is not a local path (nor written like one: `./x`, `../x`,
    `~/x`)."""
    text = str(model)
    if text.startswith((".", "/", "~")) or isinstance(model, Path):
        return False
    return bool(_HUB_ID.fullmatch(text)) and not Path(text).exists()


def resolve_model(model: str | Path, revision: str | None = None) -> Path:
    """The checkpoint directory for a local path or a Hub id (FileNotFoundError, saying what
    was tried, when neither gives one)."""
    if not isinstance(model, (str, Path)) or not str(model).strip():
        raise ValueError(f"model must be a checkpoint directory or a Hub id, got {model!r}")
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise ValueError(f"revision must be a branch, tag or commit name, got {revision!r}")
    path = Path(model).expanduser()
    if path.is_file():  # (config.json given for its directory, say)
        raise FileNotFoundError(f"model: {path} is a file; give the checkpoint's directory")
    if path.is_dir():
        return path
    if not is_hub_id(model):
        raise FileNotFoundError(f"model directory {path} does not exist")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(model), revision=revision, allow_patterns=ALLOW_PATTERNS))
    except LocalEntryNotFoundError as e:
        # A snapshot the cache holds but huggingface_hub calls incomplete (a file of the repo's
        # listing never downloaded) serves as it is: the loader names any file it lacks.
        folder = _cached_snapshot(str(model), revision)
        if folder is not None:
            # (a file it lacks that the engine reads only for defaults, generation_config.json,
            # would otherwise go unnoticed)
            log.warning("model %r: serving the cached snapshot %s as it is (%s)", model, folder, e)
            return folder
        where = f" at revision {revision!r}" if revision is not None else ""
        raise FileNotFoundError(
            f"model {model!r}{where}: not in the local Hugging Face cache and the Hub is "
            "unreachable or offline (HF_HUB_OFFLINE=1); download it once with network access, "
            f"or pass a checkpoint directory ({_one_line(e)})"
        ) from None
    except (HFValidationError, OSError) as e:
        raise FileNotFoundError(
            f"model {model!r}: no such local directory, and not found on the Hub ({_one_line(e)})"
        ) from None


def _one_line(error: BaseException) -> str:
    """`error`'s text on one line (huggingface_hub's span several when the Hub is unreachable:
    a CLI error is one line; found in review)."""
    return " ".join(str(error).split())


def _cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The cached snapshot folder of `repo_id` at `revision` that holds its config.json, if
    any (read from the cache alone)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    return Path(found).parent if isinstance(found, str) else None
