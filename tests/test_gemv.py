"""The few-row projection GEMV (`kernels/gemv.py`) against `F.linear`, under Triton's interpreter
on CPU tensors (on the GPU where there is one); where `linear` takes the kernel and where it
leaves the product to cuBLAS; and the engine's projections pointed at it.

    python -m pytest -q tests/test_gemv.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton")

from metrale.kernels import gemv, pdl  # noqa: E402
from metrale.kernels.batch_invariant import InvariantLinear, make_batch_invariant  # noqa: E402
from metrale.kernels.paged_attention import INTERPRETED  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not INTERPRETED:
    pytest.skip("no CUDA and TRITON_INTERPRET is not set", allow_module_level=True)


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """float32 to rounding (of sums as large as the largest output: a cancelling sum keeps
    their absolute error); bf16 by the whole tensor's relative error (both accumulate in
    float32, in different orders, and round once)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if out.dtype == torch.float32:
        scale = max(1.0, ref.abs().max().item())
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * scale)
    else:
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 8e-3, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows, n, k",
    [(1, 1, 7), (1, 5, 64), (3, 33, 100), (4, 300, 256), (8, 70, 1000), (2, 3, 4096)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_f_linear(dtype, rows, n, k, bias):
    """Widths off the power of two (the masks), strips of 1 to 64 weight rows, 1 to 8 rows of
    x, a bias or none."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    _close(gemv.gemv(x, w, b), F.linear(x, w, b))


def test_gemv_takes_leading_dims_and_strided_rows():
    """x [2, 3, K] gives [2, 3, N]; rows of a wider tensor (a column slice) are read in place,
    a transposed x is copied first."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=g).to(DEVICE)
    x = torch.randn(2, 3, 96, generator=g).to(DEVICE)
    _close(gemv.gemv(x, w), F.linear(x, w))
    wide = torch.randn(5, 200, generator=g).to(DEVICE)
    _close(gemv.gemv(wide[:, 50:146], w), F.linear(wide[:, 50:146], w))
    tall = torch.randn(96, 4, generator=g).to(DEVICE).t()
    _close(gemv.gemv(tall, w), F.linear(tall, w))


def test_linear_takes_the_kernel_only_where_it_applies(monkeypatch, knob_env):
    """One row of K up to MAX_K or two of K up to MAX_K_TWO_ROWS (the strip GEMV), up to
    MAX_ROWS of bf16 or fp16 (the tensor-core kernel), the weight in x's dtype and row-major, no
    autograd, the knob off; anything else is F.linear (and a CPU tensor is, unless the fused
    paths are forced under the interpreter)."""
    knob_env(METRALE_FORCE_FUSED_KERNELS="1")
    calls = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a: calls.append(1) or real(*a))
    w = torch.randn(12, 32, device=DEVICE)

    def taken(x, weight=w, **grad) -> bool:
        calls.clear()
        with torch.set_grad_enabled(grad.get("grad", False)):
            _close(gemv.linear(x, weight).detach(), F.linear(x, weight).detach())
        return bool(calls)

    assert taken(torch.randn(1, 32, device=DEVICE)) and taken(torch.randn(2, 32, device=DEVICE))
    # float32 past the strip GEMV's reach: no tensor-core kernel (F.linear)
    assert not taken(torch.randn(3, 32, device=DEVICE))
    k2 = gemv.MAX_K_TWO_ROWS
    assert taken(torch.randn(2, k2, device=DEVICE), torch.randn(3, k2, device=DEVICE))
    assert not taken(torch.randn(2, k2 + 1, device=DEVICE), torch.randn(3, k2 + 1, device=DEVICE))
    assert taken(torch.randn(1, k2 + 1, device=DEVICE), torch.randn(3, k2 + 1, device=DEVICE))
    bf = torch.bfloat16
    wb = w.to(bf)
    for rows in (3, gemv.MAX_ROWS):  # the tensor-core kernel
        assert taken(torch.randn(rows, 32, device=DEVICE, dtype=bf), wb)
    assert not taken(torch.randn(gemv.MAX_ROWS + 1, 32, device=DEVICE, dtype=bf), wb)
    assert not taken(torch.randn(2, 32, device=DEVICE), w.t().contiguous().t())  # column-major
    assert not gemv.gemv_applies(torch.randn(2, 32, device=DEVICE, dtype=torch.float64), w)
    assert not taken(torch.randn(2, 32, device=DEVICE), nn.Parameter(w), grad=True)
    assert taken(torch.randn(2, 32, device=DEVICE), nn.Parameter(w))  # (inference: no autograd)
    wide = torch.randn(4, gemv.MAX_K + 1, device=DEVICE)
    assert not taken(wide, torch.randn(3, gemv.MAX_K + 1, device=DEVICE))
    knob_env(METRALE_FORCE_FUSED_KERNELS="1", METRALE_NO_GEMV="1")
    assert not taken(torch.randn(2, 32, device=DEVICE))
    if DEVICE == "cpu":
        knob_env()
        assert not taken(torch.randn(2, 32))


def test_stream_projections_leaves_invariant_products_alone():
    """Every plain nn.Linear becomes a StreamedLinear (parameters and state dict unchanged);
    the deterministic mode's invariant products stay."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 4)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    make_batch_invariant(model[1][0])
    assert gemv.stream_projections(model) == 2
    assert type(model[0]) is gemv.StreamedLinear and type(model[1][1]) is gemv.StreamedLinear
    assert type(model[1][0]) is InvariantLinear
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    x = torch.randn(3, 8)
    assert torch.equal(model[0](x), F.linear(x, model[0].weight, model[0].bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, n, k", [(3, 40, 100), (8, 70, 300), (2, 33, 5000), (1, 5, 17000)])
def test_the_tensor_core_kernel_matches_f_linear(dtype, rows, n, k):
    """Past the strip GEMV's reach (3 to MAX_ROWS rows; two rows wider than MAX_K_TWO_ROWS; one
    wider than MAX_K), `gemv` takes the tensor-core kernel: K off its step, N off its strip, a
    bias."""
    g = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype)
    assert not gemv._strip_fits(rows, k)
    _close(gemv.gemv(x, w, b), F.linear(x, w, b))


def test_long_and_wide_weights_take_wider_tiles(monkeypatch):
    """`tiles_of`: K >= 8192, then K >= 4096 with N >= 6144, take the wider tiles (session 76's
    sweep) where the device's shared memory holds them, else TILES (review: 160 KiB is more
    than an sm86/89/120 GPU's 99). The long-K case runs in the test above (k 17000); the wide
    one here, with K and N off the tile."""
    x = torch.empty(4, 8, dtype=torch.bfloat16)
    assert gemv.tiles_of(4096, 12288, x) == gemv.TILES_LONG_K
    assert gemv.tiles_of(24576, 4096, x) == gemv.tiles_of(6144, 4096, x) == gemv.TILES_WIDE_N
    assert gemv.tiles_of(4096, 4096, x) == gemv.tiles_of(12352, 2048, x) == gemv.TILES
    for budget, long_k, wide in (
        (166912, gemv.TILES, gemv.TILES_WIDE_N),
        (101376, *[gemv.TILES] * 2),
    ):
        monkeypatch.setattr(gemv, "shared_budget", lambda device, budget=budget: budget)
        assert gemv.tiles_of(4096, 12288, x) == long_k  # (an A100; an sm86/89/120 GPU)
        assert gemv.tiles_of(24576, 12288, x) == gemv.tiles_of(24576, 4096, x) == wide
        assert gemv.shared_need(gemv.TILES, 2) <= budget
    monkeypatch.undo()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4100, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(6200, 4100, generator=g) / 4100**0.5).to(DEVICE, torch.bfloat16)
    assert gemv.tiles_of(6200, 4100, x) == gemv.TILES_WIDE_N
    _close(gemv.gemv(x, w), F.linear(x, w))


def test_frozen_weights_with_a_grad_input_a_strided_bias_or_no_width_go_their_way(knob_env):
    """Found in review: an input or bias that autograd follows goes to F.linear (the kernels
    have no backward) even where the weight is frozen; a strided bias is read as given; K = 0
    is F.linear's (the bias alone)."""
    knob_env(METRALE_FORCE_FUSED_KERNELS="1")
    w = torch.randn(6, 16, device=DEVICE)
    x = torch.randn(1, 16, device=DEVICE, requires_grad=True)
    assert not gemv.gemv_applies(x, w) and gemv.linear(x, w).grad_fn is not None
    b = torch.randn(6, device=DEVICE, requires_grad=True)
    assert not gemv.gemv_applies(x.detach(), w, b)
    with torch.no_grad():
        assert gemv.gemv_applies(x, w, b)
    wide = torch.randn(12, device=DEVICE)
    x = x.detach()
    assert gemv.gemv_applies(x, w, wide[::2])
    _close(gemv.linear(x, w, wide[::2]), F.linear(x, w, wide[::2]))
    empty = torch.zeros(6, 0, device=DEVICE)
    assert not gemv.gemv_applies(torch.zeros(1, 0, device=DEVICE), empty)
    _close(gemv.linear(torch.zeros(1, 0, device=DEVICE), empty, b.detach()), b.detach()[None])
    assert not gemv.gemv_applies(x, w.double()) and not gemv.gemv_applies(x, w, b.detach().half())
    # (found in a second review) float64, a bias F.linear would broadcast, a negated view
    assert not gemv.gemv_applies(x.double(), w.double())
    assert not gemv.gemv_applies(x, w, torch.ones(1, device=DEVICE))
    assert not gemv.gemv_applies(x._neg_view(), w)
    _close(gemv.linear(x._neg_view(), w), F.linear(-x, w))


def test_every_rank_streams_the_same_projections(tokenizer_dir, tmp_path):
    """Under tensor parallelism rank 0 and a worker build their shards with `shard.build_model`,
    which streams them: the same modules get the same kernels on every rank (found in review:
    a worker's replicated router ran cuBLAS where rank 0's ran the GEMV, and near-tied logits
    rounded differently could route a token to different experts on two ranks)."""
    from metrale.config import EngineConfig, ModelConfig
    from metrale.distributed import shard
    from metrale.distributed.parallel import TPGroup
    from metrale.models.attention import TorchPagedAttention
    from tests.test_hybrid_engine import write_hybrid

    path = write_hybrid(tmp_path, tokenizer_dir, seed=3)
    cfg = ModelConfig.from_hf(path)
    classes = []
    for rank in (0, 1):
        model = shard.build_model(
            cfg, EngineConfig(), path, TorchPagedAttention(), 64, TPGroup(rank, 2),
            torch.device("cpu"), torch.float32,
        )  # fmt: skip
        assert not [n for n, m in model.named_modules() if type(m) is nn.Linear]
        classes.append({n: type(m) for n, m in model.named_modules()})
    assert classes[0] == classes[1]
    assert gemv.StreamedLinear in classes[1].values()


def test_the_tensor_core_kernel_needs_ampere(monkeypatch):
    """bf16 products in Triton need sm80: before it (and for float32) rows past the strip
    GEMV's reach go to cuBLAS."""

    class OnGpu:
        dtype, is_cuda, device = torch.bfloat16, True, torch.device("cuda", 0)

    monkeypatch.setattr(pdl, "_majors", {})
    for major, expected in ((7, False), (8, True), (9, True)):
        pdl._majors.clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i, m=major: (m, 0))
        assert gemv._tensor_cores(OnGpu()) is expected
    OnGpu.dtype = torch.float32
    assert not gemv._tensor_cores(OnGpu())
