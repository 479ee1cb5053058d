"""Drafter acceptance on held-out text: the report behind `metrale bench --acceptance`.

For each drafter (MTP, n-gram) one engine is built with D-Cut off and K = max(ks); each K is then
a greedy run of the same prompts with `SamplingParams(num_drafts=K)`, and its statistics are the
difference of the engine's `SpecTelemetry` counters around that run. Every run's output is checked
against one non-speculative greedy run of the same prompts (`identical_outputs`).

Per-position acceptance follows vLLM: accepted[j] / verifies, the probability that the accepted
prefix reaches draft j, so it never rises with j and 1 + its sum is the mean acceptance length.
Verifies near `max_tokens` (and n-gram lookups that find fewer tokens) draft fewer than K, so
`conditional_acceptance` (accepted[j] / drafted[j]) is reported too; it need not be monotone.
"""

from __future__ import annotations

import fnmatch
import gc
import os
import random
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from metrale.api import LLM
from metrale.bench.timing import parallel_options
from metrale.config import ModelConfig, SamplingParams
from metrale.hub import resolve_model
from metrale.models.dflash import DFlashConfig
from metrale.models.mtp import detect_mtp_layout
from metrale.telemetry import SpecTelemetry
from metrale.tokenizer import Tokenizer

DRAFTERS = ("mtp", "ngram", "dflash")
KS = (1, 2, 3, 4, 5)
EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__", ".git")
MAX_CHARS = 200_000  # of each held-out file read: bounds the tokenizer's work on huge files


def _list_files(root: Path, pattern: str) -> list[Path]:
    """Files under `root` whose relative path matches `pattern` (fnmatch: `*` crosses folders, a
    leading `**/` also matches at the top level); installed-package folders are pruned."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
        for name in files:
            rel = (Path(folder) / name).relative_to(root).as_posix()
            if fnmatch.fnmatch(rel, pattern) or (
                pattern.startswith("**/") and fnmatch.fnmatch(rel, pattern[3:])
            ):
                found.append(Path(folder) / name)
    return sorted(found)


def heldout_prompts(
    path_or_texts: str | Path | Sequence[str],
    tokenizer: Tokenizer,
    num_prompts: int = 16,
    prompt_tokens: int = 128,
    seed: int = 0,
    glob: str = "**/*.py",
    min_continuation: int = 0,
) -> list[list[int]]:
    """`num_prompts` windows of `prompt_tokens` token ids cut at seeded offsets of held-out text.

    `path_or_texts`: a directory (its files matching `glob`), one file, or a list of strings.
    Sources are visited in a seeded order, one window each (cycling when there are fewer long
    enough sources than prompts); a window leaves at least `min_continuation` tokens of the
    source after it, so what follows a prompt is real held-out text too.
    """
    if num_prompts < 1 or prompt_tokens < 1:
        raise ValueError(
            f"need num_prompts >= 1 and prompt_tokens >= 1, got {num_prompts}, {prompt_tokens}"
        )
    if isinstance(path_or_texts, (str, Path)):
        root = Path(path_or_texts)
        if root.is_dir():
            sources: list = _list_files(root, glob)
        elif root.is_file():
            sources = [root]
        else:
            raise FileNotFoundError(f"held-out text {root} does not exist")
    else:
        sources = list(path_or_texts)
    rng = random.Random(seed)
    order = list(range(len(sources)))
    rng.shuffle(order)
    need = prompt_tokens + min_continuation
    prompts: list[list[int]] = []
    usable: list[list[int]] = []
    for i in order:
        source = sources[i]
        if isinstance(source, Path):
            try:
                text = source.read_text(encoding="utf-8")[:MAX_CHARS]
            except (OSError, UnicodeDecodeError):
                continue
        else:
            text = source
        ids = tokenizer.encode(text, add_special_tokens=False) if text else []
        if len(ids) < need:
            continue
        usable.append(ids)
        start = rng.randrange(len(ids) - need + 1)
        prompts.append(ids[start : start + prompt_tokens])
        if len(prompts) == num_prompts:
            return prompts
    if not usable:
        raise ValueError(
            f"held-out text: none of {len(sources)} sources holds {need} tokens "
            f"(prompt_tokens={prompt_tokens} + min_continuation={min_continuation})"
        )
    while len(prompts) < num_prompts:
        ids = usable[len(prompts) % len(usable)]
        start = rng.randrange(len(ids) - need + 1)
        prompts.append(ids[start : start + prompt_tokens])
    return prompts


def spec_counters(tel: SpecTelemetry) -> dict:
    """A copy of the telemetry's cumulative counters (what `counter_delta` subtracts)."""
    return {
        "verifies": tel.num_drafts,
        "draft_tokens": tel.num_draft_tokens,
        "accepted_tokens": tel.num_accepted_tokens,
        "drafted_per_pos": list(tel.drafted_per_pos),
        "accepted_per_pos": list(tel.accepted_per_pos),
        "matched_per_pos": list(tel.matched_per_pos),
    }


def counter_delta(before: dict, after: dict, k: int) -> dict:
    """`after - before` for every counter; per-position lists padded or cut to `k` positions
    (the telemetry's lists only grow as deep as a verify has drafted)."""

    def pad(xs: list[int]) -> list[int]:
        return (list(xs) + [0] * k)[:k]

    out = {}
    for name, value in after.items():
        if isinstance(value, list):
            out[name] = [a - b for a, b in zip(pad(value), pad(before[name]), strict=True)]
        else:
            out[name] = value - before[name]
    return out


def acceptance_stats(delta: dict) -> dict:
    """Rates from a counter delta: acceptance by position (over verifies, and over verifies that
    drafted the position), match rate by position, and the mean acceptance length."""
    n = delta["verifies"]

    def ratio(a: int, b: int) -> float | None:
        return a / b if b else None

    return {
        "acceptance": [ratio(a, n) for a in delta["accepted_per_pos"]],
        "conditional_acceptance": [
            ratio(a, d) for a, d in zip(delta["accepted_per_pos"], delta["drafted_per_pos"])
        ],
        "match_rate": [
            ratio(m, d) for m, d in zip(delta["matched_per_pos"], delta["drafted_per_pos"])
        ],
        "mean_acceptance_length": 1 + delta["accepted_tokens"] / n if n else None,
    }


def _generate(llm: LLM, prompts, params: SamplingParams) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start


def acceptance_report(
    model_dir: str | Path,
    prompts: Sequence[list[int] | str],
    drafters: Sequence[str] = DRAFTERS,
    ks: Sequence[int] = KS,
    max_tokens: int = 64,
    device: str = "auto",
    dtype: str = "auto",
    **engine_options,
) -> dict:
    """Greedy acceptance of each drafter at each K on `prompts` (JSON-serialisable).

    `engine_options` are further `LLM` options; `max_model_len` defaults to what the longest
    prompt needs and `max_num_seqs` to the number of prompts. A drafter the model cannot serve
    (MTP without MTP weights) is listed under `skipped` with the reason.
    """
    model_dir, ks, prompts = Path(model_dir), sorted(set(ks)), list(prompts)
    if not prompts or not ks or ks[0] < 1:
        raise ValueError(f"need prompts and drafts per verify K >= 1, got ks={ks}")
    tokenizer = Tokenizer.from_dir(model_dir)
    lengths = [len(p) if isinstance(p, list) else len(tokenizer.encode(p)) for p in prompts]
    engine_options.setdefault("max_model_len", max(lengths) + max_tokens + max(ks) + 1)
    engine_options.setdefault("max_num_seqs", len(prompts))
    greedy = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    report: dict = {
        "model": str(model_dir),
        "tensor_parallel_size": engine_options.get("tensor_parallel_size", 1),
        "device": device,
        "dtype": dtype,
        "num_prompts": len(prompts),
        "prompt_lengths": lengths,
        "max_tokens": max_tokens,
        "ks": ks,
        "drafters": list(drafters),
        "results": [],
        "skipped": {},
        "identical_outputs": True,
    }
    baseline = None
    for drafter in drafters:
        if (
            drafter == "mtp"
            and detect_mtp_layout(model_dir, ModelConfig.from_hf(model_dir)) is None
        ):
            report["skipped"][drafter] = f"{model_dir} holds no MTP weights"
            continue
        drafter_ks = ks
        if drafter == "dflash":
            if not (Path(model_dir) / "dflash" / "config.json").is_file():
                report["skipped"][drafter] = f"{model_dir} has no dflash/ drafter"
                continue
            block = DFlashConfig.from_dir(Path(model_dir) / "dflash").block_size
            drafter_ks = [k for k in ks if k < block]
        spec = dict(method=drafter, num_drafts=max(drafter_ks), dcut=False)
        llm = LLM(model_dir, device=device, dtype=dtype, spec=spec, **engine_options)
        tel = None
        try:
            report["device"] = str(llm.engine.runner.device)
            report["dtype"] = str(llm.engine.runner.dtype).removeprefix("torch.")
            if baseline is None:
                plain = SamplingParams(speculative=False, **greedy)
                baseline, seconds = _generate(llm, prompts, plain)
                report["baseline_seconds"] = seconds
            tel = llm.engine.telemetry
            for k in drafter_ks:
                before = spec_counters(tel.spec), tel.steps, tel.decode_tokens
                outputs, seconds = _generate(llm, prompts, SamplingParams(num_drafts=k, **greedy))
                delta = counter_delta(before[0], spec_counters(tel.spec), k)
                steps, tokens = tel.steps - before[1], tel.decode_tokens - before[2]
                mismatched = sum(a != b for a, b in zip(outputs, baseline, strict=True))
                report["identical_outputs"] &= mismatched == 0
                report["results"].append(
                    {
                        "drafter": drafter,
                        "k": k,
                        **delta,
                        **acceptance_stats(delta),
                        "target_steps": steps,
                        "tokens": tokens,
                        # output tokens per target forward, the whole batch together
                        "tokens_per_step": tokens / steps if steps else None,
                        "identical_outputs": mismatched == 0,
                        "mismatched_prompts": mismatched,
                        "seconds": seconds,
                    }
                )
        finally:
            # (a tensor-parallel engine's workers: the next drafter's engine may start)
            llm.shutdown()
        del llm, tel
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return report


def format_report(report: dict) -> str:
    """A table: one row per drafter and K, acceptance by position and mean acceptance length."""
    ks = report["ks"]
    lo, hi = min(report["prompt_lengths"]), max(report["prompt_lengths"])
    lines = [
        f"acceptance on {report['num_prompts']} held-out prompts of "
        f"{lo if lo == hi else f'{lo}-{hi}'} tokens, {report['max_tokens']} greedy tokens each; "
        f"{report['model']} on {report['device']} ({report['dtype']})",
        f"{'drafter':8s} {'K':>2s}  "
        + " ".join(f"{f'p{j}':>5s}" for j in range(1, max(ks) + 1))
        + f"  {'mean_len':>8s} {'tok/step':>8s} {'verifies':>8s} {'drafts':>7s}  same",
    ]

    def num(x: float | None, width: int) -> str:
        return f"{'-':>{width}s}" if x is None else f"{x:{width}.3f}"

    for row in report["results"]:
        cells = [num(a, 5) for a in row["acceptance"]] + [" " * 5] * (max(ks) - row["k"])
        same = "yes" if row["identical_outputs"] else f"NO ({row['mismatched_prompts']})"
        lines.append(
            f"{row['drafter']:8s} {row['k']:2d}  {' '.join(cells)}  "
            f"{num(row['mean_acceptance_length'], 8)} {num(row['tokens_per_step'], 8)} "
            f"{row['verifies']:8d} {row['draft_tokens']:7d}  {same}"
        )
    for drafter, reason in report["skipped"].items():
        lines.append(f"{drafter:8s} skipped: {reason}")
    lines.append(f"outputs identical to non-speculative greedy: {report['identical_outputs']}")
    return "\n".join(lines)


def _int_list(value, default: Sequence[int]) -> list[int]:
    if value is None:
        return list(default)
    if isinstance(value, str):
        return [int(v) for v in value.split(",") if v.strip()]
    return [int(v) for v in value]


def run_acceptance(args) -> dict:
    """`metrale bench --acceptance`: the report for an argparse-like namespace.

    Fields (a missing one takes the default shown):
      model: checkpoint directory; None = the embedded default model.
      heldout: a directory (its `**/*.py` files), a file, or None = the running Python's stdlib
        `.py` files (`sysconfig.get_paths()["stdlib"]`, installed packages excluded).
      num_prompts (16), prompt_tokens (128): how many windows of how many tokens.
      max_tokens (64): greedy tokens generated per prompt and run.
      device ("auto"), dtype ("auto"): as `LLM`'s options.
      ks ((1, 2, 3, 4, 5)): drafts per verify to measure; ints or "1,2,3".
      drafters (("mtp", "ngram", "dflash")): names or "mtp,ngram"; a drafter the checkpoint
        lacks (MTP weights, a dflash/ folder) is skipped, saying why.
      seed (0), glob ("**/*.py"): pick the held-out windows and files.
    """
    model = getattr(args, "model", None)
    if model is None:
        from metrale.default_model import default_model_dir

        model = default_model_dir()
    model = resolve_model(model)  # (a Hub id too: its snapshot in the local HF cache)
    heldout = getattr(args, "heldout", None) or sysconfig.get_paths()["stdlib"]
    drafters = getattr(args, "drafters", None) or DRAFTERS
    if isinstance(drafters, str):
        drafters = [d.strip() for d in drafters.split(",") if d.strip()]
    prompts = heldout_prompts(
        heldout,
        Tokenizer.from_dir(model),
        num_prompts=_given(args, "num_prompts", 16),
        prompt_tokens=_given(args, "prompt_tokens", 128),
        seed=getattr(args, "seed", None) or 0,
        glob=getattr(args, "glob", None) or "**/*.py",
    )
    report = acceptance_report(
        model,
        prompts,
        drafters=drafters,
        ks=_int_list(getattr(args, "ks", None), KS),
        max_tokens=getattr(args, "max_tokens", None) or 64,
        device=getattr(args, "device", None) or "auto",
        dtype=getattr(args, "dtype", None) or "auto",
        **parallel_options(args),
    )
    report["heldout"], report["seed"] = str(heldout), getattr(args, "seed", None) or 0
    return report


def _given(args, name: str, default: int) -> int:
    """`args.name` where it was given (0 included: `heldout_prompts` refuses it by name, where
    `or default` ran 16 prompts instead, found in review), else `default`."""
    value = getattr(args, name, None)
    return default if value is None else value
