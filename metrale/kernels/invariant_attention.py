"""Batch-invariant paged attention for the deterministic mode (`EngineConfig.deterministic`).

A row's output must not depend on the rows and sequences beside it, nor on whether it is a
decode row, a verify row or a row of a prompt chunk. So the keys are cut into splits at fixed
positions (SPLIT_TOKENS each, counted from the sequence's first token, never from the batch):

- split s belongs to group s % GROUPS; a group's partial (running max m, normaliser l,
  unnormalised output acc) is one online softmax over its splits' keys in key order, a tile of
  TILE_KEYS keys at a time, in [tile rows, keys] matrix products;
- the row's output is the groups' partials merged in group order by `_merge`, then
  out = acc / l. The order is a function of positions alone.

Decode and verify sequences (at most MAX_KERNEL_ROWS rows) of a small batch run one program
per (sequence, KV head, group), which writes its group's partial; `_combine_kernel` merges them
(parallel over groups, as flash-decoding: a batch-1 step still spreads over the GPU, and a fixed
number of groups bounds the programs and the partials' memory at any context length). Prompt
chunks, and the decode and verify sequences of a batch that fills the GPU alone (`fused`), run
one program per (sequence, KV head, tile of rows), which computes the same group partials and
merges them in registers with the same `_merge`: the same arithmetic in the same order, so which
of the two runs a row never changes its bits, and the choice may follow the batch. A page past a
row's position, or a split past it, is an exact no-op of the online softmax and of the merge (its
weights are exp(-inf) = 0), so a verify row sees the bits of the same position decoded alone,
and a prompt row the bits it would get decoded.

Two details keep the arithmetic independent of the tile's shape (decode tiles follow the rows
per sequence): the row sums of the softmax are float32 products with a ones matrix, whose FMA
reduction runs in key order for any layout (a `tl.sum` reduces in an order set by the layout),
and the maxima are exact in any order. The products themselves run in 16-wide matrix steps, the
same for any tile (the batch-invariant GEMM's finding, `kernels/batch_invariant.py`).

The torch reference it must equal (to rounding) is `models/attention.TorchPagedAttention`, as for
`kernels/paged_attention.py`; the tests also pin each row to its position computed alone.
"""

from __future__ import annotations

import logging

import torch

from metrale.kernels import kv_tiles
from metrale.kernels.kv_tiles import tile_scores
from metrale.models.attention import AttentionMetadata

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the deterministic mode then runs the torch reference
    triton = None

log = logging.getLogger(__name__)

# Keys per split: a fixed count, so a position's split never depends on the batch.
SPLIT_TOKENS = 128
# Keys per step of a group's loop (a split holds whole tiles): a whole split, the H200's best
# of 64-256-key splits and 64-128-key tiles at batch 1-64 (`scripts/attention_kernel_bench.py`).
TILE_KEYS = 128
# Split groups: split s belongs to group s % GROUPS; a decode program computes one group (its
# splits merged in order) and the combine merges the groups in order. A fixed count bounds the
# programs and the partials' memory at any context length, and keeps the merge order a function
# of positions alone.
GROUPS = 16

# Arguments that change from step to step, on which the kernels are not specialised: the block
# table's row stride (its width in pages, a multiple of 16 or not) and the addresses of the
# step's metadata (an eager step's are views into one packed buffer, `staging.to_device_packed`,
# 16-byte aligned or not with the step's row and sequence counts). Specialised, every new
# combination compiled the three kernels again inside a running step, seconds each, and a
# prefix-cached serving load met new ones for minutes (its first turns waited on them). They
# are read one scalar at a time, so the specialisation bought nothing.
# Not specialised: step values (a new one would compile the kernel again inside a running step).
_STEP_ARGS = ["tables_ptr", "starts_ptr", "lens_ptr", "stride_bt"]
# Nor how the partials' rows are numbered (by the step's row or by sequence, whichever is fewer
# for the step): a decode step and a verify step run one binary, since two variants of the same
# arithmetic can round differently (as `fused.qk_norm_rope`'s two did on the H200).
_GROUP_ARGS = [*_STEP_ARGS, "ROW_BY_START"]

if triton is not None:

    @triton.jit
    def _merge(m, l_run, acc, m_s, l_s, acc_s):
        """The running partial (m, l_run, acc) merged with a later split's. Shared by the combine
        kernel and the prompt tiles so that both compile the same arithmetic."""
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m - m_safe)
        b = tl.exp(m_s - m_safe)
        return m_new, l_run * a + l_s * b, acc * a[:, None] + acc_s * b[:, None]

    @triton.jit
    def _tile_step(
        q, m_i, l_i, acc, k_ptr, v_ptr, tables_ptr, seq, kvh, p, end, pos, row_ok, seq_len,
        scale, stride_cp, stride_co, stride_ch, stride_bt,
        D: tl.constexpr, PAGE: tl.constexpr, TILE_PAGES: tl.constexpr,
        PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        """The online softmax (m_i, l_i, acc) of the tile's rows taken on over pages
        p .. p + TILE_PAGES - 1 (those before `end`)."""
        v, probs, alpha, m_new = tile_scores(
            q, m_i, k_ptr, v_ptr, tables_ptr, seq, kvh, p, end, pos, row_ok, seq_len, scale,
            stride_cp, stride_co, stride_ch, stride_bt, D, PAGE, TILE_PAGES, PRECISION, DOT_F32,
        )  # fmt: skip
        probs = probs.to(v.dtype)
        # the row sum as a product with ones, of the very weights the values get: a matrix
        # product reduces in key order whatever the layout (a `tl.sum` in the layout's order)
        ones = tl.full([TILE_PAGES * PAGE, 16], 1.0, v.dtype)
        row_sum = tl.max(tl.dot(probs, ones, input_precision=PRECISION).to(tl.float32), axis=1)
        pv = tl.dot(probs, v, input_precision=PRECISION)
        return m_new, l_i * alpha + row_sum, acc * alpha[:, None] + pv.to(tl.float32)

    @triton.jit
    def _tile_rows(seq, kvh, first_row, starts_ptr, lens_ptr, BLOCK_Q: tl.constexpr,
                   GROUP: tl.constexpr, GROUP_P: tl.constexpr):  # fmt: skip
        """The tile's rows (query row x head of the GQA group), their positions and validity."""
        start = tl.load(starts_ptr + seq)
        q_len = tl.load(starts_ptr + seq + 1) - start
        seq_len = tl.load(lens_ptr + seq)
        m_idx = tl.arange(0, BLOCK_Q * GROUP_P)
        row = first_row + m_idx // GROUP_P
        head = kvh * GROUP + m_idx % GROUP_P
        row_ok = (row < q_len) & (m_idx % GROUP_P < GROUP)
        return start, q_len, seq_len, row, head, row_ok, seq_len - q_len + row

    @triton.jit
    def _group_partial(
        q, k_ptr, v_ptr, tables_ptr, seq, kvh, group, end, pos, row_ok, seq_len, scale,
        stride_cp, stride_co, stride_ch, stride_bt,
        M: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, TILE_PAGES: tl.constexpr,
        SPLIT_PAGES: tl.constexpr, GROUPS: tl.constexpr, PRECISION: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):  # fmt: skip
        """Group `group`'s partial: one online softmax over the tiles of its splits (group,
        group + GROUPS, ...) of the first `end` pages, in key order, in one flat loop (a loop
        per split would leave each too short for the loads to run ahead)."""
        m = tl.full([M], float("-inf"), tl.float32)
        l_run = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D], tl.float32)
        per_split: tl.constexpr = SPLIT_PAGES // TILE_PAGES
        count = tl.cdiv(tl.maximum(tl.cdiv(end, SPLIT_PAGES) - group, 0), GROUPS)
        for f in range(0, count * per_split):
            p = (group + GROUPS * (f // per_split)) * SPLIT_PAGES + (f % per_split) * TILE_PAGES
            m, l_run, acc = _tile_step(
                q, m, l_run, acc, k_ptr, v_ptr, tables_ptr, seq, kvh, p, end, pos, row_ok,
                seq_len, scale, stride_cp, stride_co, stride_ch, stride_bt,
                D, PAGE, TILE_PAGES, PRECISION, DOT_F32,
            )  # fmt: skip
        return m, l_run, acc

    @triton.jit
    def _all_groups(
        q, k_ptr, v_ptr, tables_ptr, seq, kvh, end, pos, row_ok, seq_len, scale,
        stride_cp, stride_co, stride_ch, stride_bt,
        M: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, TILE_PAGES: tl.constexpr,
        SPLIT_PAGES: tl.constexpr, GROUPS: tl.constexpr, PRECISION: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):  # fmt: skip
        """Every group's partial (as `_group_partial` computes it), merged in group order as
        `_combine_kernel` merges them, in one flat loop over the tiles in group order."""
        m = tl.full([M], float("-inf"), tl.float32)
        l_run = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D], tl.float32)
        m_g, l_g, acc_g = m, l_run, acc
        per_split: tl.constexpr = SPLIT_PAGES // TILE_PAGES
        splits = tl.cdiv(end, SPLIT_PAGES)
        # groups 0 .. full - 1 hold `most` splits each, the rest one fewer
        most = tl.cdiv(splits, GROUPS)
        full = splits - GROUPS * (most - 1)
        fewer = tl.maximum(most - 1, 1)
        for f in range(0, splits * per_split):
            i = f // per_split  # the split's rank in group order
            first = i < full * most
            later = i - full * most
            g = tl.where(first, i // most, full + later // fewer)
            j = tl.where(first, i % most, later % fewer)  # its rank within its group
            p = (g + GROUPS * j) * SPLIT_PAGES + (f % per_split) * TILE_PAGES
            m_g, l_g, acc_g = _tile_step(
                q, m_g, l_g, acc_g, k_ptr, v_ptr, tables_ptr, seq, kvh, p, end, pos, row_ok,
                seq_len, scale, stride_cp, stride_co, stride_ch, stride_bt,
                D, PAGE, TILE_PAGES, PRECISION, DOT_F32,
            )  # fmt: skip
            last_split = j == tl.where(first, most, most - 1) - 1
            if last_split and f % per_split == per_split - 1:  # the group's last tile
                m, l_run, acc = _merge(m, l_run, acc, m_g, l_g, acc_g)
                m_g = tl.full([M], float("-inf"), tl.float32)
                l_g = tl.zeros([M], tl.float32)
                acc_g = tl.zeros([M, D], tl.float32)
        return m, l_run, acc

    @triton.jit
    def _load_q(q_ptr, start, row, head, row_ok, stride_qt, stride_qh, D: tl.constexpr,
                DOT_F32: tl.constexpr):  # fmt: skip
        d = tl.arange(0, D)
        q = tl.load(
            q_ptr + (start + row)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        return q.to(tl.float32) if DOT_F32 else q

    @triton.jit
    def _part_offsets(seq, start, row, head, group, NUM_HEADS: tl.constexpr,
                      BLOCK_Q: tl.constexpr, GROUPS: tl.constexpr, D: tl.constexpr,
                      ROW_BY_START):  # fmt: skip
        """Where a row's group partial lives (int64: a long context's buffer is large):
        [rows, heads, GROUPS, D + 2], the rows numbered by the step's row (start + row) or by
        (sequence, row), whichever is fewer."""
        prow = tl.where(ROW_BY_START != 0, start + row, seq * BLOCK_Q + row)
        return ((prow.to(tl.int64) * NUM_HEADS + head) * GROUPS + group) * (D + 2)

    @triton.jit(do_not_specialize=_GROUP_ARGS)
    def _decode_group_kernel(
        q_ptr, k_ptr, v_ptr, part_ptr, tables_ptr, starts_ptr, lens_ptr, scale,
        stride_qt, stride_qh, stride_cp, stride_co, stride_ch, stride_bt,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
        BLOCK_Q: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, TILE_PAGES: tl.constexpr,
        SPLIT_PAGES: tl.constexpr,
        GROUPS: tl.constexpr, MAX_ROWS: tl.constexpr, ROW_BY_START,
        PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        """Group `program_id(2)` of a decode or verify sequence: its partial into part_ptr
        (acc, then m and l)."""
        seq, kvh, group = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start, q_len, seq_len, row, head, row_ok, pos = _tile_rows(
            seq, kvh, 0, starts_ptr, lens_ptr, BLOCK_Q, GROUP, GROUP_P
        )
        num_pages = tl.cdiv(seq_len, PAGE)
        # prompt chunks are the tile kernel's; a group past the sequence's splits is empty
        if q_len <= MAX_ROWS and group * SPLIT_PAGES < num_pages:
            q = _load_q(q_ptr, start, row, head, row_ok, stride_qt, stride_qh, D, DOT_F32)
            m, l_run, acc = _group_partial(
                q, k_ptr, v_ptr, tables_ptr, seq, kvh, group, num_pages, pos, row_ok, seq_len,
                scale, stride_cp, stride_co, stride_ch, stride_bt,
                BLOCK_Q * GROUP_P, D, PAGE, TILE_PAGES, SPLIT_PAGES, GROUPS, PRECISION, DOT_F32,
            )  # fmt: skip
            part = _part_offsets(seq, start, row, head, group, NUM_HEADS, BLOCK_Q, GROUPS, D,
                                 ROW_BY_START)  # fmt: skip
            d = tl.arange(0, D)
            tl.store(part_ptr + part[:, None] + d[None, :], acc, mask=row_ok[:, None])
            tl.store(part_ptr + part + D, m, mask=row_ok)
            tl.store(part_ptr + part + D + 1, l_run, mask=row_ok)

    @triton.jit(do_not_specialize=["starts_ptr", "lens_ptr", "ROW_BY_START"])
    def _combine_kernel(
        part_ptr, out_ptr, starts_ptr, lens_ptr, stride_ot, stride_oh,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
        BLOCK_Q: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, TILE_PAGES: tl.constexpr,
        SPLIT_PAGES: tl.constexpr,
        GROUPS: tl.constexpr, MAX_ROWS: tl.constexpr, ROW_BY_START,
    ):  # fmt: skip
        """A decode or verify sequence's group partials merged in group order; out = acc / l."""
        seq, kvh = tl.program_id(0), tl.program_id(1)
        start, q_len, seq_len, row, head, row_ok, pos = _tile_rows(
            seq, kvh, 0, starts_ptr, lens_ptr, BLOCK_Q, GROUP, GROUP_P
        )
        if q_len <= MAX_ROWS:
            d = tl.arange(0, D)
            m = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
            l_run = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
            acc = tl.zeros([BLOCK_Q * GROUP_P, D], tl.float32)
            # the groups the decode kernel wrote: those holding at least one split
            groups = tl.minimum(tl.cdiv(tl.cdiv(seq_len, PAGE), SPLIT_PAGES), GROUPS)
            for g in range(0, groups):
                part = _part_offsets(seq, start, row, head, g, NUM_HEADS, BLOCK_Q, GROUPS, D,
                                     ROW_BY_START)  # fmt: skip
                acc_s = tl.load(
                    part_ptr + part[:, None] + d[None, :], mask=row_ok[:, None], other=0.0
                )
                m_s = tl.load(part_ptr + part + D, mask=row_ok, other=float("-inf"))
                l_s = tl.load(part_ptr + part + D + 1, mask=row_ok, other=0.0)
                m, l_run, acc = _merge(m, l_run, acc, m_s, l_s, acc_s)
            out = acc / tl.where(l_run == 0.0, 1.0, l_run)[:, None]
            tl.store(
                out_ptr
                + (start + row)[:, None] * stride_ot
                + head[:, None] * stride_oh
                + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None],
            )

    @triton.jit(do_not_specialize=_STEP_ARGS)
    def _tile_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, starts_ptr, lens_ptr, scale,
        stride_qt, stride_qh, stride_cp, stride_co, stride_ch, stride_bt, stride_ot, stride_oh,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, D: tl.constexpr,
        PAGE: tl.constexpr, TILE_PAGES: tl.constexpr, SPLIT_PAGES: tl.constexpr,
        GROUPS: tl.constexpr, MAX_ROWS: tl.constexpr, PRECISION: tl.constexpr,
        DOT_F32: tl.constexpr, DECODE: tl.constexpr,
    ):  # fmt: skip
        """A tile of a sequence's rows: the same group partials as `_decode_group_kernel`'s,
        merged in registers in `_combine_kernel`'s order. Prompt chunks (more than MAX_ROWS
        rows), or with DECODE the decode and verify sequences, all of a sequence's rows in
        one tile (a large batch fills the GPU without splitting the keys over programs)."""
        seq, kvh, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start, q_len, seq_len, row, head, row_ok, pos = _tile_rows(
            seq, kvh, tile * BLOCK_Q, starts_ptr, lens_ptr, BLOCK_Q, GROUP, GROUP_P
        )
        mine = q_len <= MAX_ROWS if DECODE else q_len > MAX_ROWS
        if mine and tile * BLOCK_Q < q_len:
            q = _load_q(q_ptr, start, row, head, row_ok, stride_qt, stride_qh, D, DOT_F32)
            # causal: the pages up to the tile's last row
            end = tl.cdiv(seq_len - q_len + tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len), PAGE)
            m, l_run, acc = _all_groups(
                q, k_ptr, v_ptr, tables_ptr, seq, kvh, end, pos, row_ok, seq_len, scale,
                stride_cp, stride_co, stride_ch, stride_bt,
                BLOCK_Q * GROUP_P, D, PAGE, TILE_PAGES, SPLIT_PAGES, GROUPS, PRECISION, DOT_F32,
            )  # fmt: skip
            out = acc / tl.where(l_run == 0.0, 1.0, l_run)[:, None]
            d = tl.arange(0, D)
            tl.store(
                out_ptr
                + (start + row)[:, None] * stride_ot
                + head[:, None] * stride_oh
                + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None],
            )


def invariant_attention(
    q, k_cache, v_cache, meta: AttentionMetadata, scale: float, *, max_rows: int,
    prompt_tile_rows: int, interpreted: bool, fused: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Attention of every row of the step (K/V already written), batch-invariantly.

    `fused`: a decode or verify sequence's groups run in one program and merge in registers
    (for steps whose sequences fill the GPU); otherwise one program per group and a combine.
    The arithmetic, and so every bit of the output, is the same either way."""
    heads, kv_heads, dim = q.shape[1], k_cache.shape[2], q.shape[2]
    page = k_cache.shape[1]
    group = heads // kv_heads
    group_p = triton.next_power_of_2(group)
    seqs = meta.num_seqs
    out = torch.empty_like(q)
    split_pages = max(1, SPLIT_TOKENS // page)
    prompt_block_q = max(prompt_tile_rows // group_p, 1)
    decode_block_q = max(triton.next_power_of_2(max_rows), max(1, 16 // group_p))
    # The tile follows the model and the device alone, never the step (a row's bits follow
    # its tiles): sized for the widest tile of rows any step can bring.
    budget = kv_tiles.shared_budget(q.device)
    tile = kv_tiles.tile_pages(
        page, TILE_KEYS, rows=max(prompt_block_q, decode_block_q) * group_p, dim=dim,
        elem_bytes=k_cache.element_size(), shared=budget, split_pages=split_pages,
    )  # fmt: skip
    common = dict(
        GROUP=group, GROUP_P=group_p, D=dim, PAGE=page, SPLIT_PAGES=split_pages,
        TILE_PAGES=tile, GROUPS=GROUPS, MAX_ROWS=max_rows,
    )  # fmt: skip
    launch = dict(
        PRECISION="ieee" if q.dtype == torch.float32 or interpreted else "tf32",
        DOT_F32=interpreted, num_warps=kv_tiles.NUM_WARPS, num_stages=kv_tiles.NUM_STAGES,
    )  # fmt: skip
    strides = (
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        meta.block_tables.stride(0),
    )  # fmt: skip
    tables, starts, lens = meta.block_tables, meta.query_start_loc, meta.seq_lens
    tile_args = (q, k_cache, v_cache, out, tables, starts, lens, scale, *strides,
                 out.stride(0), out.stride(1))  # fmt: skip
    if not interpreted:

        def shared_of(pages: int) -> int:
            """The most shared memory the tile and group kernels ask with `pages` a tile, at
            the widest tiles of rows a step brings (compiled, not launched). 0 where this
            Triton compiles nothing here (a stand-in driver) or its warmup fails: the
            estimate then stands, as before the fit."""
            fixed = {**launch, **common, "TILE_PAGES": pages}
            try:
                compiled = [
                    _tile_kernel.warmup(
                        *tile_args, BLOCK_Q=block, DECODE=decode, grid=(1,), **fixed
                    )
                    for block, decode in ((prompt_block_q, False), (decode_block_q, True))
                ]
                compiled.append(_decode_group_kernel.warmup(
                    q, k_cache, v_cache, torch.float32, tables, starts, lens, scale, *strides,
                    NUM_HEADS=heads, BLOCK_Q=decode_block_q, ROW_BY_START=0, grid=(1,),
                    **fixed,
                ))  # fmt: skip
                return max((k.metadata.shared for k in compiled if k is not None), default=0)
            except Exception:  # noqa: BLE001 (the launch itself says what is wrong)
                log.warning("could not size the attention's tiles by compiling", exc_info=True)
                return 0

        # (every setting the compiled kernels follow: a bench's sweep, or a test, changes the
        # split, the planned tile or the launch options in one process; found in review)
        key = ("invariant", q.device, q.dtype, k_cache.dtype, heads, kv_heads, dim, page,
               max_rows, prompt_tile_rows, tile, split_pages, GROUPS,
               launch["num_warps"], launch["num_stages"])  # fmt: skip
        common["TILE_PAGES"] = kv_tiles.fitted_pages(key, tile, shared_of, budget)
    if meta.max_query_len > max_rows:  # prompt chunks in the step
        tiles = -(-meta.max_query_len // prompt_block_q)
        _tile_kernel[(seqs, kv_heads, tiles)](
            *tile_args, BLOCK_Q=prompt_block_q, DECODE=False, **launch, **common
        )  # fmt: skip
    # decode and verify sequences (every one, in a step without prompt chunks), all in tiles of
    # `max_rows` query rows (tl.dot needs 16+ tile rows, so few heads per group pad them): one
    # binary for a decode step and a verify step, as two variants of the same arithmetic can
    # round differently (found in review: the tile once followed the step's longest query)
    block_q = decode_block_q
    if fused:
        _tile_kernel[(seqs, kv_heads, 1)](
            *tile_args, BLOCK_Q=block_q, DECODE=True, **launch, **common
        )  # fmt: skip
        return out
    by_start = q.shape[0] < seqs * block_q
    rows = q.shape[0] if by_start else seqs * block_q
    part = torch.empty(rows * heads * GROUPS * (dim + 2), dtype=torch.float32, device=q.device)
    shared = dict(NUM_HEADS=heads, BLOCK_Q=block_q, ROW_BY_START=int(by_start), **common)
    _decode_group_kernel[(seqs, kv_heads, GROUPS)](
        q, k_cache, v_cache, part, tables, starts, lens, scale, *strides, **launch, **shared
    )  # fmt: skip
    _combine_kernel[(seqs, kv_heads)](
        part, out, starts, lens, out.stride(0), out.stride(1), **shared
    )  # fmt: skip
    return out
