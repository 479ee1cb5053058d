"""The deterministic mode on the CPU (issue 13): float32 logprobs with speculation are the plain
engine's to the bit, on dense and hybrid targets, alone and in a batch. CPU kernels round by how
many rows share a call (BLAS blocking, SDPA tiling, vectorised activations with scalar tails), so
the mode computes the products and attention in float64 and rounds once, the GDN rows take the
recurrent form whatever the chunk, and SiLU, sigmoid and softplus are written over `exp`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale import LLM, SamplingParams
from metrale.models.activations import sigmoid, silu, softplus
from metrale.speculative.replay import ReplayDrafter
from tests.test_hybrid_engine import hybrid_dir  # noqa: F401 (a module fixture)


@pytest.mark.parametrize(
    "ours,torchs", [(silu, F.silu), (sigmoid, torch.sigmoid), (softplus, F.softplus)]
)
def test_activations_give_an_element_the_same_bits_however_many_share_the_call(ours, torchs):
    torch.manual_seed(0)
    x = torch.randn(4099) * 6
    x[:3] = torch.tensor([-120.0, 0.0, 90.0])  # overflowing exp, zero, past softplus' threshold
    full = ours(x)
    for n in (1, 3, 8, 17):
        parts = torch.cat([ours(x[i : i + n]) for i in range(0, 272, n)])[:272]
        assert torch.equal(parts, full[:272]), n
    torch.testing.assert_close(full, torchs(x), rtol=2e-6, atol=1e-7)
    assert torch.isfinite(full).all()


@pytest.mark.parametrize("ours,torchs", [(silu, F.silu), (sigmoid, torch.sigmoid)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_activations_in_half_precision_keep_torchs_accuracy(ours, torchs, dtype):
    """Computed in float32 and rounded once, as torch's: no overflow of exp in fp16 (silu(-12)
    is not 0), no early rounding in bf16."""
    x = torch.linspace(-30, 30, 6001).to(dtype)
    got, ref = ours(x).float(), torchs(x.float()).to(dtype).float()
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("ours", [silu, sigmoid, softplus])
def test_activations_under_autograd_are_torchs_with_finite_gradients(ours):
    x = torch.tensor([-120.0, -89.0, -12.0, 0.0, 30.0, 100.0], requires_grad=True)
    ours(x).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_causal_conv_taps_accumulate_in_float32():
    """The taps are summed in float32 and rounded once (a bf16 running sum lost 3x accuracy),
    and a row's output does not depend on how many rows the call has."""
    from metrale.models.gdn import causal_conv1d

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 64, generator=g)
    w, window = torch.randn(64, 4, generator=g), torch.randn(2, 64, 3, generator=g)
    exact = causal_conv1d(x.double(), w.double(), window.double(), activation=False).out
    half = causal_conv1d(x.bfloat16(), w.bfloat16(), window.bfloat16(), activation=False).out
    rounded = causal_conv1d(
        x.bfloat16().double(), w.bfloat16().double(), window.bfloat16().double(), activation=False
    ).out.bfloat16()
    assert torch.equal(half, rounded)  # the exact sum of the rounded inputs, rounded once
    assert (half.double() - exact).abs().max() < 0.05
    one = causal_conv1d(x[:, :1], w, window).out
    assert torch.equal(one, causal_conv1d(x, w, window).out[:, :1])


def test_the_wide_experts_match_the_others_at_any_batch():
    """The deterministic mode's CPU experts (float64, one expert at a time) agree with the
    default path, and a row's bits do not depend on the rows beside it."""
    from metrale.models.qwen3_next_moe import Qwen3NextExperts

    torch.manual_seed(0)
    experts = Qwen3NextExperts(8, 32, 16)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.2)
    torch.nn.init.normal_(experts.down_proj, std=0.2)
    x = torch.randn(300, 32)
    ids = torch.randint(0, 8, (300, 2))
    w = torch.rand(300, 2)
    ref = experts(x, ids, w)
    experts.row_invariant = True
    wide = experts(x, ids, w)
    torch.testing.assert_close(wide, ref, rtol=1e-5, atol=1e-6)
    for at in (0, 17, 299):
        assert torch.equal(experts(x[at : at + 1], ids[at : at + 1], w[at : at + 1])[0], wide[at])


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in range(5, 29, 3)]
    return [p[: len(p) // 2] * 2 for p in prompts]  # repeats give the n-gram drafter matches


def _params(i: int) -> SamplingParams:
    if i % 3 == 2:  # seeded sampling: the same noise per position, so the same tokens
        return SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=14, logprobs=2)
    return SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=2)


def _bits(outs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("target", ["dense", "hybrid"])
def test_cpu_deterministic_speculation_gives_the_plain_bits(request, target):
    path = request.getfixturevalue("tiny_model_dir" if target == "dense" else "hybrid_dir")
    prompts = _prompts()
    params = [_params(i) for i in range(len(prompts))]
    kw = dict(device="cpu", dtype="float32", deterministic=True)
    plain = LLM(path, **kw)
    batch = _bits(plain.generate(prompts, params, use_tqdm=False))
    for i in (0, 2, 5):
        assert _bits(plain.generate([prompts[i]], [params[i]], use_tqdm=False)) == [batch[i]]
    truth = {tuple(p): b[0] for p, b in zip(prompts, batch, strict=True)}
    for drafter, spec in ((ReplayDrafter(truth, 0.6, 300), {}), (None, {"method": "ngram"})):
        llm = LLM(path, drafter=drafter, spec={"num_drafts": 3, **spec}, **kw)
        assert _bits(llm.generate(prompts, params, use_tqdm=False)) == batch
        assert llm.engine.telemetry.spec.verify_steps > 0
        if drafter is not None:  # (a random model's text gives n-gram drafts few matches)
            assert llm.engine.telemetry.spec.num_accepted_tokens > 0
