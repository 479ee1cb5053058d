"""Checkpoint loading: sharded checkpoints load like single files; a bad checkpoint fails with an
error that names the tensor or config field."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from metrale import LLM, SamplingParams
from metrale.config import ModelConfig
from metrale.models import loader
from metrale.models.loader import CheckpointError


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_model_dir, dst)
    return dst


def record_reads(monkeypatch) -> dict[str, tuple]:
    """{checkpoint name: shape read} of every tensor the loader reads from now on."""
    read: dict[str, tuple] = {}
    real = loader.iter_tensors

    def recording(files, keep=None, select=None):
        for name, tensor, path in real(files, keep, select):
            read[name] = tuple(tensor.shape)
            yield name, tensor, path

    monkeypatch.setattr(loader, "iter_tensors", recording)
    return read


def greedy_tokens(model_dir) -> list[int]:
    llm = LLM(model_dir, device="cpu")
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return llm.generate([[3, 4, 5]], sp, use_tqdm=False)[0].outputs[0].token_ids


def rewrite_weights(model_dir, edit) -> None:
    tensors = load_file(str(model_dir / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(model_dir / "model.safetensors"))


def test_sharded_checkpoint_with_index_loads_the_same(tiny_model_dir, model_copy):
    tensors = load_file(str(model_copy / "model.safetensors"))
    (model_copy / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(model_copy / fname))
        weight_map.update({k: fname for k in keys})
    (model_copy / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    assert greedy_tokens(model_copy) == greedy_tokens(tiny_model_dir)


def test_missing_tensor_is_named(model_copy):
    rewrite_weights(model_copy, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        LLM(model_copy, device="cpu")


def test_weights_without_any_of_the_models_tensors_say_so(model_copy):
    """A folder whose safetensors hold none of the model's tensors (a snapshot of only its
    drafter's, `mtp.safetensors`): the error says so and names the files, rather than naming
    the first tensor as if one were missing."""
    (model_copy / "model.safetensors").unlink()
    save_file({"mtp.layers.0.weight": torch.zeros(2, 2)}, model_copy / "mtp.safetensors")
    with pytest.raises(CheckpointError, match=r"mtp\.safetensors\) hold none of the model's"):
        LLM(model_copy, device="cpu")


def test_wrong_shape_is_named(model_copy):
    def edit(t):
        t["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 3)

    rewrite_weights(model_copy, edit)
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*\(3, 3\)"
    ):
        LLM(model_copy, device="cpu")


def test_integer_tensor_is_named(model_copy):
    def edit(t):
        t["model.norm.weight"] = torch.ones(64, dtype=torch.int32)

    rewrite_weights(model_copy, edit)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*int32"):
        LLM(model_copy, device="cpu")


def test_missing_weights_and_shards(model_copy):
    (model_copy / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00009.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="model-00009.safetensors"):
        LLM(model_copy, device="cpu")
    (model_copy / "model.safetensors.index.json").unlink()
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        LLM(model_copy, device="cpu")


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda c: c.update(architectures=["LlamaForCausalLM"]), "architectures"),
        (lambda c: c.pop("hidden_size"), "hidden_size"),
        (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
        (lambda c: c.update(num_hidden_layers=0), "num_hidden_layers"),
        (lambda c: c.update(dtype="int8", torch_dtype="int8"), "torch_dtype"),
        (lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_type"),
        (lambda c: c.update(use_sliding_window=True), "use_sliding_window"),
        # found in review: tracebacks from deep inside, or accepted and run wrong
        (lambda c: c.update(rms_norm_eps=None), "rms_norm_eps"),
        (lambda c: c.update(rms_norm_eps="1e-6"), "rms_norm_eps"),
        (lambda c: c.update(rms_norm_eps=-1e-6), "rms_norm_eps"),
        (lambda c: (c.pop("rope_parameters", None), c.update(rope_theta=None)), "rope_theta"),
        (lambda c: c.update(rope_parameters={"rope_theta": -10.0}), "rope_theta"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
        (lambda c: c.update(tie_word_embeddings="false"), "tie_word_embeddings"),
        (lambda c: c.update(head_dim=0), "head_dim"),
        (lambda c: c.update(num_key_value_heads=0), "num_key_value_heads"),
    ],
)
def test_bad_config_is_named(model_copy, edit, field):
    cfg = json.loads((model_copy / "config.json").read_text())
    edit(cfg)
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(model_copy)


def test_missing_config_and_tokenizer(model_copy):
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        LLM(model_copy, device="cpu")
    (model_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(model_copy, device="cpu")


@pytest.mark.parametrize("ranks", [1, 2])
def test_tensors_no_parameter_takes_are_not_read(model_copy, monkeypatch, ranks):
    """Found in review: DeepSeek-layout MTP blocks (`model.layers.{L >= num_hidden_layers}`,
    with a whole [V, H] head) were read from the file by the target's loader, on every
    tensor-parallel rank, then dropped. Only tensors a parameter takes are read; the target
    still equals the one loaded without them."""
    from metrale.distributed.layers import TPQwen3ForCausalLM
    from metrale.distributed.parallel import TPGroup, expert_renamer, selector
    from metrale.models.attention import TorchPagedAttention
    from metrale.models.mtp import write_mtp_weights

    cfg = ModelConfig.from_hf(model_copy)
    tp = TPGroup(ranks - 1, ranks)

    def load() -> dict:
        model = TPQwen3ForCausalLM(cfg, TorchPagedAttention(), 64, tp)
        loader.load_weights(
            model, model_copy, select=selector(cfg, tp), rename=expert_renamer(cfg, tp)
        )
        return {k: v.clone() for k, v in model.state_dict().items()}

    want = load()
    write_mtp_weights(model_copy, cfg, "deepseek", num_layers=1, seed=4)
    got_read = record_reads(monkeypatch)
    got = load()
    layer = f"model.layers.{cfg.num_hidden_layers}."
    assert not [name for name in got_read if name.startswith(layer)]
    assert got_read and all(name.startswith(("model.", "lm_head")) for name in got_read)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
