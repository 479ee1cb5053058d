"""DFlash block drafter (Chen, Liang, Liu, arXiv 2602.06036): a few Qwen3 decoder layers with no
embedding or head of their own, conditioned on the target's hidden states, that propose a whole
block of tokens in one forward.

    c_t   = hidden_norm(fc(cat(h_t^(l) for l in target_layer_ids)))   # context feature, [H]
    K, V  = k_norm(k_proj([c_ctx ; x_blk])), v_proj([c_ctx ; x_blk])   # in every draft layer
    Q     = q_norm(q_proj(x_blk))                                     # the block only
    x_blk = embed([last token, MASK x (B - 1)]) at positions start .. start + B - 1

Every block query attends to all context and the whole block (non-causal); block rows 1 .. B-1
projected by the target's head give B - 1 drafts. `h^(l)` is the target's residual stream after
layer l (HF `hidden_states[l + 1]`). Only the context K/V persist (the drafter keeps them in its
own paged KV layers, `speculative/dflash.py`); the block's are dropped after each draft.

Checkpoints use the published layout (z-lab `dflash`, SpecForge): an HF Qwen3 `config.json` with a
`dflash_config` object (`target_layer_ids`, `block_size`, `mask_token_id`; the same keys at the
top level are read too), and tensors `fc`, `hidden_norm`, `norm` and `layers.{i}.*` named as in an
HF Qwen3 decoder layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from metrale.kernels import fused
from metrale.kernels.dispatch import interpreter_forced
from metrale.model_config import RopeConfig, _rope_from_hf, checked_layer_fields, positive_int
from metrale.models.activations import silu
from metrale.models.attention import write_kv
from metrale.models.layers import RMSNorm, RotaryEmbedding
from metrale.models.loader import CheckpointError, load_weights


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    attention_bias: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def pool_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        """The context K/V pool: (layer, K and V, page, row, KV head, head dim)."""
        return (self.num_layers, 2, num_pages, page_size, self.num_kv_heads, self.head_dim)

    def page_bytes(self, page_size: int, dtype: torch.dtype) -> int:
        """Bytes of one page of context K/V across the draft layers."""
        per_row = 2 * self.num_kv_heads * self.head_dim * torch.finfo(dtype).bits // 8
        return per_row * page_size * self.num_layers

    @classmethod
    def from_dir(cls, path: str | Path) -> DFlashConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"DFlash drafter: {file} does not exist")
        raw = json.loads(file.read_text())
        extra = raw.get("dflash_config") or {}

        def value(name, default=None):
            return extra.get(name, raw.get(name, default))

        missing = [n for n in ("target_layer_ids", "mask_token_id") if value(n) is None]
        if missing:
            raise ValueError(f"DFlash drafter {file}: dflash_config lacks {', '.join(missing)}")
        # the target's checks (0 layers loaded, then failed every request; review)
        source = f"DFlash drafter {file}"
        sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        for name in (*sizes, "num_key_value_heads", "head_dim"):
            if name in sizes or raw.get(name) is not None:
                positive_int(source, name, raw.get(name))
        eps = checked_layer_fields(raw, source)
        heads = raw["num_attention_heads"]
        softcap = value("final_logit_softcapping")
        return cls(
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            intermediate_size=raw["intermediate_size"],
            rms_norm_eps=eps,
            rope=_rope_from_hf(raw),
            block_size=int(value("block_size", 16)),
            mask_token_id=int(value("mask_token_id")),
            target_layer_ids=tuple(int(i) for i in value("target_layer_ids")),
            attention_bias=bool(raw.get("attention_bias", False)),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=None if not softcap else float(softcap),
        )


class DFlashLayer(nn.Module):
    """One draft layer; submodule names are an HF Qwen3 decoder layer's (the checkpoint's)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.cfg = cfg
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        attn = nn.Module()
        attn.q_proj = nn.Linear(h, cfg.num_heads * d, bias=bias)
        attn.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=bias)
        attn.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=bias)
        attn.o_proj = nn.Linear(cfg.num_heads * d, h, bias=bias)
        attn.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        attn.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.self_attn = attn
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        mlp.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        mlp.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.mlp = mlp
        # (weight, bias) of q|k|v and of gate|up, whose slices the projections' weights are
        # (`fuse`, at load); None: the torch path (a drafter being trained)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def fuse(self) -> None:
        """Serve q, k, v and gate, up from one weight each (the projections' weights become
        views of it), so that the fused path runs one GEMM for each."""
        a, m = self.self_attn, self.mlp
        self.qkv = _packed(a.q_proj, a.k_proj, a.v_proj)
        self.gate_up = _packed(m.gate_proj, m.up_proj)

    def fused(self, x: torch.Tensor) -> bool:
        """Whether the fused kernels serve activation `x` (CUDA, or forced under Triton's
        interpreter): the q/k norms, rotary and KV write in one launch, gate|up and SiLU-mul
        in two. The draft forward and the context write are a few hundred launches otherwise,
        which on the H200 made a draft cost more than the small target's whole step."""
        return (
            self.qkv is not None
            and self.cfg.head_dim & (self.cfg.head_dim - 1) == 0
            and (fused.fused_enabled(x) or interpreter_forced(x))
        )

    def write_context(self, c, positions, slots, kv_cache: torch.Tensor, rotary) -> None:
        """Context features `c` [n, H] at `positions` [n]: their K (normed, rotated) and V
        written into `kv_cache` [2, pages, page_size, Hkv, D] at flat `slots` [n]."""
        a, d = self.self_attn, self.cfg.head_dim
        if not self.fused(c):
            k, v = self.kv(c, positions, rotary)
            write_kv(kv_cache, k, v, slots)
            return
        weight, bias = self.qkv
        q_rows = self.cfg.num_heads * d
        kv = F.linear(c, weight[q_rows:], None if bias is None else bias[q_rows:])
        w = a.k_norm.weight
        eps = a.k_norm.eps
        args = (rotary.cos, rotary.sin, positions, 0, self.cfg.num_kv_heads, eps, kv_cache, slots)
        fused.qk_norm_rope(kv, w, w, *args)

    def kv(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding):
        """x [..., H] (normed input or context features), positions [...] -> K, V [..., Hkv, D]
        (K normed and rotated)."""
        a, d = self.self_attn, self.cfg.head_dim
        k = a.k_norm(a.k_proj(x).unflatten(-1, (-1, d)))
        v = a.v_proj(x).unflatten(-1, (-1, d))
        flat = k.reshape(-1, *k.shape[-2:])
        _, k = rotary(positions.reshape(-1), flat[:, :1], flat)
        return k.view_as(v), v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        ctx_valid: torch.Tensor,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        """x [S, B, H] block hidden, positions [S, B]; ctx_k/v [S, L, Hkv, D] with ctx_valid
        [S, L] marking each sequence's real context -> [S, B, H]."""
        a, d = self.self_attn, self.cfg.head_dim
        s, b, _ = x.shape
        xn = self.input_layernorm(x)
        hq, hkv = self.cfg.num_heads, self.cfg.num_kv_heads
        if self.fused(x):
            qkv = F.linear(xn.reshape(s * b, -1), *self.qkv)
            w = (a.q_norm.weight, a.k_norm.weight, rotary.cos, rotary.sin, positions.reshape(-1))
            q, k_blk = fused.qk_norm_rope(qkv, *w, hq, hkv, a.q_norm.eps)
            k_blk = k_blk.view(s, b, hkv, d)
            v_blk = qkv[:, (hq + hkv) * d :].view(s, b, hkv, d)
        else:
            q = a.q_norm(a.q_proj(xn).view(s * b, -1, d))
            k_blk, v_blk = self.kv(xn, positions, rotary)
            q, _ = rotary(positions.reshape(-1), q, q[:, :1])
        keys = torch.cat([ctx_k.to(x.dtype), k_blk], dim=1).transpose(1, 2)  # [S, Hkv, L+B, D]
        values = torch.cat([ctx_v.to(x.dtype), v_blk], dim=1).transpose(1, 2)
        visible = torch.cat([ctx_valid, ctx_valid.new_ones(s, b)], dim=1)[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q.view(s, b, -1, d).transpose(1, 2), keys, values, visible, enable_gqa=True
        )  # non-causal: every block row sees the whole block
        x = x + a.o_proj(out.transpose(1, 2).reshape(s, b, -1))
        m = self.mlp
        h = self.post_attention_layernorm(x)
        if self.fused(h):
            return x + m.down_proj(fused.silu_mul(F.linear(h, *self.gate_up)))
        return x + m.down_proj(silu(m.gate_proj(h)) * m.up_proj(h))


def _packed(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One (weight, bias) stacking the linears' outputs, whose own weights (and biases) become
    views of it (no second copy)."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DFlashConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # past the model length by a block: the last block reaches that far
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions + cfg.block_size)

    def context_kv(
        self, taps: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """taps [n, |S| * H] (the target's tapped hidden states of n committed rows) at
        positions [n] -> per layer (K, V) [n, Hkv, D]: what the drafter's context cache holds."""
        c = self.context_features(taps)
        return [layer.kv(c, positions, self.rotary) for layer in self.layers]

    def context_features(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [n, |S| * H] -> the context features c [n, H] its layers project to K/V."""
        return self.hidden_norm(self.fc(taps))

    def write_context(
        self, kv: torch.Tensor, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """The context K/V of rows `taps` at `positions`, written into `kv` [layers, 2, pages,
        page_size, Hkv, D] at flat `slots` [n] (what `context_kv` computes)."""
        c = self.context_features(taps)
        for i, layer in enumerate(self.layers):
            layer.write_context(c, positions, slots, kv[i], self.rotary)

    def forward(self, block, positions, ctx_k, ctx_v, ctx_valid) -> torch.Tensor:
        """block [S, B, H] embedded block, positions [S, B]; ctx_k/ctx_v per layer [S, L, Hkv, D],
        ctx_valid [S, L] -> final-normed hidden [S, B, H]."""
        x = block
        for layer, k, v in zip(self.layers, ctx_k, ctx_v, strict=True):
            x = layer(x, positions, k, v, ctx_valid, self.rotary)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, target) -> torch.Tensor:
        """The target's head over draft hidden states, with the checkpoint's output scaling."""
        logits = target.compute_logits(hidden)
        cfg = self.config
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits


def save_dflash(model: DFlashDraftModel, path: str | Path, target_config: dict) -> Path:
    """Write `model` in the published layout (HF Qwen3 `config.json` with `dflash_config`, one
    safetensors file) that `load_dflash` (and the z-lab / SpecForge loaders) read.
    `target_config`: the target's config.json, whose vocabulary and rope the drafter shares."""
    from safetensors.torch import save_file

    from metrale.models.loader import like_written

    cfg, path = model.config, Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": cfg.attention_bias,
        "vocab_size": target_config["vocab_size"],
        "max_position_embeddings": target_config.get("max_position_embeddings", 4096),
        "block_size": cfg.block_size,
        "dflash_config": {
            "target_layer_ids": list(cfg.target_layer_ids),
            "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id,
        },
    }
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        if key in target_config:
            raw[key] = target_config[key]
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    # (cloned: a loaded drafter's projections are views of one packed weight)
    tensors = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    save_file(tensors, path / "model.safetensors")
    like_written(path / "model.safetensors")
    return path


def evenly_spaced_layers(num_target_layers: int, count: int) -> tuple[int, ...]:
    """`count` target layers spread from layer 1 to layer L - 3 (the published recipe's
    `build_target_layer_ids`; for Qwen3-8B's 36 layers and 5 taps: 1, 9, 17, 25, 33)."""
    if count == 1:
        return (num_target_layers // 2,)
    first, last = 1, max(num_target_layers - 3, 1)
    ids = tuple(round(first + (last - first) * i / (count - 1)) for i in range(count))
    if len(set(ids)) < count:  # a shallow target: as many distinct layers as it has
        count = min(count, num_target_layers)
        top = num_target_layers - 1
        ids = tuple(round(top * i / max(count - 1, 1)) for i in range(count))
    return ids


def load_dflash(
    path: str | Path, target_cfg, max_positions: int, device: torch.device, dtype: torch.dtype
) -> DFlashDraftModel:
    """A DFlash drafter for `target_cfg` (the target's ModelConfig) from `path`."""
    cfg = DFlashConfig.from_dir(path)
    layers = target_cfg.num_hidden_layers
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < layers]
    if bad:
        raise ValueError(
            f"DFlash drafter {path}: target_layer_ids {bad} are not layers of the target "
            f"({layers} layers)"
        )
    if cfg.hidden_size != target_cfg.hidden_size:
        raise ValueError(
            f"DFlash drafter {path}: hidden_size {cfg.hidden_size} != the target's "
            f"{target_cfg.hidden_size} (it reads the target's embeddings and head)"
        )
    if not 0 <= cfg.mask_token_id < target_cfg.vocab_size:
        raise ValueError(
            f"DFlash drafter {path}: mask_token_id {cfg.mask_token_id} is outside the target's "
            f"vocabulary ({target_cfg.vocab_size})"
        )
    with torch.device(device):
        model = DFlashDraftModel(cfg, max_positions)
    for param in model.parameters():  # the rotary table stays float32, as the target's
        param.data = param.data.to(dtype)
    try:
        load_weights(model, path)
    except CheckpointError as e:
        raise CheckpointError(f"DFlash drafter {path}: {e}") from None
    for layer in model.layers:
        layer.fuse()
    return model.eval()
