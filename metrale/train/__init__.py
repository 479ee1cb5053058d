"""Training for metrale's own models: `metrale train tokenizer | target | mtp | dflash`.

Four stages, each a function and a CLI subcommand, on a local corpus of text files (by default
the `.py` files of the installed packages):

- `train_tokenizer` (`bpe.py`): a byte-level BPE with the ChatML special tokens and template;
- `train_target` (`target.py`): a Qwen3-architecture causal LM from scratch, saved as a standard
  HF checkpoint;
- `train_mtp` (`mtp.py`): a Qwen3-Next-layout MTP drafter head for a frozen target, saved
  beside its weights, where `LLM(dir, spec=dict(method="mtp"))` finds it;
- `train_dflash` (`dflash.py`): a DFlash block drafter for a frozen target, saved in the
  published layout under `dflash/`, where `LLM(dir, spec=dict(method="dflash"))` finds it.

`corpus.py` selects, splits and tokenises the files; `model.py` holds the training modules (HF
parameter names); `loop.py` the shared optimisation loop (schedule, evaluation, resumption).
"""

from metrale.train.bpe import train_tokenizer
from metrale.train.corpus import CorpusSpec, default_corpus_dirs
from metrale.train.dflash import train_dflash
from metrale.train.loop import TrainOptions
from metrale.train.mtp import train_mtp
from metrale.train.target import TargetShape, train_target

__all__ = [
    "CorpusSpec",
    "TargetShape",
    "TrainOptions",
    "default_corpus_dirs",
    "train_dflash",
    "train_mtp",
    "train_target",
    "train_tokenizer",
]
