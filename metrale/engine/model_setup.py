"""Building a runner's model and KV pool: the target with its weights (or rank 0's shard), the
drafters' view of its vocabulary, the default dtype while modules are made, the pool size
that the memory budget affords, the pool itself (a device without room for it is a ValueError
naming the settings that size it), and seeded random weights for `load_format="dummy"`."""

from __future__ import annotations

import contextlib
import math
import os
import zlib

import torch

from metrale.config import EngineConfig, ModelConfig
from metrale.distributed.parallel import TPGroup, local_config
from metrale.engine.kv_cache import allocate_kv_cache, kv_page_bytes
from metrale.models.layers import HiddenTaps
from metrale.models.loader import load_weights
from metrale.models.qwen3 import Qwen3ForCausalLM
from metrale.models.qwen3_next import Qwen3NextForCausalLM, ZeroCentredRMSNorm


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
    pages_per_seq = _pages_per_seq(cfg, max_model_len, lookahead)
    wanted = cfg.max_num_seqs * pages_per_seq
    # a target without attention layers (an all-GDN hybrid) keeps no KV: pages are free
    budget = cfg.kv_cache_memory_gb if budget_gb is None else budget_gb
    affordable = int(budget * 2**30) // page_bytes if page_bytes else wanted
    pages = min(wanted, affordable)
    if pages < pages_per_seq:
        field = "kv_cache_memory_gb" if budget_gb is None else "gpu_memory_utilization"
        raise ValueError(
            f"{field}: the KV budget of {budget:.3g} GiB holds {pages} pages of "
            f"{cfg.page_size} tokens, fewer than one sequence of max_model_len={max_model_len} "
            f"needs ({pages_per_seq}); raise it, or lower max_model_len"
        )
    _check_fits(cfg, (pages + 1) * page_bytes, "kv_cache_memory_gb", budget)
    return pages + 1


def _pages_per_seq(cfg: EngineConfig, max_model_len: int, lookahead: int) -> int:
    return -(-(max_model_len + lookahead) // cfg.page_size)


def pages_wanted(cfg: EngineConfig, max_model_len: int, lookahead: int) -> int:
    """The pool's pages when no budget caps it: `max_num_seqs` full-length sequences (their
    lookahead included), plus the dummy page."""
    return cfg.max_num_seqs * _pages_per_seq(cfg, max_model_len, lookahead) + 1


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
def dummy_weights(
    model: torch.nn.Module, seed: int, rank: int = 0, whole: dict | None = None, size: int = 1
) -> None:
    """Random weights for `load_format="dummy"`: N(0, 0.02) matrices, unit norms (a (1 + w)
    norm's w = 0), each drawn from `seed` and its name, so a tensor-parallel rank's replicated
    tensors (a MoE router, a shared expert's gate) equal the other ranks' (drawn from one
    stream a rank, they differed, and so did the ranks' routing: found in review). `whole`:
    under tensor parallelism (`size` ranks), the one-rank model's shape of each name; a tensor
    this rank holds a share of takes its run of the whole tensor's values (the vocabulary's
    and column-parallel rows are exactly one rank's, and with fewer KV heads than ranks the
    ranks that read one head share its run; drawn by name alone, every rank held the same
    values and the logits tied in pairs)."""
    gen = torch.Generator(device=next(model.parameters()).device)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        # (named as in the target without its "model." root: a drafter's copy of the
        # embedding draws the target's values)
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.removeprefix("model.").encode()))
        shape = (whole or {}).get(name, param.shape)
        if tuple(shape) == tuple(param.shape):
            param.normal_(0.0, 0.02, generator=gen)
            continue
        values = torch.empty(math.prod(shape), dtype=param.dtype, device=param.device)
        values.normal_(0.0, 0.02, generator=gen)
        # runs of n: `total // n` of them (at least one) over `size` ranks, in order
        n, total = param.numel(), values.numel()
        start = rank * (total // n) // size * n
        param.copy_(values[start : start + n].view_as(param))
    for module in model.modules():
        if isinstance(module, ZeroCentredRMSNorm):
            module.weight.zero_()


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is an allocator failing for lack of memory: CUDA's `OutOfMemoryError`, a
    RuntimeError saying "out of memory", or the host allocator's "can't allocate memory"."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def kv_pool_error(
    cfg: EngineConfig,
    num_pages: int,
    pool_bytes: int,
    device: torch.device,
    wanted: int | None = None,
) -> ValueError:
    """The error for a KV pool the device had no room for, naming its size and the setting
    that bounded it (`wanted`: the pages `max_num_seqs` full-length sequences take, where
    known; it decided the size when the budget affords more), after handing a partial
    allocation's cached blocks back to the device (the caller drops what it allocated)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    size = f"{num_pages} pages, {pool_bytes} bytes = {_size(pool_bytes)}"
    on_cuda = device.type == "cuda" and cfg.gpu_memory_utilization is not None
    budget = "gpu_memory_utilization" if on_cuda else "kv_cache_memory_gb"
    if cfg.num_kv_pages is not None:
        what, how = f"num_kv_pages={num_pages}: the KV pool ({size})", "lower num_kv_pages"
    elif wanted is not None and num_pages >= wanted:
        what = f"the KV pool for max_num_seqs={cfg.max_num_seqs} full-length sequences ({size})"
        how = f"lower max_num_seqs or max_model_len, or {budget}, or set num_kv_pages"
    elif wanted is not None:
        what = f"the KV pool that {budget}={getattr(cfg, budget)} affords ({size})"
        how = f"lower {budget}, or set num_kv_pages"
    else:
        what = f"the KV pool ({size})"
        how = f"lower {budget}, max_num_seqs or max_model_len, or set num_kv_pages"
    return ValueError(f"{what} does not fit in the free {device.type} memory; {how}")


def allocate_kv_pools(
    parts: list[tuple[ModelConfig, int]],
    num_pages: int,
    cfg: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    beside: tuple[int, ...] | None = None,
    wanted: int | None = None,
) -> list:
    """One KV pool of `num_pages` pages per (model config, number of layers) in `parts`, and
    a zeroed pool of shape `beside` after them where given (the DFlash drafter's context K/V,
    paged like the KV). Out of memory: a ValueError naming the settings (`kv_pool_error`, of
    all of them together: the budget sized them together), the pools made before it dropped
    first (the error's traceback, which a REPL keeps, would hold them); any other failure is
    raised as it is."""
    pools: list = []
    try:
        for part_cfg, num_layers in parts:
            pools.append(
                allocate_kv_cache(part_cfg, num_pages, cfg.page_size, dtype, device, num_layers)
            )
        if beside is not None:
            pools.append(torch.zeros(beside, dtype=dtype, device=device))
    except RuntimeError as e:
        if not out_of_memory(e):
            raise
        pools.clear()
        pool_bytes = sum(num_pages * kv_page_bytes(c, cfg.page_size, dtype, n) for c, n in parts)
        pool_bytes += 0 if beside is None else math.prod(beside) * dtype.itemsize
        raise kv_pool_error(cfg, num_pages, pool_bytes, device, wanted) from e
    return pools


def build_target(
    model_dir,
    model_cfg: ModelConfig,
    cfg: EngineConfig,
    backend,
    positions: int,
    device: torch.device,
    dtype: torch.dtype,
):
    """The target model with its weights, and the config of the KV heads this process holds:
    the whole model, or under tensor parallelism rank 0's shard (its workers start once the KV
    pool is sized: `shard.start_workers`)."""
    if cfg.tensor_parallel_size > 1:
        from metrale.distributed.shard import build_model  # (it builds on this module)

        tp = TPGroup(0, cfg.tensor_parallel_size, cfg.expert_parallel)
        model = build_model(model_cfg, cfg, model_dir, backend, positions, tp, device, dtype)
        return model, local_config(model_cfg, tp)
    target_cls = Qwen3NextForCausalLM if model_cfg.hybrid is not None else Qwen3ForCausalLM
    with torch.device(device), default_dtype(dtype):
        model = target_cls(model_cfg, backend, positions)
    if cfg.load_format == "dummy":
        dummy_weights(model, cfg.seed)
    else:
        load_weights(model, model_dir)
    return model.eval(), model_cfg


class TargetVocab:
    """The target's embedding and head as a drafter uses them (`ModelRunner.vocab`)."""

    def __init__(self, model) -> None:
        self.model = model

    @property
    def embed_tokens(self):
        return self.model.model.embed_tokens

    def compute_logits(self, hidden, rows=None, out=None):
        return self.model.compute_logits(hidden, rows, out)


def attach_dflash(runner, cfg: EngineConfig, num_drafts: int) -> HiddenTaps:
    """The taps of the target layers the runner's DFlash drafter reads, set on its model: every
    forward writes its rows' context K/V into the drafter's pool (`runner.dflash_kv`, allocated
    with the KV pool and addressed by the same block tables), inside its own program (see
    `speculative/dflash.py`)."""
    d = runner.dflash.config
    rows = max(cfg.max_num_batched_tokens, cfg.max_num_seqs * (num_drafts + 1))
    if runner.graphs is not None:
        rows = max(rows, runner.graphs.cache.workspace.rows)
    taps = HiddenTaps(
        d.target_layer_ids,
        runner.model_cfg.hidden_size,
        rows,
        runner.device,
        runner.dtype,
        sink=lambda taps, positions, slots: runner.dflash.write_context(
            runner.dflash_kv, taps, positions, slots
        ),
    )
    runner.model.model.taps = taps
    return taps
