"""Paged attention over the KV pool, behind one interface (`AttentionBackend`).

The batch is a packed list of rows: each sequence contributes `query_len` consecutive rows (a
prefill chunk, one decode row, or later K+1 verify rows) whose queries attend causally to every
cached key of that sequence up to and including their own position. `AttentionMetadata` describes
the packing once per step; every layer reuses it.

`TorchPagedAttention` is the reference path: it gathers each sequence's keys from its pages into a
padded [B, max_kv] view and runs SDPA with a mask. It runs anywhere and is the oracle that GPU
kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Describes one packed forward. Built on the host by the runner, then moved to the device.

    NOTE: page 0 of the pool is the dummy page: padded rows write their K/V there and padded
    block-table entries point there, so no padded row can touch a live sequence's pages.
    """

    # [T] flat slot (page * page_size + offset) each row's K/V is written to
    slot_mapping: torch.Tensor
    # [T] position of each row; keys at positions <= this are visible to it
    positions: torch.Tensor
    # [B+1] row offsets of each sequence in the packed batch
    query_start_loc: torch.Tensor
    # [B] number of keys of each sequence after this step's rows are written
    seq_lens: torch.Tensor
    # [B, max_pages] page ids of each sequence (padded with the dummy page 0)
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    page_size: int
    # Reference-path gather indices, derived once per step (see `build_reference_indices`).
    q_index: torch.Tensor | None = None  # [B, max_q] row of each padded query (0 for padding)
    q_valid: torch.Tensor | None = None  # [B, max_q] bool
    kv_slots: torch.Tensor | None = None  # [B, max_kv] flat slot of each key (0 for padding)
    kv_valid: torch.Tensor | None = None  # [B, max_kv] bool: a real key (not padding)
    mask: torch.Tensor | None = None  # [B, 1, max_q, max_kv] bool: key visible to query
    row_seq: torch.Tensor | None = None  # [T] sequence index of each packed row
    row_offset: torch.Tensor | None = None  # [T] index of each row within its sequence

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


class AttentionBackend(Protocol):
    """The one seam between the model and the attention kernel.

    `prepare` derives whatever per-step index tensors the kernel needs (once per forward);
    `forward` writes this step's K/V into the layer's cache (unless `kv_written`: a glue kernel
    before it already did) and returns the attention output.
    """

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_written: bool = False,
    ) -> torch.Tensor: ...


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    """kv_cache [2, num_pages, page_size, Hkv, D]; k, v [T, Hkv, D]; slots [T] flat slots."""
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    flat[0].index_copy_(0, slots, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v.to(kv_cache.dtype))


class TorchPagedAttention:
    """Reference paged attention: gather pages into a padded view, SDPA with a boolean mask.

    `invariant` (the engine's deterministic mode): SDPA in float64, rounded once. The CPU's
    attention kernels block the keys and the query rows by how many there are, so a float32 row
    rounds by what shares its step; in float64 it is within about 1e-16 of exact either way."""

    def __init__(self, invariant: bool = False) -> None:
        self.invariant = invariant

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        device = meta.slot_mapping.device
        num_seqs = meta.num_seqs
        starts = meta.query_start_loc[:-1]  # [B]
        q_lens = meta.query_start_loc[1:] - starts  # [B]
        total_rows = meta.slot_mapping.shape[0]
        # Row -> (sequence, offset within the sequence's rows).
        # output_size: no host sync, so this also runs inside a CUDA graph capture
        row_seq = torch.repeat_interleave(
            torch.arange(num_seqs, device=device), q_lens, output_size=total_rows
        )
        row_offset = torch.arange(total_rows, device=device) - starts[row_seq]
        max_q = max(meta.max_query_len, 1)
        offs = torch.arange(max_q, device=device)
        q_valid = offs[None, :] < q_lens[:, None]  # [B, max_q]
        q_index = torch.where(q_valid, starts[:, None] + offs[None, :], 0)
        max_kv = max(meta.max_seq_len, 1)
        kv_pos = torch.arange(max_kv, device=device)  # [max_kv]
        page_of = meta.block_tables.gather(
            1,
            (kv_pos // meta.page_size)
            .clamp(max=meta.block_tables.shape[1] - 1)
            .expand(num_seqs, -1),
        )
        kv_valid = kv_pos[None, :] < meta.seq_lens[:, None]  # [B, max_kv]
        kv_slots = torch.where(kv_valid, page_of * meta.page_size + kv_pos % meta.page_size, 0)
        q_pos = meta.positions[q_index]  # [B, max_q]
        mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & kv_valid[:, None, :]
        # Padded query rows see key 0 so SDPA never normalises an empty row (NaN); they are dropped.
        mask = mask | (~q_valid[:, :, None] & (kv_pos == 0)[None, None, :])
        meta.q_index, meta.q_valid, meta.kv_slots = q_index, q_valid, kv_slots
        meta.kv_valid = kv_valid
        meta.mask = mask.unsqueeze(1)
        meta.row_seq, meta.row_offset = row_seq, row_offset
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D]."""
        if not kv_written:
            write_kv(kv_cache, k, v, meta.slot_mapping)
        flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
        keys = flat[0][meta.kv_slots].to(q.dtype)  # [B, max_kv, Hkv, D]
        values = flat[1][meta.kv_slots].to(q.dtype)
        # Padded key positions read the dummy page: zero them, or a NaN parked there would
        # reach every row through 0 * NaN (a masked score does not stop it in the values).
        valid = meta.kv_valid[:, :, None, None]
        keys, values = keys.masked_fill(~valid, 0.0), values.masked_fill(~valid, 0.0)
        queries = q[meta.q_index]  # [B, max_q, Hq, D]
        wide = self.invariant and q.dtype != torch.float64
        if wide:
            queries, keys, values = queries.double(), keys.double(), values.double()
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=meta.mask,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # [B, Hq, max_q, D]
        out = out.transpose(1, 2)[meta.row_seq, meta.row_offset]
        return out.to(q.dtype) if wide else out
