"""Building one rank's shard of a target: the sharded modules, only this rank's slices of the
checkpoint's tensors (and only its experts), a KV pool of the engine's page count holding this
rank's KV heads, and for a hybrid a recurrent-state pool of the engine's entry count holding this
rank's GDN heads. Rank 0 builds its own in the runner; each worker calls `build_worker`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from metrale.config import EngineConfig, ModelConfig
from metrale.distributed.layers import TPQwen3ForCausalLM, TPQwen3NextForCausalLM
from metrale.distributed.parallel import (
    TPGroup,
    expert_renamer,
    local_config,
    selector,
)
from metrale.engine.model_setup import allocate_kv_pools, default_dtype, dummy_weights
from metrale.kernels.gemv import stream_projections
from metrale.models.loader import load_weights
from metrale.models.qwen3 import Qwen3ForCausalLM
from metrale.models.qwen3_next import Qwen3NextForCausalLM


def build_model(
    model_cfg: ModelConfig,
    cfg: EngineConfig,
    model_dir: str | Path,
    backend,
    max_positions: int,
    tp: TPGroup,
    device: torch.device,
    dtype: torch.dtype,
) -> TPQwen3ForCausalLM:
    cls = TPQwen3ForCausalLM if model_cfg.hybrid is None else TPQwen3NextForCausalLM
    with torch.device(device), default_dtype(dtype):
        model = cls(model_cfg, backend, max_positions, tp)
    if cfg.load_format == "dummy":
        # the one-rank model's shapes (on the meta device: no memory), so this rank's shares
        # of split tensors are told from the tensors every rank holds whole
        one_rank = Qwen3ForCausalLM if model_cfg.hybrid is None else Qwen3NextForCausalLM
        with torch.device("meta"), default_dtype(dtype):
            whole = {
                name: p.shape
                for name, p in one_rank(model_cfg, backend, max_positions).named_parameters()
            }
        dummy_weights(model, cfg.seed, tp.rank, whole, tp.size)
        if device.type == "cuda":  # (the whole tensors drawn: not left reserved off the KV pool)
            torch.cuda.empty_cache()
    else:
        load_weights(
            model,
            model_dir,
            select=selector(model_cfg, tp),
            rename=expert_renamer(model_cfg, tp),
        )
    # every rank's few-row projections through the same kernels: a replicated router whose
    # logits round differently on two ranks could route a token to different experts
    stream_projections(model)
    return model.eval()


def bind_kv(model, model_cfg: ModelConfig, cfg: EngineConfig, num_pages: int, tp: TPGroup):
    """Allocate this rank's KV pool (its KV heads, the engine's pages) and bind it; a pool the
    device has no room for is a ValueError naming the settings that size it."""
    p = next(model.parameters())
    layers = model.attention_layers
    kv_cfg = local_config(model_cfg, tp)
    (caches,) = allocate_kv_pools([(kv_cfg, len(layers))], num_pages, cfg, p.dtype, p.device)
    for layer, cache in zip(layers, caches, strict=True):
        layer.kv_cache = cache


def build_worker(
    rank: int,
    tp: TPGroup,
    device: torch.device,
    *,
    model_dir: str,
    cfg: EngineConfig,
    model_cfg: ModelConfig,
    max_positions: int,
    num_pages: int,
    state_entries: int,
    dtype: torch.dtype,
    backend_name: str,
):
    from metrale.kernels.paged_attention import TritonPagedAttention
    from metrale.models.attention import TorchPagedAttention

    backend = TritonPagedAttention() if backend_name == "triton" else TorchPagedAttention()
    model = build_model(model_cfg, cfg, model_dir, backend, max_positions, tp, device, dtype)
    bind_kv(model, model_cfg, cfg, num_pages, tp)
    hybrid = model_cfg.hybrid is not None
    pool = model.make_state(state_entries, cfg.resolve_ssm_dtype(dtype)) if hybrid else None
    return model, pool


def start_workers(
    model, model_dir, cfg, model_cfg, max_positions, num_pages, state_entries, device
):
    """Start ranks 1..N-1 with this rank's pool sizes (KV pages; a hybrid's state entries, which
    rank 0's `StateSlots` will ask for) and join the group: rank 0's model handle, whose calls
    every rank runs (`workers.TPModel`)."""
    from metrale.distributed import startup, workers
    from metrale.kernels.paged_attention import TritonPagedAttention

    build = functools.partial(
        build_worker,
        model_dir=str(model_dir),
        cfg=cfg,
        model_cfg=model_cfg,
        max_positions=max_positions,
        num_pages=num_pages,
        state_entries=state_entries,
        dtype=next(model.parameters()).dtype,
        backend_name="triton" if isinstance(model.backend, TritonPagedAttention) else "torch",
    )
    size = cfg.tensor_parallel_size
    timeout = cfg.distributed_timeout_s
    _, procs, pipes = startup.start(build, size, cfg.expert_parallel, device, timeout)
    return workers.TPModel(model, procs, pipes, device)


class WholeVocab(nn.Module):
    """The whole embedding and head, on rank 0, for a drafter that runs there alone (the MTP
    heads, DFlash): a sharded target's would need every rank for each of the drafter's steps.
    Costs one more [V, H] copy (two with an untied head)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden, rows=None, out=None) -> torch.Tensor:
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        logits = F.linear(hidden, self.head_weight)
        return logits.float() if out is None else out.copy_(logits)


def whole_vocab(model_cfg, cfg: EngineConfig, model_dir, device, dtype) -> WholeVocab:
    with torch.device(device), default_dtype(dtype):
        vocab = WholeVocab(model_cfg)
    if cfg.load_format == "dummy":
        dummy_weights(vocab, cfg.seed)
    else:
        renames = {"model.embed_tokens.": "embed_tokens."}
        if not model_cfg.tie_word_embeddings:
            renames["lm_head."] = "lm_head."
        load_weights(vocab, model_dir, renames)
    return vocab.eval()
