"""When the hybrid target's Triton paths run: on CUDA (unless switched off), and on CPU tensors
only when a test forces them under Triton's interpreter (`METRALE_FORCE_FUSED_KERNELS=1` with
`TRITON_INTERPRET=1`), so that the engine's CPU parity tests can run every fused path.

The MoE kernels (`moe_routing`, `moe`), the GDN glue (`gdn_fused`) and the attention glue
(`next_attention`) follow `METRALE_NO_FUSED_KERNELS`; the delta-rule and conv kernels follow
`METRALE_NO_GDN_TRITON` (`gdn_recurrent.triton_gdn_enabled`). Where they do not run, the
models' torch reference paths do (and CPU tensors always, unless forced).
"""

from __future__ import annotations

import os

import torch

from metrale.kernels.fused import triton
from metrale.knobs import knobs


def interpreter_forced(x: torch.Tensor) -> bool:
    """A CPU tensor, Triton's interpreter on, and the fused paths forced."""
    return (
        triton is not None
        and x.device.type == "cpu"
        and os.environ.get("TRITON_INTERPRET") == "1"
        and knobs().force_fused_kernels
    )


def hybrid_kernels_enabled(x: torch.Tensor) -> bool:
    """The fused MoE / GDN-glue / attention-glue kernels serve this activation."""
    if triton is None or knobs().no_fused_kernels:
        return False
    return x.is_cuda or interpreter_forced(x)
