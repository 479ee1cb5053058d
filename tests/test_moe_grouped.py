"""The grouped-GEMM path of the routed experts (`Qwen3NextExperts._grouped`) against the per-expert
loop it replaces, its dispatch, and that it never needs a host sync. (The Triton kernels that CUDA
runs instead: `tests/test_moe_kernels.py`.)"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from metrale.models.qwen3_next_moe import Qwen3NextExperts

NAN = float("nan")


def make_experts(
    num_experts: int, hidden: int, inter: int, dtype=torch.float32, device="cpu", seed: int = 0
) -> Qwen3NextExperts:
    gen = torch.Generator().manual_seed(seed)
    m = Qwen3NextExperts(num_experts, hidden, inter)
    with torch.no_grad():
        for p, fan_in in ((m.gate_up_proj, hidden), (m.down_proj, inter)):
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
    return m.to(device, dtype)


def make_batch(n: int, hidden: int, num_experts: int, top_k: int, seed: int = 1, only=None):
    """x [n, H] and a router's choice: top_k distinct experts per row (drawn from `only` when
    given, so the other experts get no rows) with softmax weights summing to 1."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=gen)
    logits = torch.randn(n, num_experts, generator=gen)
    if only is not None:
        mask = torch.full((num_experts,), float("-inf"))
        mask[list(only)] = 0.0
        logits = logits + mask
    weights, experts = logits.softmax(dim=-1).topk(top_k, dim=-1)
    return x, experts, weights / weights.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("n", [1, 3, 17, 64])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_grouped_equals_looped(n, top_k):
    m = make_experts(8, 64, 32)
    x, experts, weights = make_batch(n, 64, 8, top_k, seed=n)
    with torch.no_grad():
        ref = m._looped(x, experts, weights)
        out = m._grouped(x, experts, weights)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["_grouped", "_gathered", "_looped"])
def test_skipped_picks_add_nothing(path, monkeypatch):
    """A pick of expert E (another expert-parallel rank's) adds nothing on every path, whatever
    its weight, even where the grouped GEMM leaves the rows past its last group as garbage (NaN
    here)."""
    grouped_mm = torch._grouped_mm

    def leaves_nan(a, b, offs):
        out = grouped_mm(a, b, offs=offs)
        return out.index_fill(0, torch.arange(int(offs[-1]), out.shape[0]), float("nan"))

    monkeypatch.setattr(torch, "_grouped_mm", leaves_nan)
    m = make_experts(8, 64, 32)
    x, experts, weights = make_batch(20, 64, 8, 3, seed=5)
    skip = torch.rand(experts.shape, generator=torch.Generator().manual_seed(5)) < 0.5
    with torch.no_grad():
        # every pick, the skipped ones weighted 0; weighted 1e9 or NaN, they add nothing too
        ref = m._looped(x, experts, weights.masked_fill(skip, 0))
        out = getattr(m, path)(x, experts.masked_fill(skip, 8), weights.masked_fill(skip, 1e9))
        nan = getattr(m, path)(x, experts.masked_fill(skip, 8), weights.masked_fill(skip, NAN))
    torch.testing.assert_close(nan, ref, rtol=1e-5, atol=1e-6)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("only", [(0, 3), (2, 5, 7), (6, 7)], ids=str)
def test_grouped_with_idle_experts(only):
    """Experts with no rows (at the ends and in the middle) make empty groups."""
    m = make_experts(8, 32, 16)
    x, experts, weights = make_batch(9, 32, 8, 2, only=only)
    assert set(experts.unique().tolist()) == set(only)
    with torch.no_grad():
        torch.testing.assert_close(
            m._grouped(x, experts, weights), m._looped(x, experts, weights), rtol=1e-5, atol=1e-6
        )


def test_grouped_takes_an_empty_batch():
    m = make_experts(4, 32, 16)
    x, experts, weights = make_batch(0, 32, 4, 2)
    with torch.no_grad():
        assert m._grouped(x, experts, weights).shape == (0, 32)


def test_dispatch():
    """The grouped GEMM whenever _grouped_mm takes the dims and dtype; otherwise the earlier split
    (gather up to GATHER_MAX_PAIRS pairs, then the loop), which forward still gets right."""
    aligned = make_experts(8, 64, 32)
    small, large = make_batch(3, 64, 8, 2), make_batch(40, 64, 8, 2)
    assert aligned._path(*small[:2]) == aligned._grouped
    assert aligned._path(*large[:2]) == aligned._grouped
    # float32 rows of 6 or 20 elements are not 16-byte multiples (H, then I)
    for hidden, inter in ((6, 8), (8, 5)):
        odd = make_experts(8, hidden, inter)
        for (x, experts, weights), path in (
            (make_batch(3, hidden, 8, 2), odd._gathered),
            (make_batch(40, hidden, 8, 2), odd._looped),
        ):
            assert odd._path(x, experts) == path
            with torch.no_grad():
                torch.testing.assert_close(
                    odd(x, experts, weights), odd._looped(x, experts, weights)
                )
    wide = make_experts(8, 64, 32, dtype=torch.float64)  # no float64 grouped GEMM
    x, experts, _ = make_batch(3, 64, 8, 2)
    assert wide._path(x.double(), experts) == wide._gathered


def test_grouped_has_no_data_dependent_step():
    """Under FakeTensorMode any op whose output shape or value the host must read (nonzero,
    torch.where(cond), bincount, .item(), .tolist(), boolean indexing: the ops that sync a GPU)
    raises. The grouped path runs through; the looped reference, which syncs, does not. (Fake
    `_grouped_mm` only takes bf16.)"""
    m = make_experts(8, 64, 32, dtype=torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(17, 64, dtype=torch.bfloat16)
        experts = torch.randint(0, 8, (17, 4))
        weights = torch.rand(17, 4, dtype=torch.bfloat16)
        assert m._grouped(x, experts, weights).shape == (17, 64)
        with pytest.raises(torch._subclasses.fake_tensor.DynamicOutputShapeException):
            m._looped(x, experts, weights)


# ------------------------------------------------------------------------------------- CUDA


def _cuda_batches():
    """Batches of 1 to 256 rows at Qwen3-Next-80B's H and I, 64 experts, top-10, in bf16."""
    for n in (1, 16, 64, 256):
        x, experts, weights = make_batch(n, 2048, 64, 10, seed=n)
        yield n, x.cuda().bfloat16(), experts.cuda(), weights.cuda().bfloat16()


@pytest.mark.gpu
def test_grouped_matches_looped_bf16_on_cuda():
    """In bf16 the grouped path (CUTLASS on sm90) and the Triton kernels are as close to a
    float32 reference as the bf16 loop is; the dispatch picks the Triton kernels."""
    m = make_experts(64, 2048, 512, dtype=torch.bfloat16, device="cuda")
    reference = copy.deepcopy(m).float()  # the same (bf16-rounded) weights
    for n, x, experts, weights in _cuda_batches():
        assert m._path(x, experts) == m._triton
        paths = [m._triton]
        if torch.cuda.get_device_capability()[0] in (9, 10):
            paths.append(m._grouped)
        with torch.no_grad():
            looped = m._looped(x, experts, weights).float()
            ref = reference._looped(x.float(), experts, weights.float())
            for path in paths:
                out = path(x, experts, weights).float()
                err = (out - ref).norm() / ref.norm()
                err_looped = (looped - ref).norm() / ref.norm()
                assert err < max(2 * err_looped, 4e-3), (path.__name__, n, err, err_looped)
                torch.testing.assert_close(out, looped, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_grouped_neither_syncs_nor_breaks_graph_capture_on_cuda():
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("grouped GEMM is sync-free only on sm90/sm100")
    m = make_experts(64, 2048, 512, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    for n, x, experts, weights in _cuda_batches():
        with torch.no_grad():
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm up where the graph will be captured
                ref = m._grouped(x, experts, weights)
                torch.cuda.set_sync_debug_mode("error")
                try:
                    m._grouped(x, experts, weights)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out = m._grouped(x, experts, weights)
            new_x, new_experts, new_weights = make_batch(n, 2048, 64, 10, seed=100 + n)
            x.copy_(new_x)
            experts.copy_(new_experts)
            weights.copy_(new_weights)
            graph.replay()
            torch.testing.assert_close(out, m._grouped(x, experts, weights), rtol=0, atol=0)
            assert not torch.equal(out, ref)
