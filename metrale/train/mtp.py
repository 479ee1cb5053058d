"""The MTP stage: train a Qwen3-Next-layout MTP head for a frozen target, chained K deep.

The math is the engine's (`metrale/models/mtp.py`, `metrale/spec/mtp.py`), unrolled over a
window x[0..L-1] with every position p as a start ("training-time test"):

- h^0[p] is the target's FINAL-NORMED hidden at p (what `Qwen3Model.forward` returns);
- depth 1 at p consumes (token x[p+1], h^0[p]) at rotary position p; its post-norm output
  h^1[p], projected by the target's head, predicts x[p+2] (the drafter's catch-up row at p and
  its first draft);
- depth d consumes (ground-truth x[p+d], h^{d-1}[p], the previous depth's own post-norm output,
  `next_hidden` in the qwen3_next layout) at rotary position p+d-1 and predicts x[p+d+1] (the
  drafter's chained step d-1, fed its own previous draft, which is x[p+d] whenever the chain so
  far was accepted); module `(d-1) % num_layers` serves it, as `MTPHeads.for_step(d-1)` does.

The loss is the weighted mean over depths of the cross-entropy against the ground truth, weights
`depth_decay ** (d-1)` normalised to sum 1. The target's embedding and head are shared and stay
frozen (no grad, eval mode); only the MTP parameters train.

Simplification versus inference: within a depth, the MTP decoder layer attends causally over
that depth's own rows (depth d at p sees depth d's rows at p' <= p). At inference the MTP KV of
the earlier positions comes from catch-up rows (depth-1 inputs: the target's hidden) and, for
accepted drafts, from the chain's own rows, so a chained row attends to a mix. The within-depth
rows share one rotary offset, so their relative positions (all attention sees) are those of
depth 1.

The weights are saved as `mtp.safetensors` beside the target's (listed in
`model.safetensors.index.json` when the checkpoint has one), under exactly the names and shapes
`metrale.models.mtp` loads.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from metrale.config import ModelConfig
from metrale.models.loader import checkpoint_files, like_written
from metrale.models.mtp import QWEN3_NEXT, _module_tensor_shapes, depth_prefixes
from metrale.train.bpe import load_tokenizer
from metrale.train.corpus import CorpusSpec, tokenize_corpus
from metrale.train.loop import TrainOptions, resolve_device, run_training
from metrale.train.model import CausalLM, MTPHead, dense_target_config
from metrale.train.state import refuse_finished_resume
from metrale.train.target import check_no_stale_drafters, drop_earlier_weights

MTP_FILE = "mtp.safetensors"
# The target stage's own files keep their names; the MTP stage's sit beside them.
STATE_FILE = "mtp_train_state.pt"
SUMMARY_FILE = "mtp_train_summary.json"
_DEEPSEEK_BLOCK = re.compile(r"model\.layers\.(\d+)\.")


def depth_weights(depths: int, decay: float) -> list[float]:
    """Loss weight of each depth 1..depths: decay**(d-1), normalised to sum to 1."""
    raw = [decay**d for d in range(depths)]
    return [w / sum(raw) for w in raw]


def expected_tensors(cfg: ModelConfig, num_layers: int) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of a Qwen3-Next MTP head, derived from the engine's loader
    tables (`_module_tensor_shapes`, `depth_prefixes`), so the two cannot drift apart."""
    out = {}
    for depth in range(num_layers):
        prefixes = depth_prefixes(QWEN3_NEXT, cfg.num_hidden_layers, depth)
        for rel, shape in _module_tensor_shapes(cfg):
            src = next((s for s, dst in prefixes.items() if rel.startswith(dst)), None)
            if src is not None:
                out[src + rel[len(prefixes[src]) :]] = shape
    return out


def mtp_checkpoint_tensors(head: MTPHead, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's weights under checkpoint names, checked against `expected_tensors`."""
    tensors = {
        "mtp." + name: t.detach().to("cpu", dtype).contiguous()
        for name, t in head.state_dict().items()
    }
    want = expected_tensors(head.config, len(head.layers))
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if got != want:
        raise RuntimeError(f"MTP tensors differ from the engine's layout: {got} != {want}")
    return tensors


def _check_no_other_mtp(model_dir: Path, cfg: ModelConfig) -> None:
    """Refuse a checkpoint that already holds MTP weights outside mtp.safetensors: the engine
    would then find two heads (or two layouts)."""
    for path in checkpoint_files(model_dir):
        if path.name == MTP_FILE:
            continue
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                block = _DEEPSEEK_BLOCK.match(name)
                if name.startswith("mtp.") or (block and int(block[1]) >= cfg.num_hidden_layers):
                    raise ValueError(
                        f"{path}: already holds MTP weights ({name}); train on a checkpoint "
                        "without them"
                    )


def weights_hash(model_dir: Path) -> str:
    """A digest of the target's weight files, so a resumed run cannot silently switch targets."""
    digest = hashlib.sha256()
    for path in checkpoint_files(model_dir):
        if path.name != MTP_FILE:
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    digest.update(chunk)
    return digest.hexdigest()[:16]


def save_mtp(model_dir: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write `mtp.safetensors` and, when the checkpoint is indexed, point the index at it
    (dropping entries of an earlier mtp.safetensors, which may have had other layers)."""
    model_dir = Path(model_dir)
    save_file(tensors, str(model_dir / MTP_FILE), metadata={"format": "pt"})
    like_written(model_dir / MTP_FILE)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        weight_map = {k: v for k, v in data["weight_map"].items() if v != MTP_FILE}
        weight_map.update(dict.fromkeys(tensors, MTP_FILE))
        data["weight_map"] = dict(sorted(weight_map.items()))
        index.write_text(json.dumps(data, indent=2) + "\n")


def _copy_target(src: Path, dst: Path) -> None:
    """The target checkpoint into the output directory (weights, configs, tokenizer). An earlier
    checkpoint's weights there go first (an index and its shards the copy would not replace:
    the engine follows the index, so it loaded the old weights beside the new config; found in
    review), as transformers' save_pretrained drops them; a DFlash drafter there, trained for
    another target, is refused, as `train target` refuses it (this stage writes the MTP head
    itself)."""
    check_no_stale_drafters(dst, ("dflash",))
    dst.mkdir(parents=True, exist_ok=True)
    drop_earlier_weights(dst)
    for path in sorted(src.iterdir()):
        if path.is_file() and path.suffix in (".json", ".safetensors", ".jinja", ".txt", ".model"):
            if path.name in (SUMMARY_FILE, MTP_FILE):
                continue
            shutil.copyfile(path, dst / path.name)
    # The source's MTP head is not copied: an index naming its file made the copy unloadable
    # until this stage wrote its own (a run stopped or failed first left it so; review).
    index = dst / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if v != MTP_FILE}
        index.write_text(json.dumps(data, indent=2) + "\n")


def train_mtp(
    target_dir: str | Path,
    corpus: CorpusSpec,
    opts: TrainOptions,
    depths: int = 3,
    depth_decay: float = 0.8,
    num_layers: int = 1,
    out_dir: str | Path | None = None,
) -> dict:
    """The MTP stage. `out_dir` None writes into `target_dir`; otherwise the target is copied
    there first. Returns the summary (also `mtp_train_summary.json` once complete)."""
    start = time.perf_counter()
    target_dir = Path(target_dir)
    if not (target_dir / "config.json").is_file():
        raise FileNotFoundError(f"{target_dir}: no config.json (run `metrale train target`)")
    if depths < 1:
        raise ValueError(f"depths must be >= 1, got {depths}")
    if depths + 1 > opts.seq_len:
        raise ValueError(f"depths {depths} needs seq_len >= {depths + 1}, got {opts.seq_len}")
    if not 0 < depth_decay < math.inf:  # inf would weigh the depths as NaN
        raise ValueError(f"depth_decay must be > 0, got {depth_decay}")
    try:  # (a finite decay's powers may not be: an OverflowError traceback, found in review)
        sane = math.isclose(math.fsum(depth_weights(depths, depth_decay)), 1.0)
    except (OverflowError, ZeroDivisionError):
        sane = False
    if not sane:
        raise ValueError(f"depth_decay {depth_decay} over {depths} depths: its powers overflow")
    cfg = dense_target_config(target_dir, "mtp")
    if opts.seq_len > cfg.max_position_embeddings:
        raise ValueError(
            f"seq_len {opts.seq_len} exceeds the target's max_position_embeddings "
            f"{cfg.max_position_embeddings}"
        )
    _check_no_other_mtp(target_dir, cfg)
    out = Path(out_dir) if out_dir is not None else target_dir
    if opts.resume:  # before the copy: refused after it, the finished head lost its index
        refuse_finished_resume(out, STATE_FILE, "mtp")
    # the corpus and the device before the copy: a bad one is refused with nothing written
    tok = load_tokenizer(target_dir)
    data = tokenize_corpus(corpus, tok, opts.seq_len)
    device = resolve_device(opts.device)
    if out.resolve() != target_dir.resolve():
        _copy_target(target_dir, out)
    target = CausalLM.from_checkpoint(target_dir, max_positions=opts.seq_len)
    target.requires_grad_(False).eval().to(device)
    head = MTPHead(cfg, num_layers)
    head.init_weights(torch.Generator().manual_seed(opts.seed))
    weights = depth_weights(depths, depth_decay)
    embed = target.model.embed_tokens

    def loss_fn(batch: torch.Tensor):
        length = batch.shape[1]  # L = seq_len + 1
        with torch.no_grad():
            # h^0 [B, L-1, H], final-normed: the last position starts no row, so the target
            # never sees a position past seq_len - 1.
            hidden = target(batch[:, :-1])
            # The target's greedy token after each position: what a draft must equal.
            greedy = None if head.training else target.logits(hidden).argmax(-1)
        total, metrics = 0.0, {}
        for d in range(1, depths + 1):
            n = length - d - 1  # starts p = 0..n-1 have a label x[p+d+1]
            positions = torch.arange(d - 1, d - 1 + n, device=batch.device)
            out = head(d - 1, batch[:, d : d + n], hidden[:, :n], positions, embed, target.rotary)
            logits = target.logits(out)  # [B, n, V]
            labels = batch[:, d + 1 : d + 1 + n]
            ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            total = total + weights[d - 1] * ce
            metrics[f"loss_d{d}"] = ce.detach()
            if greedy is not None:
                pred = logits.argmax(-1)
                metrics[f"accuracy_d{d}"] = (pred == labels).float().mean()
                # teacher-forced acceptance: the target predicts x[p+d+1] at position p+d
                metrics[f"agree_d{d}"] = (pred == greedy[:, d : d + n]).float().mean()
            hidden = out  # qwen3_next chains the post-norm output
        return total, metrics

    fingerprint = {
        "stage": "mtp",
        "target_config": json.loads((target_dir / "config.json").read_text()),
        "target_weights_sha256": weights_hash(target_dir),
        "corpus": data.identity(corpus),
        "depths": depths,
        "depth_decay": depth_decay,
        "num_layers": num_layers,
    }
    result = run_training(
        head,
        loss_fn,
        data,
        opts,
        out,
        STATE_FILE,
        fingerprint,
        "mtp",
        on_complete=lambda: save_mtp(out, mtp_checkpoint_tensors(head, cfg.dtype)),
    )
    summary = {
        "stage": "mtp",
        **result,
        "parameters": sum(p.numel() for p in head.parameters()),
        "depths": depths,
        "depth_weights": [round(w, 6) for w in weights],
        "num_layers": num_layers,
        "target": str(target_dir),
        "corpus": data.stats,
        "session_time_s": round(time.perf_counter() - start, 3),
    }
    if result["completed"]:
        (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary
