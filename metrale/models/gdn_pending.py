"""Where a hybrid target's write-on-accept forwards leave their pending rows when a CUDA-graph
runner serves it: one set of buffers for every program (see `PendingBuffers`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from metrale.models.gdn_state import GDNState


@dataclass
class PendingBuffers:
    """Where DEFER forwards on the Triton path write their pending rows (per GDN layer: the
    conv's padded input and output, whose q, k, v `commit` reads, and the raw gate inputs a and
    b), shared by every CUDA-graph program of a pool. A program's commit runs right after its
    replay, before any other forward writes here, so one set serves them all; each program kept
    its own before (about 1.2 MB a row at the Qwen3-Next shapes, summed over every verify
    program). Forwards of more than `rows` padded rows allocate their own."""

    conv_in: torch.Tensor  # [layers, rows * conv_dim], the activation dtype
    conv: torch.Tensor  # [layers, rows * conv_dim]
    a: torch.Tensor  # [layers, rows * Hv]
    b: torch.Tensor  # [layers, rows * Hv]
    rows: int

    @classmethod
    def for_pool(cls, pool: GDNState, rows: int) -> PendingBuffers:
        layers, conv_dim, hv = len(pool.conv), pool.conv[0].shape[1], pool.ssm[0].shape[1]
        like = pool.conv[0]

        def zeros(width: int) -> torch.Tensor:
            return like.new_zeros(layers, rows * width)

        return cls(zeros(conv_dim), zeros(conv_dim), zeros(hv), zeros(hv), rows)

    def views(self, layer: int, bsz: int, t: int) -> tuple[torch.Tensor, ...] | None:
        """(conv input, a, b, conv output) of layer `layer` as [bsz, t, ...], or None."""
        n = bsz * t
        if n > self.rows:
            return None
        conv_dim, hv = self.conv_in.shape[1] // self.rows, self.a.shape[1] // self.rows
        return (
            self.conv_in[layer, : n * conv_dim].view(bsz, t, conv_dim),
            self.a[layer, : n * hv].view(bsz, t, hv),
            self.b[layer, : n * hv].view(bsz, t, hv),
            self.conv[layer, : n * conv_dim].view(bsz, t, conv_dim),
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_in, self.conv, self.a, self.b))
