"""`metrale bench serve` against a running `metrale serve` on CPU (a loopback port): every
request completes, the latency percentiles are ordered and positive, and the speculative
acceptance comes from the server's /metrics."""

from __future__ import annotations

import json

from metrale.cli import main
from tests.test_server import Server


def test_bench_serve_reports_percentiles_and_acceptance(tiny_model_dir, tmp_path, capsys):
    srv = Server(tiny_model_dir, spec={"method": "ngram", "num_drafts": 3})
    try:
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("a b a b a b a b\nx y x y x y\nhello hello hello\n")
        out = tmp_path / "serve.json"
        args = ["bench", "serve", "--base-url", srv.url, "--num-prompts", "12"]
        args += ["--output-len", "16", "--ignore-eos", "--prompt-file", str(prompts)]
        args += ["--request-rate", "50", "--max-concurrency", "4", "--out", str(out)]
        assert main(args) == 0
        report = json.loads(out.read_text())
        assert report["completed"] == 12 and report["failed"] == 0
        assert report["model"] == "tiny" and report["output_tokens_per_s"] > 0
        for name in ("ttft", "tpot", "itl", "e2e"):
            p50, p90, p99 = (report[f"p{p}_{name}_ms"] for p in (50, 90, 99))
            assert 0 < p50 <= p90 <= p99, name
        assert report["p50_e2e_ms"] >= report["p50_ttft_ms"]
        assert report["spec_acceptance_rate"] is not None
        assert 0 < report["spec_acceptance_rate"] <= 1
        assert "p50" in capsys.readouterr().out
        # a request the server refuses is reported with its reason, not its status alone
        args = ["bench", "serve", "--base-url", srv.url, "--num-prompts", "2", "--out", str(out)]
        main([*args, "--served-model", "nope"])
        (failure,) = json.loads(out.read_text())["failures"]
        assert failure.startswith("404 x2: ") and "nope" in failure
        srv.wait_idle()
    finally:
        srv.close()


def test_bench_serve_over_a_model_its_server_refuses_is_exit_2(tiny_model_dir, tmp_path, capsys):
    """Found in review: the server's refusal (exit 2, a clear message) reached the user as a
    RuntimeError traceback from the bench, exit 1."""
    import shutil

    model = tmp_path / "llama"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    assert main(["bench", "serve", "--model", str(model), "--num-prompts", "1"]) == 2
    assert "metrale serve refused the settings" in capsys.readouterr().err


def test_bench_refuses_options_that_would_be_dropped(tiny_model_dir, tmp_path, capsys):
    """Found in review: `--shape` beside `--model`, `--acceptance` or `--e2e-drafter` was
    dropped without a word (the run measured another model)."""
    out = ["--out", str(tmp_path)]
    cases = [
        (["--shape", "tiny", "--model", str(tiny_model_dir)], "--shape and --model"),
        (["--shape", "tiny", "--acceptance"], "--acceptance runs"),
        (["--shape", "tiny", "--e2e-drafter", "mtp"], "--e2e-drafter runs"),
    ]
    for argv, said in cases:
        assert main(["bench", *argv, *out]) == 2
        assert said in capsys.readouterr().err
