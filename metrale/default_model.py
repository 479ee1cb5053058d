"""metrale's default models: the trained one it ships, and a tiny random one for tests.

- `default_model_dir()`: the code model trained with `metrale train` and committed under
  `metrale/assets/default-model` (its MODEL_CARD.md says how): an 11M-parameter Qwen3 with its
  MTP head, what `metrale generate`, `chat`, `serve` and `bench` run when no model is named.
- `random_model_dir()`: a tiny random-weight Qwen3 (with a random MTP head) built on first use
  under `METRALE_HOME`, for tests that want a real HF-format checkpoint (config, bf16
  safetensors, byte-level tokenizer with a ChatML template) that runs in milliseconds. The build
  is deterministic, so two machines, or two runs, get byte-identical files, and transformers
  loads the result, so it doubles as a reference for parity tests.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from metrale.knobs import knobs

# Bump the suffix whenever the files built below change, so old caches are not reused.
# v2: the checkpoint also holds a (random) MTP head, so `--spec mtp` runs on it.
RANDOM_MODEL_NAME = "default-random-qwen3-v2"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# The byte tokens take ids 0..255 (id == byte value), the special tokens follow.
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 256, 257, 258

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

DEFAULT_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 4,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "initializer_range": 0.02,
    "use_cache": True,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": IM_END_ID,
}

_INIT_STD = 0.02


SHIPPED_MODEL_DIR = Path(__file__).parent / "assets" / "default-model"


def default_model_dir() -> Path:
    """The shipped default model's directory (package data, nothing downloaded or built)."""
    if not (SHIPPED_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the default model is missing from {SHIPPED_MODEL_DIR}: reinstall metrale, or "
            "name a model with --model"
        )
    return SHIPPED_MODEL_DIR


def random_model_dir() -> Path:
    """The tiny random model's directory under `METRALE_HOME`, built there on first use."""
    target = knobs().home / "models" / RANDOM_MODEL_NAME
    if not target.is_dir():
        _build_atomically(target, _build_default)
    return target


def _build_default(path: Path) -> None:
    from metrale.config import ModelConfig
    from metrale.models.mtp import QWEN3_NEXT, write_mtp_weights

    build_random_qwen3(path)
    write_mtp_weights(path, ModelConfig.from_hf(path), QWEN3_NEXT, num_layers=1, seed=1)


def _build_atomically(target: Path, build: Callable[[Path], object]) -> None:
    """Build into a sibling temp dir and rename it into place, so readers only ever see a whole
    checkpoint; when another process wins the race, its (identical) copy is kept."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            # POSIX refuses to replace a non-empty directory: someone else finished first.
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _bytes_to_symbols() -> list[str]:
    """The printable character that stands for each byte in byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...) are moved,
    in byte order, to code points 256 and up. This is the convention GPT-2-style tokenizers and
    the `tokenizers` ByteLevel pre-tokenizer share, so ids written here decode correctly there.
    """
    printable = set(range(ord("!"), ord("~") + 1))
    printable |= set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    symbols, spare = [], 256
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(spare))
            spare += 1
    return symbols


def build_tokenizer() -> HFTokenizer:
    """A byte-level BPE with no merges (one token per byte) plus the ChatML special tokens."""
    symbols = _bytes_to_symbols()
    # Check against the library's alphabet so a drift in the convention fails loudly here.
    if set(symbols) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError("tokenizers' ByteLevel alphabet differs from the GPT-2 byte mapping")
    vocab = {s: i for i, s in enumerate(symbols)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    assert added == len(SPECIAL_TOKENS)
    assert tok.token_to_id(IM_END) == IM_END_ID and tok.token_to_id(ENDOFTEXT) == ENDOFTEXT_ID
    return tok


def _tokenizer_config() -> dict[str, Any]:
    decoder = {
        str(ENDOFTEXT_ID + i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "added_tokens_decoder": decoder,
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": DEFAULT_CONFIG["max_position_embeddings"],
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def random_qwen3_weights(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 weights under HF Qwen3 names: N(0, 0.02) matrices, all-ones norms, tied head."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads

    def matrix(rows: int, cols: int) -> torch.Tensor:
        # Drawn in float32 and then rounded, so the values do not depend on bf16 RNG kernels.
        return (torch.randn(rows, cols, generator=gen) * _INIT_STD).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    # Insertion order fixes the RNG draw order, which is what makes builds reproducible.
    weights = {"model.embed_tokens.weight": matrix(config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = matrix(heads * head_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = matrix(kv_heads * head_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = matrix(kv_heads * head_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = matrix(hidden, heads * head_dim)
        weights[p + "self_attn.q_norm.weight"] = ones(head_dim)
        weights[p + "self_attn.k_norm.weight"] = ones(head_dim)
        weights[p + "mlp.gate_proj.weight"] = matrix(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = matrix(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = matrix(hidden, inter)
        weights[p + "input_layernorm.weight"] = ones(hidden)
        weights[p + "post_attention_layernorm.weight"] = ones(hidden)
    weights["model.norm.weight"] = ones(hidden)
    if not config.get("tie_word_embeddings", False):
        weights["lm_head.weight"] = matrix(config["vocab_size"], hidden)
    return weights


def _write_json(path: Path, data: dict[str, Any]) -> None:
    # Sorted keys and a fixed layout keep the bytes identical from build to build.
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_random_qwen3(
    path: str | Path, config_overrides: dict[str, Any] | None = None, seed: int = 0
) -> Path:
    """Write a random-weight Qwen3 checkpoint with the default tokenizer into `path`.

    `config_overrides` replaces config.json fields (e.g. a different depth for a draft model);
    `seed` picks the weights. Returns `path`.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**DEFAULT_CONFIG, **(config_overrides or {})}
    tok = build_tokenizer()
    if config["vocab_size"] < tok.get_vocab_size(with_added_tokens=True):
        raise ValueError(
            f"vocab_size {config['vocab_size']} is smaller than the tokenizer's "
            f"{tok.get_vocab_size(with_added_tokens=True)} tokens"
        )
    _write_json(path / "config.json", config)
    _write_json(
        path / "generation_config.json",
        {
            "bos_token_id": ENDOFTEXT_ID,
            "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
            "pad_token_id": ENDOFTEXT_ID,
        },
    )
    save_file(
        random_qwen3_weights(config, seed),
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    write_tokenizer(path)
    return path


def write_tokenizer(path: str | Path) -> None:
    """The default byte-level tokenizer's files, to pair with any checkpoint shape."""
    build_tokenizer().save(str(Path(path) / "tokenizer.json"))
    _write_json(Path(path) / "tokenizer_config.json", _tokenizer_config())
