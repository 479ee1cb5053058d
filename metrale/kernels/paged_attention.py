"""Paged attention on CUDA, as one Triton kernel for decode, verify and prefill rows.

Decode and verify: one program per (sequence, KV head) reads that head's pages once, for all of
the sequence's query rows (a decode row, or the last token plus its drafts) and all query heads
sharing the KV head (GQA): the tile is [BLOCK_Q rows x GROUP heads, D] against each
[TILE_KEYS, D] block of keys gathered over pages (`kernels/kv_tiles.py`), with an online
softmax, and row r sees keys up to its own position (causal within the verify rows). When few
sequences run, each (sequence, head) is split over its pages into `num_splits` programs
(flash-decoding) and a second kernel combines their partial softmaxes.

Prefill chunks (more than MAX_KERNEL_ROWS rows in a sequence) tile the query rows instead: each
program takes one tile of PREFILL_TILE_ROWS (rows x heads), which reads the pages up to its last
row's position only (causal). The tiles are numbered across the step (`_tile_of`), sequence after
sequence, so the grid is the step's rows / tile rows + its sequences, whatever the longest
sequence: a prefill program (whose longest sequence is unknown at capture, so the grid used to
be sequences x its rows / tile rows) holding a verify of 64 sequences beside a short prompt had
thousands of programs per layer that found no row, 2 of its 10 ms on an H100. Every shape runs
the same compiled kernel, so a step that mixes prefill chunks with decode or verify rows costs no
per-shape set-up (the torch reference's SDPA built a cuDNN plan for each new padded shape: about
15 ms a step on the H200).
`models/attention.TorchPagedAttention` stays the kernel's test oracle and the CPU path.

Nothing here runs without CUDA and Triton; `TritonPagedAttention` falls back to the reference for
what it does not cover.
"""

from __future__ import annotations

import functools
import os

import torch

from metrale.kernels import kv_tiles, pdl
from metrale.kernels.invariant_attention import invariant_attention
from metrale.kernels.kv_tiles import tile_scores
from metrale.models.attention import AttentionMetadata, TorchPagedAttention, write_kv

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the reference path serves
    triton = None

# Under the Triton interpreter the kernels run on CPU tensors (the CPU tests use it).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Rows per sequence held in one tile (a verify of K = 15 drafts); more rows are tiled (prefill).
MAX_KERNEL_ROWS = 16
# Tile rows (query rows x heads of a GQA group) of a prefill program.
PREFILL_TILE_ROWS = 64

if triton is not None:
    from metrale.kernels.pdl import pdl_prologue

    @triton.jit
    def _tile_of(starts_ptr, num_seqs, BLOCK_Q: tl.constexpr):
        """(sequence, its first row) of this program's query tile, when tiles are numbered
        across the step: sequence s's tiles start at tile starts[s] // BLOCK_Q + s (room for
        its rows' tiles, one more for where they straddle a tile boundary), so the sequence is
        the last whose first tile is at most this one (a binary search). A tile past its
        sequence's rows (that spare one, or a sequence with none) gets a first row past them."""
        tile = tl.program_id(0)
        lo = tile * 0
        hi = lo + num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            before = tl.load(starts_ptr + mid) // BLOCK_Q + mid <= tile
            lo = tl.where(before, mid, lo)
            hi = tl.where(before, hi, mid)
        return lo, (tile - (tl.load(starts_ptr + lo) // BLOCK_Q + lo)) * BLOCK_Q

    # Not specialised on the step's metadata (the block table's width, and the addresses of
    # views into one packed buffer, 16-byte aligned or not with the step's row and sequence
    # counts): specialised, an eager step of a new kind compiled the kernel again inside a
    # running step, which a prefix-cached serving load kept meeting. They are
    # read one scalar at a time, so the specialisation bought nothing. The number of sequences
    # likewise: a step of one sequence would have compiled a kernel of its own.
    @triton.jit(do_not_specialize=["tables_ptr", "starts_ptr", "lens_ptr", "stride_bt", "num_seqs"])
    def _paged_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        part_ml_ptr,
        part_acc_ptr,
        tables_ptr,
        starts_ptr,
        lens_ptr,
        scale,
        stride_qt,
        stride_qh,
        stride_cp,
        stride_co,
        stride_ch,
        stride_bt,
        stride_ot,
        stride_oh,
        num_seqs,
        NUM_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_P: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        D: tl.constexpr,
        PAGE: tl.constexpr,
        TILE_PAGES: tl.constexpr,
        SPLITS: tl.constexpr,
        Q_TILED: tl.constexpr,
        PRECISION: tl.constexpr,
        DOT_F32: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        kvh = tl.program_id(1)
        if Q_TILED:  # axis 0: a tile of query rows of the whole step
            seq, first_row = _tile_of(starts_ptr, num_seqs, BLOCK_Q)
            split = 0
        else:  # axis 0: the sequence; axis 2: its KV split
            seq = tl.program_id(0)
            first_row = 0
            split = tl.program_id(2)
        start = tl.load(starts_ptr + seq)
        q_len = tl.load(starts_ptr + seq + 1) - start
        seq_len = tl.load(lens_ptr + seq)
        # tile row = query row * GROUP_P + head in group (GROUP padded to a power of two)
        m_idx = tl.arange(0, BLOCK_Q * GROUP_P)
        row = first_row + m_idx // GROUP_P
        head = kvh * GROUP + m_idx % GROUP_P
        row_ok = (row < q_len) & (m_idx % GROUP_P < GROUP)
        pos = seq_len - q_len + row  # each query row's position
        d = tl.arange(0, D)
        q = tl.load(
            q_ptr + (start + row)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_P, D], tl.float32)
        num_pages = tl.cdiv(seq_len, PAGE)
        if Q_TILED:
            # causal: the pages up to the tile's last row (none for a tile past the rows)
            last_row = tl.minimum(first_row + BLOCK_Q, q_len)
            first = 0
            end = tl.where(first_row < q_len, tl.cdiv(seq_len - q_len + last_row, PAGE), 0)
        else:
            # This program's share of the sequence's pages (all of them when SPLITS == 1), whole
            # tiles but the last.
            per_split = tl.cdiv(tl.cdiv(num_pages, SPLITS), TILE_PAGES) * TILE_PAGES
            first = split * per_split
            end = tl.minimum(first + per_split, num_pages)
        for p in range(first, end, TILE_PAGES):
            v, probs, alpha, m_new = tile_scores(
                q, m_i, k_ptr, v_ptr, tables_ptr, seq, kvh, p, end, pos, row_ok, seq_len,
                scale, stride_cp, stride_co, stride_ch, stride_bt,
                D, PAGE, TILE_PAGES, PRECISION, DOT_F32,
            )  # fmt: skip
            l_i = l_i * alpha + tl.sum(probs, axis=1)
            pv = tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv.to(tl.float32)
            m_i = m_new
        if SPLITS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(
                out_ptr
                + (start + row)[:, None] * stride_ot
                + head[:, None] * stride_oh
                + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None],
            )
        else:
            # Partial results: (running max, normaliser) and the unnormalised accumulator,
            # combined over the splits by `_combine_splits_kernel`.
            part = ((start + row) * NUM_HEADS + head) * SPLITS + split  # [tile]
            tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
            tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None])

    @triton.jit
    def _combine_splits_kernel(
        part_ml_ptr,
        part_acc_ptr,
        out_ptr,
        stride_ot,
        stride_oh,
        NUM_HEADS: tl.constexpr,
        D: tl.constexpr,
        SPLITS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        row = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, SPLITS)
        d = tl.arange(0, D)
        part = (row * NUM_HEADS + head) * SPLITS + s
        m = tl.load(part_ml_ptr + part * 2)
        l_s = tl.load(part_ml_ptr + part * 2 + 1)
        acc = tl.load(part_acc_ptr + part[:, None] * D + d[None, :])
        m_max = tl.max(m, axis=0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no split saw a key
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
        total = tl.sum(l_s * w, axis=0)
        # A row that sees no key (only a capture-time dummy row can) gets 0, not 0 / 0.
        out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


# Programs a step should launch at least, per streaming multiprocessor (latency hiding).
PROGRAMS_PER_SM = 2
MAX_SPLITS = 16


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H100/H200's count, for interpreted runs on CPU
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(num_seqs: int, kv_heads: int, device: torch.device) -> int:
    """KV splits per (sequence, KV head): a power of two that fills the GPU when few sequences
    run (one program per sequence and head would leave most multiprocessors idle at batch 1).

    NOTE: it depends on the batch only through next_pow2(num_seqs), which a padded decode bucket
    leaves unchanged, so a decode step splits, and rounds, alike eagerly and replayed. A verify
    padded per depth may not (the eager path only serves tables the graph cache refused)."""
    programs = (1 << (num_seqs - 1).bit_length()) * kv_heads
    wanted = -(-PROGRAMS_PER_SM * _multiprocessors(device) // programs)
    return min(1 << (wanted - 1).bit_length() if wanted > 1 else 1, MAX_SPLITS)


def triton_available(head_dim: int) -> bool:
    """The kernel runs here for this head size (CUDA, Triton, a power of two >= 16)."""
    return (
        triton is not None
        and torch.cuda.is_available()
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
    )


class TritonPagedAttention(TorchPagedAttention):
    """The Triton kernel for every batch it covers (CUDA, or the interpreter; pages of a power
    of two >= 16 rows); the torch reference (this class's parent) otherwise.

    `invariant` (the engine's deterministic mode): `kernels/invariant_attention.py`, whose KV
    splits sit at fixed positions, so a row's output depends on its query and keys alone. Here
    the KV split follows the number of sequences (`num_splits`) and a step with a prompt chunk
    tiles every sequence's rows, so a row's rounding depends on what shares its step."""

    def __init__(self, invariant: bool = False) -> None:
        super().__init__(invariant)
        # the invariant kernel's decode and verify tile: the most rows a sequence brings to a
        # decode or verify step (the engine sets 1 + its drafts, a power of two); longer query
        # runs (prompt chunks) take the prompt tiles
        self.invariant_rows = MAX_KERNEL_ROWS

    def _kernel_covers(self, meta: AttentionMetadata) -> bool:
        # tl.dot tiles need 16+ keys per page; head_dim a power of two >= 16 (checked at init).
        return (
            meta.page_size >= 16
            and meta.page_size & (meta.page_size - 1) == 0
            and (meta.slot_mapping.is_cuda or INTERPRETED)
        )

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta if self._kernel_covers(meta) else super().prepare(meta)

    def forward(
        self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, kv_written: bool = False
    ) -> torch.Tensor:
        if not self._kernel_covers(meta):
            return super().forward(q, k, v, kv_cache, meta, scale, kv_written)
        if not kv_written:
            write_kv(kv_cache, k, v, meta.slot_mapping)
        if self.invariant:
            return invariant_attention(
                q.to(kv_cache.dtype),
                kv_cache[0],
                kv_cache[1],
                meta,
                scale,
                max_rows=self.invariant_rows,
                prompt_tile_rows=PREFILL_TILE_ROWS,
                interpreted=INTERPRETED,
                # the same bits either way; once the sequences' heads outnumber the
                # multiprocessors, splitting their keys over programs costs more than it hides
                fused=meta.num_seqs * k.shape[1] >= _multiprocessors(q.device),
            )
        heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
        group = heads // kv_heads
        group_p = triton.next_power_of_2(group)
        tiled = meta.max_query_len > MAX_KERNEL_ROWS
        if tiled:  # prefill: tiles of query rows, one program each
            block_q = max(PREFILL_TILE_ROWS // group_p, 1)
        else:  # tl.dot needs 16+ tile rows: with few heads per group, pad the query rows
            block_q = max(triton.next_power_of_2(meta.max_query_len), max(1, 16 // group_p))
        out = torch.empty_like(q)
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [pages, page, Hkv, D]
        q = q.to(k_cache.dtype)
        splits = 1 if tiled else num_splits(meta.num_seqs, kv_heads, q.device)
        rows = q.shape[0]
        if tiled:  # every sequence's tiles, numbered across the step (`_tile_of`)
            grid = (rows // block_q + meta.num_seqs, kv_heads, 1)
        else:
            grid = (meta.num_seqs, kv_heads, splits)
        if splits > 1:
            part_ml = torch.empty(rows, heads, splits, 2, dtype=torch.float32, device=q.device)
            part_acc = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=q.device)
        else:
            part_ml = part_acc = out  # unused
        _paged_attention_kernel[grid](
            q,
            k_cache,
            v_cache,
            out,
            part_ml,
            part_acc,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            meta.block_tables.stride(0),
            out.stride(0),
            out.stride(1),
            meta.num_seqs,
            NUM_HEADS=heads,
            GROUP=group,
            GROUP_P=group_p,
            BLOCK_Q=block_q,
            D=dim,
            PAGE=k_cache.shape[1],
            TILE_PAGES=kv_tiles.tile_pages(
                k_cache.shape[1],
                kv_tiles.TILE_KEYS,
                rows=block_q * group_p,
                dim=dim,
                elem_bytes=k_cache.element_size(),
                shared=kv_tiles.shared_budget(q.device),
            ),
            SPLITS=splits,
            Q_TILED=tiled,
            PRECISION="ieee" if q.dtype == torch.float32 or INTERPRETED else "tf32",
            DOT_F32=INTERPRETED,
            num_warps=kv_tiles.NUM_WARPS,
            num_stages=kv_tiles.NUM_STAGES,
            **pdl.launch(q),
        )
        if splits > 1:
            _combine_splits_kernel[(rows, heads)](
                part_ml,
                part_acc,
                out,
                out.stride(0),
                out.stride(1),
                NUM_HEADS=heads,
                D=dim,
                SPLITS=splits,
                **pdl.launch(q),
            )
        return out
