"""Typed, frozen configuration: the model (from an HF config.json), the engine, and sampling.

Every user-facing value is validated here, once, with a ValueError that names the bad field, so the
engine below can trust its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from metrale.hybrid_config import HybridConfig
from metrale.model_config import ModelConfig, RopeConfig, parse_dtype
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

HYBRID_VERIFY_STATES = ("write_on_accept", "per_row_slots")
# Bounds far past any real use, so that a typo is an error naming the option, not a host
# allocation of gigabytes (block tables by sequences, the rotary table by a step's rows)
MAX_NUM_SEQS = 1 << 16
MAX_BATCHED_TOKENS = 1 << 20
MAX_PAGE_SIZE = 1 << 16
MAX_TENSOR_PARALLEL = 1 << 10
MAX_TIMEOUT_S = 7 * 24 * 3600


def resolve_device(name: str) -> torch.device:
    """A `device` option (auto, cpu, cuda[:N]) as a torch device; ValueError naming `device`
    otherwise (the engine's and the trainers')."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device: {name!r} is not a torch device ({e})") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {name!r} is not supported (auto, cpu, cuda[:N])")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device: {name!r} asked for, but this torch ({torch.__version__}) "
                "sees no CUDA GPU; use --device cpu, or install a CUDA build of torch"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device: {name!r}, but only {torch.cuda.device_count()} GPU(s) exist")
    return device


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
    # "float32" as transformers keeps it; "auto" (the model's dtype, vLLM's default) or a 16-bit
    # type halves the state's traffic at a batch's decode step in bf16 (the arithmetic is float32
    # either way), at the price of exactness: a 16-bit state rounds 1e-7 differences between a
    # verify row and a decode row, or between prefill splits, into other tokens, so speculative
    # output equals plain output only in the deterministic mode (README).
    mamba_ssm_cache_dtype: str = _opt(
        "float32", "hybrid targets: delta-rule state storage (float32; auto: the model's dtype)"
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
    # commit and scheduling overlap the device's forward. Steps that draft or follow a grammar
    # wait for the step before, as without it. On by default, as in vLLM: on the
    # H200 it makes a plain qwen3-8b decode step 1.14x-1.45x faster (batch 1-64).
    async_scheduling: bool = _opt(
        True, "schedule and launch each step while the device runs the one before"
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
        # (torch's generators take what 64 bits hold, signed or not; past that the engine's
        # start overflowed, naming no option: found in review)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed!r}")
        if not isinstance(self.device, str):
            raise ValueError(
                f"device must be a string such as 'auto' or 'cuda:0', got {self.device!r}"
            )
        timeout = self.distributed_timeout_s
        # (a timedelta of it: inf or 1e300 overflowed when the group formed)
        if not is_real(timeout) or not 0 < timeout <= MAX_TIMEOUT_S:
            raise ValueError(
                f"distributed_timeout_s must be a number in (0, {MAX_TIMEOUT_S}], got {timeout!r}"
            )
        for name, hi in (
            ("max_num_seqs", MAX_NUM_SEQS),
            ("max_num_batched_tokens", MAX_BATCHED_TOKENS),
            ("page_size", MAX_PAGE_SIZE),
            ("tensor_parallel_size", MAX_TENSOR_PARALLEL),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
                raise ValueError(f"{name} must be an integer in [1, {hi}], got {value!r}")
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
        rows = self.num_lookahead_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
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
        device = resolve_device(self.device)
        tp = self.tensor_parallel_size
        if device.type == "cuda" and tp > 1:
            # rank r runs on cuda:r (found in review: an indexed device put every rank on that
            # one GPU; too few GPUs failed a worker while the group formed, a 10-minute wait)
            if device.index is not None:
                raise ValueError(
                    f"device: {self.device!r} with tensor_parallel_size={tp}: rank r runs on "
                    "cuda:r; give 'cuda' (and pick GPUs with CUDA_VISIBLE_DEVICES)"
                )
            if tp > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size={tp}, but only {torch.cuda.device_count()} GPU(s) "
                    "are visible"
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
