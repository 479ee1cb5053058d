"""The router product, the routing and the plan in one launch for steps of up to one block of
rows (decode and short verify steps): the product is split across programs, the last to finish
routes and plans.

`moe_routing.route(hidden=, router=)` in one program reads the whole router alone (64 experts x
2048 columns of bf16: 256 KiB), which made it slower than cuBLAS's product followed by the
routing launch. Here programs split the router's experts (16 a program: a tl.dot's least N) and
its hidden columns (`SLICES` runs, whole chunks of the product's BH) between them; each stores
its float32 partial logits and counts itself in at an arrival counter. The program that arrives
last sums each logit's partials in slice order, rounds the sum to the activation dtype (a
product's output rounding), resets the counter for the next launch (a CUDA graph's next replay)
and routes and plans from registers, as the single-block routing program does
(`moe_picks._pick`, `_plan_in_registers`).

Nothing waits: a program that is not last just ends, so programs need not be resident together.
The partials reach the last program through the counter's acquire/release atomic after a
barrier (every thread's stores before it, as CUTLASS's semaphore orders them), and it reads them
past L1 (`.cg`). Every logit of a row is summed in the same order whatever the rows beside it:
a row's routing does not depend on its batch (up to one block). Its torch reference: the
product `hidden @ router.T` rounded to the activation dtype, then `moe_routing.route_reference`
(tested against `route` of those logits, `tests/test_moe_kernels.py`).
"""

from __future__ import annotations

import torch

from metrale.kernels import pdl
from metrale.kernels.fused import triton
from metrale.kernels.moe_plan import MoEPlan, max_tiles

if triton is not None:
    import triton.language as tl

    from metrale.kernels.moe_picks import _pick, _plan_in_registers, _router_product
    from metrale.kernels.pdl import pdl_prologue

# Experts a program multiplies (tl.dot's least N), and at most how many runs of the hidden
# columns the product is split into.
EXPERTS_PER_PROGRAM = 16
SLICES = 8


if triton is not None:

    @triton.jit
    def _split_route_kernel(
        x_ptr,
        stride_x,
        router_ptr,
        H,
        HS,
        partial_ptr,
        arrivals_ptr,
        ids_ptr,
        w_ptr,
        order_ptr,
        tiles_ptr,
        N,
        E,
        MAX_TILES,
        S: tl.constexpr,
        EB: tl.constexpr,
        K: tl.constexpr,
        BR: tl.constexpr,
        BE: tl.constexpr,
        BKK: tl.constexpr,
        BM: tl.constexpr,
        BH: tl.constexpr,
        BT: tl.constexpr,
        NORM: tl.constexpr,
        SHARED: tl.constexpr,
        IEEE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        eb, s = tl.program_id(0), tl.program_id(1)
        rows = tl.arange(0, BR)
        r_ok = rows < N
        experts = eb * EB + tl.arange(0, EB)
        acc = _router_product(
            x_ptr, stride_x, router_ptr, rows, r_ok, experts, experts < E, s * HS,
            tl.minimum(s * HS + HS, H), H, BR, EB, BH, IEEE,
        )  # fmt: skip
        part = partial_ptr + s * BR * BE + rows[:, None] * BE + experts[None, :]
        tl.store(part, acc, mask=r_ok[:, None] & (experts[None, :] < E))
        tl.debug_barrier()  # every thread's partials stored before the release below
        arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) * S - 1:
            tl.store(arrivals_ptr, 0)  # the next launch counts from 0
            tl.debug_barrier()  # every thread's reads after the acquire above
            cols = tl.arange(0, BE)
            ok = r_ok[:, None] & (cols[None, :] < E)
            total = tl.zeros([BR, BE], tl.float32)
            for j in tl.static_range(S):
                total += tl.load(
                    partial_ptr + j * BR * BE + rows[:, None] * BE + cols[None, :],
                    mask=ok,
                    other=0.0,
                    cache_modifier=".cg",
                )
            logit = total.to(x_ptr.dtype.element_ty).to(tl.float32)  # the product's rounding
            picks, hits = _pick(logit, rows, r_ok, ids_ptr, w_ptr, E, K, BR, BE, BKK, NORM)
            _plan_in_registers(
                picks, hits, order_ptr, tiles_ptr, N, E, MAX_TILES, K, BR, BE, BKK, BM, BT, SHARED
            )


def split_route(
    hidden: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    arrivals: torch.Tensor,
    *,
    block_rows: int,
    norm_topk_prob: bool = True,
    shared: bool = False,
    block_m: int = 16,
    interpreted: bool = False,
) -> MoEPlan:
    """`moe_routing.route(hidden=, router=, arrivals=)` for hidden [N, H] of at most
    `block_rows` rows (checked by the caller) and router [E, H]; `arrivals`: an int32 tensor of
    one zero on hidden's device, which every launch leaves at zero and no other launch may use
    at the same time (one per MoE block). A counter left at another value (a launch killed
    midway, a buffer not made by `torch.zeros`) would make the wrong program route, or none:
    it must start at zero, as `Qwen3NextSparseMoeBlock` makes it."""
    n, h = hidden.shape
    e = router.shape[0]
    block_e = triton.next_power_of_2(e + 1)  # column E: the shared expert's group
    block_h = 128
    chunks = max(triton.cdiv(h, block_h), 1)  # (H = 0: one chunk of nothing, logits 0)
    per_slice = triton.cdiv(chunks, min(SLICES, chunks)) * block_h  # whole chunks a slice
    slices = max(triton.cdiv(h, per_slice), 1)
    tiles_n = max_tiles(n, top_k, e, shared, block_m)
    device = hidden.device
    ids = torch.empty(n, top_k, dtype=torch.int32, device=device)
    weights = torch.empty(n, top_k, dtype=hidden.dtype, device=device)
    order = torch.empty(n * top_k + (n if shared else 0), dtype=torch.int32, device=device)
    tiles = torch.empty(3, tiles_n, dtype=torch.int32, device=device)
    plan = MoEPlan(ids, weights, order, tiles, n, top_k, shared, block_m, False)
    if n == 0:
        return plan
    partial = torch.empty(slices, block_rows, block_e, dtype=torch.float32, device=device)
    grid = (triton.cdiv(e, EXPERTS_PER_PROGRAM), slices)
    _split_route_kernel[grid](
        hidden, hidden.stride(0), router, h, per_slice, partial, arrivals, ids, weights, order,
        tiles, n, e, tiles_n,
        S=slices, EB=EXPERTS_PER_PROGRAM, K=top_k, BR=block_rows, BE=block_e,
        BKK=triton.next_power_of_2(top_k), BM=block_m, BH=block_h,
        BT=min(64, triton.next_power_of_2(tiles_n)), NORM=norm_topk_prob, SHARED=shared,
        IEEE=interpreted, num_warps=8, **pdl.launch(hidden),
    )  # fmt: skip
    return plan
