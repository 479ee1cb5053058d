"""Building blocks shared by the targets: RMSNorm, rotary embedding (default/linear/yarn/llama3),
SwiGLU MLP.

Numerics follow HF transformers (norms in float32, cos/sin computed in float32 then cast), so that
float32 logits match `Qwen3ForCausalLM` to rounding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from metrale.config import RopeConfig
from metrale.kernels import fused
from metrale.models.activations import silu


class RMSNorm(nn.Module):
    """y = w * x / rms(x); the reduction runs in float32 whatever the activation dtype. On CUDA
    one fused kernel; `_reference` is the torch path (CPU, tests)."""

    zero_centred = False  # the fused kernel's (1 + w) variant, for subclasses that scale so

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the fused kernel has no backward: a forward that autograd records (training a
        # drafter made of these modules) takes the torch path
        if fused.fused_enabled(x) and not (torch.is_grad_enabled() and self.weight.requires_grad):
            return fused.add_rmsnorm(x, None, self.weight, self.eps, self.zero_centred)[0]
        return self._reference(x)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the residual, then normalise: (normed, new residual)."""
        if fused.fused_enabled(x):
            return fused.add_rmsnorm(x, residual, self.weight, self.eps, self.zero_centred)
        residual = x + residual
        return self._reference(residual), residual


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (float32) and the cos/sin scale (`attention_factor`)."""
    dim = head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base_freq = 1.0 / (rope.theta**exponent)
    if rope.rope_type == "default":
        return base_freq, 1.0
    if rope.rope_type == "linear":
        return base_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, base_freq), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, dim)
    raise ValueError(f"rope_type {rope.rope_type!r} is not supported")


def _llama3_inv_freq(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    # Between the two wavelengths, blend the scaled and unscaled frequencies smoothly.
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    factor = rope.factor
    original = rope.original_max_position_embeddings

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale_of(factor, rope.mscale) / mscale_of(
                factor, rope.mscale_all_dim
            )
        else:
            attention_factor = mscale_of(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    # High-frequency dims keep their frequency (extrapolate), low-frequency dims are interpolated.
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a cos/sin table precomputed up to `max_positions`.

    Positions index the table, so a forward costs one gather, and any row may carry any position
    (prefill chunks, decodes and verify rows mixed in one batch).
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, scale = rope_inv_freq(rope, head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # [max_positions, head_dim/2] each; kept in float32 and cast at use.
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D], positions [T] -> rotated q, k (rotate-half convention)."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # HF casts cos/sin to the activation dtype before multiplying; so do we, for equal rounding.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one [2I, H] weight."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused.fused_enabled(gate_up):
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(silu(gate) * up)


class HiddenTaps:
    """The target's residual stream after chosen layers (HF `hidden_states[l + 1]`), which a
    drafter reads (DFlash's context features): every forward writes them into one persistent
    buffer [rows, len(layers) * H], so a captured CUDA graph writes it too, at no extra pass.

    `sink(taps [T, C], positions [T], slot_mapping [T])`, when set, consumes them at the end of
    the forward (`finish`), inside the same program: DFlash writes its context K/V there."""

    def __init__(self, layers, hidden_size: int, max_rows: int, device, dtype, sink=None) -> None:
        self.sink = sink
        # layer -> its columns (a checkpoint may read one layer twice)
        self.columns: dict[int, list[int]] = {}
        for j, layer in enumerate(layers):
            self.columns.setdefault(layer, []).append(j * hidden_size)
        self.hidden_size = hidden_size
        self.buffer = torch.zeros(max_rows, len(layers) * hidden_size, device=device, dtype=dtype)

    def write(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        cols = self.columns.get(layer)
        if cols is None:
            return
        rows = hidden.shape[0]
        if rows > self.buffer.shape[0]:
            raise ValueError(f"hidden taps: {rows} rows, the buffer holds {self.buffer.shape[0]}")
        for col in cols:
            torch.add(hidden, residual, out=self.buffer[:rows, col : col + self.hidden_size])

    def finish(self, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The forward's layers are done: hand its rows' taps to the sink."""
        if self.sink is not None:
            self.sink(self.buffer[: positions.shape[0]], positions, slot_mapping)
