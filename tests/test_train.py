"""`metrale train`: corpus selection, the BPE tokenizer, a tiny target trained from scratch
(loss falls, transformers and metrale load it and agree with the training module), an MTP head
for it (the engine's module computes the same function, drafts are accepted, output unchanged),
exact resumption, determinism, the CLI, and errors for bad input. CPU only, tiny shapes."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from metrale import LLM, SamplingParams
from metrale.cli import main
from metrale.tokenizer import Tokenizer
from metrale.train import (
    CorpusSpec,
    TargetShape,
    TrainOptions,
    default_corpus_dirs,
    train_mtp,
    train_target,
    train_tokenizer,
)
from metrale.train.corpus import load_corpus, tokenize_corpus
from metrale.train.model import CausalLM, MTPHead
from metrale.train.mtp import expected_tensors

SHAPE = TargetShape(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128
)
OPTS = TrainOptions(
    steps=40,
    batch_size=8,
    seq_len=48,
    lr=3e-3,
    warmup_steps=4,
    eval_every=20,
    eval_batches=2,
    save_every=0,
    device="cpu",
    progress=False,
)
SPECIAL = "héllo ✓ <|endoftext|> tokens stay text"


def write_corpus(root: Path, files: int = 40, seed: int = 0) -> Path:
    """Predictable little modules (a tiny model learns them in tens of steps), plus files the
    corpus must skip or treat specially."""
    rng = random.Random(seed)
    for i in range(files):
        body = []
        for _ in range(20):
            a = rng.randint(0, 9)
            body.append(f"def add_{a}(x):\n    return x + {a}\n\n")
        sub = root / ("pkg" if i % 2 else "") / f"mod_{i:02d}.py"
        sub.parent.mkdir(parents=True, exist_ok=True)
        sub.write_text("".join(body))
    (root / "pkg" / "special.py").write_text(f"S = {SPECIAL!r}\n")
    (root / "empty.py").write_text("")
    (root / "notes.txt").write_text("not python\n")
    (root / "latin1.py").write_bytes(b"x = '\xe9'\n")  # not UTF-8: skipped
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> CorpusSpec:
    root = write_corpus(tmp_path_factory.mktemp("corpus"))
    return CorpusSpec(dirs=(root,), heldout_fraction=0.15, max_bytes=None)


@pytest.fixture(scope="module")
def tok_dir(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    summary = train_tokenizer(corpus, out, vocab_size=320, progress=False)
    assert 259 < summary["vocab_size"] <= 320
    return out


@pytest.fixture(scope="module")
def target(corpus, tok_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("target")
    return out, train_target(tok_dir, out, corpus, SHAPE, OPTS)


@pytest.fixture(scope="module")
def mtp(corpus, target, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("mtp") / "model"
    opts = replace(OPTS, steps=40, lr=5e-3)
    return out, train_mtp(target[0], corpus, opts, depths=2, out_dir=out)


def test_corpus_is_deterministic_split_and_capped(corpus, tok_dir):
    first, second = load_corpus(corpus), load_corpus(corpus)
    assert first.train == second.train and first.heldout == second.heldout
    assert first.stats["files_heldout"] > 0 and first.stats["files_train"] > 0
    # 40 modules + special.py; empty.py, notes.txt (glob) and latin1.py (encoding) are out.
    assert first.stats["files_train"] + first.stats["files_heldout"] == 41
    assert first.stats["skipped"]["empty"] == 1 and first.stats["skipped"]["not_utf8"] == 1
    capped = load_corpus(replace(corpus, max_bytes=5000))
    assert 5000 <= capped.stats["bytes_train"] + capped.stats["bytes_heldout"] < 6000
    # A file's split depends on its path alone: capping keeps each kept file where it was.
    assert set(capped.train) <= set(first.train) and set(capped.heldout) <= set(first.heldout)
    data = tokenize_corpus(corpus, Tokenizer.from_dir(tok_dir).backend, seq_len=16)
    eot = Tokenizer.from_dir(tok_dir).backend.token_to_id("<|endoftext|>")
    # Exactly one separator per file: the literal "<|endoftext|>" in special.py stays text.
    assert int((data.train == eot).sum()) == len(first.train)
    assert int((data.heldout == eot).sum()) == len(first.heldout)
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(data.sample(4, gen_a), data.sample(4, gen_b))
    assert data.sample(4, gen_a).shape == (4, 17)


def test_default_corpus_is_site_packages():
    dirs = default_corpus_dirs()
    assert any((d / "tqdm" / "__init__.py").is_file() for d in dirs)
    files = load_corpus(CorpusSpec(glob="tqdm/*.py", heldout_fraction=0.0))
    assert files.stats["dirs"] == [str(d) for d in dirs] and len(files.train) > 3


def test_tokenizer_round_trips_and_loads_in_transformers(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    text = "def add_7(x):\n    return x + 7\n# " + SPECIAL + " \t\x00ÿ"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert len(ids) < len(text.encode())  # the merges compress
    ids_of = {t: tok.backend.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>")}
    assert ids_of == {"<|endoftext|>": 0, "<|im_start|>": 1}
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    assert hf.encode(text, add_special_tokens=False) == ids
    assert hf.decode(ids) == text and hf.eos_token == "<|im_end|>"
    msgs = [{"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == chat


def test_target_loss_falls_and_summary_is_written(target):
    out, summary = target
    assert summary["completed"] and summary["steps"] == 40
    assert summary["tokens_seen"] == 40 * 8 * 48
    assert summary["final_train_loss"] < 0.5 * summary["initial_train_loss"]
    assert summary["heldout"]["step"] == 40
    assert summary["heldout"]["loss"] < summary["heldout_history"][0]["loss"] < 5.0
    assert json.loads((out / "train_summary.json").read_text())["parameters"] > 0
    assert not (out / "train_state.pt").exists()  # removed once the checkpoint is written
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["vocab_size"] % 64 == 0
    assert config["eos_token_id"] == 0 and config["torch_dtype"] == "bfloat16"
    weights = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert "lm_head.weight" not in weights and "model.layers.1.self_attn.q_norm.weight" in weights


def test_checkpoint_matches_transformers_in_float32(target):
    transformers = pytest.importorskip("transformers")
    out, _ = target
    ours = CausalLM.from_checkpoint(out, max_positions=64).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert set(hf.state_dict()) - {"lm_head.weight"} == set(ours.state_dict())
    ids = torch.randint(
        0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours.logits(ours(ids))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_metrale_generates_what_the_training_module_predicts(target):
    out, _ = target
    llm = LLM(out, device="cpu", dtype="float32")
    prompt = "def add_3(x):\n"
    res = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    engine_ids = res[0].outputs[0].token_ids
    # Greedy decoding with the training module, full recompute per token.
    model = CausalLM.from_checkpoint(out, max_positions=64).eval()
    ids = llm.tokenizer.encode(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model.logits(model(torch.tensor([ids])))[0, -1].argmax()))
    assert engine_ids == ids[-12:]
    assert "return x +" in res[0].outputs[0].text  # it learned the corpus's shape


def _engine_heads(model_dir: Path):
    """The engine's target and MTP heads on a paged KV cache (as tests/test_mtp_module.py)."""
    from tests.test_mtp_module import build

    _, engine_target, heads, _ = build(model_dir)
    return engine_target, heads


def test_mtp_head_is_the_engines_function(mtp):
    from tests.test_mtp_module import meta_for

    out, _ = mtp
    target = CausalLM.from_checkpoint(out, max_positions=64).eval()
    saved = load_file(str(out / "mtp.safetensors"))
    assert {k: tuple(v.shape) for k, v in saved.items()} == expected_tensors(target.config, 1)
    assert all(v.dtype == torch.bfloat16 for v in saved.values())
    head = MTPHead(target.config, 1)
    head.load_state_dict({k.removeprefix("mtp."): v.float() for k, v in saved.items()})
    engine_target, heads = _engine_heads(out)
    n = 11
    x = torch.randint(0, 300, (n + 2,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        hidden = target(x[None, :n])  # [1, n, H] final-normed
        engine_hidden = engine_target(x[:n], torch.arange(n), meta_for(0, n))
        torch.testing.assert_close(hidden[0], engine_hidden, atol=1e-5, rtol=0)
        # Depth 1: (token p+1, hidden p) at position p, exactly the drafter's catch-up rows.
        ours = head(
            0, x[None, 1 : n + 1], hidden, torch.arange(n), target.model.embed_tokens, target.rotary
        )
        module = heads.for_step(0)
        theirs, nxt = module(
            x[1 : n + 1],
            torch.arange(n),
            engine_hidden,
            meta_for(0, n),
            engine_target.model.embed_tokens,
        )
        torch.testing.assert_close(ours[0], theirs, atol=1e-5, rtol=0)
        assert torch.equal(nxt, theirs)  # the engine chains the post-norm output, as training
        # Depth 2 consumes token p+2 and depth 1's output at position p+1; with attention
        # within the depth, a shared rotary offset leaves the function unchanged.
        ours2 = head(
            1,
            x[None, 2 : n + 1],
            ours[:, : n - 1],
            torch.arange(1, n),
            target.model.embed_tokens,
            target.rotary,
        )
        theirs2, _ = heads.for_step(1)(
            x[2 : n + 1],
            torch.arange(n - 1),
            theirs[: n - 1],
            meta_for(0, n - 1),
            engine_target.model.embed_tokens,
        )
        torch.testing.assert_close(ours2[0], theirs2, atol=1e-4, rtol=0)


def test_mtp_loss_falls_and_the_engine_accepts_its_drafts(mtp, target):
    out, summary = mtp
    assert (
        summary["completed"] and summary["final_train_loss"] < 0.5 * summary["initial_train_loss"]
    )
    assert summary["heldout"]["agree_d1"] > 0.6 and "agree_d2" in summary["heldout"]
    assert (out / "mtp_train_summary.json").is_file()
    assert (out / "train_summary.json").is_file()  # the target's, copied along
    assert not (target[0] / "mtp.safetensors").exists()  # --out left the target alone
    prompts = ["def add_3(x):\n", "def add_7(x):\n    return", "\n\ndef"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(out, device="cpu", dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(out, device="cpu", dtype="float32", spec=dict(method="mtp", num_drafts=2))
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.telemetry.spec
    # Trained with the engine's position conventions, nearly every draft is right on this
    # corpus (0.96 at both positions when written); feeding token p instead of p+1 gave 0.85
    # and 0.23, and other misalignments do worse.
    assert stats.num_draft_tokens > 20
    assert min(stats.acceptance_by_position()) > 0.75


def test_resume_gives_the_uninterrupted_weights_and_seeds_decide(corpus, tok_dir, tmp_path):
    opts = replace(OPTS, steps=10, eval_every=4, keep_state=True)

    def run(name: str, **changes) -> dict:
        return train_target(tok_dir, tmp_path / name, corpus, SHAPE, replace(opts, **changes))

    def state(name: str) -> dict:
        return torch.load(tmp_path / name / "train_state.pt", weights_only=True)

    full = run("full")
    partial = run("resumed", stop_at=6, save_every=4)
    assert not partial["completed"] and partial["steps"] == 6
    assert not (tmp_path / "resumed" / "model.safetensors").exists()
    resumed = run("resumed", resume=True)
    assert resumed["completed"] and resumed["steps"] == 10
    a, b = state("full"), state("resumed")
    assert all(torch.equal(a["module"][k], b["module"][k]) for k in a["module"])
    assert a["history"] == b["history"] and resumed["heldout_history"] == full["heldout_history"]
    same_seed = run("again")
    assert all(torch.equal(a["module"][k], state("again")["module"][k]) for k in a["module"])
    assert same_seed["final_train_loss"] == full["final_train_loss"]
    run("other", seed=1)
    assert not torch.equal(
        a["module"]["model.embed_tokens.weight"],
        state("other")["module"]["model.embed_tokens.weight"],
    )
    with pytest.raises(ValueError, match="pass --resume"):
        run("full")
    with pytest.raises(ValueError, match=r"lr: saved 0\.003, now 0\.001"):
        run("full", resume=True, lr=1e-3)


def test_mtp_resume_writes_the_uninterrupted_head(corpus, target, tmp_path):
    opts = replace(OPTS, steps=6, seq_len=24, eval_every=0)
    full = train_mtp(target[0], corpus, opts, depths=2, out_dir=tmp_path / "full")
    part = train_mtp(target[0], corpus, replace(opts, stop_at=3), depths=2, out_dir=tmp_path / "r")
    assert not part["completed"] and (tmp_path / "r" / "mtp_train_state.pt").is_file()
    assert not (tmp_path / "r" / "mtp.safetensors").exists()
    with pytest.raises(ValueError, match="depths: saved 2, now 3"):
        train_mtp(target[0], corpus, replace(opts, resume=True), depths=3, out_dir=tmp_path / "r")
    done = train_mtp(
        target[0], corpus, replace(opts, resume=True), depths=2, out_dir=tmp_path / "r"
    )
    assert done["completed"] and done["final_train_loss"] == full["final_train_loss"]
    a, b = (load_file(str(tmp_path / d / "mtp.safetensors")) for d in ("full", "r"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "r" / "mtp_train_state.pt").exists()


def test_cli_trains_all_three_stages(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", files=24)
    common = ["--corpus", str(corpus), "--heldout-fraction", "0.2", "-q"]
    tok, tgt = tmp_path / "tok", tmp_path / "tgt"
    assert main(["train", "tokenizer", "--out", str(tok), "--vocab-size", "300", *common]) == 0
    shape = ["--hidden-size", "32", "--num-layers", "1", "--num-heads", "2", "--num-kv-heads", "1"]
    shape += ["--head-dim", "16", "--intermediate-size", "64", "--untie-embeddings"]
    small = ["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--device", "cpu"]
    args = ["train", "target", "--tokenizer", str(tok), "--out", str(tgt), *shape, *small]
    assert main([*args, *common]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["stage"] == "target" and summary["steps"] == 3
    assert "lm_head.weight" in load_file(str(tgt / "model.safetensors"))
    assert main(["train", "mtp", "--target", str(tgt), "--depths", "2", *small, *common]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stage"] == "mtp"
    llm = LLM(tgt, device="cpu", spec=dict(method="mtp", num_drafts=2))
    assert (
        len(llm.generate(["def"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)) == 1
    )


def test_bad_input_is_named(tmp_path, tok_dir, capsys):
    missing = tmp_path / "nope"
    assert main(["train", "tokenizer", "--corpus", str(missing), "--out", str(tmp_path)]) == 2
    assert f"{missing} is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("x")
    with pytest.raises(ValueError, match="no files match"):
        load_corpus(CorpusSpec(dirs=(tmp_path / "empty",)))
    (tmp_path / "empty" / "b.py").write_text("\n\n")
    with pytest.raises(ValueError, match="empty or skipped"):
        load_corpus(CorpusSpec(dirs=(tmp_path / "empty",)))
    with pytest.raises(ValueError, match="vocab_size 100 is too small"):
        train_tokenizer(CorpusSpec(dirs=(tmp_path / "empty",)), tmp_path / "t", vocab_size=100)
    with pytest.raises(ValueError, match="heldout_fraction"):
        CorpusSpec(heldout_fraction=1.5)
    with pytest.raises(ValueError, match="not a multiple"):
        train_target(tok_dir, tmp_path / "t", CorpusSpec(), replace(SHAPE, num_kv_heads=3), OPTS)
    with pytest.raises(ValueError, match="lr must be > 0"):
        replace(OPTS, lr=0.0)
    small = write_corpus(tmp_path / "small", files=3)
    with pytest.raises(ValueError, match="fewer than one window"):
        spec = CorpusSpec(dirs=(small,), heldout_fraction=0.0)
        train_target(tok_dir, tmp_path / "t", spec, SHAPE, replace(OPTS, seq_len=100_000))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        train_mtp(tmp_path, CorpusSpec(dirs=(small,)), OPTS)
    with pytest.raises(SystemExit) as exc:
        main(["train", "target", "--tokenizer", str(tok_dir), "--out", "x", "--steps", "-1"])
    assert exc.value.code == 2 and "expected a positive integer" in capsys.readouterr().err


def test_max_seconds_ends_the_run_with_a_checkpoint(corpus, tok_dir, tmp_path, monkeypatch):
    """A run past `max_seconds` finishes as if done: the checkpoint is written, no resume state
    is left, and the summary says it was truncated."""
    from metrale.train import loop

    clock = iter(range(0, 10**6, 10))  # each reading is 10 s after the previous one
    monkeypatch.setattr(loop.time, "perf_counter", lambda: float(next(clock)))
    opts = replace(OPTS, max_seconds=35)
    summary = train_target(tok_dir, tmp_path, corpus, SHAPE, opts)
    assert summary["truncated"] and summary["completed"]
    assert 1 <= summary["steps"] < OPTS.steps
    assert (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / "train_state.pt").exists()


def test_a_run_without_heldout_writes_a_clean_checkpoint(corpus, tok_dir, tmp_path):
    """`heldout_fraction=0` (documented) evaluates nothing: the run used to crash on an empty
    held-out batch at its end, before the checkpoint was written. The checkpoint replaces an
    earlier sharded one's index and shards (the engine followed the stale index), and its
    weights are readable as the other files are (safetensors writes 0600). (Found in review.)"""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    opts = replace(OPTS, steps=2, eval_every=1)
    summary = train_target(tok_dir, out, replace(corpus, heldout_fraction=0.0), SHAPE, opts)
    assert summary["completed"] and (out / "model.safetensors").is_file()
    assert not (out / "model.safetensors.index.json").exists()
    assert not (out / "model-00001-of-00002.safetensors").exists()
    mode = (out / "config.json").stat().st_mode
    assert (out / "model.safetensors").stat().st_mode == mode
    assert len(LLM(out, device="cpu").generate("def", SamplingParams(max_tokens=2))) == 1


def test_training_refuses_what_would_go_wrong_later(corpus, tok_dir, target, tmp_path):
    """Refused before any step, each naming why (found in review): a resume over changed
    corpus files, even of the same length (the options alone were checked), a resume of a run
    that completed (it started over, overwriting its checkpoint; a run with nothing saved yet
    starts), a target written beside drafters
    of an earlier one, a glob leaving the corpus, a device training cannot use, a depth decay
    whose powers overflow."""
    from metrale.train.loop import resolve_device

    root = tmp_path / "corpus"
    write_corpus(root, files=12)
    spec = replace(corpus, dirs=(root,))
    opts = replace(OPTS, steps=4, eval_every=0)
    partial = train_target(tok_dir, tmp_path / "r", spec, SHAPE, replace(opts, stop_at=2))
    assert not partial["completed"]
    original = (root / "mod_00.py").read_text()
    for changed in (original.replace("x + ", "x - ", 1), "def changed():\n    return 1\n"):
        (root / "mod_00.py").write_text(changed)  # the same length, then another
        with pytest.raises(ValueError, match="corpus"):
            train_target(tok_dir, tmp_path / "r", spec, SHAPE, replace(opts, resume=True))
    (root / "mod_00.py").write_text(original)
    # a state saved before the identity had the files' digest resumes on its options
    path = tmp_path / "r" / "train_state.pt"
    state = torch.load(path, weights_only=False)
    state["identity"]["corpus"].pop("files")
    torch.save(state, path)
    done = train_target(tok_dir, tmp_path / "r", spec, SHAPE, replace(opts, resume=True))
    assert done["completed"]
    with pytest.raises(ValueError, match="completed .*nothing to continue"):
        train_target(tok_dir, tmp_path / "r", spec, SHAPE, replace(opts, resume=True))
    # nothing saved yet (a run killed before its first save): --resume starts it
    assert train_target(tok_dir, tmp_path / "new", spec, SHAPE, replace(opts, resume=True))[
        "completed"
    ]
    (tmp_path / "d" / "dflash").mkdir(parents=True)
    with pytest.raises(ValueError, match="holds dflash, trained for an earlier target"):
        train_target(tok_dir, tmp_path / "d", spec, SHAPE, opts)
    for glob in ("/etc/*", "../*.py", "pkg/../../*.py"):
        with pytest.raises(ValueError, match="glob must stay inside"):
            CorpusSpec(dirs=(root,), glob=glob)
    for device in ("meta", "mps"):
        with pytest.raises(ValueError, match="not supported"):
            resolve_device(device)
    with pytest.raises(ValueError, match="overflow"):
        train_mtp(target[0], spec, opts, depths=5, depth_decay=1e300, out_dir=tmp_path / "m")


def test_mtp_out_over_an_earlier_checkpoint_drops_its_shards(corpus, target, tmp_path):
    """Found in review: `train mtp --out DIR` over a sharded checkpoint kept its index and
    shards, which the engine follows: it loaded the old weights beside the new config."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text('{"weight_map": {"x": "model-1.st"}}')
    for i in (1, 2):
        (out / f"model-0000{i}-of-00002.safetensors").write_bytes(b"old")
    opts = replace(OPTS, steps=2, seq_len=16, eval_every=0)
    train_mtp(target[0], corpus, opts, depths=1, out_dir=out)
    assert not (out / "model.safetensors.index.json").exists()
    assert not list(out.glob("model-*-of-*.safetensors"))
    llm = LLM(out, device="cpu", spec=dict(method="mtp", num_drafts=1))
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0].finished
    stale = tmp_path / "stale"
    (stale / "dflash").mkdir(parents=True)
    with pytest.raises(ValueError, match="holds dflash"):
        train_mtp(target[0], corpus, opts, depths=1, out_dir=stale)


def test_a_refused_resume_leaves_a_finished_mtp_checkpoint_whole(corpus, target, tmp_path):
    """Found in review: `train mtp --resume` into an --out whose run completed copied the
    target over it (its index without the head's entries) before refusing: the engine then
    found no MTP head there."""
    opts = replace(OPTS, steps=2, seq_len=16, eval_every=0)
    out = tmp_path / "out"
    train_mtp(target[0], corpus, opts, depths=1, out_dir=out)
    index = out / "model.safetensors.index.json"
    # a sharded finished checkpoint: its index names the head (`save_mtp` adds it)
    names = load_file(str(out / "model.safetensors"))
    index.write_text(json.dumps({"weight_map": dict.fromkeys(names, "model.safetensors")}))
    from metrale.train.mtp import save_mtp

    save_mtp(out, load_file(str(out / "mtp.safetensors")))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(ValueError, match="completed"):
        train_mtp(target[0], corpus, replace(opts, resume=True), depths=1, out_dir=out)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_drafter_training_refuses_a_hybrid_target_before_writing(corpus, tokenizer_dir, tmp_path):
    """`train mtp` / `train dflash` over a Qwen3-Next target: refused naming the target, before
    any copy is written (it failed on a weight's shape, a full copy of the target left behind;
    found in review)."""
    from metrale.train.dflash import train_dflash
    from tests.test_hybrid_engine import write_hybrid

    hybrid = write_hybrid(tmp_path / "hybrid", tokenizer_dir, seed=1)
    opts = replace(OPTS, steps=2, eval_every=0)
    for train, stage in ((train_mtp, "mtp"), (train_dflash, "dflash")):
        out = tmp_path / f"out-{stage}"
        with pytest.raises(ValueError, match=f"hybrid .*`metrale train {stage}`"):
            train(hybrid, corpus, opts, out_dir=out)
        assert not out.exists()


def test_a_refused_mtp_run_writes_nothing_and_a_copy_always_loads(corpus, mtp, tmp_path):
    """Found in review: `train mtp --out` copied the target before reading the corpus, so a
    corpus with no files left a copy whose index named an MTP file it lacked (unloadable), as
    did a run stopped before its head was written."""
    import shutil

    model = tmp_path / "source"  # a checkpoint with an indexed MTP head
    shutil.copytree(mtp[0], model)
    index = model / "model.safetensors.index.json"
    names = load_file(str(model / "model.safetensors"))
    index.write_text(json.dumps({"weight_map": dict.fromkeys(names, "model.safetensors")}))
    from metrale.train.mtp import save_mtp

    save_mtp(model, load_file(str(model / "mtp.safetensors")))  # the index names the head
    empty = tmp_path / "empty"
    empty.mkdir()
    opts = replace(OPTS, steps=4, seq_len=16, eval_every=0)
    with pytest.raises(ValueError):
        train_mtp(model, CorpusSpec(dirs=(empty,)), opts, depths=1, out_dir=tmp_path / "o")
    assert not (tmp_path / "o").exists()
    train_mtp(model, corpus, replace(opts, stop_at=2), depths=1, out_dir=tmp_path / "s")
    assert not (tmp_path / "s" / "mtp.safetensors").exists()
    llm = LLM(tmp_path / "s", device="cpu")  # the stopped run's copy loads as a plain target
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_a_diverging_run_fails_naming_the_lr_and_writes_no_head(corpus, target, tmp_path):
    """Found in review: `--lr 1e10` trained NaN weights, wrote them and reported a completed
    run. A non-finite loss (training or held-out) now ends the run with a ValueError."""
    opts = replace(OPTS, steps=20, seq_len=16, lr=1e10, grad_clip=0.0, eval_every=0)
    with pytest.raises(ValueError, match="diverged .* lower lr than 1e\\+10"):
        train_mtp(target[0], corpus, opts, depths=1, out_dir=tmp_path / "o")
    assert not (tmp_path / "o" / "mtp.safetensors").exists()
    with pytest.raises(ValueError, match="seed must be in"):
        replace(OPTS, seed=2**64)
    assert replace(OPTS, seed=-1).seed == -1  # (torch's range: what trained before trains)
