"""The Gated DeltaNet layer of Qwen3-Next (HF `Qwen3NextGatedDeltaNet`): in-projections, the
causal conv and the gated delta rule over the recurrent state (`gdn_state.GDNState`), the gated
RMSNorm, the out-projection.

Two paths compute the same thing. The torch path (CPU, and the reference) follows HF op by op.
The fused path (CUDA, or the forced interpreter: `kernels/dispatch.py`) is six launches: one
GEMM over both in-projections (their rows reordered once so that q, k, v, z, b and a are column
ranges of its output), `gdn_fused.prepare` (gates and padding), the conv and delta-rule kernels
(through the state), `gdn_fused.gated_norm` and out_proj. Where the state's delta rule runs the
Triton kernels (`GDNState.fuses_gates`) it gets the raw gate inputs and makes g and beta in
registers; at decode `prepare` then has nothing to pad either: five launches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.config import ModelConfig
from metrale.kernels import gdn_fused
from metrale.kernels.dispatch import hybrid_kernels_enabled
from metrale.kernels.gdn_recurrent import GateInputs
from metrale.models.activations import sigmoid, softplus
from metrale.models.gdn import GatedRMSNorm, RowLayout
from metrale.models.gdn_state import GDNState, SplitState


class Qwen3NextGatedDeltaNet(nn.Module):
    """One GDN layer (HF `Qwen3NextGatedDeltaNet`); `state_index` is its entry in `GDNState`.

    in_proj_qkvz and in_proj_ba are grouped by key head: for each of the Hk key heads,
    [q (dk), k (dk), v (r*dv), z (r*dv)] and [b (r), a (r)], r = Hv / Hk value heads per key
    head. The conv runs over the channels [q of all heads, k of all heads, v of all heads].
    """

    def __init__(self, cfg: ModelConfig, state_index: int) -> None:
        super().__init__()
        hybrid = cfg.hybrid
        assert hybrid is not None
        self.state_index = state_index
        self.num_k_heads = hybrid.linear_num_key_heads
        self.num_v_heads = hybrid.linear_num_value_heads
        self.head_k_dim = hybrid.linear_key_head_dim
        self.head_v_dim = hybrid.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        kernel = hybrid.linear_conv_kernel_dim
        h = cfg.hidden_size
        self.in_proj_qkvz = nn.Linear(h, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(h, 2 * self.num_v_heads, bias=False)
        # HF's parameter [conv_dim, 1, K]; the module is only its holder (see causal_conv1d)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)
        # Set by `_flatten` (the fused path's first forward): the in-projections' rows in the
        # flat order and both weights views of `_in_proj`, one [rows, H] matrix.
        self._in_proj: torch.Tensor | None = None

    def _split(self, qkvz: torch.Tensor, ba: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """-> mixed qkv [N, conv_dim], z [N, Hv, dv], b, a [N, Hv]. The checkpoint's layout groups
        the rows by key head; after `_flatten` they are in the flat order already."""
        n, hk, hv = qkvz.shape[0], self.num_k_heads, self.num_v_heads
        if self._in_proj is not None:
            mixed, z = qkvz.split([self.conv_dim, self.value_dim], -1)
            return mixed, z.reshape(n, hv, self.head_v_dim), ba[:, :hv], ba[:, hv:]
        r_dv = self.num_v_heads // hk * self.head_v_dim
        q, k, v, z = qkvz.view(n, hk, -1).split([self.head_k_dim, self.head_k_dim, r_dv, r_dv], -1)
        b, a = ba.view(n, hk, -1).chunk(2, dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return mixed, z.reshape(n, hv, self.head_v_dim), b.reshape(n, hv), a.reshape(n, hv)

    @torch.no_grad()
    def _flatten(self) -> None:
        """Reorder the in-projections' rows from per-key-head groups ([q, k, v, z] and [b, a] of
        each key head) to [q of all heads, k, v, z] and [b, a], and make both weights views of
        one matrix: the fused path runs one GEMM whose output columns the conv, the gates and the
        norm read in place (no cat, no copies of z, b, a). Once, at the first fused forward (the
        loader fills the checkpoint's layout); the torch path reads either layout."""
        hk, dk = self.num_k_heads, self.head_k_dim
        r, r_dv = self.num_v_heads // hk, self.num_v_heads // hk * self.head_v_dim
        qkvz, ba = self.in_proj_qkvz.weight, self.in_proj_ba.weight
        with torch.inference_mode(False):  # plain tensors, whatever mode the forward runs in
            idx = torch.arange(qkvz.shape[0], device=qkvz.device).view(hk, -1)
            parts = idx.split([dk, dk, r_dv, r_dv], -1)
            order = torch.cat([p.reshape(-1) for p in parts])
            idx_ba = torch.arange(ba.shape[0], device=ba.device).view(hk, 2 * r)
            order_ba = torch.cat([idx_ba[:, :r].reshape(-1), idx_ba[:, r:].reshape(-1)])
            packed = torch.cat([qkvz[order], ba[order_ba]])
        self.in_proj_qkvz.weight.data = packed[: qkvz.shape[0]]
        self.in_proj_ba.weight.data = packed[qkvz.shape[0] :]
        self._in_proj = packed
        if packed.is_cuda:  # the old storage is freed: let the reads above finish first
            torch.cuda.current_stream(packed.device).synchronize()

    def forward(
        self, hidden: torch.Tensor, layout: RowLayout, state: GDNState | SplitState
    ) -> torch.Tensor:
        """`layout` is the forward's rows; with a `SplitState`, the mixing runs once per group
        of sequences (`SplitState.layouts`), the projections once over all rows."""
        if hybrid_kernels_enabled(hidden):
            return self._fused(hidden, layout, state)
        rows = hidden.shape[0]
        mixed, z, b, a = self._split(self.in_proj_qkvz(hidden), self.in_proj_ba(hidden))
        if isinstance(state, SplitState):
            n = state.head_rows
            head, tail = state.layouts(layout.query_start_loc, rows)
            out = torch.cat(
                [
                    self._torch_mix(mixed[:n], z[:n], b[:n], a[:n], head, state.head),
                    self._torch_mix(mixed[n:], z[n:], b[n:], a[n:], tail, state.tail),
                ]
            )
        else:
            out = self._torch_mix(mixed, z, b, a, layout, state)
        return self.out_proj(out.reshape(rows, self.value_dim))

    def _torch_mix(self, mixed, z, b, a, layout: RowLayout, state: GDNState) -> torch.Tensor:
        """The torch path's conv, delta rule and gated norm over the layout's rows."""
        conv_in = layout.pad(mixed)  # [B, T, conv_dim]
        bsz, t = conv_in.shape[:2]
        conv = state.causal_conv(
            self.state_index, conv_in, self.conv1d.weight[:, 0], layout.lengths
        )
        q, k, v = self._heads(conv, bsz, t)
        # NOTE: padded rows get g = beta = 0, which leaves the state unchanged.
        beta = layout.pad(sigmoid(b))  # [B, T, Hv]
        g = layout.pad(-self.A_log.float().exp() * softplus(a.float() + self.dt_bias))
        out = state.delta_rule(self.state_index, q, k, v, g, beta)
        return self.norm(layout.unpad(out), z)  # [N, Hv, dv]

    def _heads(self, conv: torch.Tensor, bsz: int, t: int) -> tuple[torch.Tensor, ...]:
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.view(bsz, t, self.num_k_heads, self.head_k_dim)
        k = k.view(bsz, t, self.num_k_heads, self.head_k_dim)
        return q, k, v.view(bsz, t, self.num_v_heads, self.head_v_dim)

    def _fused(
        self, hidden: torch.Tensor, layout: RowLayout, state: GDNState | SplitState
    ) -> torch.Tensor:
        """The same layer in six launches (five at decode): one in-projection GEMM,
        `gdn_fused.prepare`, the conv and delta-rule kernels (through `state`),
        `gdn_fused.gated_norm`, out_proj (with a `SplitState`, the middle four per group)."""
        if self._in_proj is None:
            self._flatten()
        # the projections' own product (the deterministic mode's batch-invariant one, or the
        # few-row kernels', where their class has one)
        product = getattr(self.in_proj_qkvz, "product", F.linear)
        proj = product(hidden, self._in_proj)  # [N, conv_dim + value_dim + 2 Hv]
        if isinstance(state, SplitState):
            n = state.head_rows
            head, tail = state.layouts(layout.query_start_loc, hidden.shape[0])
            out = torch.cat(
                [
                    self._fused_mix(proj[:n], head, state.head),
                    self._fused_mix(proj[n:], tail, state.tail),
                ]
            )
        else:
            out = self._fused_mix(proj, layout, state)
        return self.out_proj(out)

    def _fused_mix(self, proj: torch.Tensor, layout: RowLayout, state: GDNState) -> torch.Tensor:
        """The fused path's prepare, conv, delta rule and gated norm over the layout's rows
        -> [N, value_dim]."""
        mixed, z, ba = proj.split([self.conv_dim, self.value_dim, 2 * self.num_v_heads], -1)
        # Where the delta rule runs as a Triton kernel, it makes g and beta from a and b itself:
        # `prepare` then only pads (-inf on padding rows), and at decode launches nothing. The
        # torch delta rule gets g and beta from `prepare` (one launch, not its half-dozen ops).
        raw = state.fuses_gates(proj)
        # A decode step (one row per sequence) with the raw gates pads nothing: `prepare` makes
        # views and needs no index or lengths, nor does anything below: the layout derives none
        decode = layout.width == 1
        index, lengths = (None, None) if raw and decode else (layout.index, layout.lengths)
        # a write-on-accept verify's pending rows: where the graph runner keeps them for every
        # program (`gdn_state.PendingBuffers`), else new tensors
        kept = None
        if raw and index is not None:
            kept = state.pending_outputs(self.state_index, *index.shape)
        conv_in, g, beta = gdn_fused.prepare(
            mixed,
            ba,
            self.A_log,
            self.dt_bias,
            index,
            lengths,
            raw=raw,
            out=None if kept is None else kept[:3],
        )  # raw: g, beta hold the (padded) gate inputs a, b
        bsz, t = conv_in.shape[:2]
        # the layout itself: the conv kernel reads the rows per sequence from its offsets
        weight = self.conv1d.weight[:, 0]
        conv = state.causal_conv(
            self.state_index, conv_in, weight, layout, None if kept is None else kept[3]
        )
        q, k, v = self._heads(conv, bsz, t)
        if raw:
            gates = GateInputs(g, beta, self.A_log, self.dt_bias)
            out = state.delta_rule(self.state_index, q, k, v, gates=gates)
        else:
            out = state.delta_rule(self.state_index, q, k, v, g, beta)
        norm = self.norm
        # one row per sequence: the kernel reads no row_seq, row_offset
        seq, offset = (None, None) if decode else (layout.row_seq, layout.row_offset)
        return gdn_fused.gated_norm(out, z, norm.weight, norm.eps, seq, offset)
