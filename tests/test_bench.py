"""`metrale bench` end to end on a tiny shape on CPU: a table, a JSON document as the last stdout
line (and in bench.json) whose verify cost curve the D-Cut planner can read, and a PNG plot."""

from __future__ import annotations

import json

import pytest
import torch

from metrale.api import LLM
from metrale.bench.shapes import SHAPES, write_shape
from metrale.cli import main
from metrale.default_model import default_model_dir
from metrale.engine.sequence import Batch, ScheduledSeq, Sequence
from metrale.sampling_params import SamplingParams
from metrale.speculative.verify_cost import VerifyCostModel


def test_bench_writes_table_json_and_png(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main(
        [
            "bench",
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--batch-sizes",
            "1,3",
            "--q",
            "1,2,4",
            "--context",
            "24",
            "--e2e-batch-sizes",
            "2",
            "--max-tokens",
            "12",
            "--alpha",
            "0.7",
            "--num-drafts",
            "2",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    stdout = capsys.readouterr().out.strip().splitlines()
    result = json.loads(stdout[-1])
    assert json.loads((out / "bench.json").read_text())["verify_cost"] == result["verify_cost"]
    assert any("x_roofline" in line for line in stdout)
    # the engine that ran is named: the ratios depend on it (the default: async scheduling)
    assert result["async_scheduling"] is True and "async scheduling)" in stdout[0]
    assert [d["batch"] for d in result["decode"]] == [1, 3]
    assert all(d["ms"] > 0 and d["roofline_ratio"] > 0 for d in result["decode"])
    cost = result["verify_cost"]
    assert cost["q"] == [1, 2, 3, 4]  # K + 1 = 3 is always measured
    assert all(row[0] == 1.0 for row in cost["ratio"])
    VerifyCostModel.from_json(cost).step_time(6, 3)  # the planner reads it
    (e2e,) = result["e2e"]
    assert e2e["batch"] == 2 and e2e["speedup"] > 0 and e2e["ideal_speedup"] > 0
    assert 1.0 <= e2e["mean_acceptance_length"] <= 3.0
    assert 0.0 <= e2e["first_draft_acceptance"] <= 1.0  # (drafts were verified: no D-Cut)
    # Both ideals price one verify the same way: they differ by the acceptance length only.
    ratio = e2e["ideal_speedup_at_measured_acceptance"] / e2e["ideal_speedup"]
    expected = (1 - 0.7**3) / (1 - 0.7)  # alpha 0.7, K = 2
    assert ratio == pytest.approx(e2e["mean_acceptance_length"] / expected)
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capture = result["graph_capture"]  # no CUDA graphs on the CPU: nothing at start-up
    assert capture["startup_programs"] is None and capture["startup_capture_bytes"] is None


def test_capture_report_counts_start_up_and_first_use(monkeypatch):
    """The bench's capture figures: every program the process captured and their seconds,
    and apart the target's start-up capture with its memory."""
    from types import SimpleNamespace

    from metrale.bench.timing import capture_line, capture_report
    from metrale.engine import program_cache

    monkeypatch.setattr(program_cache, "_captures", 20)
    monkeypatch.setattr(program_cache, "_capture_seconds", 5.25)
    report = capture_report(SimpleNamespace(startup_capture=(12, 3.5, 3 * 2**29)))
    assert report == {
        "startup_programs": 12,
        "startup_capture_s": 3.5,
        "startup_capture_bytes": 3 * 2**29,
        "programs_captured": 20,
        "capture_s": 5.25,
    }
    assert capture_line(report) == (
        "CUDA graphs: 20 captured in 5.2 s (12 at start-up: 3.5 s, 1.50 GiB)"
    )
    report = capture_report(SimpleNamespace(startup_capture=None))
    assert capture_line(report) == "CUDA graphs: 20 captured in 5.2 s"
    monkeypatch.setattr(program_cache, "_captures", 0)
    assert capture_line(capture_report(SimpleNamespace(startup_capture=None))) is None


@pytest.mark.gpu
def test_bench_reports_the_start_up_capture_on_cuda(tmp_path, capsys):
    args = ["bench", "--shape", "tiny", "--device", "cuda", "--batch-sizes", "1,4"]
    args += ["--q", "1,2", "--context", "64", "--e2e-batch-sizes", "2", "--max-tokens", "8"]
    args += ["--alpha", "0.5", "--num-drafts", "2", "--out", str(tmp_path / "bench")]
    assert main(args) == 0
    printed = capsys.readouterr().out
    capture = json.loads(printed.strip().splitlines()[-1])["graph_capture"]
    assert capture["startup_programs"] > 0 and capture["startup_capture_s"] > 0
    assert capture["programs_captured"] >= capture["startup_programs"]
    assert capture["capture_s"] > 0 and capture["startup_capture_bytes"] > 0
    assert "at start-up" in printed


def test_bench_e2e_drafter_on_the_default_model(tmp_path, capsys):
    """`--e2e-drafter mtp`: real tokens/s with and without the shipped model's MTP head on
    held-out prompts; float32 on CPU, so speculative output equals plain output."""
    heldout = tmp_path / "heldout"
    heldout.mkdir()
    body = "".join(f"def f_{i}(x):\n    return x * {i} + 1\n\n\n" for i in range(40))
    (heldout / "mod.py").write_text(body)
    out = tmp_path / "bench"
    # without --model: the embedded model (default_model_dir()) and its MTP head
    args = ["bench", "--e2e-drafter", "mtp"]
    args += ["--device", "cpu", "--dtype", "float32", "--e2e-batch-sizes", "1,2"]
    args += ["--max-tokens", "16", "--prompt-tokens", "32", "--num-drafts", "3"]
    args += ["--heldout", str(heldout), "--out", str(out), "--steady-requests-per-slot", "2"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    result = json.loads(printed.strip().splitlines()[-1])
    assert "steady state (2 requests per slot)" in printed
    assert "req_tpot_x" in printed
    assert result["async_scheduling"] is True and "async scheduling)" in printed
    assert result == json.loads((out / "drafter_e2e.json").read_text())
    assert result["model"] == str(default_model_dir())
    assert [r["batch"] for r in result["e2e"]] == [1, 2]
    for row in result["e2e"]:
        assert row["identical_outputs"] == 1.0
        assert 1.0 < row["mean_acceptance_length"] <= 4.0  # the trained head is sometimes right
        assert row["tokens_per_s_plain"] > 0 and row["tokens_per_s_spec"] > 0
        # each request's own time per output token, from the engine's request telemetry
        assert row["request_tpot_ms_plain"] > 0 and row["request_tpot_ms_spec"] > 0
        assert not any(key.startswith("request_") for key in row["steady"])
        # steady state: twice as many requests as slots, streamed through them
        assert row["steady"]["requests"] == 2 * row["batch"]
        assert 1.0 < row["steady"]["mean_acceptance_length"] <= 4.0


@pytest.mark.parametrize(
    "variant, ssm", [("write_on_accept", "auto"), ("per_row_slots", "bfloat16")]
)
def test_bench_runs_a_hybrid_shape(tmp_path, capsys, variant, ssm):
    """A Qwen3-Next-shaped random model: decode and verify cost curves and the end-to-end run,
    with a roofline that counts the experts a batch-1 token reads, not all of them; the verify
    variant's state pool is reported (per-row slots: K + 1 = 3 entries per sequence), with the
    delta-rule state's type (auto: the model's, float32 here)."""
    out = tmp_path / "bench"
    args = ["bench", "--shape", "qwen3-next-tiny", "--device", "cpu", "--batch-sizes", "1,2"]
    args += ["--q", "1,3", "--context", "20", "--e2e-batch-sizes", "2", "--max-tokens", "10"]
    args += ["--num-drafts", "2", "--out", str(out), "--hybrid-verify-state", variant]
    args += ["--mamba-ssm-cache-dtype", ssm]
    assert main(args) == 0
    printed = capsys.readouterr().out
    result = json.loads(printed.strip().splitlines()[-1])
    assert result["hybrid_verify_state"] == variant
    state_type = "float32" if ssm == "auto" else ssm
    assert result["ssm_state_dtype"] == state_type
    assert f"hybrid verify state {variant}: state pool" in printed and state_type in printed
    # 3 GDN layers, float32: a conv window (conv_dim 2*2*16 + 4*16 = 128, width 3) and a 4x16x16
    # state each (2 bytes an element in bfloat16); 2 sequences (the largest batch) plus the
    # dummy entry
    entry = 3 * (128 * 3 * 4 + 4 * 16 * 16 * (4 if ssm == "auto" else 2))
    width = 3 if variant == "per_row_slots" else 1
    assert result["state_pool_bytes"] == (1 + 2 * width) * entry
    assert [d["batch"] for d in result["decode"]] == [1, 2]
    assert result["verify_cost"]["q"] == [1, 3]
    (e2e,) = result["e2e"]
    assert e2e["speedup"] > 0 and 1.0 <= e2e["mean_acceptance_length"] <= 3.0
    shape = SHAPES["qwen3-next-tiny"]
    experts = shape["num_hidden_layers"] * shape["num_experts"] * 3 * 64 * 32 * 4  # float32
    active = experts * shape["num_experts_per_tok"] // shape["num_experts"]
    assert result["weight_bytes"] > 0
    # all weights = counted weights + the routed experts a token does not read
    llm = LLM(write_shape("qwen3-next-tiny", tmp_path / "s"), load_format="dummy", device="cpu")
    total = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    assert total - result["weight_bytes"] == experts - active


def test_bench_dcut_plans_with_the_measured_curve(tmp_path, capsys, monkeypatch):
    """`--dcut`: the end-to-end runs let D-Cut choose depths, and it plans with the verify cost
    curve the same run measured. At alpha = 0 (every draft wrong) it learns to stop drafting, so
    far fewer draft rows are verified than K per step. The step times are fixed here (rows cost
    more with q) so that the plan does not depend on a tiny CPU model's timing noise."""
    from metrale.bench import command as bench
    from metrale.speculative import planning

    def fixed_step_times(llm, batch_sizes, qs, context):
        return {b: {q: 1e-3 * (1 + 0.1 * (q - 1)) for q in qs} for b in batch_sizes}

    monkeypatch.setattr(bench, "step_times", fixed_step_times)

    seen = []
    real_plan = planning.plan
    monkeypatch.setattr(
        planning,
        "plan",
        lambda i, cost, cap, **kw: seen.append(cost) or real_plan(i, cost, cap, **kw),
    )
    out = tmp_path / "bench"
    args = ["bench", "--shape", "tiny", "--device", "cpu", "--batch-sizes", "1,2", "--q", "1,3"]
    args += ["--context", "16", "--e2e-batch-sizes", "2", "--max-tokens", "24", "--alpha", "0"]
    args += ["--num-drafts", "2", "--dcut", "--out", str(out)]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["dcut"] is True and seen
    measured = VerifyCostModel.from_json(result["verify_cost"])
    assert all(c.step_time(6, 2) == measured.step_time(6, 2) for c in seen)
    (e2e,) = result["e2e"]
    assert e2e["verify_steps"] < 12  # without --dcut: 22 (every step verifies K drafts)


def test_forced_acceptance_draws_prefixes_at_rate_alpha():
    """Each draft row matches with probability alpha, independently; the accepted count is the
    matching prefix (E = sum_j alpha^j); the emitted tokens stay the target's picks."""
    from metrale.bench.forced import ForcedAcceptance
    from metrale.speculative.verify import Acceptance, build_layout

    k, seqs = 3, 4000
    layout = build_layout([k] * seqs, [[5, 6, 7]] * seqs, torch.device("cpu"))
    rows = seqs * (k + 1)
    picks = torch.arange(rows)
    acc = Acceptance(
        torch.zeros(seqs, dtype=torch.long),
        torch.zeros(rows, dtype=torch.bool),
        picks,
        None,
        None,
        None,
        None,
    )
    for alpha in (0.0, 0.5, 0.8, 1.0):
        forced = ForcedAcceptance(alpha, seed=1)(acc, layout)
        assert torch.equal(forced.emitted, picks)
        assert not forced.matches[k :: k + 1].any()  # the last row of a sequence has no draft
        expected = sum(alpha**j for j in range(1, k + 1))
        mean = forced.num_accepted.double().mean().item()
        assert mean == pytest.approx(expected, abs=0.06)
        # the count is the matching prefix of each sequence's rows
        m = forced.matches.view(seqs, k + 1)[:, :k].long()
        assert torch.equal(forced.num_accepted, m.cumprod(dim=1).sum(dim=1))


def test_forced_acceptance_on_the_greedy_fast_path():
    """The runner's host-side greedy verdicts under forced acceptance: matches at rate alpha,
    the accepted count their prefix, every emitted token the target's pick at its row."""
    from metrale.bench.forced import ForcedAcceptance
    from metrale.config import SamplingParams
    from metrale.engine.sequence import ScheduledSeq, Sequence
    from metrale.engine.step_output import greedy_verdicts

    k, seqs, sp = 3, 3000, SamplingParams(temperature=0.0)
    entries = []
    for s in range(seqs):
        seq = Sequence(s, f"r{s}", [1, 2], sp, seed=s, eos_token_ids=(0,), arrival=s)
        seq.num_computed_tokens = 1
        entries.append(ScheduledSeq(seq, k + 1, [5, 6, 7]))
    picks = torch.arange(seqs * (k + 1))
    for alpha in (0.0, 0.5, 1.0):
        verdicts = greedy_verdicts(entries, picks, ForcedAcceptance(alpha, seed=2))
        for n, v in enumerate(verdicts):
            prefix = next((i for i, m in enumerate(v.matches) if not m), k)
            assert v.num_accepted == prefix
            rows = picks[n * (k + 1) : (n + 1) * (k + 1)].tolist()
            assert [t.token_id for t in v.tokens] == rows[: prefix + 1]
        mean = sum(v.num_accepted for v in verdicts) / seqs
        assert mean == pytest.approx(sum(alpha**j for j in range(1, k + 1)), abs=0.08)


def test_forced_acceptance_is_bench_only():
    """No engine, speculative or API option reaches it; the bench labels its rows."""
    import dataclasses

    from metrale.config import EngineConfig, SpecConfig

    fields = {f.name for cls in (EngineConfig, SpecConfig) for f in dataclasses.fields(cls)}
    assert not any("forced" in name for name in fields)
    with pytest.raises((TypeError, ValueError)):
        EngineConfig(forced_acceptance=True)


def test_bench_forced_acceptance_with_dcut(tmp_path, capsys):
    """`--forced-acceptance --alpha 0,1 --dcut`: at alpha 1 every verify accepts all its drafts;
    at alpha 0 D-Cut stops drafting; rows are labelled forced and time the decode phase."""
    out = tmp_path / "bench"
    args = ["bench", "--shape", "tiny", "--device", "cpu", "--batch-sizes", "1,2", "--q", "1,3"]
    args += ["--context", "16", "--e2e-batch-sizes", "2", "--max-tokens", "24"]
    args += ["--alpha", "0,1", "--forced-acceptance", "--dcut", "--num-drafts", "2"]
    args += ["--out", str(out), "--no-async-scheduling"]
    assert main(args) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    result = json.loads(printed[-1])
    assert result["async_scheduling"] is False and "synchronous)" in printed[0]
    assert result["acceptance"] == "forced" and result["alpha"] == [0.0, 1.0]
    zero, one = result["e2e"]
    assert zero["acceptance"] == one["acceptance"] == "forced"
    assert "identical_outputs" not in one
    assert one["mean_acceptance_length"] > 2.8  # 3 but for the last verify, cut by max_tokens
    assert zero["mean_acceptance_length"] == pytest.approx(1.0)
    for row in (zero, one):
        assert row["tpot_ms_plain"] > 0 and row["tpot_ms_spec"] > 0 and row["prefill_ms"] > 0
        assert row["decode_speedup"] > 0 and row["graph_refusals"] == 0


def test_bench_defaults_to_the_embedded_model(tmp_path, capsys):
    """No --model and no --shape: the shipped model's trained weights, not random ones."""
    out = tmp_path / "bench"
    args = ["bench", "--device", "cpu", "--batch-sizes", "1", "--q", "1,2", "--context", "16"]
    args += ["--e2e-batch-sizes", "1", "--max-tokens", "6", "--num-drafts", "1"]
    assert main([*args, "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["shape"] == str(default_model_dir())


def test_steady_state_streams_requests_through_the_slots(tiny_model_dir):
    """`concurrency` caps the running sequences (the rest wait, as in a server's queue) and
    restores the engine's own limit afterwards, even when the run raises."""
    from metrale.bench.drafter import concurrency
    from metrale.config import SamplingParams

    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_num_seqs=4)
    engine = llm.engine
    most = 0
    step = engine.step

    def counting_step():
        nonlocal most
        outputs = step()
        most = max(most, len(engine.scheduler.running))
        return outputs

    engine.step = counting_step
    with concurrency(llm, 2):
        outs = llm.generate(
            [[1, 2, 3]] * 5, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False
        )
    assert len(outs) == 5 and all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert most == 2
    assert engine.scheduler.max_num_seqs == 4
    with pytest.raises(RuntimeError), concurrency(llm, 1):
        raise RuntimeError
    assert engine.scheduler.max_num_seqs == 4


def test_bench_grid_streams_requests_at_the_forced_acceptance(tmp_path, capsys):
    """`--steady-requests-per-slot 2`: each end-to-end cell is also run with twice as many
    requests as slots streamed through them, at the same forced acceptance (alpha 1: every
    verify accepts its K drafts, so the acceptance length is near K + 1); without the flag the
    grid runs closed batches only."""
    out = tmp_path / "bench"
    args = ["bench", "--shape", "tiny", "--device", "cpu", "--batch-sizes", "1,2", "--q", "1,3"]
    args += ["--context", "16", "--e2e-batch-sizes", "2", "--max-tokens", "12"]
    args += ["--alpha", "1", "--forced-acceptance", "--num-drafts", "2"]
    assert main([*args, "--out", str(out), "--steady-requests-per-slot", "2"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    result = json.loads(printed[-1])
    assert result["steady_requests_per_slot"] == 2
    (row,) = result["e2e"]
    steady = row["steady"]
    assert steady["requests"] == 4 and steady["output_tokens"] >= 4 * 6
    assert 2.5 < steady["mean_acceptance_length"] <= 3.0
    assert steady["tokens_per_s_plain"] > 0 and steady["speedup"] > 0
    assert any("steady state, 4 requests through 2 slots" in line for line in printed)
    assert main([*args, "--out", str(tmp_path / "closed")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["steady_requests_per_slot"] == 0 and "steady" not in result["e2e"][0]


def test_dummy_weights_depend_on_the_seed_and_each_parameters_name_alone():
    """The ranks of a tensor-parallel engine hold other parameters beside a replicated one (a
    MoE router, a shared expert's gate): drawn from one stream a rank, its values differed
    between them, and so did the ranks' routing (found in review)."""
    from torch import nn

    from metrale.engine.model_setup import dummy_weights

    rank0 = nn.ModuleDict({"q": nn.Linear(8, 16), "router": nn.Linear(8, 4)})
    rank1 = nn.ModuleDict(
        {"q": nn.Linear(8, 8), "extra": nn.Linear(3, 3), "router": nn.Linear(8, 4)}
    )
    other_seed = nn.ModuleDict({"router": nn.Linear(8, 4)})
    dummy_weights(rank0, 3)
    dummy_weights(rank1, 3)
    dummy_weights(other_seed, 4)
    assert torch.equal(rank0["router"].weight, rank1["router"].weight)
    assert torch.equal(rank0["router"].bias, rank1["router"].bias)
    assert not torch.equal(rank0["router"].weight, other_seed["router"].weight)
    assert rank0["q"].weight.std().item() == pytest.approx(0.02, rel=0.3)
    # shares of a split tensor: a run of the whole one's values each; with fewer runs than
    # ranks (KV heads fewer than ranks) the ranks reading one run share it, in order
    whole = nn.ModuleDict({"k": nn.Linear(4, 2, bias=False)})
    dummy_weights(whole, 3)
    for size, runs in ((2, [0, 1]), (4, [0, 0, 1, 1])):
        for rank, run in enumerate(runs):
            share = nn.ModuleDict({"k": nn.Linear(4, 1, bias=False)})
            dummy_weights(share, 3, rank, {"k.weight": (2, 4)}, size)
            assert torch.equal(share["k"].weight[0], whole["k"].weight[run]), (size, rank)


def test_tensor_parallel_dummy_shards_follow_the_one_rank_model(tmp_path):
    """Under tensor parallelism, dummy weights a rank holds whole equal the one-rank model's,
    and a split tensor's shards differ by rank: the embedding's first rank holds the one-rank
    model's first rows. (Drawn by name alone, both ranks held the same shard values: every
    logit tied with the one V/2 away, and greedy decoding never reached the vocabulary's
    upper half; found in review.)"""
    path = write_shape("qwen3-next-tiny", tmp_path / "s")
    kw = dict(load_format="dummy", device="cpu", dtype="float32")
    one = dict(LLM(path, **kw).engine.runner.model.named_parameters())
    llm = LLM(path, tensor_parallel_size=2, **kw)
    try:
        two = dict(llm.engine.runner.model._model.named_parameters())
        routers = [n for n in two if n.endswith("mlp.gate.weight")]
        assert routers and all(torch.equal(two[n], one[n]) for n in routers)
        embed = two["model.embed_tokens.weight"]
        assert torch.equal(embed, one["model.embed_tokens.weight"][: embed.shape[0]])
        engine, prompt = llm.engine, [3, 40, 90, 7]
        seq = Sequence(10**6, "probe", prompt, SamplingParams(), 0, (), arrival=0, slot=0)
        engine.allocator.reserve(seq, len(prompt) + 1)
        logits = engine.runner.all_logits(Batch([ScheduledSeq(seq, len(prompt))]))
        engine.allocator.free(seq)
        half = logits.shape[-1] // 2
        assert (logits[:, :half] - logits[:, half : 2 * half]).abs().max() > 1e-3
    finally:
        llm.shutdown()


def test_end_to_end_batches_larger_than_the_step_table_run_together(tmp_path, monkeypatch, capsys):
    """`--batch-sizes 1 --e2e-batch-sizes 3`: the three requests of the end-to-end batch share
    steps (the engine was once built for the step table's largest batch alone, so a batch of 64
    ran one request at a time and its figures were batch 1's)."""
    from metrale.engine.scheduler import Scheduler

    widest = []
    schedule = Scheduler.schedule

    def counted(self, *a, **kw):
        batch = schedule(self, *a, **kw)
        if batch is not None:
            widest.append(len(batch.entries))
        return batch

    monkeypatch.setattr(Scheduler, "schedule", counted)
    args = ["bench", "--shape", "tiny", "--device", "cpu", "--batch-sizes", "1", "--q", "1,2"]
    args += ["--context", "16", "--e2e-batch-sizes", "3", "--max-tokens", "6", "--alpha", "0"]
    assert main(args + ["--num-drafts", "1", "--out", str(tmp_path / "bench")]) == 0
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["e2e"]
    assert row["batch"] == 3
    assert max(widest) == 3


@pytest.mark.parametrize(
    "mode", [["--shape", "tiny"], ["--acceptance", "--ks", "1"], ["--e2e-drafter", "ngram"]]
)
def test_every_bench_mode_builds_its_engine_with_the_parallel_options(mode, tmp_path, monkeypatch):
    """Found in review: `--acceptance` and `--e2e-drafter` dropped `--tensor-parallel-size` (one
    rank was measured, unsaid), and `bench` had no `--expert-parallel`."""
    import metrale.bench.acceptance as acceptance_mod
    import metrale.bench.command as command_mod
    import metrale.bench.drafter as drafter_mod

    class Built(Exception):
        pass

    seen = []

    def engine(*args, **kwargs):
        seen.append(kwargs)
        raise Built

    for module in (acceptance_mod, command_mod, drafter_mod):
        monkeypatch.setattr(module, "LLM", engine)
    parallel = ["--tensor-parallel-size", "2", "--expert-parallel", "--distributed-timeout-s", "30"]
    with pytest.raises(Built):
        main(["bench", *mode, "--device", "cpu", *parallel, "--out", str(tmp_path)])
    (kwargs,) = seen
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["expert_parallel"] is True
    assert kwargs["distributed_timeout_s"] == 30.0


def test_a_collapsed_replay_is_flagged_in_the_table():
    """A replayed row whose drafts stopped matching (random bf16 weights: first drafts accepted
    far below alpha) says so and points at forced acceptance. Not a replay whose first drafts
    match at alpha however short its acceptance length (D-Cut's shallow depths, a short run),
    one where nothing was verified (D-Cut drafted nothing), nor a forced row (found in
    review: the first version compared acceptance lengths and flagged those)."""
    from metrale.bench.command import replay_collapsed, table

    def row(acceptance: str, alpha: float, length: float, first: float | None) -> dict:
        return dict(
            acceptance=acceptance, alpha=alpha, batch=1, mean_acceptance_length=length,
            first_draft_acceptance=first, tpot_ms_plain=5.7, tpot_ms_spec=5.9,
            decode_speedup=0.97, ideal_speedup=2.88, ideal_speedup_at_measured_acceptance=1.07,
            tokens_per_s_plain=174.0, tokens_per_s_spec=168.0, speedup=0.97,
            graph_refusals=0, distinct_verify_keys=3,
        )  # fmt: skip

    collapsed = row("replayed", 0.8, 1.10, 0.09)
    shallow = row("replayed", 0.95, 1.9, 0.95)  # depth 1 at K = 7: length far below alpha's
    nothing = row("replayed", 0.8, 1.0, None)  # D-Cut verified nothing
    forced = row("forced", 0.8, 1.10, 0.09)
    assert replay_collapsed(collapsed)
    assert not any(map(replay_collapsed, (shallow, nothing, forced)))
    assert not replay_collapsed(row("replayed", 0.0, 1.0, 0.0))  # alpha 0: none should match
    result = dict(
        shape="qwen3-8b", device="cuda", dtype="torch.bfloat16", bandwidth_GBps=2900.0,
        roofline_ms=5.5, verify_cost={"q": [1], "ratio": [[1.0]]}, decode=[], num_drafts=3,
        e2e=[collapsed, shallow, nothing, forced],
    )  # fmt: skip
    lines = table(result).splitlines()
    hints = [i for i, line in enumerate(lines) if "stopped matching" in line]
    assert len(hints) == 1 and "--forced-acceptance" in lines[hints[0]]
    assert "9% against alpha 0.8" in lines[hints[0]] and "16-bit" in lines[hints[0]]
    assert "acceptance length 1.10" in lines[hints[0] - 1]  # under the collapsed row
    result["dtype"] = "torch.float32"  # no rounding story for float32
    assert "16-bit" not in table(result)
