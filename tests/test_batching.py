"""Continuous batching is invisible in the output: a batch of prompts of different lengths, with
chunked prefill, mixed prefill/decode steps and preemption by recompute, gives each prompt the
tokens it gets alone (greedy, and seeded sampling)."""

from __future__ import annotations

import random

import pytest

from metrale import LLM, SamplingParams


def prompts_of_mixed_lengths(n: int = 16, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(2, 60))] for _ in range(n)]


def params_for(i: int, sampled: bool) -> SamplingParams:
    if sampled:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=12 + i % 7)
    return SamplingParams(temperature=0.0, max_tokens=12 + i % 7, ignore_eos=True)


def alone(model_dir, prompts, params) -> list[list[int]]:
    llm = LLM(model_dir, device="cpu", max_num_seqs=1)
    return [
        llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids
        for p, sp in zip(prompts, params, strict=True)
    ]


@pytest.fixture(scope="module")
def prompts():
    return prompts_of_mixed_lengths()


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_batch_equals_alone_with_chunked_prefill_and_preemption(tiny_model_dir, prompts, sampled):
    params = [params_for(i, sampled) for i in range(len(prompts))]
    expected = alone(tiny_model_dir, prompts, params)

    # Roomy pool, small token budget: long prompts are chunked and share steps with decodes.
    llm = LLM(tiny_model_dir, device="cpu", max_num_batched_tokens=24, page_size=4)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    tel = llm.engine.telemetry
    assert tel.preemptions == 0
    assert tel.steps_by_phase["mixed"] > 0 and tel.steps_by_phase["decode"] > 0
    assert tel.decode_tokens == sum(map(len, expected))
    assert tel.prefill_tokens == sum(map(len, prompts))
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable

    # A pool far smaller than the batch needs: sequences are preempted and recomputed.
    llm = LLM(tiny_model_dir, device="cpu", max_num_batched_tokens=64, page_size=4, num_kv_pages=32)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.telemetry.preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable


def test_seeded_sampling_independent_of_batch_order(tiny_model_dir, prompts):
    params = [params_for(i, True) for i in range(6)]
    llm = LLM(tiny_model_dir, device="cpu")
    forward = llm.generate(prompts[:6], params, use_tqdm=False)
    backward = llm.generate(prompts[:6][::-1], params[::-1], use_tqdm=False)[::-1]
    assert [o.outputs[0].token_ids for o in forward] == [o.outputs[0].token_ids for o in backward]
    # different seeds, different samples (a uniform-ish random model: collisions are negligible)
    other = llm.generate(
        prompts[:6],
        [SamplingParams(temperature=0.9, seed=7 + i, max_tokens=12) for i in range(6)],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in other] != [o.outputs[0].token_ids for o in forward]


def test_seeds_that_agree_in_63_bits_sample_apart(tiny_model_dir):
    """Every seed SamplingParams takes is its own: masked to 63 bits, -1 drew 2**63 - 1's
    tokens, -2**63 seed 0's (found in review)."""
    llm = LLM(tiny_model_dir, device="cpu")
    pairs = [(-1, 2**63 - 1), (-(2**63), 0), (-5, 2**63 - 5)]
    seeds = [s for pair in pairs for s in pair]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12) for s in seeds]
    outs = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3]] * 6, params, use_tqdm=False)]
    assert all(outs[i] != outs[i + 1] for i in range(0, 6, 2))
    again = llm.generate([[1, 2, 3]], params[0], use_tqdm=False)[0].outputs[0].token_ids
    assert again == outs[0]


def test_n_samples_are_distinct_and_reproducible(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu")
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10)
    a = llm.generate([[1, 2, 3]], sp, use_tqdm=False)[0]
    b = llm.generate([[1, 2, 3]], sp, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3
    assert [c.index for c in a.outputs] == [0, 1, 2]


def test_abort_at_any_point_frees_pages(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", max_num_batched_tokens=8, page_size=4)
    engine = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", list(range(10, 40 + i)), sp)
    engine.step()  # r0 is mid-prefill, others waiting
    out = engine.abort_request("r0")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    for _ in range(12):  # r1.. decode
        engine.step()
    assert engine.abort_request("r1").outputs[0].finish_reason == "abort"
    assert engine.abort_request("r3").outputs[0].finish_reason == "abort"
    assert engine.abort_request("nope") is None
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.allocator.num_free == engine.allocator.num_usable
    assert not engine.requests


def test_max_model_len_ends_generation(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", max_model_len=20)
    out = llm.generate(
        [list(range(1, 15))],
        SamplingParams(max_tokens=100, ignore_eos=True, temperature=0.0),
        use_tqdm=False,
    )[0]
    assert len(out.outputs[0].token_ids) == 6
    assert out.outputs[0].finish_reason == "length"


def test_a_failing_forward_ends_only_its_sequence(tiny_model_dir, prompts, monkeypatch):
    llm = LLM(tiny_model_dir, device="cpu")
    runner = llm.engine.runner
    real_execute = runner.execute

    def execute(batch, **kw):  # (`defer`: a step launched ahead fails the same way)
        if any(e.seq.request_id == "req-2" for e in batch.entries):
            raise RuntimeError("NaN in the forward")
        return real_execute(batch, **kw)

    monkeypatch.setattr(runner, "execute", execute)
    params = [params_for(i, sampled=False) for i in range(5)]
    outs = llm.generate(prompts[:5], params, use_tqdm=False)
    assert outs[2].outputs[0].finish_reason == "error"
    assert "NaN in the forward" in outs[2].outputs[0].error
    assert not outs[2].outputs[0].error_by_request  # the engine's failure: a 500 when served
    monkeypatch.undo()
    expected = alone(tiny_model_dir, prompts[:5], params)
    for i in (0, 1, 3, 4):
        assert outs[i].outputs[0].token_ids == expected[i]
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable


def test_merged_step_output_skips_failed_parts_on_another_device():
    """Failure isolation merges the parts of a step run sequence by sequence; a failed part holds
    an empty CPU tensor, which must not be concatenated with the others' (CUDA) hidden states."""
    import torch

    from metrale.engine.step_output import StepOutput

    failed = StepOutput([], [], torch.empty(0), [])
    ok = StepOutput([object()], [], torch.zeros(2, 4, device="meta"), [2])
    merged = StepOutput.merge([failed, ok, failed])
    assert merged.hidden.device.type == "meta" and merged.hidden.shape == (2, 4)
    assert merged.row_ends == [2]
