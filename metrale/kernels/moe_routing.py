"""MoE routing and the grouped GEMMs' plan in one Triton launch: (hidden -> router logits, for up
to 127 experts) -> softmax -> top-k -> (renormalised) weights -> each pair's place in expert
order -> the tiles of rows that the grouped expert kernels (`kernels/moe.py`) walk.

Per row, as `Qwen3NextSparseMoeBlock.route` (the torch reference): p = softmax(logits) in float32,
the k largest picked one by one, weights p / sum(picked p) under `norm_topk_prob`, then rounded
to the activation dtype. The pick compares the float32 logits (softmax is monotone: the same
experts, without the exp's rounding making near-equal logits tie); equal logits go to the lower
expert index first, the rule `route` follows too (torch.topk leaves ties unspecified: on CPU it
does not pick the lower index).

The plan (`kernels/moe_plan.py`: each pair's place in expert order, the tiles) is for pairs
p = row * k + slot, plus, with a shared expert, one pair per row after them (p = N k + row, as
"expert" E); its kernels run at the end of this launch.

One program routes and plans up to `SINGLE_MAX_BLOCKS` blocks of rows (decode steps; one block
whose experts it picks is planned from registers, without reading back what it stored); more rows
(verify and prefill steps) take two launches of one program per block (route, then plan), with
the same per-row arithmetic. Per-expert counts are integer sums: the plan is deterministic.
"""

from __future__ import annotations

import os

import torch

from metrale.kernels.fused import triton
from metrale.kernels.moe_plan import MoEPlan, max_tiles

if triton is not None:
    from metrale.kernels.moe_picks import _pick, _plan_in_registers, _router_product
    from metrale.kernels.moe_plan import _plan_block, _tile_map

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# One program plans up to this many blocks of rows; beyond, a program per block in two launches.
SINGLE_MAX_BLOCKS = 2
# One block of rows whose experts the launch picks is planned from registers (PHASE 3).
REGISTER_PLAN = True
# Elements of a block's (row, expert) tables: 16 rows per block for up to 127 experts, fewer for
# more (sm90, 8 warps: no register spills).
BLOCK_ELEMENTS = 2048


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _route_block(
        blk,
        logits_ptr,
        stride_l,
        router_ptr,
        H,
        ids_in_ptr,
        ids_ptr,
        w_ptr,
        counts_ptr,
        N,
        E,
        K: tl.constexpr,
        BR: tl.constexpr,
        BE: tl.constexpr,
        BKK: tl.constexpr,
        FROM_LOGITS: tl.constexpr,
        FROM_HIDDEN: tl.constexpr,
        BH: tl.constexpr,
        NORM: tl.constexpr,
    ):
        """Rows blk*BR ..: pick each row's experts (or read them), store ids (and weights), and
        the block's per-expert counts; returns (picks [BR, BKK], picks of each expert in each
        row [BR, BE]) for a caller that plans from registers (picks made here only).
        FROM_HIDDEN: logits_ptr holds the hidden rows [N, H], whose router logits (rows of
        router [E, H]) are made here, rounded to their dtype."""
        rows = blk * BR + tl.arange(0, BR)
        r_ok = rows < N
        cols = tl.arange(0, BE)
        if FROM_LOGITS:
            if FROM_HIDDEN:  # each row's logits over H in a fixed order: batch invariant
                acc = _router_product(
                    logits_ptr, stride_l, router_ptr, rows, r_ok, cols, cols < E, 0, H, H,
                    BR, BE, BH, FROM_HIDDEN == 2,
                )  # fmt: skip
                logit = acc.to(logits_ptr.dtype.element_ty)  # a GEMM's output rounding
            else:
                ok = r_ok[:, None] & (cols[None, :] < E)
                logit = tl.load(
                    logits_ptr + rows[:, None] * stride_l + cols[None, :], mask=ok, other=0.0
                )
            picks, hits = _pick(
                logit.to(tl.float32), rows, r_ok, ids_ptr, w_ptr, E, K, BR, BE, BKK, NORM
            )
        else:
            picks = tl.zeros([BR, BKK], tl.int32)  # (not returned to any caller: ids given)
            hits = tl.zeros([BR, BE], tl.int32)  # picks of e in row r (masked picks repeat)
            for j in tl.static_range(K):
                idx = tl.load(ids_in_ptr + rows * K + j, mask=r_ok, other=0).to(tl.int32)
                tl.store(ids_ptr + rows * K + j, idx, mask=r_ok)
                hits += ((cols[None, :] == idx[:, None]) & r_ok[:, None]).to(tl.int32)
        counts = tl.sum(hits, axis=0)
        tl.store(counts_ptr + blk * BE + cols, counts)
        return picks, hits

    @triton.jit
    def _route_plan_kernel(
        logits_ptr,
        stride_l,
        router_ptr,
        H,
        ids_in_ptr,
        ids_ptr,
        w_ptr,
        counts_ptr,
        order_ptr,
        tiles_ptr,
        N,
        E,
        NB,
        MAX_TILES,
        K: tl.constexpr,
        BR: tl.constexpr,
        BE: tl.constexpr,
        BKK: tl.constexpr,
        BM: tl.constexpr,
        FROM_LOGITS: tl.constexpr,
        FROM_HIDDEN: tl.constexpr,
        BH: tl.constexpr,
        NORM: tl.constexpr,
        SHARED: tl.constexpr,
        DISTINCT: tl.constexpr,
        BT: tl.constexpr,
        PHASE: tl.constexpr,  # 0: route, 1: plan (a program per block); 2: both, one program
    ):
        if PHASE == 3:
            # one block of rows whose picks are made here: planned from registers, without
            # reading back the ids and counts just stored (a decode step's dependent round
            # trips through memory, and a barrier)
            picks, hits = _route_block(
                0, logits_ptr, stride_l, router_ptr, H, ids_in_ptr, ids_ptr, w_ptr,
                counts_ptr, N, E, K, BR, BE, BKK, FROM_LOGITS, FROM_HIDDEN, BH, NORM,
            )  # fmt: skip
            _plan_in_registers(
                picks, hits, order_ptr, tiles_ptr, N, E, MAX_TILES, K, BR, BE, BKK, BM, BT, SHARED
            )
        elif PHASE == 2:
            for blk in range(NB):
                _route_block(
                    blk, logits_ptr, stride_l, router_ptr, H, ids_in_ptr, ids_ptr, w_ptr,
                    counts_ptr, N, E, K, BR, BE, BKK, FROM_LOGITS, FROM_HIDDEN, BH, NORM,
                )  # fmt: skip
            tl.debug_barrier()  # the counts and ids other threads stored, visible below
            for blk in range(NB):
                _plan_block(
                    blk, ids_ptr, counts_ptr, order_ptr, N, NB, K, BR, BE, BKK, SHARED, DISTINCT
                )
            _tile_map(counts_ptr, tiles_ptr, N, E, NB, MAX_TILES, K, BE, BM, BT, SHARED)
        elif PHASE == 0:
            _route_block(
                tl.program_id(0), logits_ptr, stride_l, router_ptr, H, ids_in_ptr, ids_ptr,
                w_ptr, counts_ptr, N, E, K, BR, BE, BKK, FROM_LOGITS, FROM_HIDDEN, BH, NORM,
            )  # fmt: skip
        else:
            blk = tl.program_id(0)
            _plan_block(
                blk, ids_ptr, counts_ptr, order_ptr, N, NB, K, BR, BE, BKK, SHARED, DISTINCT
            )
            if blk == 0:
                _tile_map(counts_ptr, tiles_ptr, N, E, NB, MAX_TILES, K, BE, BM, BT, SHARED)


def _block_rows(num_experts: int) -> int:
    """Rows per block of the routing tables: 16 up to 127 experts, fewer past (registers)."""
    block_r = max(1, min(16, BLOCK_ELEMENTS // triton.next_power_of_2(num_experts + 1)))
    return 1 << (block_r.bit_length() - 1)  # a power of two


def route_block_rows(num_experts: int) -> int:
    """Rows one block of the routing launch holds: steps of at most this many rows route in one
    program (and with the split router, `moe_router`)."""
    return _block_rows(num_experts)


def makes_logits(num_experts: int) -> bool:
    """Whether `route` can make the router logits itself (`hidden=`, `router=`): blocks of 16
    rows, tl.dot's least M, so up to 127 experts (Qwen3-Next-80B's 512 take the GEMM first)."""
    return triton is not None and _block_rows(num_experts) >= 16


def route(
    logits: torch.Tensor | None,
    top_k: int,
    *,
    num_experts: int | None = None,
    norm_topk_prob: bool = True,
    shared: bool = False,
    block_m: int = 16,
    ids: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    hidden: torch.Tensor | None = None,
    router: torch.Tensor | None = None,
    arrivals: torch.Tensor | None = None,
) -> MoEPlan:
    """logits [N, E] (any row stride) -> the routing and the plan, in the activation dtype
    (`dtype`, default the logits'). Or, with `hidden` [N, H] and `router` [E, H] instead of
    logits (`makes_logits(E)`), the logits hidden @ router.T made in the same launch, rounded
    to hidden's dtype: the router GEMM's launch saved. Or, with `ids` [N, k] and `weights`
    given (an expert-parallel rank's picks), only the plan; `num_experts` (E) then bounds the
    ids, and without `shared` an id of E is a pick to skip (another rank's expert): no tile
    computes it and the combine leaves it out, so a rank's work is its own experts' pairs.
    With `shared`, given ids must be below E (column E is then the shared expert's; not
    checked here, which would cost a host sync). With `hidden` and `arrivals` (an int32 zero
    of the caller's own, `moe_router.split_route`), up to one block of rows is routed by
    programs that split the router product, the last routing and planning."""
    from_hidden = hidden is not None
    if from_hidden:
        if router is None or logits is not None or not makes_logits(router.shape[0]):
            raise ValueError("route(hidden=...) needs router [E, H], no logits, E <= 127")
        if router.shape[1] != hidden.shape[1] or router.dtype != hidden.dtype:
            raise ValueError("router [E, H] must match hidden [N, H] in H and dtype")
        logits, router = (hidden if hidden.stride(1) == 1 else hidden.contiguous()), router
        router = router.contiguous()
    from_logits = ids is None
    skips = not from_logits and not shared  # (with `shared`, column E is the shared expert's)
    n = logits.shape[0] if from_logits else ids.shape[0]
    e = (router.shape[0] if from_hidden else logits.shape[1]) if from_logits else num_experts
    if from_logits and not 0 < top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}] (the experts), got {top_k}")
    ref = logits if from_logits else ids
    device = ref.device
    dtype = dtype or (logits.dtype if from_logits else weights.dtype)
    if from_hidden and arrivals is not None and n <= _block_rows(e) and dtype == logits.dtype:
        from metrale.kernels.moe_router import split_route

        return split_route(
            logits, router, top_k, arrivals, block_rows=_block_rows(e), shared=shared,
            norm_topk_prob=norm_topk_prob, block_m=block_m, interpreted=INTERPRETED,
        )  # fmt: skip
    block_e = triton.next_power_of_2(e + 1)  # column E: the shared expert's group
    block_k = triton.next_power_of_2(top_k)
    block_r = _block_rows(e)
    blocks = triton.cdiv(n, block_r)
    tiles_n = max_tiles(n, top_k, e, shared, block_m)
    out_ids = torch.empty(n, top_k, dtype=torch.int32, device=device)
    if from_logits:
        out_w = torch.empty(n, top_k, dtype=dtype, device=device)
    else:
        out_w = weights.contiguous()  # the combine reads [N, k] rows
    counts = torch.empty(max(blocks, 1), block_e, dtype=torch.int32, device=device)
    order = torch.empty(n * top_k + (n if shared else 0), dtype=torch.int32, device=device)
    tiles = torch.empty(3, tiles_n, dtype=torch.int32, device=device)
    plan = MoEPlan(out_ids, out_w, order, tiles, n, top_k, shared, block_m, skips)
    if n == 0:
        return plan
    args = (
        logits if from_logits else ids,
        logits.stride(0) if from_logits else 0,
        router if from_hidden else out_ids,  # (unused without hidden)
        router.shape[1] if from_hidden else 0,
        ids.contiguous() if not from_logits else out_ids,
        out_ids,
        out_w,
        counts,
        order,
        tiles,
        n,
        e,
        blocks,
        tiles_n,
    )
    meta = dict(
        K=top_k,
        BR=block_r,
        BE=block_e,
        BKK=block_k,
        BM=block_m,
        FROM_LOGITS=from_logits,
        FROM_HIDDEN=(2 if INTERPRETED else 1) if from_hidden else 0,
        BH=128,
        NORM=norm_topk_prob,
        SHARED=shared,
        DISTINCT=from_logits,  # picks made here: a row's experts are distinct
        BT=min(64, triton.next_power_of_2(tiles_n)),  # tiles mapped at a time
    )
    if from_logits and logits.stride(1) != 1:
        raise ValueError("router logits need unit column stride")
    if blocks > SINGLE_MAX_BLOCKS:
        _route_plan_kernel[(blocks,)](*args, **meta, PHASE=0, num_warps=8)
        _route_plan_kernel[(blocks,)](*args, **meta, PHASE=1, num_warps=8)
    elif blocks == 1 and from_logits and REGISTER_PLAN:
        _route_plan_kernel[(1,)](*args, **meta, PHASE=3, num_warps=8)
    else:
        _route_plan_kernel[(1,)](*args, **meta, PHASE=2, num_warps=8)
    return plan


def route_reference(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch routing with the kernel's tie rule: (ids [N, k] int64, weights [N, k] in the
    logits' dtype). Equal logits go to the lower expert index (a stable descending sort)."""
    logits32 = logits.float()
    probs = logits32.softmax(dim=-1)
    experts = logits32.sort(dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights.to(logits.dtype)
