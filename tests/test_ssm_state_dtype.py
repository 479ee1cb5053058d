"""A hybrid target's delta-rule state kept in a 16-bit type (`mamba_ssm_cache_dtype`, vLLM's
option; "auto" = the model's dtype). The state is rounded to its type after every row, as a step
ending at that row stores it, so a verify of T rows computes each row exactly as T decode steps
would: speculation stays lossless. Against references: the recurrent kernel (Triton's
interpreter on CPU) and the torch path, T rows at once against T one-row calls, bit for bit; the
kernel against the torch reference; the chunked kernel's state against its float32 run rounded
once; and the engine, with a bfloat16 state, giving plain decoding's tokens with speculation in
both verify variants (torch path and kernels), and its pool in the type asked for."""

from __future__ import annotations

import os

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.config import EngineConfig
from metrale.models.gdn import recurrent_gated_delta_rule
from metrale.speculative.replay import ReplayDrafter
from tests.test_hybrid_engine import PROMPTS, hybrid_dir  # noqa: F401 (fixture)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = [torch.bfloat16, torch.float16]


def _inputs(b=2, t=5, hk=2, hv=4, dk=16, dv=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hk, dk, generator=g)
    k = torch.randn(b, t, hk, dk, generator=g)
    v = torch.randn(b, t, hv, dv, generator=g)
    decay = -torch.rand(b, t, hv, generator=g)
    beta = torch.rand(b, t, hv, generator=g)
    state = torch.randn(b, hv, dk, dv, generator=g)
    return [x.to(DEVICE) for x in (q, k, v, decay, beta, state)]


@pytest.mark.parametrize("state_dtype", HALF)
def test_torch_rows_at_once_equal_one_row_steps(state_dtype):
    """The torch reference: T rows in one call give the outputs and states of T one-row calls,
    each starting from the state the one before stored (in `state_dtype`)."""
    q, k, v, g, beta, state = _inputs()
    state = state.to(state_dtype)
    whole = recurrent_gated_delta_rule(
        q, k, v, g, beta, state, output_all_states=True, state_dtype=state_dtype
    )
    s = state
    for t in range(q.shape[1]):
        one = recurrent_gated_delta_rule(
            *(x[:, t : t + 1] for x in (q, k, v, g, beta)), s, state_dtype=state_dtype
        )
        assert torch.equal(one.out[:, 0], whole.out[:, t])
        s = one.state.to(state_dtype)
        assert torch.equal(s.float(), whole.states[:, t])
    assert torch.equal(s.float(), whole.state)
    # the float32 path is untouched by the option: no rounding between rows
    plain = recurrent_gated_delta_rule(q, k, v, g, beta, state, state_dtype=torch.float32)
    assert not torch.equal(plain.state.to(state_dtype).float(), whole.state)


@pytest.mark.parametrize("state_dtype", HALF)
@pytest.mark.parametrize("mode", ["final", "rows"])
def test_kernel_rows_at_once_equal_one_row_steps(state_dtype, mode):
    """The recurrent kernel on a 16-bit pool: a verify's T rows (the final state, or each row's
    state into its own entry) give the bits of T decode steps, each reading the entry the one
    before wrote; and the kernel agrees with the torch reference."""
    from metrale.kernels.gdn_recurrent import delta_rule_in_pool

    q, k, v, g, beta, state = _inputs()
    b, t = q.shape[:2]
    pool = torch.zeros(1 + b * (t + 1), *state.shape[1:], dtype=state_dtype, device=DEVICE)
    read = torch.arange(1, b + 1, device=DEVICE)
    pool[read] = state.to(state_dtype)
    steps = pool.clone()
    rows = (b + 1 + torch.arange(b * t, device=DEVICE)).view(b, t)
    whole = delta_rule_in_pool(
        q, k, v, g, beta, pool, read,
        final=read if mode == "final" else None, rows=rows if mode == "rows" else None,
    )  # fmt: skip
    for i in range(t):
        one = delta_rule_in_pool(
            *(x[:, i : i + 1] for x in (q, k, v, g, beta)), steps, read, final=read
        )
        assert torch.equal(one[:, 0], whole[:, i])
        if mode == "rows":
            assert torch.equal(steps[read], pool[rows[:, i]])
    if mode == "final":
        assert torch.equal(steps[read], pool[read])
    ref = recurrent_gated_delta_rule(
        q, k, v, g, beta, state.to(state_dtype), state_dtype=state_dtype
    )
    torch.testing.assert_close(whole, ref.out, rtol=2e-2, atol=2e-2)


def test_chunk_kernel_rounds_its_state_once():
    """A prefill chunk on a bfloat16 pool: computed in float32 from the stored state, rounded
    once at the end: its float32-pool run's final state, rounded."""
    from metrale.kernels.gdn_chunk import chunk_delta_rule_in_pool

    q, k, v, g, beta, state = _inputs(t=37, seed=3)
    g = g * 0.1
    wide = torch.zeros(3, *state.shape[1:], device=DEVICE)
    wide[1:] = state.to(torch.bfloat16).float()
    narrow = wide.to(torch.bfloat16)
    read = torch.tensor([1, 2], device=DEVICE)
    out32 = chunk_delta_rule_in_pool(q, k, v, g, beta, wide, read, read)
    out16 = chunk_delta_rule_in_pool(q, k, v, g, beta, narrow, read, read)
    assert torch.equal(out16, out32)
    if DEVICE == "cuda":
        assert torch.equal(narrow[read], wide[read].to(torch.bfloat16))
    else:  # the interpreter's conversion to bfloat16 truncates: within one unit in the last place
        torch.testing.assert_close(narrow[read].float(), wide[read], rtol=2**-7, atol=0)


def test_config_names_the_field_and_resolves_auto():
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype"):
        EngineConfig(mamba_ssm_cache_dtype="int8")
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype"):
        EngineConfig(mamba_ssm_cache_dtype=3)
    # float32 by default, as transformers keeps it; "auto": the model's dtype, as vLLM's default
    assert EngineConfig().resolve_ssm_dtype(torch.bfloat16) is torch.float32
    cfg = EngineConfig(mamba_ssm_cache_dtype="auto")
    assert cfg.resolve_ssm_dtype(torch.bfloat16) is torch.bfloat16


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _spec_equals_plain(path, variant: str, ssm: str, tokens: int):
    """Plain greedy tokens of three PROMPTS, and a replay drafter's (alpha 0.6, K = 3) run of them:
    they must be equal; returns the plain ones. (Each prompt is prefilled whole in both runs: a
    16-bit state is rounded where a prefill chunk ends, so a prompt split elsewhere may give
    other bits, as in vLLM; the deterministic mode runs every row in the recurrent form, which
    rounds after each row wherever the split falls.)"""
    # deterministic: the products' bits do not depend on the rows beside them (BLAS on the CPU
    # rounds a GEMV and a GEMM differently by 1e-7), which a 16-bit state's rounding could
    # otherwise turn into a flipped token; the state's own rounding is what is under test
    kw = dict(device="cpu", dtype="float32", mamba_ssm_cache_dtype=ssm, deterministic=True)
    plain_llm = LLM(path, **kw)
    assert {t.dtype for t in plain_llm.engine.runner.states.pool.ssm} == {getattr(torch, ssm)}
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(PROMPTS[:3], _greedy(tokens))]
    alone = plain_llm.generate([PROMPTS[2]], _greedy(tokens))[0].outputs[0].token_ids
    assert alone == plain[2]
    truth = {tuple(p): o for p, o in zip(PROMPTS, plain)}
    spec_llm = LLM(
        path,
        drafter=ReplayDrafter(truth, 0.6, vocab_size=320, seed=5),
        spec={"num_drafts": 3},
        hybrid_verify_state=variant,
        **kw,
    )
    spec = spec_llm.generate(PROMPTS[:3], _greedy(tokens))
    assert [o.outputs[0].token_ids for o in spec] == plain
    tel = spec_llm.engine.telemetry.spec
    assert 0 < tel.num_accepted_tokens < tel.num_draft_tokens
    return plain


@pytest.mark.parametrize("variant", ["write_on_accept", "per_row_slots"])
@pytest.mark.parametrize("kernels", [False, True])
def test_engine_with_a_bf16_state_is_lossless(hybrid_dir, variant, kernels, monkeypatch):  # noqa: F811
    """A float32 hybrid target whose state is kept in bfloat16: speculation gives plain
    decoding's greedy tokens and a sequence alone gives its tokens in the batch, on the torch
    path and through the state's Triton kernels (the interpreter on CPU; what CUDA runs: the
    recurrent kernel's per-row rounding, the write-on-accept commit, per-row slots)."""
    if kernels:
        from metrale.kernels import gdn_recurrent
        from metrale.models import gdn_state

        if gdn_recurrent.triton is None or not os.environ.get("TRITON_INTERPRET"):
            pytest.skip("needs Triton's interpreter")
        monkeypatch.setattr(gdn_state, "triton_gdn_enabled", lambda x: True)
    _spec_equals_plain(hybrid_dir, variant, "bfloat16", 10)
