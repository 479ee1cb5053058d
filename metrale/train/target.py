"""The target stage: a Qwen3-architecture causal LM trained from scratch on the corpus.

The output directory is a standard HF checkpoint that `metrale`, transformers and any Qwen3
loader read: `config.json` (model_type qwen3), `model.safetensors` in bf16 under HF names,
`generation_config.json`, the tokenizer's files, and `train_summary.json`.

End of sequence: the corpus puts `<|endoftext|>` after every file, so that is what a model
trained on it emits when a file is done; config.json names it as eos (and bos), and
generation_config.json lists it with `<|im_end|>` (the chat template's turn end), so generation
stops at either.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from metrale.config import ModelConfig
from metrale.default_model import ENDOFTEXT, IM_END
from metrale.models.loader import like_written
from metrale.train.bpe import TOKENIZER_FILES, load_tokenizer
from metrale.train.corpus import CorpusSpec, tokenize_corpus
from metrale.train.loop import TrainOptions, run_training
from metrale.train.model import CausalLM

STATE_FILE = "train_state.pt"
SUMMARY_FILE = "train_summary.json"


@dataclass(frozen=True)
class TargetShape:
    """The model's shape; the vocabulary comes from the tokenizer."""

    hidden_size: int = 512
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 1536
    tie_embeddings: bool = True
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int | None = None  # None: the training seq_len
    # The embedding is padded to a multiple of this (never-seen rows): friendlier GEMM shapes.
    vocab_multiple: int = 64

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("intermediate_size", "vocab_multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_position_embeddings is not None and self.max_position_embeddings < 1:
            raise ValueError(
                f"max_position_embeddings must be >= 1, got {self.max_position_embeddings}"
            )
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")


def target_config(shape: TargetShape, tok, seq_len: int) -> dict:
    """The HF `config.json` of a model of `shape` for tokenizer `tok` (validated by metrale's
    own `ModelConfig`, so a bad head count is refused before any training)."""
    eot, im_end = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)
    if eot is None or im_end is None:
        raise ValueError(f"the tokenizer lacks {ENDOFTEXT} or {IM_END}")
    vocab = tok.get_vocab_size(with_added_tokens=True)
    vocab = -(-vocab // shape.vocab_multiple) * shape.vocab_multiple
    max_pos = shape.max_position_embeddings or seq_len
    if max_pos < seq_len:
        raise ValueError(f"max_position_embeddings {max_pos} is below seq_len {seq_len}")
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": shape.num_layers,
        "tie_word_embeddings": shape.tie_embeddings,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
    }
    ModelConfig.from_dict(config, source="target shape")
    return config


def save_checkpoint(
    model: CausalLM, config: dict, tokenizer_dir: str | Path, out_dir: str | Path
) -> None:
    """config.json, bf16 model.safetensors, generation_config.json and the tokenizer files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {
        name: t.detach().to("cpu", torch.bfloat16).contiguous()
        for name, t in model.state_dict().items()
    }
    drop_earlier_weights(out_dir)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    like_written(out_dir / "model.safetensors")
    eot = config["eos_token_id"]
    tok = load_tokenizer(tokenizer_dir)
    generation = {
        "bos_token_id": eot,
        "eos_token_id": [eot, tok.token_to_id(IM_END)],
        "pad_token_id": eot,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        src, dst = Path(tokenizer_dir) / name, out_dir / name
        if src.is_file() and src.resolve() != dst.resolve():
            shutil.copyfile(src, dst)


INDEX_FILE = "model.safetensors.index.json"
# drafters trained for the weights of a checkpoint directory
DRAFTER_FILES = ("mtp.safetensors", "dflash")


def drop_earlier_weights(out_dir: Path) -> None:
    """An earlier checkpoint's weights in `out_dir`: a sharded one's index and shards would be
    loaded before a new model.safetensors (the engine follows the index), so they go, as
    transformers' save_pretrained drops them, and model.safetensors with them."""
    for stale in [
        out_dir / "model.safetensors",
        out_dir / INDEX_FILE,
        *out_dir.glob("model-*-of-*.safetensors"),
    ]:
        stale.unlink(missing_ok=True)


def check_no_stale_drafters(out_dir: Path, names: tuple[str, ...] = DRAFTER_FILES) -> None:
    """Refuse, before training, to write a target where drafters (`names`) of an earlier
    target lie: they would not match the new weights (a head of the same shape loads silently
    and drafts nothing useful; found in review)."""
    found = [name for name in names if (out_dir / name).exists()]
    if found:
        raise ValueError(
            f"out: {out_dir} holds {', '.join(found)}, trained for an earlier target: they "
            "would not match the new weights; remove them or choose another --out"
        )


def train_target(
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    corpus: CorpusSpec,
    shape: TargetShape,
    opts: TrainOptions,
) -> dict:
    """The target stage. Returns the summary (also written to `train_summary.json` once the run
    completes); a run stopped early (`stop_at`, `time_limit`) leaves `train_state.pt` for
    `resume` and writes no checkpoint."""
    start = time.perf_counter()
    check_no_stale_drafters(Path(out_dir))
    tok = load_tokenizer(tokenizer_dir)
    config = target_config(shape, tok, opts.seq_len)
    cfg = ModelConfig.from_dict(config)
    data = tokenize_corpus(corpus, tok, opts.seq_len)
    model = CausalLM(cfg, max_positions=opts.seq_len)
    model.init_weights(torch.Generator().manual_seed(opts.seed))

    def loss_fn(batch: torch.Tensor):
        labels = batch[:, 1:]
        logits = model.logits(model(batch[:, :-1]))  # [B, T, V] float32
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if model.training:  # metrics are for held-out evaluation only
            return loss, {}
        return loss, {"accuracy": (logits.argmax(-1) == labels).float().mean()}

    tok_hash = hashlib.sha256((Path(tokenizer_dir) / "tokenizer.json").read_bytes()).hexdigest()
    fingerprint = {
        "stage": "target",
        "config": config,
        "corpus": data.identity(corpus),
        "tokenizer_sha256": tok_hash[:16],
    }
    result = run_training(
        model,
        loss_fn,
        data,
        opts,
        out_dir,
        STATE_FILE,
        fingerprint,
        "target",
        on_complete=lambda: save_checkpoint(model, config, tokenizer_dir, out_dir),
    )
    embed = model.model.embed_tokens.weight.numel()
    params = sum(p.numel() for p in model.parameters())
    summary = {
        "stage": "target",
        **result,
        "parameters": params,
        "parameters_non_embedding": params - embed * (1 if shape.tie_embeddings else 2),
        "shape": asdict(shape),
        "config": config,
        "corpus": data.stats,
        "session_time_s": round(time.perf_counter() - start, 3),
    }
    if result["completed"]:
        (Path(out_dir) / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary
