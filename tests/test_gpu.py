"""The same engine on a CUDA device (skipped without one): transformers parity in float32, batch
== alone with preemption, and a bf16 run of the CLI path. CPU tests pin the reference behaviour;
these pin that the device path matches it."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


def test_cuda_float32_greedy_matches_transformers(tiny_model_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    hf = hf.cuda().eval()
    llm = LLM(tiny_model_dir, device="cuda", dtype="float32")
    prompt = [5, 17, 300, 42, 9, 11]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt], device="cuda"),
            max_new_tokens=48,
            min_new_tokens=48,
            do_sample=False,
            pad_token_id=0,
        )
    assert out[0].outputs[0].token_ids == ref[0, len(prompt) :].tolist()


def test_cuda_batch_with_preemption_equals_cpu(tiny_model_dir):
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(12)]
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=20)
    cpu = LLM(tiny_model_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    gpu = LLM(
        tiny_model_dir,
        device="cuda",
        dtype="float32",
        page_size=4,
        num_kv_pages=24,
        max_num_batched_tokens=32,
    )
    outs = gpu.generate(prompts, params, use_tqdm=False)
    assert gpu.engine.telemetry.preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in cpu]


def test_cuda_bf16_default_model_generates(tmp_path, monkeypatch):
    monkeypatch.setenv("METRALE_HOME", str(tmp_path))
    from metrale.knobs import knobs

    knobs.cache_clear()
    llm = LLM(device="cuda")
    assert llm.engine.runner.dtype == torch.bfloat16
    outs = llm.generate(["def fibonacci(n):"] * 8, SamplingParams(temperature=0, max_tokens=16))
    assert all(
        len(o.outputs[0].token_ids) == 16 or o.outputs[0].finish_reason == "stop" for o in outs
    )
    knobs.cache_clear()


def test_cuda_speculation_equals_plain_decoding(tiny_model_dir):
    from tests.test_spec_lossless import make_prompts, params_for, replay

    prompts = make_prompts(seed=3)
    params = [params_for(i) for i in range(len(prompts))]
    plain = LLM(tiny_model_dir, device="cuda", dtype="float32")
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    for drafter, spec in ((None, {"method": "ngram"}), (replay(prompts, ref, 0.7), {})):
        llm = LLM(
            tiny_model_dir,
            drafter=drafter,
            device="cuda",
            dtype="float32",
            spec={"num_drafts": 4, **spec},
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert llm.engine.telemetry.spec.num_drafts > 0


def test_cuda_graph_replay_equals_eager(tiny_model_dir):
    from tests.test_spec_lossless import make_prompts, params_for, replay

    prompts = make_prompts(seed=4)
    params = [params_for(i) for i in range(len(prompts))]
    eager = LLM(tiny_model_dir, device="cuda", dtype="float32", cuda_graphs=False)
    ref = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    graphed = LLM(tiny_model_dir, device="cuda", dtype="float32")
    outs = graphed.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    spec = LLM(
        tiny_model_dir,
        drafter=replay(prompts, ref, 0.7),
        device="cuda",
        dtype="float32",
        spec={"num_drafts": 3},
    )
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert graphed.engine.runner.graphs.cache.stats()["hits"] > 0
    assert spec.engine.runner.graphs.cache.stats()["misses"] > 0  # verify steps were graphed


def test_cuda_prefill_programs_equal_eager(tiny_model_dir):
    """Prompts arriving while others decode and verify (3 slots, chunked prompts): steps with
    prompt chunks replay prefill programs captured at start-up, and the output equals eager
    plain decoding (float32), with and without speculation."""
    from metrale.engine.program_shapes import PrefillShape
    from tests.test_spec_lossless import replay

    prompts = [[(5 * i + 7 * j) % 300 + 3 for j in range(4 + 9 * i)] for i in range(9)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eager = LLM(tiny_model_dir, device="cuda", dtype="float32", cuda_graphs=False)
    ref = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    kwargs = dict(device="cuda", dtype="float32", max_num_seqs=3, max_num_batched_tokens=48)
    for llm in (
        LLM(tiny_model_dir, **kwargs),
        LLM(tiny_model_dir, drafter=replay(prompts, ref, 0.7), spec={"num_drafts": 3}, **kwargs),
    ):
        runner = llm.engine.runner
        assert runner.graphs.prefill_rows == 32
        before = runner.graphs.cache.stats()
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        stats = runner.graphs.cache.stats()
        assert stats["misses"] == before["misses"]  # every program was captured at start-up
        assert any(isinstance(key[0], PrefillShape) for key in runner.graphs.cache._programs)
        assert stats["hits"] > before["hits"]


def test_cuda_mtp_chain_graphs_are_lossless():
    """The shipped model's MTP drafter on CUDA: chain steps replay captured programs, and the
    speculative output equals plain greedy output (float32)."""
    llm = LLM(device="cuda", dtype="float32", spec={"method": "mtp", "num_drafts": 3})
    prompts = ["def fibonacci(n):", "import os\n\n\ndef main():\n", "class Stack:\n"] * 3
    params = dict(temperature=0, max_tokens=48, ignore_eos=True)
    plain = llm.generate(prompts, SamplingParams(**params, speculative=False), use_tqdm=False)
    spec = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    drafter = llm.engine.spec.drafter
    assert drafter.chain_graphs is not None and drafter.chain_graphs._programs
    assert drafter.chain_graphs.catch_up_replays > 0  # decode/verify catch-ups were graphed
    assert llm.engine.telemetry.spec.num_accepted_tokens > 48


def test_cuda_mtp_drafts_chained_ahead_stay_on_the_device_for_few_sequences():
    """Up to `AHEAD_ON_DEVICE_SEQS` sequences, the drafts the catch-up chained ahead are not
    read back before their verify (its input ids take them on the device): the output still
    equals plain greedy output, and the drafts the verdicts judged are those values."""
    import metrale.speculative.mtp as mtp

    llm = LLM(device="cuda", dtype="float32", spec={"method": "mtp", "num_drafts": 3})
    prompts = ["def fibonacci(n):", "class Stack:\n"][: mtp.AHEAD_ON_DEVICE_SEQS]
    params = dict(temperature=0, max_tokens=48, ignore_eos=True)
    plain = llm.generate(prompts, SamplingParams(**params, speculative=False), use_tqdm=False)
    spec = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    drafter = llm.engine.spec.drafter
    assert drafter.ahead_on_device == drafter.drafted_ahead > 0
    assert llm.engine.telemetry.spec.num_accepted_tokens > 48


def test_cuda_batch_64_k3_ragged_programs_never_refuse(tiny_model_dir):
    """64 sequences at mixed depths (K = 3, D-Cut off): every decode and verify step replays a
    ragged program captured at start-up (no refusal, no capture mid-run), output equal to eager
    plain decoding."""
    from metrale.engine.program_shapes import (
        PrefillShape,
        RaggedShape,
        all_prefill_shapes,
        all_ragged_shapes,
    )
    from tests.test_spec_lossless import replay

    prompts = [[(3 * i + 5 * j) % 400 + 3 for j in range(6 + i % 11)] for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = LLM(tiny_model_dir, device="cuda", dtype="float32", cuda_graphs=False)
    ref = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    spec = LLM(
        tiny_model_dir,
        drafter=replay(prompts, ref, 0.6),
        device="cuda",
        dtype="float32",
        max_num_seqs=64,
        spec={"num_drafts": 3, "dcut": False},
    )
    runner = spec.engine.runner
    captured = runner.graphs.cache.stats()["misses"]
    assert runner.graphs.prefill_rows == 2048  # graph_prefill_rows=None: the token budget
    assert captured == len(all_ragged_shapes(64, 4)) + len(all_prefill_shapes(64, 2048, 4))
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert runner.graphs.ragged and runner.graph_refusals == 0
    stats = runner.graphs.cache.stats()
    programs = runner.graphs.cache._programs
    assert all(isinstance(key[0], (RaggedShape, PrefillShape)) for key in programs)
    assert stats["misses"] == captured and stats["hits"] > 0
