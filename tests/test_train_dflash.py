"""`metrale train dflash`: the DFlash stage on a tiny target trained from scratch: the loss falls,
the engine loads the saved drafter and accepts its drafts with output unchanged, a resumed run
writes the uninterrupted weights, and the CLI runs it. CPU only, tiny shapes."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from metrale import LLM, SamplingParams
from metrale.cli import main
from metrale.train import train_dflash
from tests.test_train import OPTS, corpus, target, tok_dir  # noqa: F401


@pytest.fixture(scope="module")
def dflash(corpus, target, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("dflash")
    opts = replace(OPTS, steps=60, lr=5e-3)
    return out / "dflash", train_dflash(target[0], corpus, opts, block_size=4, out_dir=out)


def test_dflash_loss_falls_and_the_engine_accepts_its_drafts(dflash, target):  # noqa: F811
    path, summary = dflash
    assert summary["completed"]
    assert summary["final_train_loss"] < 0.5 * summary["initial_train_loss"]
    assert (path / "config.json").is_file() and (path / "dflash_train_summary.json").is_file()
    assert not (target[0] / "dflash").exists()  # --out left the target alone
    prompts = ["def add_3(x):\n", "def add_7(x):\n    return", "\n\ndef"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(target[0], device="cpu", dtype="float32").generate(prompts, params)
    spec = dict(method="dflash", model=str(path), num_drafts=3, dcut=False)
    llm = LLM(target[0], device="cpu", dtype="float32", spec=spec)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.telemetry.spec
    assert stats.num_draft_tokens > 20
    # trained with the engine's block and context conventions, most first drafts land
    assert stats.acceptance_by_position()[0] > 0.5
    assert summary["heldout"]["accept_len"] > 1.5


def test_dflash_resume_writes_the_uninterrupted_drafter(corpus, target, tmp_path):  # noqa: F811
    opts = replace(OPTS, steps=6, seq_len=24, eval_every=0)
    full = train_dflash(target[0], corpus, opts, block_size=4, out_dir=tmp_path / "full")
    part = train_dflash(
        target[0], corpus, replace(opts, stop_at=3), block_size=4, out_dir=tmp_path / "r"
    )
    assert not part["completed"]
    with pytest.raises(ValueError, match="block_size: saved 4, now 3"):
        train_dflash(
            target[0], corpus, replace(opts, resume=True), block_size=3, out_dir=tmp_path / "r"
        )
    done = train_dflash(
        target[0], corpus, replace(opts, resume=True), block_size=4, out_dir=tmp_path / "r"
    )
    assert done["completed"] and done["final_train_loss"] == full["final_train_loss"]
    a, b = (load_file(str(tmp_path / d / "dflash" / "model.safetensors")) for d in ("full", "r"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_starts_from_an_earlier_drafter(dflash, corpus, target, tmp_path):  # noqa: F811
    """`init`: the weights of a saved drafter of the same shape, not random ones: the first
    loss is the trained drafter's, not a fresh one's; another shape is refused by name."""
    path, trained = dflash
    opts = replace(OPTS, steps=2, lr=1e-6, eval_every=0)
    kw = dict(block_size=4, out_dir=tmp_path / "warm")
    warm = train_dflash(target[0], corpus, opts, init=path, **kw)
    fresh = train_dflash(target[0], corpus, opts, block_size=4, out_dir=tmp_path / "cold")
    assert warm["initial_train_loss"] < 0.6 * fresh["initial_train_loss"]
    assert warm["init"] == str(path)
    with pytest.raises(ValueError, match=r"block_size 4 \(this run: 3\)"):
        train_dflash(target[0], corpus, opts, block_size=3, out_dir=tmp_path / "x", init=path)
    # a scaling this run would not train with (nor save) is refused too
    scaled = tmp_path / "scaled"
    shutil.copytree(path, scaled)
    raw = json.loads((scaled / "config.json").read_text())
    raw["dflash_config"]["output_multiplier"] = 30.0
    (scaled / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="output_multiplier 30.0"):
        train_dflash(target[0], corpus, opts, block_size=4, out_dir=tmp_path / "y", init=scaled)


def test_cli_trains_a_dflash_drafter(corpus, target, tmp_path, capsys):  # noqa: F811
    args = ["train", "dflash", "--target", str(target[0]), "--out", str(tmp_path), "-q"]
    args += ["--corpus", str(corpus.dirs[0]), "--steps", "3", "--seq-len", "24"]
    args += ["--batch-size", "2", "--block-size", "4", "--eval-every", "0", "--device", "cpu"]
    assert main(args + ["--teacher", "greedy"]) == 0
    again = ["--out", str(tmp_path / "again"), "--init", str(tmp_path / "dflash")]
    assert main(args + again) == 0
    assert (tmp_path / "dflash" / "model.safetensors").is_file()
    out = capsys.readouterr().out
    assert '"stage": "dflash"' in out and '"teacher": "greedy"' in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_training_runs_through_autograd(corpus, target, tmp_path):  # noqa: F811
    """On CUDA the engine's norms have a fused kernel without a backward: training the drafter
    must take the differentiable path (the loss falls)."""
    opts = replace(OPTS, steps=30, lr=5e-3, device="cuda", eval_every=0)
    summary = train_dflash(target[0], corpus, opts, block_size=4, out_dir=tmp_path)
    assert summary["final_train_loss"] < 0.7 * summary["initial_train_loss"]


def test_a_run_projected_to_take_hours_is_warned_about(
    corpus,  # noqa: F811
    target,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
):
    from metrale.train import loop

    monkeypatch.setattr(loop, "LONG_RUN_SECONDS", 0.0)  # any run counts as long here
    opts = replace(OPTS, steps=12, seq_len=24, eval_every=0)
    train_dflash(target[0], corpus, opts, block_size=4, out_dir=tmp_path)
    assert "pass --max-seconds or fewer --steps" in capsys.readouterr().err
    train_dflash(
        target[0], corpus, replace(opts, max_seconds=600.0), block_size=4, out_dir=tmp_path / "b"
    )
    assert "--max-seconds" not in capsys.readouterr().err  # a bounded run is not warned about


def test_every_batch_has_an_anchor():
    """Each batch of windows has at least one anchor, each with a whole block of labels in the
    window, `stride` apart, whatever the stride against the window (a stride past the room left
    some batches none, and `train dflash` crashed at such a batch: found in review)."""
    import torch

    from metrale.train.dflash import anchors_of

    gen = torch.Generator().manual_seed(0)
    for block in range(2, 9):
        for length in range(block + 2, 40, 3):
            for stride in (1, 2, 5, 16, 64):
                batch = torch.randint(0, 500, (2, length), generator=gen)
                anchors = anchors_of(batch, block, stride).tolist()
                assert anchors and anchors[0] >= 1 and anchors[-1] + block - 1 <= length - 1
                assert all(b - a == stride for a, b in zip(anchors, anchors[1:], strict=False))


def test_dflash_resume_over_other_target_weights_is_refused(corpus, target, tmp_path):  # noqa: F811
    """Found in review: a stopped DFlash run resumed after its target's weights changed (same
    config), and reported a completed drafter trained against two targets; the MTP stage
    refused it."""
    from safetensors.torch import save_file

    model = tmp_path / "target"
    shutil.copytree(target[0], model)
    opts = replace(OPTS, steps=6, seq_len=24, eval_every=0)
    part = train_dflash(model, corpus, replace(opts, stop_at=3), block_size=4, out_dir=tmp_path)
    assert not part["completed"]
    weights = load_file(str(model / "model.safetensors"))
    save_file({k: v + 0.01 for k, v in weights.items()}, str(model / "model.safetensors"))
    with pytest.raises(ValueError, match="target_weights_sha256"):
        train_dflash(model, corpus, replace(opts, resume=True), block_size=4, out_dir=tmp_path)
    # a state saved before the digest was recorded resumes, unchecked, as before
    from metrale.train.dflash import STATE_FILE

    state_path = tmp_path / "dflash" / STATE_FILE
    state = torch.load(state_path, weights_only=True)
    del state["identity"]["target_weights_sha256"]
    torch.save(state, state_path)
    done = train_dflash(model, corpus, replace(opts, resume=True), block_size=4, out_dir=tmp_path)
    assert done["completed"]


def test_the_draft_model_may_be_trainings_out_dir_and_zero_layers_are_refused(
    dflash,  # noqa: F811
    target,  # noqa: F811
    tmp_path,
):
    """Found in review: `train dflash --out OUT` writes OUT/dflash, and `spec.model=OUT` said
    there was no drafter there; a drafter config of 0 layers loaded, then failed every
    request."""
    path, _ = dflash
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for model in (path, path.parent):
        spec = dict(method="dflash", model=str(model), num_drafts=3)
        llm = LLM(target[0], device="cpu", dtype="float32", spec=spec)
        assert llm.generate(["def f(x):"], params, use_tqdm=False)[0].outputs[0].token_ids
    broken = tmp_path / "dflash"
    shutil.copytree(path, broken)
    config = json.loads((broken / "config.json").read_text())
    spec = dict(method="dflash", model=str(broken), num_drafts=3)
    edits = [
        ({"num_hidden_layers": 0}, "'num_hidden_layers' must be a positive integer, got 0"),
        ({"head_dim": 0}, "'head_dim' must be a positive integer, got 0"),
        ({"attention_bias": "false"}, "'attention_bias' must be true or false"),
        ({"hidden_act": "gelu"}, "'hidden_act' 'gelu' is not supported"),
        ({"rms_norm_eps": None}, "'rms_norm_eps' must be in"),
    ]
    for edit, said in edits:
        (broken / "config.json").write_text(json.dumps({**config, **edit}))
        with pytest.raises(ValueError, match=said):
            LLM(target[0], device="cpu", dtype="float32", spec=spec)


def test_more_taps_than_target_layers_is_refused(corpus, target, tmp_path):  # noqa: F811
    """Found in review: `--num-taps 100` was clamped to the target's layers without a word."""
    with pytest.raises(ValueError, match="num_taps 100: the target has 2 layers"):
        train_dflash(target[0], corpus, replace(OPTS, steps=2), num_taps=100, out_dir=tmp_path)
    assert not (tmp_path / "dflash").exists()
