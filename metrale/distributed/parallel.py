"""The tensor-parallel group of one engine and how a dense Qwen3 target splits across it.

Rank 0 is the engine's own process (scheduler, drafter, sampling); ranks 1..N-1 are workers. The
group is torch.distributed's default one: gloo on CPU, NCCL on CUDA, every collective under the
group's timeout, so a rank that dies ends the engine with an error instead of a hang.

Splits (Megatron's, as vLLM's): attention heads and the MLP's intermediate rows across ranks
(column parallel q/k/v and gate/up, row parallel o and down with one all-reduce each), KV heads
across ranks too, or each rank holding the one KV head its query heads read when there are fewer
KV heads than ranks; the vocabulary of the embedding and the head across ranks (the embedding
all-reduces, the head's logits are gathered).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from metrale.config import ModelConfig


class DistributedError(RuntimeError):
    """A tensor-parallel rank failed or stopped answering: the engine cannot go on."""


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's [..., n] -> [..., size * n], in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def check_tp(cfg: ModelConfig, size: int) -> None:
    """A ValueError naming what does not divide across `size` ranks."""
    for name, value in (
        ("num_attention_heads", cfg.num_attention_heads),
        ("intermediate_size", cfg.intermediate_size),
        ("vocab_size", cfg.vocab_size),
    ):
        if value % size:
            raise ValueError(
                f"tensor_parallel_size={size}: the model's {name}={value} does not split"
            )
    kv = cfg.num_key_value_heads
    if kv % size and size % kv:
        raise ValueError(
            f"tensor_parallel_size={size}: num_key_value_heads={kv} neither splits across the "
            "ranks nor divides them"
        )


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shapes one rank holds."""
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // size,
        num_key_value_heads=max(cfg.num_key_value_heads // size, 1),
        intermediate_size=cfg.intermediate_size // size,
        vocab_size=cfg.vocab_size // size,
    )


def kv_heads_of(cfg: ModelConfig, rank: int, size: int) -> tuple[int, int]:
    """(first KV head, count) that `rank` holds: its share, or the one its query heads read."""
    kv = cfg.num_key_value_heads
    if kv >= size:
        return rank * (kv // size), kv // size
    return rank * kv // size, 1


def shard_ranges(cfg: ModelConfig, rank: int, size: int) -> dict[str, tuple[int, int, int]]:
    """HF weight suffix -> (dim, start, stop) of the slice `rank` reads; suffixes not named
    are read whole (norms, and biases of row-parallel layers)."""
    d = cfg.head_dim
    q = cfg.num_attention_heads // size
    kv_first, kv_count = kv_heads_of(cfg, rank, size)
    inter = cfg.intermediate_size // size
    vocab = cfg.vocab_size // size
    q_rows = (rank * q * d, (rank + 1) * q * d)
    kv_rows = (kv_first * d, (kv_first + kv_count) * d)
    i_rows = (rank * inter, (rank + 1) * inter)
    out = {
        "q_proj.weight": (0, *q_rows),
        "q_proj.bias": (0, *q_rows),
        "k_proj.weight": (0, *kv_rows),
        "k_proj.bias": (0, *kv_rows),
        "v_proj.weight": (0, *kv_rows),
        "v_proj.bias": (0, *kv_rows),
        "o_proj.weight": (1, *q_rows),
        "gate_proj.weight": (0, *i_rows),
        "up_proj.weight": (0, *i_rows),
        "down_proj.weight": (1, *i_rows),
        "embed_tokens.weight": (0, rank * vocab, (rank + 1) * vocab),
        "lm_head.weight": (0, rank * vocab, (rank + 1) * vocab),
    }
    return out


def selector(cfg: ModelConfig, rank: int, size: int):
    """For the loader: checkpoint name -> (dim, start, stop) to read, or None (whole)."""
    ranges = shard_ranges(cfg, rank, size)

    def select(name: str) -> tuple[int, int, int] | None:
        for suffix, rng in ranges.items():
            if name.endswith("." + suffix) or name == suffix:
                return rng
        return None

    return select
