"""Hub ids resolve through huggingface_hub: offline (`HF_HUB_OFFLINE=1`) from a local HF cache
laid out as the Hub client writes it, served under the id; a missing one is a clear error.
Nothing is downloaded."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(root: Path, model_dir: Path, repo: str = "acme/tiny-qwen3") -> Path:
    """`root` as an HF hub cache holding `model_dir`'s files as `repo` at `COMMIT`."""
    base = root / ("models--" + repo.replace("/", "--"))
    snapshot = base / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for path in model_dir.iterdir():
        if path.is_file():
            shutil.copy(path, snapshot / path.name)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(COMMIT)
    return root


def run(code: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache)}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


def test_a_hub_id_resolves_from_the_local_cache_offline(tiny_model_dir, tmp_path):
    cache = fake_cache(tmp_path / "hub", tiny_model_dir)
    code = (
        "from metrale import LLM, SamplingParams\n"
        "llm = LLM('acme/tiny-qwen3', device='cpu')\n"
        "out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))\n"
        "print(str(llm.engine.model_dir), out[0].outputs[0].token_ids)\n"
        "from metrale.server import build\n"
        "app, loop = build('acme/tiny-qwen3', device='cpu')\n"
        "from fastapi.testclient import TestClient\n"
        "print(TestClient(app).get('/v1/models').json()['data'][0]['id'])\n"
    )
    result = run(code, cache)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert COMMIT in lines[0] and "[" in lines[0]
    assert lines[-1] == "acme/tiny-qwen3"  # served under its Hub id, not the commit hash


def error_offline(call: str, error: str, root: Path) -> subprocess.CompletedProcess:
    """`call` (an `LLM(...)` expression) run offline on an empty cache under `root`, printing
    'ERR' and the `error` it raises."""
    (root / "hub").mkdir()
    code = f"from metrale import LLM\ntry:\n    {call}\nexcept {error} as e:\n    print('ERR', e)\n"
    result = run(code, root / "hub")
    assert result.returncode == 0, result.stderr
    return result


def test_a_hub_id_missing_offline_is_a_clear_error(tmp_path):
    result = error_offline("LLM('acme/absent', device='cpu')", "FileNotFoundError", tmp_path)
    assert "ERR model 'acme/absent'" in result.stdout and "HF_HUB_OFFLINE" in result.stdout


def test_path_like_names_are_never_hub_ids():
    from metrale.hub import is_hub_id

    assert is_hub_id("acme/model") and is_hub_id("gpt2")
    for name in ("./acme/model", "../acme", "~/acme/m", "/abs/path", "acme/tiny\n", "a/b/c"):
        assert not is_hub_id(name), name


def test_a_bare_hub_name_resolves_from_the_cache(tiny_model_dir, tmp_path):
    """`gpt2`-style ids (no organisation) are Hub ids too, as in vLLM and transformers (found in
    review: 'model directory gpt2 does not exist')."""
    cache = fake_cache(tmp_path / "hub", tiny_model_dir, repo="tinyqwen")
    code = "from metrale.hub import resolve_model\nprint(resolve_model('tinyqwen'))\n"
    result = run(code, cache)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(COMMIT)


def test_bench_resolves_a_hub_id_and_bad_names_are_value_errors(tiny_model_dir, tmp_path):
    """`metrale bench --model ORG/NAME` reads the same local cache as generate and serve (found
    in review: it took the id for a directory); a model or revision that is no name at all is
    a ValueError naming it, a file a clear error."""
    cache = fake_cache(tmp_path / "hub", tiny_model_dir)
    code = (
        "import argparse\n"
        "from metrale.bench.acceptance import run_acceptance\n"
        "from metrale.hub import resolve_model\n"
        "for bad in (5, '', None):\n"
        "    try:\n"
        "        resolve_model(bad)\n"
        "    except ValueError as e:\n"
        "        print('ERR', e)\n"
        "try:\n"
        "    resolve_model('acme/tiny-qwen3', revision=5)\n"
        "except ValueError as e:\n"
        "    print('ERR', e)\n"
        "print(resolve_model('acme/tiny-qwen3'))\n"
        "args = argparse.Namespace(model='acme/tiny-qwen3', heldout=None, drafters='ngram',\n"
        "    num_prompts=2, prompt_tokens=16, ks=[1], device='cpu', dtype=None, seed=0)\n"
        "print('RAN', sorted(run_acceptance(args)))\n"
    )
    result = run(code, cache)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert [line.split(",")[0] for line in lines[:3]] == [
        "ERR model must be a checkpoint directory or a Hub id"
    ] * 3
    assert lines[3].startswith("ERR revision must be")
    assert COMMIT in lines[4] and lines[-1].startswith("RAN")


def _listing(cache: Path, repo: str, names: list[str]) -> None:
    """The repo's file listing at COMMIT as huggingface_hub caches it (`trees/<commit>.json`):
    offline, it refuses a snapshot lacking a listed file the allow patterns match."""
    tree = __import__("pytest").importorskip("huggingface_hub._tree_cache")
    folder = cache / ("models--" + repo.replace("/", "--"))
    entries = {name: tree.TreeCacheEntry(size=1, blob_id="0" * 40) for name in names}
    tree.write_tree_cache(str(folder), COMMIT, entries)
    assert (folder / "trees" / f"{COMMIT}.json").is_file()


def test_files_the_engine_never_reads_need_not_be_in_the_cache(tiny_model_dir, tmp_path):
    """Found in review: a cache made by `hf download --include "*.safetensors" "*.json"` (no
    merges.txt, no onnx/) was refused offline, the listing naming files the patterns took in;
    and a snapshot that lacks a file the engine does read is named by the loader's error."""
    cache = fake_cache(tmp_path / "hub", tiny_model_dir)
    present = [p.name for p in tiny_model_dir.iterdir() if p.is_file()]
    _listing(
        cache, "acme/tiny-qwen3", [*present, "merges.txt", "vocab.json", "onnx/model.safetensors"]
    )
    code = (
        "from metrale import LLM, SamplingParams\n"
        "llm = LLM('acme/tiny-qwen3', device='cpu')\n"
        "print(llm.generate([[5, 6]], SamplingParams(max_tokens=2))[0].finished)\n"
    )
    result = run(code, cache)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "True"
    assert "as it is" not in result.stderr  # complete for what the engine reads: no warning
    # a file read for defaults alone, listed and never downloaded: served, with a warning
    snapshot = cache / "models--acme--tiny-qwen3" / "snapshots" / COMMIT
    (snapshot / "generation_config.json").unlink(missing_ok=True)
    _listing(cache, "acme/tiny-qwen3", [*present, "generation_config.json"])
    result = run(code, cache)
    assert result.returncode == 0, result.stderr
    assert "serving the cached snapshot" in result.stderr
    # a file the engine reads, listed and never downloaded: the loader names it
    (cache / "models--acme--tiny-qwen3" / "snapshots" / COMMIT / "tokenizer.json").unlink()
    result = run("from metrale import LLM\nLLM('acme/tiny-qwen3', device='cpu')\n", cache)
    assert result.returncode != 0 and "tokenizer.json" in result.stderr


def test_a_dflash_drafter_given_as_a_hub_id_resolves_from_the_cache(tmp_path):
    """`spec.model` (`--draft-model`) resolves as `model` does: a Hub id from the local cache
    (it was read as a relative path and refused; review)."""
    from metrale.default_model import default_model_dir

    cache = fake_cache(tmp_path / "hub", default_model_dir() / "dflash", "acme/tiny-dflash")
    code = (
        "from metrale import LLM, SamplingParams\n"
        "spec = dict(method='dflash', model='acme/tiny-dflash', num_drafts=3)\n"
        "llm = LLM(device='cpu', spec=spec)\n"
        "out = llm.generate(['def f(x):'], SamplingParams(temperature=0, max_tokens=8))\n"
        "print(llm.engine.telemetry.spec.num_draft_tokens, out[0].outputs[0].token_ids)\n"
    )
    result = run(code, cache)
    assert result.returncode == 0, result.stderr
    drafted = int(result.stdout.strip().splitlines()[-1].split()[0])
    assert drafted > 0


def test_a_dflash_hub_id_missing_offline_says_what_the_hub_lookup_found(tmp_path):
    """`--draft-model acme/absent` offline and not cached: the Hub's finding, as for `model`,
    not "no DFlash drafter at acme/absent" as if it were a folder (found in review)."""
    call = "LLM(device='cpu', spec=dict(method='dflash', model='acme/absent'))"
    result = error_offline(call, "ValueError", tmp_path)
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("ERR spec.model: model 'acme/absent'") and "HF_HUB_OFFLINE" in line


@pytest.mark.parametrize("error", ["LocalEntryNotFoundError", "OSError"])
def test_a_hub_error_of_several_lines_is_said_on_one(monkeypatch, error):
    """With the Hub unreachable but not marked offline, huggingface_hub's error spans lines;
    the CLI's error is one line (found in review)."""
    import huggingface_hub
    import huggingface_hub.errors

    from metrale.hub import resolve_model

    cls = getattr(huggingface_hub.errors, error, OSError)

    def unreachable(*args, **kwargs):
        raise cls("(Got: ConnectError: name not known\nAn error happened while trying to locate)")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(FileNotFoundError) as caught:
        resolve_model("acme/absent")
    message = str(caught.value)
    assert "\n" not in message and "name not known An error happened" in message
