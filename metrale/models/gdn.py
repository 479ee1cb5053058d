"""Gated DeltaNet (GDN) in plain torch: the delta-rule kernels, the causal conv over a carried
window, the gated RMSNorm, and the recurrent state a hybrid target carries between steps.

Per value head the state S is a [dk, dv] float32 matrix. Row t (after the conv, q and k
L2-normalised, q scaled by dk^-0.5) updates and reads it:

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)
    o_t = S_t^T q_t

`recurrent_gated_delta_rule` runs this row by row and can return the state after every row (what
verify needs: the committed state is the one after the last accepted row).
`chunk_gated_delta_rule` computes the same thing 64 rows at a time (the WY form, see there), for
prefill. Both take padded batches [B, T, ...]; a row with g = 0 and beta = 0 leaves the state as
it is, so padding past a sequence's end never changes its state. These are the references that
GPU kernels are tested against; `gdn_state.GDNState` holds the state between steps.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from metrale.kernels import fused
from metrale.models.activations import silu

L2NORM_EPS = 1e-6  # as fla and HF: x * rsqrt(sum(x^2) + eps)
CHUNK_SIZE = 64


class DeltaRuleOutput(NamedTuple):
    out: torch.Tensor  # [B, T, Hv, dv], in v's dtype
    state: torch.Tensor  # [B, Hv, dk, dv] float32: after the last row
    states: torch.Tensor | None  # [B, T, Hv, dk, dv] float32: after each row (when asked)


class ConvOutput(NamedTuple):
    out: torch.Tensor  # [B, T, D]
    window: torch.Tensor  # [B, D, K-1]: the last K-1 inputs, oldest first
    windows: torch.Tensor | None  # [B, T, D, K-1]: the window after each row (when asked)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _heads_first(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    l2norm_qk: bool,
) -> tuple[torch.Tensor, ...]:
    """[B, T, H, d] / [B, T, H] -> float32 [B, Hv, T, d] / [B, Hv, T]; key heads repeated over
    their group of value heads (value head j reads key head j // (Hv / Hk)); q, k normalised."""
    hk, hv = q.shape[2], v.shape[2]
    if hv % hk:
        raise ValueError(f"{hv} value heads are not a multiple of {hk} key heads")
    if hk != hv:
        q, k = (x.repeat_interleave(hv // hk, dim=2) for x in (q, k))
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))
    if l2norm_qk:
        q, k = l2norm(q), l2norm(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k, v, g, beta


def _initial_state(state: torch.Tensor | None, v: torch.Tensor, dk: int) -> torch.Tensor:
    b, h, _, dv = v.shape
    if state is None:
        return v.new_zeros(b, h, dk, dv)
    return state.float().clone()


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    l2norm_qk: bool = True,
    output_all_states: bool = False,
    state_dtype: torch.dtype = torch.float32,
) -> DeltaRuleOutput:
    """The delta rule row by row. q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g (log-decay, <= 0) and
    beta [B, T, Hv]; state [B, Hv, dk, dv] (None: zeros; never modified); T >= 1.
    `state_dtype`: the type the state is kept in between steps; below float32 the state is
    rounded to it after every row's output, as a step ending at that row would store it (the
    arithmetic stays float32), so T rows give the bits of T one-row steps."""
    dtype = v.dtype
    rounds = state_dtype != torch.float32
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, scale, l2norm_qk)
    s = _initial_state(state, v, q.shape[-1])
    outs, states = [], []
    for t in range(q.shape[2]):
        k_t = k[:, :, t]  # [B, H, dk]
        s = s * g[:, :, t].exp()[..., None, None]
        u = (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k_t, s)) * beta[:, :, t, None]
        s = s + k_t[..., :, None] * u[..., None, :]  # rank-1 write of the correction
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], s))
        if rounds:
            s = s.to(state_dtype).float()
        states.append(s)
    out = torch.stack(outs, dim=1)  # [B, T, H, dv]
    all_states = torch.stack(states, dim=1) if output_all_states else None
    return DeltaRuleOutput(out.to(dtype), s, all_states)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    l2norm_qk: bool = True,
    chunk_size: int = CHUNK_SIZE,
) -> DeltaRuleOutput:
    """The delta rule a chunk of C rows at a time; same arguments and results as the recurrent
    form (no per-row states).

    Inside a chunk, with G the cumulative log-decay and Gamma_ij = exp(G_i - G_j) (i >= j),
    unrolling the recurrence from the chunk's start state S0 gives, for the corrections u_t:

        (I + L) U_all = diag(beta) V - diag(beta exp(G)) K S0
        L = strict_lower(diag(beta) K K^T o Gamma)

    so with the WY tables U = (I + L)^-1 diag(beta) V and W = (I + L)^-1 diag(beta exp(G)) K:

        U_all = U - W S0
        O     = diag(exp(G)) Q S0 + ((Q K^T) o Gamma o causal) U_all
        S_C   = exp(G_C) S0 + (diag(exp(G_C - G)) K)^T U_all

    The chunk touches S0 through matmuls only; the rows are padded with g = beta = 0 (identity).
    """
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, scale, l2norm_qk)
    b, h, t, dk = q.shape
    s = _initial_state(state, v, dk)
    pad = (-t) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk_size
    q, k, v = (x.reshape(b, h, n, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(b, h, n, chunk_size) for x in (g, beta))

    cum = g.cumsum(-1)  # G [B, H, n, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # Gamma, masked before exp: G_i - G_j > 0 above the diagonal and may overflow.
    gamma = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    system = eye + ((k_beta @ k.transpose(-1, -2)) * gamma).tril(-1)  # I + L
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False)
    attn = (q @ k.transpose(-1, -2)) * gamma  # causal, diagonal included
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, n, 1, 1]

    out = torch.empty_like(v)
    for i in range(n):
        corr = u[:, :, i] - w[:, :, i] @ s  # U_all [B, H, C, dv]
        out[:, :, i] = q_decayed[:, :, i] @ s + attn[:, :, i] @ corr
        s = s * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ corr
    out = out.reshape(b, h, n * chunk_size, -1)[:, :, :t].transpose(1, 2)
    return DeltaRuleOutput(out.to(dtype), s, None)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    window: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    activation: bool = True,
    output_all_windows: bool = False,
) -> ConvOutput:
    """Causal depthwise conv of kernel K over T rows that continue a carried window.

    x [B, T, D]; weight [D, K]; window [B, D, K-1] (the K-1 inputs before row 0, oldest first;
    None: zeros); lengths [B] (real rows per sequence, the rest is padding; None: all T). Row t's
    output is sum_j weight[:, j] * input[t - K + 1 + j], then SiLU. The new window holds each
    sequence's last K-1 real inputs, so a prefill and then single-row updates equal one pass over
    the whole sequence. Prefill and decode are the same call with T rows or one.
    """
    b, t, d = x.shape
    k = weight.shape[-1]
    if window is None:
        window = x.new_zeros(b, d, k - 1)
    seq = torch.cat([window.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, D, K-1+T]
    # The taps one at a time, oldest first, rather than F.conv1d: every output is then the same
    # sum in the same order whatever T is (a decode row and a verify row of one token get the
    # same bits; the CPU's convolution kernels block by length).
    # (accumulated in float32 and rounded once to the weight's dtype, as the convolution was)
    taps, w = seq.to(weight.dtype).float(), weight.float()
    out = w[:, 0, None] * taps[..., :t]
    for j in range(1, k):
        out = out + w[:, j, None] * taps[..., j : j + t]
    if bias is not None:
        out = out + bias.float()[:, None]
    out = out.to(weight.dtype)
    if activation:
        out = silu(out)
    out = out.to(x.dtype).transpose(1, 2)
    views = seq.unfold(-1, k - 1, 1)  # [B, D, T+1, K-1]: view j = the window after j rows
    ends = torch.full((b,), t, device=x.device) if lengths is None else lengths
    new_window = views.gather(2, ends.view(b, 1, 1, 1).expand(b, d, 1, k - 1)).squeeze(2)
    windows = None
    if output_all_windows:
        # after row j; past a sequence's end its last window again (padding shifts nothing in)
        after = torch.arange(1, t + 1, device=x.device).minimum(ends[:, None])  # [B, T]
        windows = views.gather(2, after[:, None, :, None].expand(b, d, t, k - 1))
        windows = windows.permute(0, 2, 1, 3)  # [B, T, D, K-1]
    return ConvOutput(out, new_window.contiguous(), windows)


def window_after(window: torch.Tensor, x: torch.Tensor, num_rows: torch.Tensor) -> torch.Tensor:
    """The conv window [B, D, K-1] after the first num_rows[b] rows of x [B, T, D] (a
    write-on-accept commit re-bases the window over the accepted rows only)."""
    b, d, width = window.shape
    seq = torch.cat([window, x.transpose(1, 2).to(window.dtype)], dim=-1)  # [B, D, K-1+T]
    views = seq.unfold(-1, width, 1)  # [B, D, T+1, K-1]
    return views.gather(2, num_rows.view(b, 1, 1, 1).expand(b, d, 1, width)).squeeze(2)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(gate) over the last dim, numerics of HF `Qwen3NextRMSNormGated`
    (the norm in float32, the weight applied in x's dtype, the gate in float32)."""
    dtype = x.dtype
    x32 = x.float()
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (normed * silu(gate.float())).to(dtype)


class GatedRMSNorm(nn.Module):
    """`gated_rms_norm` with its weight (plain, not zero-centred: initialised to ones)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if fused.fused_enabled(x):
            return fused.gated_rmsnorm(x, gate, self.weight, self.eps)
        return gated_rms_norm(x, gate, self.weight, self.eps)


class RowLayout:
    """Packed rows (sequence b owns rows query_start_loc[b]:query_start_loc[b+1]) <-> a padded
    [B, T] view, T = the longest sequence's rows. Built once per forward.

    The index tensors are derived on first use and kept for the forward (a layout lives for one
    forward: a CUDA-graph capture builds its own, so whatever it derives is captured): a decode
    step's fused path (T = 1) reads none of them (the conv kernel reads each sequence's rows
    from `query_start_loc` itself), so it launches nothing for the layout, where deriving them
    all took about 15 small kernels per step on CUDA. One arange serves every index range."""

    def __init__(self, query_start_loc: torch.Tensor, max_query_len: int, num_rows: int) -> None:
        self.query_start_loc = query_start_loc  # [B+1]
        self.width = max(max_query_len, 1)  # T
        self.num_rows = num_rows  # N
        self.num_seqs = query_start_loc.shape[0] - 1  # B

    @classmethod
    def build(cls, query_start_loc: torch.Tensor, max_query_len: int, num_rows: int) -> RowLayout:
        return cls(query_start_loc, max_query_len, num_rows)

    @functools.cached_property
    def _arange(self) -> torch.Tensor:
        """0 .. max(T, B, N) - 1: every range below is a slice of it."""
        size = max(self.width, self.num_seqs, self.num_rows)
        return torch.arange(size, device=self.query_start_loc.device)

    @functools.cached_property
    def lengths(self) -> torch.Tensor:
        """[B] rows per sequence."""
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @functools.cached_property
    def valid(self) -> torch.Tensor:
        """[B, T] bool: a real row (not padding)."""
        return self._arange[: self.width][None, :] < self.lengths[:, None]

    @functools.cached_property
    def index(self) -> torch.Tensor:
        """[B, T] packed row of each padded position (0 for padding)."""
        offs = self._arange[: self.width]
        return torch.where(self.valid, self.query_start_loc[:-1, None] + offs[None, :], 0)

    @functools.cached_property
    def row_seq(self) -> torch.Tensor:
        """[N] sequence of each packed row."""
        # output_size: no host sync
        return torch.repeat_interleave(
            self._arange[: self.num_seqs], self.lengths, output_size=self.num_rows
        )

    @functools.cached_property
    def row_offset(self) -> torch.Tensor:
        """[N] position of each packed row within its sequence."""
        return self._arange[: self.num_rows] - self.query_start_loc[:-1][self.row_seq]

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, ...] packed -> [B, T, ...] padded with zeros."""
        if self.width == 1:  # one row per sequence (decode): a view, no kernel
            return rows.unsqueeze(1)
        valid = self.valid.view(*self.valid.shape, *([1] * (rows.dim() - 1)))
        return torch.where(valid, rows[self.index], 0)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] padded -> [N, ...] packed."""
        if padded.shape[1] == 1:
            return padded.squeeze(1)
        return padded[self.row_seq, self.row_offset]
