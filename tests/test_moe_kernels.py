"""The MoE Triton kernels against their torch references: routing + plan (`moe_routing.route`:
ties, renormalisation, the stable expert order, the tiles; one launch and two), the grouped
experts with the shared one and the folded norm (`moe.grouped_experts`), the whole sparse block,
and batch invariance: a row's output is bitwise the same alone, or among 3 or 17 rows at any place.

Under Triton's interpreter on CPU (conftest sets TRITON_INTERPRET=1), natively on CUDA.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton")

from metrale.config import ModelConfig  # noqa: E402
from metrale.kernels import moe, moe_router, moe_routing  # noqa: E402
from metrale.models import qwen3_next_moe  # noqa: E402
from metrale.models.qwen3_next import ZeroCentredRMSNorm  # noqa: E402
from metrale.models.qwen3_next_moe import Qwen3NextSparseMoeBlock  # noqa: E402
from tests.test_moe_grouped import make_batch, make_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not set", allow_module_level=True)
DTYPES = [torch.float32, torch.bfloat16]


def _plan_reference(ids: torch.Tensor, num_experts: int, shared: bool, block_m: int):
    """(order, tiles) as the plan defines them, in plain Python."""
    n, k = ids.shape
    order = ids.reshape(-1).cpu().sort(stable=True).indices.tolist()
    counts = torch.bincount(ids.reshape(-1).cpu(), minlength=num_experts).tolist()
    if shared:
        order += list(range(n * k, n * k + n))
        counts.append(n)
    tiles, start = [], 0
    for e, c in enumerate(counts):
        tiles += [(e, start + t, start + min(t + block_m, c)) for t in range(0, c, block_m)]
        start += c
    return order, tiles


def _launches(launches: str, monkeypatch) -> None:
    """`registers`: one block of rows planned from registers, where it applies; `one`: one
    program, planning from what it stored; `two`: a program per block, route then plan."""
    if launches != "registers":
        monkeypatch.setattr(moe_routing, "REGISTER_PLAN", False)
    if launches == "two":
        monkeypatch.setattr(moe_routing, "SINGLE_MAX_BLOCKS", 0)


LAUNCHES = ["registers", "one", "two"]


@pytest.mark.parametrize("launches", LAUNCHES)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("n, experts, top_k", [(1, 8, 2), (5, 8, 3), (17, 64, 10), (300, 8, 2)])
def test_routing_and_plan_match_the_reference(n, experts, top_k, norm, launches, monkeypatch):
    """Integer-valued logits tie often: the picks equal the stable-sort reference exactly."""
    _launches(launches, monkeypatch)
    gen = torch.Generator().manual_seed(n)
    logits = (torch.randint(-3, 3, (n, experts), generator=gen) * 0.5).to(DEVICE)
    for shared in (False, True):
        plan = moe_routing.route(logits, top_k, norm_topk_prob=norm, shared=shared, block_m=4)
        ids, weights = moe_routing.route_reference(logits, top_k, norm)
        assert torch.equal(plan.ids.long(), ids)
        torch.testing.assert_close(plan.weights, weights, rtol=1e-6, atol=1e-7)
        order, tiles = _plan_reference(ids, experts, shared, 4)
        assert plan.order.tolist() == order
        got = [tuple(t) for t in plan.tiles.T.tolist()]
        assert got[: len(tiles)] == tiles
        assert all(t[0] == -1 for t in got[len(tiles) :])


@pytest.mark.parametrize("launches", LAUNCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, experts, top_k, hidden", [(1, 64, 10, 200), (37, 8, 2, 64)])
def test_router_logits_made_in_the_kernel(n, experts, top_k, hidden, dtype, launches, monkeypatch):
    """route(hidden=, router=) equals route(logits) of the router product rounded to the
    activation dtype (H not a multiple of the kernel's chunk; masked rows and experts), and a
    row's plan does not depend on the rows beside it."""
    _launches(launches, monkeypatch)
    gen = torch.Generator().manual_seed(n + hidden)
    # integer-valued hidden and router entries: every product and sum is exact, so the logits
    # are the same bits whatever the order of summation (and ties are frequent)
    x = torch.randint(-2, 3, (n, hidden), generator=gen).to(DEVICE, dtype)
    router = torch.randint(-1, 2, (experts, hidden), generator=gen).to(DEVICE, dtype)
    plan = moe_routing.route(None, top_k, hidden=x, router=router, shared=True, block_m=4)
    want = moe_routing.route(x @ router.T, top_k, shared=True, block_m=4)
    for got, ref in zip(plan[:4], want[:4], strict=True):
        assert torch.equal(got, ref)
    alone = moe_routing.route(None, top_k, hidden=x[-1:], router=router)
    assert torch.equal(alone.ids, plan.ids[-1:]) and torch.equal(alone.weights, plan.weights[-1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n, experts, top_k, hidden", [(1, 64, 10, 2048), (5, 8, 2, 200), (16, 100, 7, 300)]
)
def test_router_split_across_programs(n, experts, top_k, hidden, dtype):
    """route(hidden=, router=, arrivals=): programs split the router product (experts, runs of
    hidden columns), the last sums their partials and routes: the plan of route(logits) of the
    product rounded to the activation dtype (the weights to rounding: the two launches may sum
    a row's softmax in other orders, as on the H100 in float32); the arrival counter is back at
    0 after each launch (a graph's next replay), and a row routes alone bitwise as in its
    batch. Past one block of rows it is the one-program launch's plan."""
    gen = torch.Generator().manual_seed(n + hidden)
    x = torch.randint(-2, 3, (n + 20, hidden), generator=gen).to(DEVICE, dtype)
    router = torch.randint(-1, 2, (experts, hidden), generator=gen).to(DEVICE, dtype)
    arrivals = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for rows in (x[:n], x[:n], x):  # twice: the counter was reset; then more than one block
        plan = moe_routing.route(
            None, top_k, hidden=rows, router=router, arrivals=arrivals, shared=True, block_m=4
        )
        want = moe_routing.route(rows @ router.T, top_k, shared=True, block_m=4)
        assert torch.equal(plan.ids, want.ids)
        assert torch.equal(plan.order, want.order) and torch.equal(plan.tiles, want.tiles)
        rtol = 1e-6 if dtype == torch.float32 else 8e-3  # (bf16: one unit in the last place)
        torch.testing.assert_close(plan.weights, want.weights, rtol=rtol, atol=1e-7)
        assert int(arrivals) == 0
    alone = moe_routing.route(None, top_k, hidden=x[n - 1 : n], router=router, arrivals=arrivals)
    plan = moe_routing.route(None, top_k, hidden=x[:n], router=router, arrivals=arrivals)
    assert torch.equal(alone.ids, plan.ids[-1:]) and torch.equal(alone.weights, plan.weights[-1:])


def test_split_router_rounds_the_logits_as_the_product_does():
    """The last program rounds each summed logit to the activation dtype before picking, as a
    bf16 product's output is: 256 and 257 (exact in float32) are both 256 in bf16, a tie that
    goes to the lower expert (found in review: the rounding was untested)."""
    x = torch.ones(2, 300, dtype=torch.bfloat16, device=DEVICE)
    router = torch.zeros(2, 300, dtype=torch.bfloat16, device=DEVICE)
    router[0, :256] = 1.0
    router[1, :257] = 1.0
    arrivals = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    plan = moe_routing.route(None, 1, hidden=x, router=router, arrivals=arrivals)
    assert plan.ids.tolist() == [[0], [0]]
    assert torch.equal(plan.ids, moe_routing.route(x @ router.T, 1).ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_router_under_back_to_back_graph_replays():
    """The last program's reads of the other programs' partials (acquire/release through the
    arrival counter), stressed on the device: launches of several blocks' counters replayed
    back to back in one CUDA graph, never synchronised between replays, each plan equal to
    the product's routing (the interpreter runs programs in turn: no ordering shows there)."""
    gen = torch.Generator().manual_seed(11)
    n, e, h, k, launches = 5, 64, 2048, 10, 8
    xs = [torch.randint(-2, 3, (n, h), generator=gen).cuda().bfloat16() for _ in range(launches)]
    router = torch.randint(-1, 2, (e, h), generator=gen).cuda().bfloat16()
    counters = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(2)]

    def run():
        return [
            moe_routing.route(None, k, hidden=x, router=router, arrivals=counters[i % 2])
            for i, x in enumerate(xs)
        ]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compiled outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plans = run()
    for _ in range(200):
        graph.replay()
    eager = [run() for _ in range(25)]  # and eagerly, every launch's plan kept
    torch.cuda.synchronize()
    wants = [moe_routing.route(x @ router.T, k) for x in xs]
    for got in [plans, *eager]:
        for plan, want in zip(got, wants, strict=True):
            assert torch.equal(plan.ids, want.ids) and torch.equal(plan.order, want.order)
    assert all(int(c) == 0 for c in counters)


def test_router_logits_in_the_kernel_are_refused_where_they_cannot_run():
    x = torch.zeros(2, 16, device=DEVICE)
    assert moe_routing.makes_logits(127) and not moe_routing.makes_logits(128)
    with pytest.raises(ValueError, match="router"):
        moe_routing.route(None, 2, hidden=x, router=torch.zeros(512, 16, device=DEVICE))
    with pytest.raises(ValueError, match="router"):
        moe_routing.route(None, 2, hidden=x, router=torch.zeros(8, 15, device=DEVICE))


def test_ties_pick_the_lower_index_and_weights_renormalise():
    logits = torch.tensor(
        [[1.0, 1.0, 1.0, 1.0], [0.0, 2.0, 2.0, 1.0], [3.0, 1.0, 1.0, 1.0]], device=DEVICE
    )
    plan = moe_routing.route(logits, 2, norm_topk_prob=True)
    assert plan.ids.tolist() == [[0, 1], [1, 2], [0, 1]]
    torch.testing.assert_close(plan.weights.sum(-1), torch.ones(3, device=DEVICE))
    torch.testing.assert_close(plan.weights[0], torch.full((2,), 0.5, device=DEVICE))
    raw = moe_routing.route(logits, 2, norm_topk_prob=False)
    torch.testing.assert_close(raw.weights[0], torch.full((2,), 0.25, device=DEVICE))
    probs = logits.softmax(-1)
    torch.testing.assert_close(raw.weights[2], probs[2, :2])
    # the torch block's route() follows the same rule
    ids, _ = moe_routing.route_reference(logits, 2, True)
    assert ids.tolist() == [[0, 1], [1, 2], [0, 1]]


def test_picks_follow_the_float_order_across_signs_zeros_and_infinities():
    """The kernel sorts each row by an integer made of the logit's bits: negative logits, -0.0
    against 0.0 (equal: the lower index first), -inf and magnitudes far apart order as floats
    do, and every weight is the reference's softmax probability."""
    inf = float("inf")
    logits = torch.tensor(
        [
            [-0.0, 0.0, -0.0, 0.0, -1.0, -2.0],
            [-3.5, -3.25, -1e30, 1e30, -inf, -inf],
            [-inf, -2.0, -inf, -1.5, -2.0, -7.0],
            [1e-38, -1e-38, 0.0, -0.0, 2e-38, -2e-38],
        ],
        device=DEVICE,
    )
    for k in (1, 3, 4):
        plan = moe_routing.route(logits, k, norm_topk_prob=False)
        ids, weights = moe_routing.route_reference(logits, k, False)
        assert plan.ids.long().tolist() == ids.tolist(), k
        torch.testing.assert_close(plan.weights, weights, rtol=1e-6, atol=0.0)
    assert plan.ids.tolist()[0] == [0, 1, 2, 3]


@pytest.mark.parametrize("launches", LAUNCHES)
def test_rows_of_minus_infinity_or_nan_keep_their_picks_distinct(launches, monkeypatch):
    """A row whose logits run out (-inf) or are NaN still picks k distinct experts below E, so
    the plan is a permutation of the pairs and every tile holds real pairs (found in review:
    the same expert picked twice left a hole in `order` that a tile covered, an index out of
    bounds for the down kernel); the other rows route as the reference does."""
    _launches(launches, monkeypatch)
    inf, nan = float("inf"), float("nan")
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 8, generator=gen)
    logits[1] = torch.tensor([0.0, -inf, -inf, -inf, 2.0, -inf, -inf, -inf])
    logits[2] = nan
    logits[3, ::2] = nan
    logits[4] = -inf
    logits = logits.to(DEVICE)
    good = [0, 5]
    for k in (2, 5, 8):
        for shared in (False, True):
            plan = moe_routing.route(logits, k, shared=shared, block_m=4)
            ids = plan.ids.long()
            assert int(ids.min()) >= 0 and int(ids.max()) < 8
            assert all(len(set(row)) == k for row in ids.tolist())
            pairs = 6 * k + (6 if shared else 0)
            assert sorted(plan.order.tolist()) == list(range(pairs))
            order, tiles = _plan_reference(ids, 8, shared, 4)
            assert plan.order.tolist() == order
            assert [tuple(t) for t in plan.tiles.T.tolist()][: len(tiles)] == tiles
            want_ids, want_w = moe_routing.route_reference(logits[good], k, True)
            assert torch.equal(ids[good], want_ids)
            torch.testing.assert_close(plan.weights[good], want_w, rtol=1e-6, atol=1e-7)
            assert ids[1].tolist()[:2] == [4, 0]  # then the -inf columns, lowest first
            assert ids[4].tolist() == list(range(k))
    with pytest.raises(ValueError, match="top_k"):
        moe_routing.route(logits, 9)


def test_plan_from_given_ids():
    """Given picks (repeats of an expert in a row included): the plan alone."""
    ids = torch.tensor([[0, 2], [0, 0], [3, 1]], device=DEVICE)
    weights = torch.rand(3, 2, device=DEVICE)
    plan = moe_routing.route(None, 2, num_experts=4, ids=ids, weights=weights, block_m=2)
    order, tiles = _plan_reference(ids, 4, False, 2)
    assert plan.order.tolist() == order and torch.equal(plan.weights, weights)
    assert [tuple(t) for t in plan.tiles.T.tolist()][: len(tiles)] == tiles


class _PoisonedTorch:
    """`torch` as `kernels/moe.py` sees it, whose `empty` float buffers hold NaN: a row the
    kernels never write then shows in the output."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        out = torch.empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out


@pytest.mark.parametrize("n, top_k, block_m", [(1, 2, 16), (9, 3, 2), (40, 4, 4)])
def test_skipped_picks_are_neither_tiled_nor_combined(n, top_k, block_m, monkeypatch):
    """An expert-parallel rank's picks of other ranks' experts come as id E: the tiles hold
    only this rank's pairs, and the output is the sum over them alone, whatever the buffers
    held (NaN here)."""
    experts = make_experts(8, 48, 24, device=DEVICE)
    x, ids, weights = make_batch(n, 48, 8, top_k, seed=n)
    x, ids, weights = x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE)
    skip = torch.rand(ids.shape, generator=torch.Generator().manual_seed(n)).to(DEVICE) < 0.6
    skip[0, 0] = True  # (some row skips, whatever the draw)
    kept_w = weights.masked_fill(skip, 0)
    plan = moe_routing.route(
        None, top_k, num_experts=8, ids=ids.masked_fill(skip, 8), weights=kept_w,
        block_m=block_m,
    )  # fmt: skip
    kept = ids[~skip]
    counts = torch.bincount(kept.cpu(), minlength=8).tolist()
    tiled = [t for t in plan.tiles.T.tolist() if t[0] >= 0]
    assert len(tiled) == sum(-(-c // block_m) for c in counts)  # this rank's pairs alone
    assert all(e < 8 for e, _, _ in tiled)
    assert sum(end - first for _, first, end in tiled) == kept.numel()
    monkeypatch.setattr(moe, "torch", _PoisonedTorch())
    out = moe.grouped_experts(x, plan, experts.gate_up_proj, experts.down_proj)
    ref = experts._looped(x, ids, kept_w)  # every pick, the skipped ones weighted 0
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _shared(hidden: int, inter: int, dtype, seed: int = 2) -> moe.SharedExpert:
    gen = torch.Generator().manual_seed(seed)
    parts = (
        torch.randn(2 * inter, hidden, generator=gen) / math.sqrt(hidden),
        torch.randn(hidden, inter, generator=gen) / math.sqrt(inter),
        torch.randn(hidden, generator=gen) / math.sqrt(hidden),
    )
    return moe.SharedExpert(*(p.to(DEVICE, dtype) for p in parts))


def _shared_reference(x: torch.Tensor, s: moe.SharedExpert) -> torch.Tensor:
    gate, up = torch.nn.functional.linear(x, s.gate_up).chunk(2, -1)
    y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, s.down)
    return torch.sigmoid(torch.nn.functional.linear(x, s.gate[None])) * y


def _close(out: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    """float32 tightly; bf16 by the whole tensor's relative error. The interpreter truncates to
    bf16 (no round to nearest): over the experts' chain of eight roundings that triples the
    error (measured 2e-2 where torch's bf16 path has 6e-3), hence its looser bound."""
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < (8e-3 if DEVICE == "cuda" else 4e-2), err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, top_k, inter_s", [(1, 4, 48), (3, 2, 32), (17, 4, 80)])
def test_grouped_experts_match_the_loop(dtype, n, top_k, inter_s):
    """Dims off the blocks (H 160, I 48), experts shared by rows, a shared expert narrower,
    as wide and wider than the routed ones, and without one."""
    experts = make_experts(8, 160, 48, dtype=dtype, device=DEVICE)
    x, ids, weights = make_batch(n, 160, 8, top_k)
    x, ids, weights = x.to(DEVICE, dtype), ids.to(DEVICE), weights.to(DEVICE, dtype)
    routed = experts._looped(x, ids, weights)
    plan = moe_routing.route(None, top_k, num_experts=8, ids=ids, weights=weights)
    out = moe.grouped_experts(x, plan, experts.gate_up_proj, experts.down_proj)
    _close(out, routed, dtype)
    shared = _shared(160, inter_s, dtype)
    plan = moe_routing.route(None, top_k, num_experts=8, ids=ids, weights=weights, shared=True)
    out = moe.grouped_experts(x, plan, experts.gate_up_proj, experts.down_proj, shared)
    _close(out, routed + _shared_reference(x, shared), dtype)


def _block(dtype, hidden=64, experts=8, top_k=3, inter=32, inter_s=48, norm=True):
    raw = dict(
        architectures=["Qwen3NextForCausalLM"], hidden_size=hidden, intermediate_size=96,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=inter, shared_expert_intermediate_size=inter_s,
        norm_topk_prob=norm, vocab_size=64,
    )  # fmt: skip
    block = Qwen3NextSparseMoeBlock(ModelConfig.from_dict(raw))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return block.to(DEVICE, dtype)


@pytest.fixture
def kernels(monkeypatch):
    """force(on): the sparse block's fused path on or off, whatever the device."""

    def force(on: bool) -> None:
        monkeypatch.setattr(qwen3_next_moe, "hybrid_kernels_enabled", lambda x: on)

    return force


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("router", ["router_gemm", "router_in_kernel", "split_router"])
@pytest.mark.parametrize("rows", [9, 40])  # one block of the routing's rows, and more
def test_sparse_block_fused_equals_torch(dtype, norm, router, rows, kernels, monkeypatch):
    monkeypatch.setattr(qwen3_next_moe, "ROUTER_IN_KERNEL", router == "router_in_kernel")
    monkeypatch.setattr(qwen3_next_moe, "SPLIT_ROUTER", router == "split_router")
    splits = []
    real = moe_router.split_route
    monkeypatch.setattr(
        moe_router, "split_route", lambda *a, **k: splits.append(1) or real(*a, **k)
    )
    block = _block(dtype, norm=norm)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(rows, 64, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(rows, 64, generator=gen).to(DEVICE, dtype)
    next_norm = ZeroCentredRMSNorm(64, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        next_norm.weight.normal_(0, 0.1)
        kernels(False)
        ref = block(x)
        ref_normed = next_norm._reference(ref + residual)
        kernels(True)
        out = block(x)
        normed, res = block(x, residual, next_norm)
    _close(out, ref, dtype)
    _close(res, ref + residual, dtype)
    _close(normed, ref_normed, dtype)
    assert bool(splits) == (router == "split_router" and rows <= 16)


def test_the_deterministic_mode_keeps_its_invariant_router_product(kernels):
    """The split router launch sums a logit's partials in its own order: only where the router
    is a plain product (the deterministic mode's invariant one serves every batch size)."""
    from metrale.kernels.batch_invariant import make_batch_invariant

    kernels(True)
    block = _block(torch.float32)
    x = torch.zeros(3, 64, device=DEVICE)
    assert block._splits_router(x) and not block._splits_router(torch.zeros(17, 64, device=DEVICE))
    make_batch_invariant(block)
    assert not block._splits_router(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_batch_invariant(dtype, kernels, monkeypatch):
    """One row's output (and its folded norm) bitwise alone, among 3, 17 and 300 rows, at
    different places, routed in one launch or two: the kernels' reduction order never depends
    on the batch."""
    kernels(True)
    block = _block(dtype, hidden=160, experts=16, top_k=4, inter=48, inter_s=48)
    next_norm = ZeroCentredRMSNorm(160, 1e-6).to(DEVICE, dtype)
    gen = torch.Generator().manual_seed(5)
    row = torch.randn(1, 160, generator=gen).to(DEVICE, dtype)
    res_row = torch.randn(1, 160, generator=gen).to(DEVICE, dtype)
    outs = []
    with torch.no_grad():
        single = moe_routing.SINGLE_MAX_BLOCKS
        for n, at in ((1, 0), (3, 1), (3, 2), (17, 0), (17, 9), (17, 16), (300, 150)):
            # the routing's two-launch form for 300 rows
            monkeypatch.setattr(moe_routing, "SINGLE_MAX_BLOCKS", 0 if n == 300 else single)
            x = torch.randn(n, 160, generator=gen).to(DEVICE, dtype)
            residual = torch.randn(n, 160, generator=gen).to(DEVICE, dtype)
            x[at], residual[at] = row[0], res_row[0]
            logits = block.gate(x)
            # the router GEMM is not this file's kernel: give every batch the row's own logits
            logits[at] = block.gate(row)[0]
            plan = moe_routing.route(logits, 4, shared=True, block_m=moe.BLOCK_M)
            se = block.shared_expert
            shared = moe.SharedExpert(
                se.gate_up_proj.weight, se.down_proj.weight, block.shared_expert_gate.weight[0]
            )
            exp = block.experts
            out = moe.grouped_experts(x, plan, exp.gate_up_proj, exp.down_proj, shared)
            normed, res = moe.grouped_experts(
                x, plan, exp.gate_up_proj, exp.down_proj, shared,
                residual=residual, norm_weight=next_norm.weight, eps=1e-6,
            )  # fmt: skip
            outs.append((out[at], normed[at], res[at], plan.weights[at], plan.ids[at]))
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            assert torch.equal(a, b)


def test_empty_batch(kernels):
    kernels(True)
    block = _block(torch.float32)
    with torch.no_grad():
        assert block(torch.zeros(0, 64, device=DEVICE)).shape == (0, 64)
