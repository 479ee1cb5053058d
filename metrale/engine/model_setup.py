"""Building a runner's model and KV pool: the default dtype while modules are made, the pool size
that the memory budget affords, and seeded random weights for `load_format="dummy"`."""

from __future__ import annotations

import contextlib
import os

import torch

from metrale.config import EngineConfig, ModelConfig
from metrale.engine.kv_cache import kv_page_bytes
from metrale.models.qwen3_next import ZeroCentredRMSNorm


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def num_pages_for(
    model_cfg: ModelConfig,
    cfg: EngineConfig,
    max_model_len: int,
    dtype: torch.dtype,
    lookahead: int,
    num_layers: int,
    extra_page_bytes: int = 0,
    budget_gb: float | None = None,
) -> int:
    """Pool size: `num_kv_pages` if given, else room for `max_num_seqs` full-length sequences,
    capped by `kv_cache_memory_gb`; plus the dummy page. `extra_page_bytes`: what a drafter
    keeps per page beside the target's KV (DFlash's context K/V)."""
    page_bytes = kv_page_bytes(model_cfg, cfg.page_size, dtype, num_layers) + extra_page_bytes
    if cfg.num_kv_pages is not None:
        _check_fits(cfg, cfg.num_kv_pages * page_bytes, "num_kv_pages", cfg.num_kv_pages)
        return cfg.num_kv_pages
    pages_per_seq = -(-(max_model_len + lookahead) // cfg.page_size)
    wanted = cfg.max_num_seqs * pages_per_seq
    # a target without attention layers (an all-GDN hybrid) keeps no KV: pages are free
    budget = cfg.kv_cache_memory_gb if budget_gb is None else budget_gb
    affordable = int(budget * 2**30) // page_bytes if page_bytes else wanted
    pages = min(wanted, affordable)
    if pages < pages_per_seq:
        raise ValueError(
            f"the KV budget of {budget:.2f} GiB holds {pages} pages, fewer than one "
            f"sequence of max_model_len={max_model_len} needs ({pages_per_seq})"
        )
    _check_fits(cfg, (pages + 1) * page_bytes, "kv_cache_memory_gb", budget)
    return pages + 1


def _check_fits(cfg: EngineConfig, pool_bytes: int, field: str, value) -> None:
    """Refuse a pool larger than the device's whole memory before allocating it: the allocator's
    own failure is a RuntimeError (or the OOM killer) that names no setting."""
    device = cfg.resolve_device()
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # no sysconf: let the allocator decide
            return
    if pool_bytes > total:
        raise ValueError(
            f"{field}={value}: the KV pool would take {pool_bytes / 2**30:.1f} GiB, more than "
            f"the {total / 2**30:.1f} GiB of {device.type} memory; lower {field}"
        )


@torch.no_grad()
def dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights for `load_format="dummy"`: N(0, 0.02) matrices, unit norms (a (1 + w)
    norm's w = 0), seeded."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)
    for module in model.modules():
        if isinstance(module, ZeroCentredRMSNorm):
            module.weight.zero_()
