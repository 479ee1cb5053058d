"""The model's configuration, read from a Hugging Face `config.json` (`ModelConfig`, with its
rope scaling), and the dtype names every config accepts (`parse_dtype`). Each bad field is a
ValueError that names it and the file it came from."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from metrale.hybrid_config import HybridConfig, hybrid_from_hf
from metrale.spec_config import is_real

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3NextForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(value: str | torch.dtype, field_name: str = "dtype") -> torch.dtype:
    """Map a config/CLI dtype name to a torch dtype, naming the field when it is unknown."""
    if isinstance(value, torch.dtype):
        if value in _DTYPES.values():
            return value
        raise ValueError(f"{field_name}: unsupported dtype {value}")
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(
            f"{field_name}: unsupported dtype {value!r}; expected one of {sorted(_DTYPES)}"
        )
    return _DTYPES[name]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from either HF layout (`rope_scaling` in 4.x,
    `rope_parameters` in 5.x)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # yarn
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0


def positive_int(source: str, key: str, value: Any) -> int:
    """`value` of field `key` of `source`, which must be a positive integer (ValueError)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
    return value


def checked_layer_fields(cfg: dict[str, Any], source: str) -> float:
    """The fields a Qwen3 decoder layer's config shares, the target's and a DFlash drafter's:
    `hidden_act` silu only (another ran as SiLU, silently wrong), `tie_word_embeddings` and
    `attention_bias` booleans ("false" was read as true), `rms_norm_eps` in (0, 1) (null
    reached the norms); found in review. Returns rms_norm_eps."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: field 'hidden_act' {act!r} is not supported (silu only)")
    for key in ("tie_word_embeddings", "attention_bias"):
        if not isinstance(cfg.get(key, False), bool):
            raise ValueError(f"{source}: field {key!r} must be true or false, got {cfg[key]!r}")
    eps = cfg.get("rms_norm_eps", 1e-6)
    if not is_real(eps) or not 0 < eps < 1:
        raise ValueError(f"{source}: field 'rms_norm_eps' must be in (0, 1), got {eps!r}")
    return float(eps)


def _given(cfg: dict[str, Any], key: str, default: Any) -> Any:
    """cfg[key] where present and not null, else `default`."""
    value = cfg.get(key)
    return default if value is None else value


def _rope_from_hf(cfg: dict[str, Any], source: str = "config.json") -> RopeConfig:
    params, legacy = cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if not isinstance(value, dict):
            raise ValueError(f"{source}: field {key!r} must be an object, got {value!r}")
    params = {**legacy, **params}

    def num(key: str, default: Any = None) -> float | None:
        # float() of a string or list would raise a message that names no field
        value = params.get(key, default)
        if value is not None and not is_real(value):
            name = f"rope_scaling.{key}" if key in params else key
            raise ValueError(f"{source}: field {name!r} must be a number, got {value!r}")
        return None if value is None else float(value)

    theta = num("rope_theta", cfg.get("rope_theta", 10000.0))
    if theta is None or not 0 < theta < math.inf:  # (null reached the rotary tables: review)
        raise ValueError(f"{source}: field 'rope_theta' must be a positive number, got {theta!r}")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: rope_scaling.rope_type {rope_type!r} is not supported; "
            f"expected one of {SUPPORTED_ROPE_TYPES}"
        )
    factor = num("factor") or 1.0
    if rope_type != "default" and factor <= 0:
        raise ValueError(f"{source}: rope_scaling.factor must be > 0, got {factor}")
    original = params.get("original_max_position_embeddings")
    if rope_type in ("yarn", "llama3") and original is None:
        original = cfg.get("max_position_embeddings")
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        factor=factor,
        original_max_position_embeddings=(
            None if original is None else int(num("original_max_position_embeddings", original))
        ),
        attention_factor=num("attention_factor"),
        beta_fast=num("beta_fast") or 32.0,
        beta_slow=num("beta_slow") or 1.0,
        mscale=num("mscale"),
        mscale_all_dim=num("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        low_freq_factor=num("low_freq_factor", 1.0),
        high_freq_factor=num("high_freq_factor", 4.0),
    )


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Qwen3 target, read from an HF `config.json`; `hybrid` holds what a
    Qwen3-Next target adds (None for a dense Qwen3)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope: RopeConfig
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    hybrid: HybridConfig | None = None

    @classmethod
    def from_hf(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json in the model directory")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(cfg, source=str(path))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        if not isinstance(cfg, dict):  # e.g. a JSON list: .get below would raise AttributeError
            raise ValueError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"{source}: architectures {archs!r} not supported; expected one of "
                f"{SUPPORTED_ARCHITECTURES}"
            )

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise ValueError(f"{source}: missing field {key!r}")
            return cfg[key]

        def positive(key: str, value: Any) -> int:
            return positive_int(source, key, value)

        hidden = positive("hidden_size", need("hidden_size"))
        heads = positive("num_attention_heads", need("num_attention_heads"))
        # (0 is refused, not read as absent: review)
        kv_heads = positive("num_key_value_heads", _given(cfg, "num_key_value_heads", heads))
        if heads % kv_heads:
            raise ValueError(
                f"{source}: num_attention_heads {heads} is not a multiple of "
                f"num_key_value_heads {kv_heads}"
            )
        head_dim = positive("head_dim", _given(cfg, "head_dim", hidden // heads))
        if head_dim % 2:
            raise ValueError(f"{source}: field 'head_dim' must be even for rotary, got {head_dim}")
        eps = checked_layer_fields(cfg, source)
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{source}: field 'use_sliding_window' = true is not supported")
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        try:
            dtype = parse_dtype(dtype_name, field_name=f"{source}: field 'torch_dtype'")
        except ValueError as e:
            raise ValueError(str(e)) from None
        eos = cfg.get("eos_token_id")
        eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in eos_list):
            raise ValueError(f"{source}: field 'eos_token_id' must hold token ids, got {eos!r}")
        bos = cfg.get("bos_token_id")
        if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int) or bos < 0):
            raise ValueError(f"{source}: field 'bos_token_id' must be a token id, got {bos!r}")
        num_layers = positive("num_hidden_layers", need("num_hidden_layers"))
        hybrid = None
        if arch == "Qwen3NextForCausalLM":
            hybrid = hybrid_from_hf(cfg, source, num_layers, head_dim, positive)
        return cls(
            architecture=arch,
            vocab_size=positive("vocab_size", need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=positive("intermediate_size", need("intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=eps,
            max_position_embeddings=positive(
                "max_position_embeddings", cfg.get("max_position_embeddings", 32768)
            ),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            rope=_rope_from_hf(cfg, source),
            dtype=dtype,
            eos_token_ids=tuple(eos_list),
            bos_token_id=bos,
            hybrid=hybrid,
        )
