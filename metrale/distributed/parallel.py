"""The tensor-parallel group of one engine and how a dense Qwen3 target splits across it.

Rank 0 is the engine's own process (scheduler, drafter, sampling); ranks 1..N-1 are workers.
gloo on CPU, NCCL on CUDA; every collective of the forward runs in a group with the engine's
`distributed_timeout_s`, so a rank that dies ends the engine with an error instead of a hang
(forming the group, which waits for the workers to start and build, has more patience).

Splits (Megatron's, as vLLM's): attention heads and the MLP's intermediate rows across ranks
(column parallel q/k/v and gate/up, row parallel o and down with one all-reduce each), KV heads
across ranks too, or each rank holding the one KV head its query heads read when there are fewer
KV heads than ranks; the vocabulary of the embedding and the head across ranks (the embedding
all-reduces, the head's logits are gathered).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from metrale.config import ModelConfig


class DistributedError(RuntimeError):
    """A tensor-parallel rank failed or stopped answering: the engine cannot go on."""


# The process group the forward's collectives run in, under `distributed_timeout_s`; the default
# group, formed with a start-up's patience, only forms it (`startup._init_group`).
_collectives: dist.ProcessGroup | None = None


def set_collective_group(group: dist.ProcessGroup | None) -> None:
    global _collectives
    _collectives = group


@dataclass(frozen=True)
class TPGroup:
    """One rank's place in the group; `expert_parallel`: a hybrid's experts are split across
    the ranks (each holds whole experts) rather than each expert across them (each holds a
    slice of every expert, as an MLP is split)."""

    rank: int
    size: int
    expert_parallel: bool = False

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=_collectives)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's [..., n] -> [..., size * n], in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=_collectives)
        return torch.cat(parts, dim=-1)


def _splits(cfg: ModelConfig, expert_parallel: bool) -> list[tuple[str, int]]:
    """(field, value) of everything a rank holds a share of."""
    h = cfg.hybrid
    out = [("num_attention_heads", cfg.num_attention_heads), ("vocab_size", cfg.vocab_size)]
    # (a hybrid's dense MLP width only where a layer has a dense MLP: found in review, one
    # whose every layer is MoE was refused for a width it never uses)
    if h is None or not all(h.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        out.insert(1, ("intermediate_size", cfg.intermediate_size))
    if h is not None:
        out += [
            ("linear_num_key_heads", h.linear_num_key_heads),
            ("linear_num_value_heads", h.linear_num_value_heads),
            ("shared_expert_intermediate_size", h.shared_expert_intermediate_size),
            ("num_experts", h.num_experts)
            if expert_parallel
            else ("moe_intermediate_size", h.moe_intermediate_size),
        ]
    return out


def check_tp(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """A ValueError naming what does not divide across `size` ranks."""
    for name, value in _splits(cfg, expert_parallel):
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


def local_config(cfg: ModelConfig, tp: TPGroup) -> ModelConfig:
    """The shapes one rank holds. A hybrid's `num_experts` stays the router's width: with
    expert parallelism each rank holds `num_experts / size` whole experts
    (`layers.ParallelSparseMoeBlock`), else a `moe_intermediate_size / size` slice of each."""
    size, hybrid = tp.size, cfg.hybrid
    if hybrid is not None:
        moe = hybrid.moe_intermediate_size
        hybrid = dataclasses.replace(
            hybrid,
            linear_num_key_heads=hybrid.linear_num_key_heads // size,
            linear_num_value_heads=hybrid.linear_num_value_heads // size,
            shared_expert_intermediate_size=hybrid.shared_expert_intermediate_size // size,
            moe_intermediate_size=moe if tp.expert_parallel else moe // size,
        )
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // size,
        num_key_value_heads=max(cfg.num_key_value_heads // size, 1),
        intermediate_size=cfg.intermediate_size // size,
        vocab_size=cfg.vocab_size // size,
        hybrid=hybrid,
    )


def kv_heads_of(cfg: ModelConfig, rank: int, size: int) -> tuple[int, int]:
    """(first KV head, count) that `rank` holds: its share, or the one its query heads read."""
    kv = cfg.num_key_value_heads
    if kv >= size:
        return rank * (kv // size), kv // size
    return rank * kv // size, 1


def experts_of(cfg: ModelConfig, tp: TPGroup) -> tuple[int, int]:
    """(first expert, count) that a rank holds: its share with expert parallelism, else all."""
    total = cfg.hybrid.num_experts if cfg.hybrid is not None else 0
    if not tp.expert_parallel:
        return 0, total
    return tp.rank * (total // tp.size), total // tp.size


Ranges = list[tuple[int, int, int]]


def _share(rank: int, total: int, size: int, unit: int = 1) -> tuple[int, int]:
    n = total // size * unit
    return rank * n, (rank + 1) * n


def shard_ranges(cfg: ModelConfig, tp: TPGroup) -> dict[str, Ranges]:
    """HF weight suffix -> the (dim, start, stop) slices `rank` reads, concatenated; suffixes
    not named are read whole (norms, routers, biases of row-parallel layers). The more specific
    suffixes come first."""
    rank, size = tp.rank, tp.size
    d = cfg.head_dim
    # a Qwen3-Next q_proj holds each head's query then its gate
    q_rows = _share(rank, cfg.num_attention_heads, size, d * (2 if cfg.hybrid else 1))
    q_cols = _share(rank, cfg.num_attention_heads, size, d)
    kv_first, kv_count = kv_heads_of(cfg, rank, size)
    kv_rows = (kv_first * d, (kv_first + kv_count) * d)
    i_rows = _share(rank, cfg.intermediate_size, size)
    vocab = _share(rank, cfg.vocab_size, size)
    out: dict[str, Ranges] = {}
    h = cfg.hybrid
    if h is not None:
        s_rows = _share(rank, h.shared_expert_intermediate_size, size)
        e_first, e_count = experts_of(cfg, tp)
        moe = h.moe_intermediate_size
        m_rows = _share(rank, moe, size)
        hk, hv, dk, dv = (
            h.linear_num_key_heads,
            h.linear_num_value_heads,
            h.linear_key_head_dim,
            h.linear_value_head_dim,
        )
        per_key = 2 * dk + 2 * (hv // hk) * dv  # in_proj_qkvz rows of one key head's group
        keys, values = _share(rank, hk, size, dk), _share(rank, hv, size, dv)
        out |= {
            "shared_expert.gate_proj.weight": [(0, *s_rows)],
            "shared_expert.up_proj.weight": [(0, *s_rows)],
            "shared_expert.down_proj.weight": [(1, *s_rows)],
        }
        if tp.expert_parallel:  # whole experts: a range of them
            out |= {
                "experts.gate_up_proj": [(0, e_first, e_first + e_count)],
                "experts.down_proj": [(0, e_first, e_first + e_count)],
            }
        else:  # every expert's slice: its gate rows and its up rows, its down columns
            out |= {
                "experts.gate_up_proj": [(1, *m_rows), (1, moe + m_rows[0], moe + m_rows[1])],
                "experts.down_proj": [(2, *m_rows)],
                ".experts.*.gate_proj.weight": [(0, *m_rows)],
                ".experts.*.up_proj.weight": [(0, *m_rows)],
                ".experts.*.down_proj.weight": [(1, *m_rows)],
            }
        out |= {
            "in_proj_qkvz.weight": [(0, *_share(rank, hk, size, per_key))],
            "in_proj_ba.weight": [(0, *_share(rank, hk, size, 2 * (hv // hk)))],
            # the conv's channels: q of every key head, k of every key head, v of every value head
            "conv1d.weight": [
                (0, *keys),
                (0, hk * dk + keys[0], hk * dk + keys[1]),
                (0, 2 * hk * dk + values[0], 2 * hk * dk + values[1]),
            ],
            "dt_bias": [(0, *_share(rank, hv, size))],
            "A_log": [(0, *_share(rank, hv, size))],
            "linear_attn.out_proj.weight": [(1, *values)],
        }
    out |= {
        "q_proj.weight": [(0, *q_rows)],
        "q_proj.bias": [(0, *q_rows)],
        "k_proj.weight": [(0, *kv_rows)],
        "k_proj.bias": [(0, *kv_rows)],
        "v_proj.weight": [(0, *kv_rows)],
        "v_proj.bias": [(0, *kv_rows)],
        "o_proj.weight": [(1, *q_cols)],
        "gate_proj.weight": [(0, *i_rows)],
        "up_proj.weight": [(0, *i_rows)],
        "down_proj.weight": [(1, *i_rows)],
        "embed_tokens.weight": [(0, *vocab)],
        "lm_head.weight": [(0, *vocab)],
    }
    return out


_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(.*)")


def selector(cfg: ModelConfig, tp: TPGroup):
    """For the loader: checkpoint name -> the slices to read, or None (whole)."""
    ranges = shard_ranges(cfg, tp)

    def select(name: str) -> Ranges | None:
        m = _EXPERT.fullmatch(name)
        if m is not None:  # one expert's tensor: whole (if the rank holds it), or its slice
            return ranges.get(f".experts.*.{m.group(3)}")
        for suffix, parts in ranges.items():
            if name.endswith("." + suffix) or name == suffix:
                return parts
        return None

    return select


def expert_renamer(cfg: ModelConfig, tp: TPGroup):
    """For the loader: a per-expert tensor of an expert this rank holds, renamed to its local
    index; those of other ranks' experts skipped; anything else kept as is."""
    first, count = experts_of(cfg, tp)

    def rename(name: str) -> str | None:
        m = _EXPERT.fullmatch(name)
        if m is None:
            return name
        e = int(m.group(2)) - first
        return f"{m.group(1)}.{e}.{m.group(3)}" if 0 <= e < count else None

    return rename
