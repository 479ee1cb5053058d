"""The command line's engine flags are generated from EngineConfig: every field reachable from
`metrale serve` (and generate/chat, where a command's own `--seed` stays the sampling seed),
parsed into exactly the config the Python API builds; vLLM's `--speculative-config`; a CUDA
device asked for on a machine without one is one clear line."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from metrale.cli import build_parser
from metrale.cli_config import engine_options
from metrale.config import EngineConfig

FIELDS = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "spec"]


def test_every_engine_field_is_a_serve_flag():
    args = build_parser().parse_args(["serve"])
    assert sorted(args.engine_fields) == sorted(FIELDS)
    assert EngineConfig(**engine_options(args)) == EngineConfig()  # defaults are the config's


def test_flags_build_the_config_the_api_builds():
    argv = ["serve", "--max-model-len", "512", "--max-num-seqs", "8", "--page-size", "32"]
    argv += ["--num-kv-pages", "100", "--no-cuda-graphs", "--seed", "7", "--dtype", "float32"]
    argv += ["--hybrid-verify-state", "per_row_slots", "--gpu-memory-utilization", "0.8"]
    argv += ["--mamba-ssm-cache-dtype", "bfloat16"]
    argv += ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}']
    cfg = EngineConfig(**engine_options(build_parser().parse_args(argv)))
    want = EngineConfig(
        max_model_len=512,
        max_num_seqs=8,
        page_size=32,
        num_kv_pages=100,
        cuda_graphs=False,
        seed=7,
        dtype="float32",
        hybrid_verify_state="per_row_slots",
        mamba_ssm_cache_dtype="bfloat16",
        gpu_memory_utilization=0.8,
        spec={"method": "mtp", "num_drafts": 3},
    )
    assert cfg == want


def test_generate_keeps_its_sampling_seed():
    args = build_parser().parse_args(["generate", "x", "--seed", "5", "--max-num-seqs", "2"])
    assert "seed" not in args.engine_fields and args.seed == 5
    assert engine_options(args)["max_num_seqs"] == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--speculative-config", "{nope"], "not JSON"),
        (["--speculative-config", "{}", "--spec", "ngram"], "say it all in one"),
        (["--speculative-config", "{}", "--num-drafts", "7"], "--num-drafts"),
        (["--speculative-config", '{"num_drafts": 2, "num_speculative_tokens": 3}'], "twice"),
        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
        # speculative flags without a method were ignored, silently (found in review)
        (["--num-drafts", "7"], "--num-drafts: speculative options need --spec"),
        (["--no-dcut", "--draft-model", "d"], "--draft-model, --no-dcut: speculative"),
        (["--speculative-config", '{"num_speculative_tokens": 3}'], "give a method"),
    ],
)
def test_bad_engine_flags_are_one_line(argv, message):
    args = build_parser().parse_args(["serve", *argv])
    with pytest.raises(ValueError, match=message):
        EngineConfig(**engine_options(args))


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the machine without CUDA"
)
def test_cuda_without_cuda_is_one_clear_line(tiny_model_dir, tmp_path):
    env = {**os.environ, "METRALE_HOME": str(tmp_path)}
    res = subprocess.run(
        [sys.executable, "-m", "metrale.cli", "generate", "x", "--model", str(tiny_model_dir)]
        + ["--device", "cuda"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "sees no CUDA GPU" in res.stderr and len(res.stderr.strip().splitlines()) == 1
