"""SiLU, sigmoid and softplus that compute each element the same way however many there are.

On the CPU, torch's own kernels for these take a vectorised path over full SIMD registers and a
scalar one over the tail, and the two round differently: the same row gives other bits alone (a
decode row) than beside its drafts (a verify row), or by where it falls in the flattened batch.
Written over `exp`, whose two paths agree, each element's result depends on its value alone (the
add, divide and log1p after it are correctly rounded or themselves path-independent). They run
in float32 (float64 stays float64) and round once to the input's dtype, as torch's do
internally (in bf16 or fp16 `exp` would overflow or round early).

On the GPU torch's kernels are elementwise the same way already and are used as they are; so
they are where autograd records the call (training a drafter on the CPU): there row invariance
buys nothing, and the `exp` forms give NaN gradients where `exp` overflows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# softplus's threshold (torch's default): above it, softplus(x) = x to float32 precision
SOFTPLUS_THRESHOLD = 20.0


def _torchs(x: torch.Tensor) -> bool:
    return x.is_cuda or (x.requires_grad and torch.is_grad_enabled())


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in float32 at least (float64 stays float64)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    if _torchs(x):
        return torch.sigmoid(x)
    return (1.0 / (1.0 + torch.exp(-_wide(x)))).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    if _torchs(x):
        return F.silu(x)
    w = _wide(x)
    return (w / (1.0 + torch.exp(-w))).to(x.dtype)


def softplus(x: torch.Tensor) -> torch.Tensor:
    if _torchs(x):
        return F.softplus(x)
    w = _wide(x)
    return torch.where(w > SOFTPLUS_THRESHOLD, w, torch.log1p(torch.exp(w))).to(x.dtype)
