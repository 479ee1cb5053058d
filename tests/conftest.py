"""Shared fixtures: tiny random checkpoints written by transformers itself."""

from __future__ import annotations

import os
import platform

# The Triton interpreter computes `tl.dot` with numpy's OpenBLAS. Its AVX2/FMA kernels (picked on
# Haswell and later, Zen included) sum a row of a small product differently depending on the
# rows beside it, so a kernel whose own reduction order is batch-invariant would look otherwise
# under the interpreter (tests/test_deterministic*.py). Its AVX kernels keep each row's order.
# Set before numpy's OpenBLAS loads (torch imports numpy); the GPU tests never go through it.
# Set, not defaulted: machines here export OPENBLAS_CORETYPE=Haswell, which is one of those
# kernels (12 invariance tests failed on such a machine). x86-64 only (the names are x86's);
# SSE3's Prescott kernels where the CPU has no AVX.
if platform.machine() in ("x86_64", "AMD64"):
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            avx = " avx " in cpuinfo.read().replace("\n", " ")
    except OSError:
        avx = False
    os.environ["OPENBLAS_CORETYPE"] = "Sandybridge" if avx else "Prescott"

import torch  # noqa: E402

# Without CUDA, Triton kernels run under its interpreter on CPU tensors (tests/test_kernels.py);
# this must be set before anything imports the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the README runs `-n 2`) each worker is one process: one intra-op thread
# each keeps the workers from oversubscribing the cores, where spinning OpenMP threads of two
# processes would slow both.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

import shutil
from pathlib import Path

import pytest

from metrale.default_model import build_random_qwen3
from metrale.knobs import knobs

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The default model's byte-level tokenizer files, to pair with any tiny checkpoint."""
    return build_random_qwen3(tmp_path_factory.mktemp("tokenizer"))


def write_hf_qwen3(path: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Save a random `transformers.Qwen3ForCausalLM` (float32) with save_pretrained."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def hf_qwen3_factory(tmp_path_factory, tokenizer_dir):
    """factory(name, **config overrides) -> model dir, cached per name for the session."""
    cache: dict[str, Path] = {}

    def make(name: str, seed: int = 0, **overrides) -> Path:
        if name not in cache:
            cache[name] = write_hf_qwen3(
                tmp_path_factory.mktemp(name), tokenizer_dir, seed, **overrides
            )
        return cache[name]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(hf_qwen3_factory) -> Path:
    return hf_qwen3_factory("tiny")


@pytest.fixture(scope="session")
def tiny_mtp_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with one MTP layer beside it (Qwen3-Next's layout, seed 4)."""
    from metrale.config import ModelConfig
    from metrale.models.mtp import write_mtp_weights

    dst = tmp_path_factory.mktemp("tiny-mtp") / "model"
    shutil.copytree(tiny_model_dir, dst)
    write_mtp_weights(dst, ModelConfig.from_hf(dst), "qwen3_next", num_layers=1, seed=4)
    return dst


@pytest.fixture
def knob_env(monkeypatch):
    """Set `METRALE_*` knobs for one test: `knob_env(METRALE_X="1", ...)`. The knobs are read
    afresh then (`knobs()` is cached per process), and again after the test, with the
    environment as it was."""

    def set_knobs(**env: str) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        knobs.cache_clear()

    yield set_knobs
    monkeypatch.undo()
    knobs.cache_clear()


@pytest.fixture
def canonical_arm(request, monkeypatch):
    """Run a test with the canonical verify-key arm at every width, or never."""
    if request.param:
        monkeypatch.setenv("METRALE_CANONICAL_KEY_MIN_WIDTH", "0")
    else:
        monkeypatch.setenv("METRALE_NO_CANONICAL_VERIFY_KEY", "1")
    knobs.cache_clear()
    yield request.param
    monkeypatch.undo()
    knobs.cache_clear()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def client(server):
    """An openai client of the `server` fixture of the requesting test module."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
