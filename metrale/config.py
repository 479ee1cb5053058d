"""Typed, frozen configuration: the model (from an HF config.json), the engine, and sampling.

Every user-facing value is validated here, once, with a ValueError that names the bad field, so the
engine below can trust its inputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from metrale.hybrid_config import HybridConfig, hybrid_from_hf
from metrale.sampling_params import SamplingParams
from metrale.spec_config import SPEC_METHODS, SpecConfig, is_real, require_bools

__all__ = [
    "SPEC_METHODS",
    "EngineConfig",
    "HybridConfig",
    "ModelConfig",
    "RopeConfig",
    "SamplingParams",
    "SpecConfig",
]

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

        def positive_int(key: str, value: Any) -> int:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"{source}: field {key!r} must be a positive integer, got {value!r}"
                )
            return value

        hidden = positive_int("hidden_size", need("hidden_size"))
        heads = positive_int("num_attention_heads", need("num_attention_heads"))
        kv_heads = positive_int("num_key_value_heads", cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(
                f"{source}: num_attention_heads {heads} is not a multiple of "
                f"num_key_value_heads {kv_heads}"
            )
        head_dim = positive_int("head_dim", cfg.get("head_dim") or hidden // heads)
        if head_dim % 2:
            raise ValueError(f"{source}: field 'head_dim' must be even for rotary, got {head_dim}")
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
        num_layers = positive_int("num_hidden_layers", need("num_hidden_layers"))
        hybrid = None
        if arch == "Qwen3NextForCausalLM":
            hybrid = hybrid_from_hf(cfg, source, num_layers, head_dim, positive_int)
        return cls(
            architecture=arch,
            vocab_size=positive_int("vocab_size", need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=positive_int("intermediate_size", need("intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=positive_int(
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


HYBRID_VERIFY_STATES = ("write_on_accept", "per_row_slots")


def _opt(default, help_text: str):
    """A config field whose `help` the command line shows (its flags are generated from it)."""
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: device, dtype, cache and batching limits.

    `num_kv_pages=None` sizes the page pool so that `max_num_seqs` sequences of `max_model_len`
    fit (capped by `kv_cache_memory_gb`); a smaller pool makes the scheduler preempt.
    """

    device: str = _opt("auto", "torch device: auto (CUDA when present), cpu, cuda, cuda:1 ...")
    dtype: str = _opt(
        "auto", "auto (the checkpoint's dtype on GPU, float32 on CPU), bfloat16, float16, float32"
    )
    max_model_len: int | None = _opt(None, "context length limit (default: the model's)")
    max_num_seqs: int = _opt(64, "sequences running at once")
    max_num_batched_tokens: int = _opt(2048, "rows one step runs at most (prefill chunk budget)")
    page_size: int = _opt(16, "KV rows per page")
    num_kv_pages: int | None = _opt(None, "KV pages in the pool (default: sized from memory)")
    kv_cache_memory_gb: float = _opt(4.0, "KV pool budget in GiB when not sized otherwise")
    # a fraction of the GPU's memory for the whole engine: the KV pool gets what the weights
    # leave of it (vLLM's gpu_memory_utilization); overrides kv_cache_memory_gb on CUDA
    gpu_memory_utilization: float | None = _opt(
        None, "fraction of GPU memory for the engine; the KV pool takes what the weights leave"
    )
    num_lookahead_rows: int = _opt(0, "KV rows reserved past each step (drafters raise it)")
    seed: int = _opt(0, "engine seed (random weights; requests without a seed draw from it)")
    spec: SpecConfig | dict | None = None
    # "safetensors": the checkpoint's weights; "dummy": random weights of the config's shape
    # (benchmarks of published shapes without their weights, as vLLM's load_format=dummy)
    load_format: str = _opt("safetensors", "safetensors, or dummy (random weights of the shape)")
    # the Hub revision (branch, tag or commit) when the model is a Hugging Face Hub id
    revision: str | None = _opt(None, "Hub revision (branch, tag or commit) of a Hub id")
    # CUDA graphs for decode and verify steps (CUDA only); tables of more rows run eagerly.
    # None: as many rows as `max_num_seqs` sequences of 1 + num_drafts rows can take after the
    # graph padding (`program_shapes`), so that no decode or verify step is refused.
    cuda_graphs: bool = _opt(True, "replay decode and verify steps as CUDA graphs (CUDA only)")
    graph_max_rows: int | None = _opt(None, "rows a graphed step takes at most (default: all)")
    # Steps with prompt (prefill) chunks of at most this many rows in all replay captured
    # programs too (a short prompt's eager forward is mostly launch overhead); rounded down to a
    # power of two; 0 runs every such step eagerly. None: the whole token budget on dense targets,
    # so that a step that admits a few requests beside a verify of the running batch (often more
    # than 512 rows at batch 64) is not eager; 512 on hybrid targets, whose prefill programs are
    # keyed by width too (124 programs at 64 sequences and 512 rows, 180 at 2048).
    graph_prefill_rows: int | None = _opt(
        None,
        "rows of a graphed step with prompt chunks (0: eager; default: token budget, hybrid 512)",
    )
    tensor_parallel_size: int = _opt(1, "ranks the target is split across (worker processes)")
    expert_parallel: bool = _opt(
        False, "with tensor parallelism: split a MoE's experts across ranks, not each expert"
    )
    distributed_timeout_s: float = _opt(
        120.0, "seconds a tensor-parallel collective may wait before the engine fails"
    )
    # How a hybrid target's verify treats the recurrent state (HYBRID_VERIFY_STATES, see
    # `models/gdn_state.py`): "write_on_accept" writes it once, for the accepted rows;
    # "per_row_slots" writes every row's state into K+1 entries per sequence and commits by
    # pointing at one (no second pass, K+1 times the state memory).
    hybrid_verify_state: str = _opt(
        "write_on_accept", "hybrid verify: write_on_accept or per_row_slots"
    )
    # The storage type of a hybrid target's delta-rule state (vLLM's option of the same name):
    # "auto" keeps it in the model's dtype, as vLLM does, which halves the state's traffic at a
    # batch's decode step in bf16 (the arithmetic is float32 either way); "float32" keeps it as
    # transformers does.
    mamba_ssm_cache_dtype: str = _opt(
        "auto", "hybrid targets: delta-rule state storage (auto: the model's dtype; float32, ...)"
    )
    # Full KV pages (and, on hybrid targets, recurrent-state snapshots at page boundaries) are
    # kept after their sequence ends, keyed by their tokens, and reused by later prompts.
    prefix_caching: bool = _opt(True, "reuse cached KV pages of shared prompt prefixes")
    # Hybrid targets: recurrent-state snapshots kept for prefix caching (each one sequence's
    # state, outside the KV budget); None: 2 x max_num_seqs; 0: hybrids cache nothing.
    prefix_cache_snapshots: int | None = _opt(
        None, "hybrid targets: state snapshots kept for prefix caching (default 2 x max_num_seqs)"
    )
    # Batch-invariant kernels on the decode and verify path: a row's logits do not depend on the
    # rows beside it, so greedy output is the same alone, in a batch, with or without speculation.
    deterministic: bool = _opt(
        False, "batch-invariant kernels: the same bits alone, in a batch, with speculation"
    )
    # Launch each step before the host commits the one before (`engine/ahead.py`): the host's
    # commit and scheduling overlap the device's forward. Steps that draft, follow a grammar or
    # apply a penalty wait for the step before, as without it.
    async_scheduling: bool = _opt(
        False, "schedule and launch each step while the device runs the one before"
    )

    def __post_init__(self) -> None:
        spec = self.spec
        if spec is None:
            spec = SpecConfig()
        elif isinstance(spec, dict):
            try:
                spec = SpecConfig(**spec)
            except TypeError as e:
                raise ValueError(f"spec: {e}") from None
        elif not isinstance(spec, SpecConfig):
            raise ValueError(f"spec must be a SpecConfig or a dict, got {spec!r}")
        object.__setattr__(self, "spec", spec)
        util = self.gpu_memory_utilization
        if util is not None and (not is_real(util) or not 0.0 < util <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        # inf would overflow the page count, nan compares False everywhere
        if not is_real(self.kv_cache_memory_gb) or not self.kv_cache_memory_gb > 0:
            raise ValueError(
                f"kv_cache_memory_gb must be a finite number > 0, got {self.kv_cache_memory_gb!r}"
            )
        flags = ("cuda_graphs", "expert_parallel", "prefix_caching", "deterministic")
        require_bools(self, (*flags, "async_scheduling"))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.device, str):
            raise ValueError(
                f"device must be a string such as 'auto' or 'cuda:0', got {self.device!r}"
            )
        timeout = self.distributed_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"distributed_timeout_s must be a positive number, got {timeout!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, lo in (
            ("max_model_len", 2),
            ("num_kv_pages", 2),
            ("graph_max_rows", 1),
            ("graph_prefill_rows", 0),
            ("prefix_cache_snapshots", 0),
        ):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < lo
            ):
                raise ValueError(f"{name} must be None or an integer >= {lo}, got {value!r}")
        if not isinstance(self.num_lookahead_rows, int) or self.num_lookahead_rows < 0:
            raise ValueError(
                f"num_lookahead_rows must be an integer >= 0, got {self.num_lookahead_rows!r}"
            )
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(
                f"load_format must be 'safetensors' or 'dummy', got {self.load_format!r}"
            )
        if self.deterministic and self.tensor_parallel_size > 1:
            # an all-reduce may sum a row's shards in an order that follows the message size
            raise ValueError("deterministic: not supported with tensor_parallel_size > 1")
        if self.hybrid_verify_state not in HYBRID_VERIFY_STATES:
            raise ValueError(
                f"hybrid_verify_state must be one of {HYBRID_VERIFY_STATES}, "
                f"got {self.hybrid_verify_state!r}"
            )
        if self.mamba_ssm_cache_dtype != "auto":
            parse_dtype(self.mamba_ssm_cache_dtype, "mamba_ssm_cache_dtype")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device: {self.device!r} is not a torch device ({e})") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    f"device: {self.device!r} asked for, but this torch ({torch.__version__}) "
                    "sees no CUDA GPU; use --device cpu, or install a CUDA build of torch"
                )
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ValueError(
                    f"device: {self.device!r}, but only {torch.cuda.device_count()} GPU(s) exist"
                )
        return device

    def resolve_dtype(self, model: ModelConfig, device: torch.device) -> torch.dtype:
        """`auto`: the checkpoint's dtype on GPU; float32 on CPU (where bf16 matmuls are slow
        and the tests compare against float32 references)."""
        if self.dtype != "auto":
            return parse_dtype(self.dtype)
        return model.dtype if device.type == "cuda" else torch.float32

    def resolve_ssm_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The delta-rule state's storage type for a model run in `dtype`."""
        if self.mamba_ssm_cache_dtype == "auto":
            return dtype
        return parse_dtype(self.mamba_ssm_cache_dtype, "mamba_ssm_cache_dtype")
