"""The `metrale train tokenizer | target | mtp | dflash` sub-commands: their flags and their runner.

Kept beside the training code so that `metrale/cli.py` stays about serving; importing this module
loads no training code (the stages are imported when one runs).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import fields


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    # an argparse type, so that a bad list is a usage error naming the flag (exit 2)
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values:
        raise argparse.ArgumentTypeError(f"expected integers like 1,3,5, got {text!r}")
    return values


def _finite_float(text: str) -> float:
    # inf or nan (which float() accepts) would train NaN weights and still report success
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _add_corpus_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--corpus",
        action="append",
        default=None,
        metavar="DIR",
        help="directory of text files (repeatable; default: this Python's site-packages)",
    )
    p.add_argument("--glob", default="**/*.py", help="files of the corpus, relative to each DIR")
    p.add_argument(
        "--max-bytes",
        type=int,
        default=100_000_000,
        help="corpus size cap, files sampled by a stable hash (0 = no cap)",
    )
    p.add_argument(
        "--max-file-bytes", type=int, default=1_000_000, help="skip larger files (0 = no limit)"
    )
    p.add_argument(
        "--heldout-fraction",
        type=_finite_float,
        default=0.02,
        help="share of files held out for evaluation, chosen by a stable hash of the path",
    )


def _add_optim_args(p: argparse.ArgumentParser, steps: int, lr: float) -> None:
    p.add_argument("--steps", type=_positive_int, default=steps, help="optimizer steps")
    p.add_argument("--batch-size", type=_positive_int, default=16, help="windows per step")
    p.add_argument("--seq-len", type=_positive_int, default=512, help="tokens per window")
    p.add_argument("--lr", type=_finite_float, default=lr, help="peak learning rate (AdamW)")
    p.add_argument(
        "--min-lr-ratio", type=_finite_float, default=0.1, help="cosine floor, as lr * ratio"
    )
    p.add_argument("--warmup-steps", type=int, default=100, help="linear warmup steps")
    p.add_argument(
        "--weight-decay", type=_finite_float, default=0.1, help="AdamW decay of matrices"
    )
    p.add_argument("--beta1", type=_finite_float, default=0.9, help="AdamW beta1")
    p.add_argument("--beta2", type=_finite_float, default=0.95, help="AdamW beta2")
    p.add_argument(
        "--grad-clip", type=_finite_float, default=1.0, help="max gradient norm (0 = off)"
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the init and the data windows")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda:1 ...")
    p.add_argument("--compile", action="store_true", help="torch.compile the training step")
    p.add_argument(
        "--eval-every", type=int, default=200, help="held-out eval interval (0 = at the end only)"
    )
    p.add_argument("--eval-batches", type=_positive_int, default=8, help="held-out batches")
    p.add_argument(
        "--save-every", type=int, default=200, help="resume-state interval in steps (0 = never)"
    )
    p.add_argument("--resume", action="store_true", help="continue from the saved state")
    p.add_argument(
        "--stop-at", type=_positive_int, default=None, help="stop after this step (state saved)"
    )
    p.add_argument(
        "--time-limit",
        type=_finite_float,
        default=None,
        help="stop after this many seconds (state saved)",
    )
    p.add_argument(
        "--max-seconds",
        type=_finite_float,
        default=None,
        help="end the run here as if its steps were done (checkpoint written)",
    )
    p.add_argument(
        "--keep-state", action="store_true", help="keep the resume state after completing"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def add_train_parsers(sub) -> None:
    train = sub.add_parser("train", help="train a tokenizer, a target model or an MTP head")
    stages = train.add_subparsers(dest="stage", required=True)
    tok = stages.add_parser("tokenizer", help="byte-level BPE with the ChatML special tokens")
    _add_corpus_args(tok)
    tok.add_argument("--out", required=True, help="directory for tokenizer.json and its config")
    tok.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size at most")
    tok.add_argument("--min-frequency", type=int, default=2, help="rarest pair merged")
    tok.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    tgt = stages.add_parser("target", help="a Qwen3-architecture model from scratch")
    tgt.add_argument("--tokenizer", required=True, help="directory with tokenizer.json")
    tgt.add_argument("--out", required=True, help="checkpoint directory to write")
    _add_corpus_args(tgt)
    tgt.add_argument("--hidden-size", type=_positive_int, default=512, help="model width")
    tgt.add_argument("--num-layers", type=_positive_int, default=8, help="decoder layers")
    tgt.add_argument("--num-heads", type=_positive_int, default=8, help="query heads")
    tgt.add_argument("--num-kv-heads", type=_positive_int, default=4, help="key/value heads")
    tgt.add_argument("--head-dim", type=_positive_int, default=64, help="per-head width")
    tgt.add_argument("--intermediate-size", type=_positive_int, default=1536, help="MLP width")
    tgt.add_argument(
        "--untie-embeddings", action="store_true", help="own lm_head (default: tied to input)"
    )
    tgt.add_argument("--rope-theta", type=_finite_float, default=1_000_000.0, help="rotary base")
    tgt.add_argument(
        "--max-position-embeddings",
        type=_positive_int,
        default=None,
        help="context the config declares (default: --seq-len)",
    )
    tgt.add_argument(
        "--vocab-multiple", type=_positive_int, default=64, help="pad the vocabulary to this"
    )
    _add_optim_args(tgt, steps=2000, lr=1e-3)
    mtp = stages.add_parser("mtp", help="an MTP drafter head for a frozen target")
    mtp.add_argument("--target", required=True, help="target checkpoint directory")
    mtp.add_argument(
        "--out", default=None, help="write here (a copy of the target); default: the target"
    )
    _add_corpus_args(mtp)
    mtp.add_argument("--depths", type=_positive_int, default=3, help="chained depths trained (K)")
    mtp.add_argument(
        "--depth-decay",
        type=_finite_float,
        default=0.8,
        help="loss weight of depth d: decay**(d-1)",
    )
    mtp.add_argument(
        "--num-mtp-layers", type=_positive_int, default=1, help="MTP decoder layers (cycled)"
    )
    _add_optim_args(mtp, steps=1000, lr=1e-3)
    dfl = stages.add_parser("dflash", help="a DFlash block drafter for a frozen target")
    dfl.add_argument("--target", required=True, help="target checkpoint directory")
    dfl.add_argument(
        "--out", default=None, help="write <OUT>/dflash instead of <TARGET>/dflash (the default)"
    )
    _add_corpus_args(dfl)
    dfl.add_argument("--block-size", type=_positive_int, default=8, help="block (drafts + 1)")
    dfl.add_argument("--num-draft-layers", type=_positive_int, default=1, help="draft layers")
    dfl.add_argument(
        "--num-taps",
        type=_positive_int,
        default=None,
        help="target layers read, evenly spaced (default: 3, or every layer of a shallower target)",
    )
    dfl.add_argument(
        "--target-layers",
        type=_int_list,
        default=None,
        help="target layers read, e.g. 1,3,5 (default: --num-taps evenly spaced)",
    )
    dfl.add_argument(
        "--gamma",
        type=_finite_float,
        default=4.0,
        help="loss decay over block rows: exp(-(j-1)/gamma)",
    )
    dfl.add_argument(
        "--anchor-stride", type=_positive_int, default=16, help="one block every this many tokens"
    )
    dfl.add_argument(
        "--teacher",
        choices=("target", "greedy", "data"),  # train.dflash.TEACHERS (not imported here)
        default="data",
        help="what block rows learn: the corpus token, or the target's next-token distribution "
        "or its greedy pick (self-distillation)",
    )
    dfl.add_argument(
        "--init",
        default=None,
        help="start from this DFlash checkpoint's weights (same shape) instead of random ones",
    )
    _add_optim_args(dfl, steps=1000, lr=1e-3)


def cmd_train(args: argparse.Namespace) -> int:
    from metrale import train

    corpus = train.CorpusSpec(
        dirs=tuple(args.corpus or ()),
        glob=args.glob,
        max_bytes=args.max_bytes or None,
        max_file_bytes=args.max_file_bytes or None,
        heldout_fraction=args.heldout_fraction,
    )
    if args.stage == "tokenizer":
        summary = train.train_tokenizer(
            corpus, args.out, args.vocab_size, args.min_frequency, progress=not args.quiet
        )
    else:
        names = {f.name for f in fields(train.TrainOptions)} - {"progress"}
        opts = train.TrainOptions(**{n: getattr(args, n) for n in names}, progress=not args.quiet)
        if args.stage == "target":
            shape = train.TargetShape(
                hidden_size=args.hidden_size,
                num_layers=args.num_layers,
                num_heads=args.num_heads,
                num_kv_heads=args.num_kv_heads,
                head_dim=args.head_dim,
                intermediate_size=args.intermediate_size,
                tie_embeddings=not args.untie_embeddings,
                rope_theta=args.rope_theta,
                max_position_embeddings=args.max_position_embeddings,
                vocab_multiple=args.vocab_multiple,
            )
            summary = train.train_target(args.tokenizer, args.out, corpus, shape, opts)
        elif args.stage == "dflash":
            summary = train.train_dflash(
                args.target,
                corpus,
                opts,
                block_size=args.block_size,
                num_layers=args.num_draft_layers,
                num_taps=args.num_taps,
                target_layers=args.target_layers,
                gamma=args.gamma,
                anchor_stride=args.anchor_stride,
                out_dir=args.out,
                teacher=args.teacher,
                init=args.init,
            )
        else:
            summary = train.train_mtp(
                args.target,
                corpus,
                opts,
                depths=args.depths,
                depth_decay=args.depth_decay,
                num_layers=args.num_mtp_layers,
                out_dir=args.out,
            )
    print(json.dumps(summary))
    return 0
