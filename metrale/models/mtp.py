"""MTP drafter heads for a dense Qwen3 target, and their loading from the target's checkpoint.

A depth module turns (token at position p+1, target hidden at position p) into the hidden that
the target's head projects to predict the token at p+2:

    u   = fc(cat(norm_e(embed(token)), norm_h(hidden)))    # [T, 2H] -> [T, H], no bias
    x   = decoder_layer(u) at position p                    # one Qwen3 layer, its own paged KV
    out = norm(x)                                           # logits = target head(out)

The embedding and the head are the target's, shared and never copied. Checkpoints store the
modules beside the target's weights in one of two layouts:

- `qwen3_next`: `mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm}` once, and one decoder
  layer per depth `mtp.layers.{i}` (the depths share the fc and norms, as the names say);
- `deepseek`: everything per depth in `model.layers.{N + i}` (N = num_hidden_layers):
  `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and the layer's own attention/MLP/norms.

The layouts also differ in what a chained step consumes (`MTPModule.chain_pre_norm`): DeepSeek
passes on the pre-norm `x`, Qwen3-Next the post-norm `out`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from metrale.config import ModelConfig
from metrale.models.attention import AttentionBackend, AttentionMetadata
from metrale.models.layers import RMSNorm, RotaryEmbedding
from metrale.models.loader import CheckpointError, checkpoint_files, load_weights
from metrale.models.qwen3 import PACKED_MODULES, Qwen3Attention, Qwen3DecoderLayer
from metrale.models.qwen3_next import Qwen3NextDecoderLayer, ZeroCentredRMSNorm

QWEN3_NEXT = "qwen3_next"
DEEPSEEK = "deepseek"
LAYOUTS = (QWEN3_NEXT, DEEPSEEK)

# The fc/norm pieces of a depth module: DeepSeek name -> MTPModule (= Qwen3-Next) name.
_DEEPSEEK_PIECES = {
    "enorm.": "pre_fc_norm_embedding.",
    "hnorm.": "pre_fc_norm_hidden.",
    "eh_proj.": "fc.",
    "shared_head.norm.": "norm.",
}
# The decoder layer's submodules, named as in an HF Qwen3 layer.
_BLOCK_PIECES = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")
# A tensor that only a DeepSeek-layout MTP block has; group 1 is the block's layer index.
_DEEPSEEK_MARKER = re.compile(r"model\.layers\.(\d+)\.(?:enorm|hnorm|eh_proj|shared_head)\.")
_QWEN3_NEXT_LAYER = re.compile(r"mtp\.layers\.(\d+)\.")


class MTPModule(nn.Module):
    """One depth module. `shared` (Qwen3-Next depths > 0) lends its fc and norms instead of
    owning new ones; the decoder layer is always the module's own."""

    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        chain_pre_norm: bool,
        shared: MTPModule | None = None,
    ) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.chain_pre_norm = chain_pre_norm
        self._backend = backend
        # A hybrid (Qwen3-Next) target's heads use its (1 + w) norms and its decoder layer.
        norm = RMSNorm if cfg.hybrid is None else ZeroCentredRMSNorm
        self.pre_fc_norm_embedding = shared.pre_fc_norm_embedding if shared else norm(h, eps)
        self.pre_fc_norm_hidden = shared.pre_fc_norm_hidden if shared else norm(h, eps)
        self.fc = shared.fc if shared else nn.Linear(2 * h, h, bias=False)
        if cfg.hybrid is None:
            self.layer: nn.Module = Qwen3DecoderLayer(cfg, rotary, backend)
            self._layer_args: tuple = ()
        else:
            self.layer = Qwen3NextDecoderLayer(cfg, 0, rotary, backend, mtp=True)
            self._layer_args = (None, None)  # no GDN rows or state: a full-attention layer
        self.norm = shared.norm if shared else norm(h, eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        embed: nn.Embedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] (tokens at p+1), positions [T] (p), hidden [T, H] (the target's, or the
        previous step's `next_hidden`) -> (logits_input [T, H] for the target head, next_hidden
        [T, H] for the next chained step)."""
        meta = self._backend.prepare(meta)
        emb = self.pre_fc_norm_embedding(embed(input_ids))  # [T, H]
        u = self.fc(torch.cat([emb, self.pre_fc_norm_hidden(hidden)], dim=-1))  # [T, 2H] -> [T, H]
        mlp_out, residual = self.layer(positions, u, None, meta, *self._layer_args)
        out, x = self.norm.forward_residual(mlp_out, residual)  # x: the layer output, pre-norm
        return out, (x if self.chain_pre_norm else out)


class MTPHeads(nn.Module):
    """The depth modules of a checkpoint (usually one). Draft step j uses `for_step(j)`."""

    packed_modules = PACKED_MODULES

    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        layout: str,
        num_layers: int,
    ) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"unknown MTP layout {layout!r}; expected one of {LAYOUTS}")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if cfg.hybrid is not None and layout != QWEN3_NEXT:
            raise ValueError(f"a Qwen3-Next target's MTP heads use the {QWEN3_NEXT!r} layout")
        self.layout = layout
        self.depths = nn.ModuleList()
        for i in range(num_layers):
            shared = self.depths[0] if layout == QWEN3_NEXT and i > 0 else None
            self.depths.append(MTPModule(cfg, rotary, backend, layout == DEEPSEEK, shared))

    @property
    def num_layers(self) -> int:
        return len(self.depths)

    @property
    def attention_layers(self) -> list[Qwen3Attention]:
        """One per depth module; the runner binds each to a KV-cache layer after the target's."""
        return [m.layer.self_attn for m in self.depths]

    def for_step(self, step: int) -> MTPModule:
        """The module of chained draft step `step` (0-based); the modules are reused cyclically."""
        return self.depths[step % len(self.depths)]


def depth_prefixes(layout: str, num_hidden_layers: int, depth: int) -> dict[str, str]:
    """Checkpoint name prefix -> name prefix inside `MTPModule`, for depth module `depth`.

    Qwen3-Next names the shared fc/norms once, so only depth 0 maps them."""
    if layout == QWEN3_NEXT:
        table = {f"mtp.layers.{depth}.": "layer."}
        if depth == 0:
            table.update({f"mtp.{dst}": dst for dst in _DEEPSEEK_PIECES.values()})
        return table
    if layout == DEEPSEEK:
        block = f"model.layers.{num_hidden_layers + depth}."
        table = {block + src: dst for src, dst in _DEEPSEEK_PIECES.items()}
        table.update({block + piece: "layer." + piece for piece in _BLOCK_PIECES})
        return table
    raise ValueError(f"unknown MTP layout {layout!r}; expected one of {LAYOUTS}")


def _tensor_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> file, from the safetensors headers only (no tensor is read)."""
    files: dict[str, Path] = {}
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                files.update(dict.fromkeys(f.keys(), path))
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from e
    return files


def _detect(names: list[str], cfg: ModelConfig, model_dir: str | Path) -> tuple[str, int] | None:
    n = cfg.num_hidden_layers
    # Layer indices of DeepSeek MTP blocks: past the target's own layers.
    marked = {int(m.group(1)) for name in names if (m := _DEEPSEEK_MARKER.match(name))}
    deepseek = {i for i in marked if i >= n}
    if any(name.startswith("mtp.") for name in names):
        if deepseek:
            raise CheckpointError(
                f"{model_dir}: holds MTP tensors of both layouts (mtp.* and model.layers.{n}+)"
            )
        layout, first = QWEN3_NEXT, 0
        found = {int(m.group(1)) for name in names if (m := _QWEN3_NEXT_LAYER.match(name))}
    elif deepseek:
        layout, first, found = DEEPSEEK, n, deepseek
    else:
        return None
    if not found or found != set(range(first, first + len(found))):
        where = "mtp.layers" if layout == QWEN3_NEXT else "model.layers"
        raise CheckpointError(
            f"{model_dir}: {layout} MTP layers must be {where}.{{{first}, {first}+1, ...}}, "
            f"found indices {sorted(found)}"
        )
    return layout, len(found)


def detect_mtp_layout(model_dir: str | Path, cfg: ModelConfig) -> tuple[str, int] | None:
    """(layout, number of depth modules) of the MTP weights in the target's checkpoint, or None
    when it holds none. Reads tensor names only."""
    return _detect(list(_tensor_files(model_dir)), cfg, model_dir)


def _check_deepseek_heads(files: dict[str, Path], cfg: ModelConfig, num_layers: int) -> None:
    """DeepSeek stores a `shared_head.head` per depth, a copy of the target head, which is used
    instead; only one of another shape (a head of its own) is an error."""
    want = (cfg.vocab_size, cfg.hidden_size)
    for i in range(num_layers):
        name = f"model.layers.{cfg.num_hidden_layers + i}.shared_head.head.weight"
        if name not in files:
            continue
        with safe_open(str(files[name]), framework="pt") as f:
            shape = tuple(f.get_slice(name).get_shape())
        if shape != want:
            raise CheckpointError(
                f"{files[name].name}: tensor {name} has shape {shape}, expected the target "
                f"head's {want} (an MTP head of its own is not supported)"
            )


def load_mtp(
    model_dir: str | Path,
    cfg: ModelConfig,
    rotary: RotaryEmbedding,
    backend: AttentionBackend,
    device: torch.device | str,
    dtype: torch.dtype,
) -> MTPHeads | None:
    """The MTP heads stored with the target in `model_dir`, built on `device` in `dtype` and
    filled; None when the checkpoint has none. `rotary` and `backend` are the target's."""
    files = _tensor_files(model_dir)
    found = _detect(list(files), cfg, model_dir)
    if found is None:
        return None
    layout, num_layers = found
    if layout == DEEPSEEK:
        _check_deepseek_heads(files, cfg, num_layers)
    with torch.device(device):
        heads = MTPHeads(cfg, rotary, backend, layout, num_layers).to(dtype)
    renames = {
        src: f"depths.{i}.{dst}"
        for i in range(num_layers)
        for src, dst in depth_prefixes(layout, cfg.num_hidden_layers, i).items()
    }
    load_weights(heads, model_dir, renames)
    return heads.eval()


def _module_tensor_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """HF-spelled (unfused) tensor names and shapes of one depth module, relative to it."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = [
        ("pre_fc_norm_embedding.weight", (h,)),
        ("pre_fc_norm_hidden.weight", (h,)),
        ("fc.weight", (h, 2 * h)),
        ("norm.weight", (h,)),
        ("layer.input_layernorm.weight", (h,)),
        ("layer.self_attn.q_proj.weight", (q, h)),
        ("layer.self_attn.k_proj.weight", (kv, h)),
        ("layer.self_attn.v_proj.weight", (kv, h)),
        ("layer.self_attn.o_proj.weight", (h, q)),
        ("layer.self_attn.q_norm.weight", (d,)),
        ("layer.self_attn.k_norm.weight", (d,)),
        ("layer.post_attention_layernorm.weight", (h,)),
        ("layer.mlp.gate_proj.weight", (inter, h)),
        ("layer.mlp.up_proj.weight", (inter, h)),
        ("layer.mlp.down_proj.weight", (h, inter)),
    ]
    if cfg.attention_bias:
        shapes += [(f"layer.self_attn.{p}_proj.bias", (s,)) for p, s in zip("qkvo", (q, kv, kv, h))]
    return shapes


def write_mtp_weights(
    model_dir: str | Path,
    cfg: dict | ModelConfig,
    layout: str,
    num_layers: int = 1,
    seed: int = 0,
    std: float = 0.02,
) -> list[str]:
    """Add random MTP weights in `layout` to the checkpoint in `model_dir`: a new file
    `mtp.safetensors`, listed in `model.safetensors.index.json` when there is one. Returns the
    tensor names written.

    `cfg` is the target's (a ModelConfig or an HF config.json dict). Matrices and biases are
    N(0, std), norm weights 1 + N(0, std) (distinct, so that swapped norms show). One seed gives
    the same underlying weights in both layouts; the DeepSeek layout also gets the
    `shared_head.head.weight` copies of the target-head shape (random: the loader ignores them).
    """
    if isinstance(cfg, dict):
        cfg = ModelConfig.from_dict(cfg)
    if cfg.hybrid is not None:
        raise ValueError(
            "write_mtp_weights writes dense Qwen3 MTP heads; a Qwen3-Next target's heads "
            "(gated attention, experts) are not written here"
        )
    model_dir = Path(model_dir)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for depth in range(num_layers):
        prefixes = depth_prefixes(layout, cfg.num_hidden_layers, depth)
        for rel, shape in _module_tensor_shapes(cfg):
            # Drawn whatever the layout keeps, so a seed means the same weights in both.
            w = torch.randn(shape, generator=gen) * std
            # every norm's weight (the pre-fc norms' names end otherwise: drawn near 0, they
            # made the head all but ignore its inputs; found in review)
            if "norm" in rel.split(".")[-2]:
                w += 1.0
            src = next((s for s, dst in prefixes.items() if rel.startswith(dst)), None)
            if src is not None:
                tensors[src + rel[len(prefixes[src]) :]] = w
    if layout == DEEPSEEK:
        for depth in range(num_layers):
            name = f"model.layers.{cfg.num_hidden_layers + depth}.shared_head.head.weight"
            tensors[name] = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * std
    save_file(tensors, str(model_dir / "mtp.safetensors"))
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update(dict.fromkeys(tensors, "mtp.safetensors"))
        index.write_text(json.dumps(data, indent=2))
    return sorted(tensors)
