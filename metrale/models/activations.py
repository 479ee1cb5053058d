"""SiLU, sigmoid and softplus that compute each element the same way however many there are.

On the CPU, torch's own kernels for these take a vectorised path over full SIMD registers and a
scalar one over the tail, and the two round differently: the same row gives other bits alone (a
decode row) than beside its drafts (a verify row), or by where it falls in the flattened batch.
Written over `exp`, whose two paths agree, each element's result depends on its value alone (the
add, divide and log1p after it are correctly rounded or themselves path-independent). On the
GPU, torch's kernels are elementwise the same way already and are used as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# softplus's threshold (torch's default): above it, softplus(x) = x to float32 precision
SOFTPLUS_THRESHOLD = 20.0


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return torch.sigmoid(x)
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return F.silu(x)
    return x / (1.0 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return F.softplus(x)
    return torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x)))
