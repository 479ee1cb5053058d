"""The hybrid Qwen3-Next target (HF `Qwen3NextForCausalLM`): Gated DeltaNet layers and gated
full-attention layers (`layer_types`), each followed by a sparse MoE block or a dense MLP.

`forward(input_ids, positions, meta, state) -> hidden` runs the packed rows of one step: the
attention layers over the paged KV cache (`meta`, as in `qwen3.py`), the GDN layers over the
recurrent state (`state`, a `metrale.models.gdn_state.GDNState`; batch sequence b, the rows
meta.query_start_loc[b]:[b+1], starts from entry state.read[b] of every GDN layer).
`compute_logits(hidden, rows)` projects only the rows that need logits.

Parameter names follow HF's; q/k/v and gate/up are fused as in `qwen3.py` (`PACKED_MODULES`),
and the routed experts are stacked (see `qwen3_next_moe.py`). Unlike Qwen3, every RMSNorm outside
the GDN layers scales by (1 + weight): the checkpoints store the weights centred on zero. The GDN
layer lives in `qwen3_next_gdn.py`. Where the MoE kernels run, each sparse block's last launch
also applies the next layer's input norm (or the final norm) with its residual add.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.config import ModelConfig
from metrale.kernels import next_attention
from metrale.kernels.dispatch import hybrid_kernels_enabled
from metrale.models.activations import sigmoid
from metrale.models.attention import AttentionBackend, AttentionMetadata
from metrale.models.gdn import RowLayout
from metrale.models.gdn_state import GDNState
from metrale.models.layers import HiddenTaps, RMSNorm, RotaryEmbedding, SwiGLUMLP
from metrale.models.qwen3 import PACKED_MODULES
from metrale.models.qwen3_next_gdn import Qwen3NextGatedDeltaNet
from metrale.models.qwen3_next_moe import Qwen3NextSparseMoeBlock


class ZeroCentredRMSNorm(RMSNorm):
    """y = (1 + w) * x / rms(x), in float32 then cast back (HF `Qwen3NextRMSNorm`)."""

    zero_centred = True

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Qwen3NextAttention(nn.Module):
    """GQA with QK-norm, rotary on the leading dims of each head only, and an output gate:
    q_proj yields, per head, the query then a gate g; the output is o_proj(attn * sigmoid(g))."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = 2 * self.num_heads * self.head_dim  # q_proj rows (queries and gates)
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(
            self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_bias
        )
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self._rotary = (rotary,)  # shared, not owned (see qwen3.py)
        self._backend = backend
        self.kv_cache: torch.Tensor | None = None  # [2, pages, page_size, Hkv, D], bound by runner

    def _rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rotary = self._rotary[0]
        dim = 2 * rotary.cos.shape[-1]  # the rotated leading dims; the rest pass through
        q_rot, k_rot = rotary(positions, q[..., :dim], k[..., :dim])
        return torch.cat([q_rot, q[..., dim:]], -1), torch.cat([k_rot, k[..., dim:]], -1)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("attention layer has no KV cache bound; the runner binds it")
        if hybrid_kernels_enabled(hidden):
            return self._fused(positions, hidden, meta)
        rows = hidden.shape[0]
        qg, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], -1)
        q, gate = qg.view(rows, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(rows, self.num_kv_heads, self.head_dim))
        q, k = self._rope(positions, q, k)
        v = v.view(rows, self.num_kv_heads, self.head_dim)
        out = self._backend.forward(q, k, v, self.kv_cache, meta, self.scale)  # [T, Hq, D]
        out = out.reshape(rows, -1) * sigmoid(gate.reshape(rows, -1))
        return self.o_proj(out)

    def _fused(
        self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The same layer with its glue in two launches (`kernels/next_attention.py`)."""
        rows = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        rotary = self._rotary[0]
        # k and v are written into the cache too (kv_written below)
        q, k = next_attention.qk_norm_rope(
            qkv, self.q_norm.weight, self.k_norm.weight, rotary.cos, rotary.sin, positions,
            self.num_heads, self.num_kv_heads, self.q_norm.eps, self.kv_cache, meta.slot_mapping,
        )  # fmt: skip
        v = qkv[:, self.q_size + self.kv_size :].view(rows, self.num_kv_heads, self.head_dim)
        out = self._backend.forward(q, k, v, self.kv_cache, meta, self.scale, kv_written=True)
        return self.o_proj(next_attention.output_gate(out, qkv, self.num_heads))


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        mtp: bool = False,
    ) -> None:
        """`mtp`: the layer of an MTP depth module (`mtp.layers.{i}`), outside the target's
        layer list: full attention, with the sparse MoE when the model has experts."""
        super().__init__()
        hybrid = cfg.hybrid
        assert hybrid is not None
        self.layer_type = "full_attention" if mtp else hybrid.layer_types[layer]
        if self.layer_type == "linear_attention":
            self.linear_attn = Qwen3NextGatedDeltaNet(cfg, hybrid.gdn_layers.index(layer))
        else:
            self.self_attn = Qwen3NextAttention(cfg, rotary, backend)
        if (hybrid.num_experts > 0) if mtp else hybrid.is_moe_layer(layer):
            self.mlp: nn.Module = Qwen3NextSparseMoeBlock(cfg)
        else:
            self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def folds_next_norm(self, x: torch.Tensor) -> bool:
        """Whether this layer's MLP can apply the next norm in its last launch (a sparse MoE
        block on the kernels' path): then `forward(..., next_norm=...)` does."""
        mlp = self.mlp
        return isinstance(mlp, Qwen3NextSparseMoeBlock) and mlp.folds_next_norm(x)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        layout: RowLayout,
        state: GDNState,
        next_norm: nn.Module | None = None,
        normed: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the MLP's output, the residual before it); see `forward_fold` for `next_norm`
        and `normed`."""
        hidden, residual, _ = self.forward_fold(
            positions, hidden, residual, meta, layout, state, next_norm, normed
        )
        return hidden, residual

    def forward_fold(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        layout: RowLayout,
        state: GDNState,
        next_norm: nn.Module | None,
        normed: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """`forward`, where `normed` says `hidden` is already this layer's input norm of
        (hidden + residual) and `residual` that sum (the previous layer folded it), and
        `next_norm` (only where `folds_next_norm`: the next layer's input norm, or the final
        one) is applied in the MLP's last launch: then the result is (next_norm(output +
        residual), output + residual, True)."""
        if not normed and residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        elif not normed:
            hidden, residual = self.input_layernorm.forward_residual(hidden, residual)
        if self.layer_type == "linear_attention":
            hidden = self.linear_attn(hidden, layout, state)
        else:
            hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm.forward_residual(hidden, residual)
        if next_norm is not None:
            hidden, residual = self.mlp(hidden, residual, next_norm)
            return hidden, residual, True
        return self.mlp(hidden), residual, False


class Qwen3NextModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int):
        super().__init__()
        assert cfg.hybrid is not None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary_dim = int(cfg.head_dim * cfg.hybrid.partial_rotary_factor)
        self.rotary = RotaryEmbedding(cfg.rope, rotary_dim, max_positions)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(cfg, i, self.rotary, backend)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.taps: HiddenTaps | None = None  # set by a runner whose drafter reads them

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        layout: RowLayout,
        state: GDNState,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        taps = self.taps
        layers = self.layers
        normed = False
        for i, layer in enumerate(layers):
            # Without taps (which read each layer's output), each MoE block's last launch also
            # runs the next norm's residual add: one launch fewer per layer.
            fold = taps is None and layer.folds_next_norm(hidden)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            hidden, residual = layer(
                positions, hidden, residual, meta, layout, state, nxt if fold else None, normed
            )
            normed = fold
            if taps is not None:
                taps.write(i, hidden, residual)
        if taps is not None:
            taps.finish(positions, meta.slot_mapping)
        if not normed:
            hidden, _ = self.norm.forward_residual(hidden, residual)
        return hidden


class Qwen3NextForCausalLM(nn.Module):
    """The hybrid target. `forward` returns final-normed hidden states [T, H] of every packed row
    and advances `state` (see `GDNState` for the slots and the verify mode)."""

    packed_modules = PACKED_MODULES
    # the head's product; `make_batch_invariant` swaps in the batch-invariant kernel
    head_linear = staticmethod(torch.nn.functional.linear)

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int):
        super().__init__()
        if cfg.hybrid is None:
            raise ValueError(f"{cfg.architecture} is not a hybrid (Qwen3-Next) config")
        self.config = cfg
        self.backend = backend
        self.model = Qwen3NextModel(cfg, backend, max_positions)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def attention_layers(self) -> list[Qwen3NextAttention]:
        """The full-attention layers only, in order: one KV-cache layer each."""
        return [m.self_attn for m in self.model.layers if m.layer_type == "full_attention"]

    @property
    def gdn_layers(self) -> list[Qwen3NextGatedDeltaNet]:
        """The GDN layers in order; the i-th owns entry i of `GDNState.conv` / `.ssm`."""
        return [m.linear_attn for m in self.model.layers if m.layer_type == "linear_attention"]

    @property
    def head_weight(self) -> torch.Tensor:
        """[V, H] output projection (the embedding when tied); drafters share it."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def make_state(self, num_entries: int, ssm_dtype: torch.dtype = torch.float32) -> GDNState:
        """A zeroed `GDNState` of `num_entries` entries per GDN layer, on the model's device;
        conv windows in the activation dtype, delta-rule states in `ssm_dtype`."""
        hybrid = self.config.hybrid
        assert hybrid is not None
        weight = self.model.embed_tokens.weight
        return GDNState.zeros(
            len(hybrid.gdn_layers),
            num_entries,
            (hybrid.conv_dim, hybrid.linear_conv_kernel_dim - 1),
            (
                hybrid.linear_num_value_heads,
                hybrid.linear_key_head_dim,
                hybrid.linear_value_head_dim,
            ),
            weight.dtype,
            weight.device,
            ssm_dtype,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        state: GDNState,
    ) -> torch.Tensor:
        meta = self.backend.prepare(meta)
        layout = RowLayout.build(meta.query_start_loc, meta.max_query_len, input_ids.shape[0])
        return self.model(input_ids, positions, meta, layout, state)

    def compute_logits(
        self,
        hidden: torch.Tensor,
        rows: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden [T, H], rows [R] (None = all) -> float32 logits [R, V], into `out` if given
        (a graph's shared logits buffer: the float32 conversion writes it directly)."""
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        logits = self.head_linear(hidden, self.head_weight)
        return logits.float() if out is None else out.copy_(logits)
