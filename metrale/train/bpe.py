"""The tokenizer stage: a byte-level BPE trained on the corpus's training split.

The result is the same kind of tokenizer as the default model's (GPT-2 byte alphabet, ByteLevel
pre-tokenizer and decoder, ChatML special tokens and chat template), only with learned merges, so
`metrale.tokenizer.Tokenizer` and transformers' `AutoTokenizer` both load it and any byte string
round-trips. Only the training split is seen, so held-out numbers stay honest.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from metrale.default_model import SPECIAL_TOKENS, _tokenizer_config
from metrale.train.corpus import CorpusSpec, encode_stream, load_corpus

DEFAULT_VOCAB_SIZE = 4096
# The 256 byte tokens plus the special tokens are in every vocabulary before any merge.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _check_options(vocab_size: int, min_frequency: int) -> None:
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size {vocab_size} is too small: the byte alphabet and special tokens alone "
            f"take {MIN_VOCAB_SIZE}"
        )
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")


def build_bpe(
    texts: list[str], vocab_size: int = DEFAULT_VOCAB_SIZE, min_frequency: int = 2, progress=False
) -> HFTokenizer:
    """Train a byte-level BPE of at most `vocab_size` tokens (fewer when the texts run out of
    merges at `min_frequency`). The special tokens take ids 0, 1, 2, the bytes the next 256."""
    _check_options(vocab_size, min_frequency)
    tok = HFTokenizer(models.BPE(unk_token=None))
    # The same pipeline as the default model's byte-level tokenizer (default_model.py).
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        # Every byte is a token even if the corpus never shows it, so any text encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def tokenizer_config(tok: HFTokenizer) -> dict:
    """`tokenizer_config.json` for `tok`: the default model's (ChatML template, eos <|im_end|>,
    pad <|endoftext|>, no BOS) with the special tokens' ids as this vocabulary assigns them."""
    cfg = _tokenizer_config()
    decoder = {}
    for entry in cfg["added_tokens_decoder"].values():
        token_id = tok.token_to_id(entry["content"])
        if token_id is None:
            raise ValueError(f"tokenizer lacks the special token {entry['content']!r}")
        decoder[str(token_id)] = entry
    cfg["added_tokens_decoder"] = dict(sorted(decoder.items(), key=lambda kv: int(kv[0])))
    return cfg


def save_tokenizer(tok: HFTokenizer, out_dir: str | Path) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    text = json.dumps(tokenizer_config(tok), indent=2, sort_keys=True) + "\n"
    (out_dir / "tokenizer_config.json").write_text(text, encoding="utf-8")


def load_tokenizer(tokenizer_dir: str | Path) -> HFTokenizer:
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json (run `metrale train tokenizer`)")
    return HFTokenizer.from_file(str(path))


def train_tokenizer(
    corpus: CorpusSpec,
    out_dir: str | Path,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    min_frequency: int = 2,
    progress: bool = True,
) -> dict:
    """The tokenizer stage: train on the corpus, save `tokenizer.json`, `tokenizer_config.json`
    and `train_summary.json` into `out_dir`, and return the summary (vocabulary size, corpus
    facts, held-out bytes per token)."""
    _check_options(vocab_size, min_frequency)  # before reading a large corpus
    start = time.perf_counter()
    files = load_corpus(corpus)
    tok = build_bpe(files.train, vocab_size, min_frequency, progress)
    save_tokenizer(tok, out_dir)
    # Compression on text the merges never saw: the number a tokenizer is judged by.
    split = files.heldout or files.train
    tokens = encode_stream(tok, split).numel() - len(split)  # minus the separators
    summary = {
        "stage": "tokenizer",
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "vocab_size_requested": vocab_size,
        "min_frequency": min_frequency,
        "bytes_per_token": round(sum(len(t.encode()) for t in split) / max(tokens, 1), 4),
        "bytes_per_token_split": "heldout" if files.heldout else "train",
        "corpus": files.stats,
        "wall_time_s": round(time.perf_counter() - start, 3),
    }
    (Path(out_dir) / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
