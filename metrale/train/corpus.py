"""The training corpus: a deterministic set of text files, split, tokenised, and cut into windows.

A corpus is one or more directories and a glob (`**/*.py` by default); with no directory given it
is the `.py` files of the running interpreter's installed packages, which every machine has.
Everything about it is a pure function of the file tree and the options, so two runs (or a run
and its resumption) see the same data:

- files are enumerated in sorted relative-path order;
- a file is held out when a stable hash of its relative path falls below `heldout_fraction`
  (a file never moves between splits when others are added or removed);
- under `max_bytes`, files are admitted in the order of a second stable hash (a fixed shuffle),
  so a cap samples every package instead of the alphabetically first ones, and are then read
  back in sorted order.

Each split becomes one long stream of token ids with `<|endoftext|>` after every file. Training
batches are random windows of it drawn with a seeded `torch.Generator` (whose state a resumed run
restores); held-out batches are fixed consecutive windows.
"""

from __future__ import annotations

import hashlib
import site
import sysconfig
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer

DEFAULT_GLOB = "**/*.py"
DEFAULT_MAX_BYTES = 100_000_000
# Larger files in package trees are mostly generated tables, not code worth learning from.
DEFAULT_MAX_FILE_BYTES = 1_000_000
DEFAULT_HELDOUT_FRACTION = 0.02
ENDOFTEXT = "<|endoftext|>"
# Files are tokenised this many at a time: bounds the memory `encode_batch` holds in Encodings.
_ENCODE_CHUNK = 512


def default_corpus_dirs() -> tuple[Path, ...]:
    """The site-packages directories of the running interpreter (existing ones, deduplicated)."""
    paths = sysconfig.get_paths()
    candidates = [paths.get("purelib"), paths.get("platlib")]
    # Some virtualenv builds of `site` lack getsitepackages.
    candidates += getattr(site, "getsitepackages", list)()
    seen: dict[Path, None] = {}
    for c in candidates:
        if c and Path(c).is_dir():
            seen.setdefault(Path(c).resolve(), None)
    if not seen:
        raise ValueError("no site-packages directory found for the default corpus; pass --corpus")
    return tuple(seen)


def _unit_hash(salt: str, rel: str) -> float:
    """A stable number in [0, 1) for a relative path (independent of PYTHONHASHSEED)."""
    digest = hashlib.sha256(f"{salt}:{rel}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass(frozen=True)
class CorpusSpec:
    """Which files make the corpus and how they split; validated on construction."""

    dirs: tuple[Path, ...] = ()  # empty: the default corpus (site-packages)
    glob: str = DEFAULT_GLOB
    max_bytes: int | None = DEFAULT_MAX_BYTES
    max_file_bytes: int | None = DEFAULT_MAX_FILE_BYTES
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION

    def __post_init__(self) -> None:
        object.__setattr__(self, "dirs", tuple(Path(d) for d in self.dirs))
        for d in self.dirs:
            if not d.is_dir():
                raise ValueError(f"corpus: {d} is not a directory")
        if not self.glob:
            raise ValueError("corpus: glob must not be empty")
        if Path(self.glob).is_absolute() or ".." in Path(self.glob).parts:
            # (pathlib raised NotImplementedError on an absolute one; `..` read files outside
            # the corpus directories: found in review)
            raise ValueError(f"corpus: glob must stay inside the directories, got {self.glob!r}")
        for name in ("max_bytes", "max_file_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"corpus: {name} must be positive, got {value}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(
                f"corpus: heldout_fraction must be in [0, 1), got {self.heldout_fraction}"
            )

    def roots(self) -> tuple[Path, ...]:
        return self.dirs or default_corpus_dirs()

    def describe(self) -> dict:
        """JSON-able options, for summaries and for checking that a resumed run matches."""
        return {
            "dirs": [str(d) for d in self.roots()],
            "glob": self.glob,
            "max_bytes": self.max_bytes,
            "max_file_bytes": self.max_file_bytes,
            "heldout_fraction": self.heldout_fraction,
        }


@dataclass
class CorpusFiles:
    """The selected files' texts per split, plus facts for the training summary."""

    train: list[str] = field(default_factory=list)
    heldout: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def _candidates(spec: CorpusSpec) -> list[tuple[str, Path, int]]:
    """(key, path, size) of every matching regular file, sorted by key. The key is the path
    relative to its root, prefixed by the root's index when there are several roots."""
    roots = spec.roots()
    found = []
    for i, root in enumerate(roots):
        for path in root.glob(spec.glob):
            if not path.is_file():
                continue
            rel = path.relative_to(root).as_posix()
            key = rel if len(roots) == 1 else f"{i}/{rel}"
            found.append((key, path, path.stat().st_size))
    found.sort(key=lambda t: t[0])
    return found


def load_corpus(spec: CorpusSpec) -> CorpusFiles:
    """Read the corpus's files into texts, per split. Empty, oversized and non-UTF-8 files are
    skipped (and counted); an empty result is an error naming the directories and glob."""
    candidates = _candidates(spec)
    where = f"{', '.join(str(r) for r in spec.roots())} (glob {spec.glob!r})"
    if not candidates:
        raise ValueError(f"corpus: no files match in {where}")
    skipped = {"empty": 0, "too_large": 0, "not_utf8": 0, "over_max_bytes": 0}
    chosen: dict[str, str] = {}
    total = 0
    # Admission order is a fixed shuffle so that a byte cap samples the whole tree.
    for key, path, size in sorted(candidates, key=lambda t: (_unit_hash("order", t[0]), t[0])):
        if spec.max_bytes is not None and total >= spec.max_bytes:
            skipped["over_max_bytes"] += 1
            continue
        if size == 0:
            skipped["empty"] += 1
            continue
        if spec.max_file_bytes is not None and size > spec.max_file_bytes:
            skipped["too_large"] += 1
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            continue
        if not text.strip():
            skipped["empty"] += 1
            continue
        chosen[key] = text
        total += len(text.encode("utf-8"))
    if not chosen:
        raise ValueError(f"corpus: every file matching in {where} is empty or skipped ({skipped})")
    files = CorpusFiles()
    fingerprint = hashlib.sha256()
    split_bytes = {"train": 0, "heldout": 0}
    for key in sorted(chosen):  # the stream's order: sorted, whatever the admission order was
        text = chosen[key]
        split = "heldout" if _unit_hash("heldout", key) < spec.heldout_fraction else "train"
        getattr(files, split).append(text)
        split_bytes[split] += len(text.encode("utf-8"))
        fingerprint.update(f"{split}\0{key}\0{len(text)}\n".encode())
        # (the text too: an edit that kept a file's length let a resume go on over it, found
        # in review; `identity` uses this digest)
        fingerprint.update(hashlib.sha256(text.encode("utf-8")).digest())
    if not files.train:
        raise ValueError(f"corpus: every file of {where} fell into the held-out split")
    if spec.heldout_fraction > 0 and not files.heldout:
        raise ValueError(
            f"corpus: the held-out split of {where} is empty ({len(chosen)} files at "
            f"heldout_fraction {spec.heldout_fraction}); add files or raise --heldout-fraction"
        )
    files.stats = {
        **spec.describe(),
        "files_train": len(files.train),
        "files_heldout": len(files.heldout),
        "bytes_train": split_bytes["train"],
        "bytes_heldout": split_bytes["heldout"],
        "skipped": skipped,
        "fingerprint": fingerprint.hexdigest()[:16],
    }
    return files


def encode_stream(tok: HFTokenizer, texts: list[str]) -> torch.Tensor:
    """One int32 stream of ids: each text's tokens followed by `<|endoftext|>`."""
    eot = tok.token_to_id(ENDOFTEXT)
    if eot is None:
        raise ValueError(f"tokenizer has no {ENDOFTEXT} token")
    # Source files may contain the literal string "<|endoftext|>" (tokenizer code does); encode
    # it as text, so that the only separators in the stream are the ones put there.
    previous = tok.encode_special_tokens
    tok.encode_special_tokens = True
    try:
        parts = []
        for start in range(0, len(texts), _ENCODE_CHUNK):
            for enc in tok.encode_batch(
                texts[start : start + _ENCODE_CHUNK], add_special_tokens=False
            ):
                parts.append(np.asarray(enc.ids, dtype=np.int32))
                parts.append(np.asarray([eot], dtype=np.int32))
    finally:
        tok.encode_special_tokens = previous
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return torch.from_numpy(stream)


@dataclass
class TokenData:
    """The tokenised splits and the window length (`seq_len + 1`: inputs plus the next token)."""

    train: torch.Tensor  # [N] int32
    heldout: torch.Tensor  # [M] int32, may be empty when heldout_fraction is 0
    window: int
    stats: dict

    def __post_init__(self) -> None:
        if self.train.numel() < self.window:
            raise ValueError(
                f"corpus: the training split has {self.train.numel()} tokens, fewer than one "
                f"window of {self.window} (seq_len + 1); add files or lower --seq-len"
            )
        if 0 < self.heldout.numel() < self.window:
            raise ValueError(
                f"corpus: the held-out split has {self.heldout.numel()} tokens, fewer than one "
                f"window of {self.window}; raise --heldout-fraction or lower --seq-len"
            )

    def to(self, device: torch.device) -> TokenData:
        """The same data with the streams on `device` (windows are then cut there)."""
        return replace(self, train=self.train.to(device), heldout=self.heldout.to(device))

    def sample(self, batch_size: int, gen: torch.Generator) -> torch.Tensor:
        """[batch_size, window] int64 on the streams' device: random windows of the training
        stream. The starts come from `gen` (a CPU generator) whatever the device, so a seed
        picks the same windows everywhere."""
        starts = torch.randint(
            0, self.train.numel() - self.window + 1, (batch_size,), generator=gen
        )
        device = self.train.device
        index = starts.to(device)[:, None] + torch.arange(self.window, device=device)
        return self.train[index].long()

    def identity(self, spec: CorpusSpec) -> dict:
        """What a resumed run must find again: the corpus options and the digest of the files
        they selected (the options alone let a resume train on changed files: found in
        review)."""
        return {**spec.describe(), "files": self.stats["fingerprint"]}

    def heldout_batches(self, batch_size: int, max_batches: int) -> list[torch.Tensor]:
        """Fixed consecutive windows of the held-out stream, at most `max_batches` batches."""
        n = min(self.heldout.numel() // self.window, batch_size * max_batches)
        if n == 0:
            # (split of no windows is one empty batch: evaluated, it crashed the end of a run
            # with --heldout-fraction 0 before its checkpoint was written; found in review)
            return []
        windows = self.heldout[: n * self.window].view(n, self.window).long()
        return list(windows.split(batch_size))


def tokenize_corpus(spec: CorpusSpec, tok: HFTokenizer, seq_len: int) -> TokenData:
    """Load and tokenise the corpus for windows of `seq_len + 1` tokens."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    files = load_corpus(spec)
    train, heldout = encode_stream(tok, files.train), encode_stream(tok, files.heldout)
    stats = {**files.stats, "tokens_train": train.numel(), "tokens_heldout": heldout.numel()}
    return TokenData(train, heldout, seq_len + 1, stats)
