"""Tensor parallelism on CPU with gloo (`metrale/distributed/`): 2 and 4 ranks give the greedy
tokens of one rank and its logits to 1e-5 (float32), with n-gram speculation and preemption
too; each rank reads only its slices of the checkpoint; what is not covered yet is refused with
an error naming it; a worker that dies ends the engine with an error, not a hang."""

from __future__ import annotations

import time

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.config import ModelConfig
from metrale.distributed.parallel import DistributedError, kv_heads_of, local_config, selector
from metrale.engine.sequence import Batch, ScheduledSeq, Sequence
from metrale.models import loader

PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(5 + 4 * i)] for i in range(4)]


def greedy(n: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def tp_llm(path, size: int, **kw) -> LLM:
    return LLM(path, device="cpu", dtype="float32", tensor_parallel_size=size, **kw)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32")
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def first_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The float32 logits of every row of one prompt's prefill."""
    engine = llm.engine
    seq = Sequence(10**6, "probe", list(prompt), SamplingParams(), 0, (), arrival=0, slot=0)
    engine.allocator.reserve(seq, len(prompt) + 1)
    try:
        return engine.runner.all_logits(Batch([ScheduledSeq(seq, len(prompt))]))
    finally:
        engine.allocator.free(seq)


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_give_one_ranks_tokens_and_logits(tiny_model_dir, reference, size):
    want, single = reference
    llm = tp_llm(tiny_model_dir, size)
    try:
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        got = first_logits(llm, PROMPTS[2])
        torch.testing.assert_close(got, first_logits(single, PROMPTS[2]), atol=1e-5, rtol=0)
    finally:
        llm.shutdown()


def test_ranks_with_ngram_speculation_and_preemption(tiny_model_dir, reference):
    want, _ = reference
    # A pool too small for every sequence at once: some are preempted and recomputed.
    llm = tp_llm(
        tiny_model_dir, 2, num_kv_pages=8, page_size=8, spec={"method": "ngram", "num_drafts": 3}
    )
    try:
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.engine.telemetry.preemptions > 0
        assert llm.engine.telemetry.spec.num_drafts > 0
    finally:
        llm.shutdown()


def test_each_rank_reads_only_its_slices(tiny_model_dir, monkeypatch):
    from tests.test_loader import record_reads

    cfg = ModelConfig.from_hf(tiny_model_dir)
    read = record_reads(monkeypatch)
    from metrale.distributed.layers import TPQwen3ForCausalLM
    from metrale.distributed.parallel import TPGroup
    from metrale.models.attention import TorchPagedAttention

    tp = TPGroup(1, 2)
    model = TPQwen3ForCausalLM(cfg, TorchPagedAttention(), 64, tp)
    loader.load_weights(model, tiny_model_dir, select=selector(cfg, tp))
    local = local_config(cfg, tp)
    d = cfg.head_dim
    layer = "model.layers.0."
    assert read[layer + "self_attn.q_proj.weight"] == (
        local.num_attention_heads * d,
        cfg.hidden_size,
    )
    assert read[layer + "self_attn.k_proj.weight"] == (
        local.num_key_value_heads * d,
        cfg.hidden_size,
    )
    assert read[layer + "mlp.down_proj.weight"] == (cfg.hidden_size, local.intermediate_size)
    assert read["model.embed_tokens.weight"] == (cfg.vocab_size // 2, cfg.hidden_size)


def test_fewer_kv_heads_than_ranks_replicate_the_one_each_rank_reads(tiny_model_dir):
    cfg = ModelConfig.from_hf(tiny_model_dir)  # 4 query heads, 2 KV heads
    assert [kv_heads_of(cfg, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_heads_of(cfg, r, 2) for r in range(2)] == [(0, 1), (1, 1)]


def test_what_does_not_split_or_is_not_covered_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="num_attention_heads"):
        tp_llm(tiny_model_dir, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        tp_llm(tiny_model_dir, 0)


def test_expert_parallel_without_experts_to_split_is_said(tiny_model_dir, caplog):
    """Ignored where there is nothing to split (a dense target; one rank), and said so."""
    with caplog.at_level("WARNING", logger="metrale.engine.llm"):
        LLM(tiny_model_dir, device="cpu", dtype="float32", expert_parallel=True)
    assert "expert_parallel: ignored" in caplog.text and "no experts" in caplog.text


def test_a_dead_worker_ends_the_engine_with_an_error(tiny_model_dir):
    llm = tp_llm(tiny_model_dir, 2, distributed_timeout_s=10)
    try:
        worker = llm.engine.runner.model._workers[0]
        worker.kill()
        worker.join(timeout=10)
        # an error naming the stopped rank (a hang would end at the 10 s collective timeout
        # with a timeout error instead)
        with pytest.raises(DistributedError, match="worker stopped: rank 1"):
            llm.generate(PROMPTS[:1], greedy(4), use_tqdm=False)
    finally:
        llm.shutdown()


def test_bench_runs_with_two_ranks(tmp_path, capsys):
    """`metrale bench --tensor-parallel-size 2` on a tiny shape, gloo on CPU."""
    import json

    from metrale.cli import main

    args = ["bench", "--shape", "tiny", "--device", "cpu", "--batch-sizes", "1,2", "--q", "1,3"]
    args += ["--context", "16", "--e2e-batch-sizes", "2", "--max-tokens", "8", "--num-drafts", "2"]
    args += ["--tensor-parallel-size", "2", "--out", str(tmp_path / "bench")]
    assert main(args) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    result = json.loads(printed[-1])
    assert result["tensor_parallel_size"] == 2
    assert any("x 2 ranks" in line for line in printed)
    assert result["decode"][0]["ms"] > 0 and result["e2e"][0]["tokens_per_s_spec"] > 0


def test_generate_command_with_two_ranks(tiny_model_dir):
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "metrale.cli", "generate", "a b", "--model", str(tiny_model_dir)]
        + ["--device", "cpu", "--tensor-parallel-size", "2", "--max-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("a b")


HYBRID_PROMPTS = [[(11 * i + 5 * j) % 250 + 3 for j in range(6 + 5 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def hybrid_wide_dir(tmp_path_factory, tokenizer_dir):
    """A tiny Qwen3-Next whose GDN key heads, experts and the rest split 4 ways (the module's
    shared one has 2 key heads: 2 ranks at most)."""
    from tests.test_hybrid_engine import write_hybrid

    path = tmp_path_factory.mktemp("hybrid-wide")
    wide = dict(linear_num_key_heads=4, linear_num_value_heads=8, num_experts=8)
    return write_hybrid(path, tokenizer_dir, seed=5, **wide)


def test_a_hybrid_dense_width_must_split_only_where_a_layer_uses_it(hybrid_wide_dir):
    """Found in review: a hybrid whose every layer is MoE was refused for an
    `intermediate_size` (the dense MLP's) that no layer uses."""
    import dataclasses

    from metrale.distributed.parallel import check_tp

    cfg = dataclasses.replace(ModelConfig.from_hf(hybrid_wide_dir), intermediate_size=97)
    assert all(cfg.hybrid.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    check_tp(cfg, 2)
    check_tp(cfg, 2, expert_parallel=True)
    dense = dataclasses.replace(cfg, hybrid=dataclasses.replace(cfg.hybrid, mlp_only_layers=(0,)))
    with pytest.raises(ValueError, match="intermediate_size=97 does not split"):
        check_tp(dense, 2)


def test_hybrid_verify_beside_a_prompt_chunk_runs_on_every_rank(hybrid_wide_dir):
    """A step that verifies beside a prompt chunk runs as two forwards under tensor
    parallelism (the workers address one state mode a forward): never a forward that fails and
    is run again one sequence at a time (found in review: the one-forward `SplitState` did)."""
    from metrale.speculative.replay import ReplayDrafter

    prompts = [HYBRID_PROMPTS[0], HYBRID_PROMPTS[3], HYBRID_PROMPTS[2], HYBRID_PROMPTS[1] * 2]
    single = LLM(hybrid_wide_dir, device="cpu", dtype="float32")
    want = [o.outputs[0].token_ids for o in single.generate(prompts, greedy(10), use_tqdm=False)]
    llm = tp_llm(
        hybrid_wide_dir,
        2,
        drafter=ReplayDrafter(dict(zip(map(tuple, prompts), want)), 0.6, vocab_size=320, seed=11),
        spec={"num_drafts": 3, "dcut": False},
        max_num_batched_tokens=20,
        max_num_seqs=2,  # the later prompts are admitted beside verifies
        async_scheduling=False,
    )
    try:
        outs = llm.generate(prompts, greedy(10), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.engine.retried_batches == 0
        assert llm.engine.telemetry.spec.num_draft_tokens > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "size, variant, expert_parallel",
    [
        (2, "write_on_accept", True),
        (2, "per_row_slots", False),
        (4, "write_on_accept", False),
        (4, "per_row_slots", True),
    ],
)
def test_hybrid_ranks_give_one_ranks_tokens_with_speculation(
    hybrid_wide_dir, size, variant, expert_parallel
):
    """GDN heads and their state split by key head, experts split across ranks (expert
    parallelism) or each expert across them; n-gram drafts verified in either hybrid verify
    variant (state resets and commits on every rank)."""
    single = LLM(hybrid_wide_dir, device="cpu", dtype="float32")
    want = single.generate(HYBRID_PROMPTS, greedy(), use_tqdm=False)
    spec = {"method": "ngram", "num_drafts": 3}
    llm = tp_llm(
        hybrid_wide_dir,
        size,
        spec=spec,
        hybrid_verify_state=variant,
        expert_parallel=expert_parallel,
    )
    try:
        outs = llm.generate(HYBRID_PROMPTS, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
        assert llm.engine.telemetry.spec.num_drafts > 0
        got = first_logits(llm, HYBRID_PROMPTS[2])
        # every expert split across ranks sums its down projection in another order: within
        # 1e-5 of one rank's logits, relative to their size (their largest; element by element
        # a logit near 0 measured the CPU BLAS's blocking: 1.3e-5 against a largest of 3.4 on
        # an AVX2 machine, 1 thread a process as under `-n 2`)
        ref = first_logits(single, HYBRID_PROMPTS[2])
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("layout", ["qwen3_next", "deepseek"])
def test_mtp_drafts_on_rank_zero_beside_a_sharded_target(tiny_model_dir, tmp_path, layout):
    """The MTP heads run on rank 0 alone, with a whole copy of the vocabulary (the sharded
    target's would need every rank for each chained draft): the tokens of one rank."""
    import shutil

    from metrale.models.mtp import write_mtp_weights

    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    write_mtp_weights(path, ModelConfig.from_hf(path), layout, num_layers=1, seed=4)
    assert_drafts_as_one_rank(path, {"method": "mtp", "num_drafts": 3})


def assert_drafts_as_one_rank(path, spec: dict) -> None:
    """2 ranks with drafter `spec` give one rank's tokens, from the same drafts judged the same
    way (random drafters: few are right)."""
    single = LLM(path, device="cpu", dtype="float32", spec=spec)
    want = [o.outputs[0].token_ids for o in single.generate(PROMPTS, greedy(), use_tqdm=False)]
    llm = tp_llm(path, 2, spec=spec)
    try:
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        tel, ref = llm.engine.telemetry.spec, single.engine.telemetry.spec
        assert tel.num_draft_tokens == ref.num_draft_tokens > 0
        assert tel.matched_per_pos == ref.matched_per_pos
    finally:
        llm.shutdown()


def test_a_failing_sequence_ends_alone_with_ranks(tiny_model_dir, reference):
    """A drafter raising for one sequence ends it; the others finish with one rank's tokens and
    the ranks stay in step (the failure is rank 0's, before any forward)."""
    from tests.test_spec_depth_zero import FailsLate

    want, _ = reference
    prompts = PROMPTS[:2]
    ref = [
        o.outputs[0].token_ids
        for o in LLM(tiny_model_dir, device="cpu", dtype="float32").generate(
            prompts, greedy(30), use_tqdm=False
        )
    ]
    llm = tp_llm(tiny_model_dir, 2, drafter=FailsLate(prompts, ref), spec={"num_drafts": 3})
    try:
        outs = llm.generate(prompts, greedy(30), use_tqdm=False)
        assert outs[0].outputs[0].token_ids == ref[0]
        assert outs[1].outputs[0].finish_reason == "error"
        # the ranks still agree (without the drafter, which fails every other prompt)
        again = llm.generate(PROMPTS, greedy(speculative=False), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == want
    finally:
        llm.shutdown()


def test_workers_wait_for_commands_past_the_collective_timeout(tiny_model_dir, reference):
    """An idle engine keeps its workers: only collectives run under the timeout."""
    want, _ = reference
    llm = tp_llm(tiny_model_dir, 2, distributed_timeout_s=4)
    try:
        llm.generate(PROMPTS[:1], greedy(2), use_tqdm=False)
        time.sleep(5)
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    finally:
        llm.shutdown()


def test_ctrl_c_in_a_terminal_leaves_the_workers_to_rank_zero(tiny_model_dir, reference):
    import os
    import signal

    want, _ = reference
    llm = tp_llm(tiny_model_dir, 2)
    try:
        os.kill(llm.engine.runner.model._workers[0].pid, signal.SIGINT)
        time.sleep(0.5)
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    finally:
        llm.shutdown()


def test_a_failure_on_rank_zero_ends_the_engine_and_its_workers_are_killed(tiny_model_dir):
    import signal

    llm = tp_llm(tiny_model_dir, 2, distributed_timeout_s=60)
    worker = llm.engine.runner.model._workers[0]
    layer = llm.engine.runner.model._model.model.layers[1]

    def broken(*args):
        raise RuntimeError("injected")

    layer.forward = broken
    try:
        with pytest.raises(DistributedError, match="injected"):
            llm.generate(PROMPTS[:1], greedy(4), use_tqdm=False)
        with pytest.raises(DistributedError, match="earlier failure"):
            llm.generate(PROMPTS[:1], greedy(4), use_tqdm=False)
    finally:
        llm.shutdown()
    # the worker waited in an all-reduce: killed, not sent a stop command it could not read
    # (exit 0) nor left to time out (exit 1)
    assert worker.exitcode == -signal.SIGKILL


def test_a_dropped_engine_frees_the_group_for_the_next(tiny_model_dir, reference):
    import gc

    want, _ = reference
    llm = tp_llm(tiny_model_dir, 2)
    llm.generate(PROMPTS[:1], greedy(2), use_tqdm=False)
    del llm
    gc.collect()
    llm = tp_llm(tiny_model_dir, 2)
    try:
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    finally:
        llm.shutdown()


def failing_build(*args, **kwargs):
    raise FileNotFoundError("no shard here")


def test_a_worker_that_cannot_build_fails_the_engine_with_why(tiny_model_dir, monkeypatch):
    from metrale.distributed import shard

    monkeypatch.setattr(shard, "build_worker", failing_build)
    with pytest.raises(DistributedError, match="rank 1 could not build its shard: .*no shard"):
        tp_llm(tiny_model_dir, 2)
    llm = tp_llm(tiny_model_dir, 1)  # nothing left behind: the group is gone
    assert llm.engine.runner.tp_size == 1
    import torch.distributed as dist

    assert not dist.is_initialized()


def worker_gone_before_the_group(rank, size, ep, address, build, device, timeout, pipe):
    """A worker that starts and then exits before it joins the group (killed while importing,
    say), or says why it cannot join first (a device it cannot use)."""
    import os

    pipe.send("started")
    if rank == 2:
        pipe.send(("RuntimeError", "CUDA error: invalid device ordinal"))
    os._exit(3)


@pytest.mark.parametrize("size", [2, 4])
def test_a_worker_gone_before_the_group_forms_is_seen_at_once(tiny_model_dir, monkeypatch, size):
    """Found in review: rank 0 waited in the group's formation for the start-up's patience
    (ten minutes) for a worker that had already exited or said why. With that patience cut to
    60 s, the old code failed only at the group's own timeout, naming no rank."""
    from metrale.distributed import startup

    monkeypatch.setattr(startup, "STARTUP_TIMEOUT", 60.0)
    monkeypatch.setattr(startup, "_worker_main", worker_gone_before_the_group)
    want = "rank 1 exited before it joined the group [(]exit code 3[)]"
    if size == 4:  # ranks 1 and 3 exit silently, 2 says why: whichever is seen first is named
        want = "rank ([13] exited before it joined the group|2 could not build .*invalid device)"
    with pytest.raises(DistributedError, match=want):
        tp_llm(tiny_model_dir, size)
    assert not torch.distributed.is_initialized()
    monkeypatch.undo()
    llm = tp_llm(tiny_model_dir, 2)  # the group is free for the next engine
    try:
        assert llm.generate(PROMPTS[:1], greedy(2), use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_a_server_whose_worker_dies_says_so(tiny_model_dir):
    """The engine thread stops on a rank's failure (no busy loop of failing steps): requests
    get a 503 in the OpenAI error shape, /health a 503 naming the failure."""
    import httpx

    from metrale.server import startup_banner
    from tests.test_server import Server

    srv = Server(tiny_model_dir, tensor_parallel_size=2, distributed_timeout_s=10)
    try:
        assert "tensor parallel over 2 ranks" in startup_banner(srv.loop, "h", 1, False)
        body = {"model": "tiny", "prompt": "a b", "max_tokens": 4}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
        worker = srv.loop.engine.runner.model._workers[0]
        worker.kill()
        worker.join(10)
        first = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert first.status_code in (200, 503)  # in flight when the step failed: aborted
        if first.status_code == 200:
            assert first.json()["choices"][0]["finish_reason"] == "abort"
        late = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert late.status_code == 503 and "worker stopped" in late.json()["error"]["message"]
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 503 and "worker stopped" in health.json()["error"]
    finally:
        srv.close()


def test_a_worker_that_exits_while_starting_is_seen_at_once(tiny_model_dir, tmp_path):
    """A script without the `__main__` guard: each spawned worker re-runs it and exits while
    starting. The engine says so from the worker's exit, not after the start-up timeout (600 s,
    past this run's own 120 s limit)."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from metrale import LLM\n"
        f"LLM({str(tiny_model_dir)!r}, device='cpu', tensor_parallel_size=2)\n"
    )
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "exited while starting" in res.stderr and "__main__" in res.stderr


def test_dflash_drafts_on_rank_zero_beside_a_sharded_target(tiny_model_dir, tmp_path):
    """DFlash reads rank 0's taps of the target's (all-reduced, whole) hidden states and its
    whole vocabulary copy: the tokens and drafts of one rank."""
    import shutil

    from tests.test_spec_dflash import write_dflash

    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    write_dflash(path, path / "dflash", block_size=4)
    assert_drafts_as_one_rank(path, {"method": "dflash", "num_drafts": 3})
