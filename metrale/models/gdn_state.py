"""The recurrent state a hybrid (Gated DeltaNet) target carries between steps, and how one forward
reads and writes it: in place for prefill and decode, and in one of two variants for verify.

Entry i of `conv` / `ssm` belongs to the i-th GDN layer (in layer order):
  conv[i] [S, conv_dim, K-1]  the last K-1 conv inputs (oldest first), activation dtype
  ssm[i]  [S, Hv, dk, dv]     the delta-rule state, float32 or a 16-bit type (`ssm_dtype`:
                              `EngineConfig.mamba_ssm_cache_dtype`); computed in float32
Batch sequence b (packed rows query_start_loc[b]:query_start_loc[b+1]) reads its state from
entry `read[b]` of every layer (`read=None`: entry b). A new sequence's entry must be zero
(`reset`). What a forward writes depends on `mode`:

  WRITE  the state after each sequence's last row goes back into `read[b]` (prefill chunks,
         decode steps).
  ROWS   per-row slots (verify): the state after row t goes into entry `rows[b, t]`; the caller
         hands each sequence K+1 entries and, once the acceptance is known, just points the
         sequence at the entry of its last accepted row: no copy, K+1 times the memory.
  DEFER  write-on-accept (verify): nothing is written; each layer keeps its rows' inputs
         (q, k, v, the gates or their inputs, and the conv inputs: about 2 * conv_dim
         activations per row and layer, 32 KB at Qwen3-Next-80B's shape) and
         `commit(num_rows)` then advances `read[b]` over the accepted rows only. A CUDA-graph
         program keeps these buffers while it is cached, beside its logits (about 1.2 MB per row
         at that shape over 36 layers).

A step that verifies beside prompt chunks takes a `SplitState`: the prompt chunks' entries in
WRITE mode, the verify's in its mode, in one forward.

The gates reach `delta_rule` either as g and beta or, where the Triton kernels run
(`fuses_gates`), as the layer's raw gate inputs (`gdn_recurrent.GateInputs`), which the kernels
turn into g and beta in registers: no launch to make them. The torch path materialises them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import NamedTuple

import torch

from metrale.kernels.gdn_chunk import chunk_delta_rule_in_pool
from metrale.kernels.gdn_conv import conv_in_pool
from metrale.kernels.gdn_recurrent import (
    GateInputs,
    delta_rule_in_pool,
    invariant_block_v,
    triton_gdn_enabled,
)
from metrale.models.gdn import (
    RowLayout,
    causal_conv1d,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    window_after,
)
from metrale.models.gdn_pending import PendingBuffers

# Prefill chunks of more rows than this run the chunked (WY) kernel on the GPU; shorter ones, and
# every verify, the recurrent kernel (a chunk is 16 rows: fewer leave its matmuls mostly empty).
CHUNK_MIN_ROWS = 16


def _conv_kernel_runs(x: torch.Tensor, windows: torch.Tensor) -> bool:
    """The Triton conv serves this layer: on CUDA, for kernel width 4 (windows of 3 inputs)."""
    return triton_gdn_enabled(x) and windows.shape[-1] == 3


class StateMode(Enum):
    WRITE = "write"
    ROWS = "rows"
    DEFER = "defer"


class PendingRows(NamedTuple):
    """A DEFER forward's delta-rule inputs of one GDN layer, padded [B, T, ...], for `commit`:
    g and beta, or (Triton path) the gate inputs the forward's kernel read instead."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor | None
    beta: torch.Tensor | None
    gates: GateInputs | None


@dataclass
class GDNState:
    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]
    read: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    mode: StateMode = StateMode.WRITE
    pending: dict[int, PendingRows] = field(default_factory=dict)
    # per layer: the conv's inputs [B, T, conv_dim], to re-base the window at commit
    pending_conv: dict[int, torch.Tensor] = field(default_factory=dict)
    # where DEFER forwards write their pending rows, where a graph runner set them
    pending_out: PendingBuffers | None = None
    # forwards of more rows per sequence run the chunked kernel on the GPU; the deterministic
    # mode sets it past any row count, so a row takes the recurrent form whatever shares its
    # step (the chunked form's 16-row blocks start at the chunk's first row)
    chunk_min_rows: int = CHUNK_MIN_ROWS
    # the delta-rule kernel's value columns per program: None picks them by the batch (the
    # fastest); the deterministic mode fixes them (`invariant_block_v`), since a row's bits
    # follow its program's tile, and runs every call as one binary (`delta_rule_in_pool`'s
    # `invariant`)
    block_v: int | None = None

    def make_deterministic(self) -> None:
        """The deterministic mode's state: every row in the recurrent form, whatever shares its
        forward (the chunked form's 16-row blocks start at the forward's first row), and one
        kernel tile at every batch size (a row's bits follow its program's tile)."""
        self.chunk_min_rows = sys.maxsize
        if self.ssm:
            self.block_v = invariant_block_v(self.ssm[0].shape[-1])

    @classmethod
    def zeros(
        cls,
        num_layers: int,
        num_entries: int,
        conv_shape: tuple[int, int],
        ssm_shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        ssm_dtype: torch.dtype = torch.float32,
    ) -> GDNState:
        """conv_shape (conv_dim, K-1), ssm_shape (Hv, dk, dv); conv windows in `dtype`,
        delta-rule states in `ssm_dtype`."""
        return cls(
            conv=[
                torch.zeros(num_entries, *conv_shape, dtype=dtype, device=device)
                for _ in range(num_layers)
            ],
            ssm=[
                torch.zeros(num_entries, *ssm_shape, dtype=ssm_dtype, device=device)
                for _ in range(num_layers)
            ],
        )

    def view(
        self, read: torch.Tensor | None, mode: StateMode, rows: torch.Tensor | None = None
    ) -> GDNState:
        """The same entries, addressed for one forward: every other field (and a subclass's,
        such as the tensor-parallel pool's) kept, no pending rows yet."""
        if (mode is StateMode.ROWS) != (rows is not None):
            raise ValueError(f"mode {mode.value} with rows={'given' if rows is not None else None}")
        return replace(self, read=read, rows=rows, mode=mode, pending={}, pending_conv={})

    def pending_outputs(self, layer: int, bsz: int, t: int) -> tuple[torch.Tensor, ...] | None:
        """Where a DEFER forward of [bsz, t] padded rows on the Triton path writes layer
        `layer`'s conv input, raw gates and conv output (`PendingBuffers.views`), or None."""
        if self.mode is not StateMode.DEFER or self.pending_out is None or t == 1:
            return None
        return self.pending_out.views(layer, bsz, t)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.ssm)

    def _read(self, batch: int, device: torch.device) -> torch.Tensor:
        return torch.arange(batch, device=device) if self.read is None else self.read

    def fuses_gates(self, x: torch.Tensor) -> bool:
        """Whether `delta_rule` for activations like x runs the Triton kernels, which take the
        gate inputs and make g and beta themselves (the layer then launches nothing for them)."""
        return triton_gdn_enabled(x)

    def delta_rule(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor | None = None,
        beta: torch.Tensor | None = None,
        *,
        gates: GateInputs | None = None,
    ) -> torch.Tensor:
        """The delta rule over padded rows (see `gdn.recurrent_gated_delta_rule`) from each
        sequence's entry, writing as `mode` says -> out [B, T, Hv, dv]. The gates come as g and
        beta [B, T, Hv] (padding rows g = beta = 0) or as `gates` (padding rows a = b = -inf,
        which give the same zeros); a padding row leaves the state unchanged."""
        bsz, t = q.shape[:2]
        pool = self.ssm[layer]
        read = self._read(bsz, pool.device)
        mode = self.mode
        triton = triton_gdn_enabled(v)
        if gates is not None and not triton:
            g, beta = gates.materialize()
            gates = None
        if g is None and gates is None:
            raise ValueError("delta_rule needs g and beta, or gates")
        if mode is StateMode.DEFER:
            self.pending[layer] = PendingRows(q, k, v, g, beta, gates)
        if triton and mode is StateMode.WRITE and t > self.chunk_min_rows:
            return chunk_delta_rule_in_pool(q, k, v, g, beta, pool, read, read, gates=gates)
        if triton:
            return delta_rule_in_pool(
                q,
                k,
                v,
                g,
                beta,
                pool,
                read,
                final=read if mode is StateMode.WRITE else None,
                rows=self.rows if mode is StateMode.ROWS else None,
                gates=gates,
                block_v=self.block_v,
                invariant=self.block_v is not None,
            )
        assert g is not None and beta is not None
        if mode is StateMode.WRITE and t > self.chunk_min_rows:  # as the kernels choose
            res = chunk_gated_delta_rule(q, k, v, g, beta, pool[read])
        else:
            res = recurrent_gated_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                pool[read],
                output_all_states=mode is StateMode.ROWS,
                state_dtype=pool.dtype,
            )
        if mode is StateMode.WRITE:
            pool.index_copy_(0, read, res.state.to(pool.dtype))
        elif mode is StateMode.ROWS:
            assert self.rows is not None and res.states is not None
            pool.index_copy_(0, self.rows.flatten(), res.states.flatten(0, 1).to(pool.dtype))
        return res.out

    def causal_conv(
        self,
        layer: int,
        conv_in: torch.Tensor,
        weight: torch.Tensor,
        lengths: torch.Tensor | RowLayout,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's causal conv (+ SiLU) over padded rows conv_in [B, T, conv_dim] (lengths
        [B] real rows each, or the forward's `RowLayout`: the conv kernel then reads them from
        its `query_start_loc`, and the layout makes no lengths tensor for it), continuing each
        sequence's window and storing the windows as `mode` says -> [B, T, conv_dim] (the
        kernel writes it into `out` if given)."""
        bsz = conv_in.shape[0]
        store = self.conv[layer]
        read = self._read(bsz, store.device)
        if self.mode is StateMode.DEFER:
            self.pending_conv[layer] = conv_in
        if _conv_kernel_runs(conv_in, store):
            layout = lengths if isinstance(lengths, RowLayout) else None
            return conv_in_pool(
                conv_in,
                weight,
                store,
                read,
                None if layout is not None else lengths,
                final=read if self.mode is StateMode.WRITE else None,
                rows=self.rows if self.mode is StateMode.ROWS else None,
                starts=None if layout is None else layout.query_start_loc,
                out=out,
            )
        if isinstance(lengths, RowLayout):
            lengths = lengths.lengths
        conv = causal_conv1d(
            conv_in,
            weight,
            store[read],
            lengths=lengths,
            output_all_windows=self.mode is StateMode.ROWS,
        )
        if self.mode is StateMode.WRITE:
            store.index_copy_(0, read, conv.window.to(store.dtype))
        elif self.mode is StateMode.ROWS:
            assert self.rows is not None and conv.windows is not None
            store.index_copy_(0, self.rows.flatten(), conv.windows.flatten(0, 1).to(store.dtype))
        return conv.out

    def commit(self, num_rows: torch.Tensor) -> None:
        """After a DEFER forward: advance each sequence's entry over its first num_rows[b] rows
        (its last token plus the accepted drafts), as a WRITE forward of only those rows would."""
        if self.mode is not StateMode.DEFER:
            raise RuntimeError(f"commit after a {self.mode.value} forward")
        for layer, p in self.pending.items():
            bsz, t = p.q.shape[:2]
            pool, store = self.ssm[layer], self.conv[layer]
            read = self._read(bsz, pool.device)
            if triton_gdn_enabled(p.v):
                delta_rule_in_pool(
                    p.q, p.k, p.v, p.g, p.beta, pool, read,
                    final=read, lengths=num_rows, gates=p.gates, block_v=self.block_v,
                    invariant=self.block_v is not None,
                )  # fmt: skip
            else:
                # the recurrent form whatever t is, as the verify itself ran; the forward kept
                # g and beta (the torch path materialises gate inputs)
                assert p.g is not None and p.beta is not None
                keep = torch.arange(t, device=pool.device)[None, :] < num_rows[:, None]
                g, beta = p.g * keep[..., None], p.beta * keep[..., None]  # masked rows: identity
                res = recurrent_gated_delta_rule(
                    p.q, p.k, p.v, g, beta, pool[read], state_dtype=pool.dtype
                )
                pool.index_copy_(0, read, res.state.to(pool.dtype))
            conv_in = self.pending_conv[layer]
            if _conv_kernel_runs(conv_in, store):
                conv_in_pool(conv_in, None, store, read, num_rows, final=read)
            else:
                window = window_after(store[read], conv_in, num_rows)
                store.index_copy_(0, read, window.to(store.dtype))
        # NOTE: nothing is popped: a graph capture runs this twice (warm-up, capture), a graphed
        # commit replays over the same static tensors, and the next DEFER forward replaces them.

    def zeros_like(self, num_entries: int) -> GDNState:
        """A zeroed pool of `num_entries` entries shaped as this one (prefix-cache snapshots)."""
        return GDNState(
            conv=[c.new_zeros(num_entries, *c.shape[1:]) for c in self.conv],
            ssm=[t.new_zeros(num_entries, *t.shape[1:]) for t in self.ssm],
        )

    def entry_bytes(self) -> int:
        """Bytes of one entry across every GDN layer (conv window and delta-rule state)."""
        return sum(t[0].numel() * t.element_size() for t in self.conv + self.ssm)

    def copy_entries(self, dst: torch.Tensor, src_pool: GDNState, src: torch.Tensor) -> None:
        """Entries dst[i] of this pool become entries src[i] of `src_pool`, every layer (a
        prefix-cache snapshot taken or resumed): two indexed copies per layer."""
        for mine, theirs in zip(self.conv + self.ssm, src_pool.conv + src_pool.ssm, strict=True):
            mine.index_copy_(0, dst, theirs.index_select(0, src))

    def reset(self, entries: torch.Tensor) -> None:
        """Zero the given entries (a sequence starting from its first token)."""
        for conv, ssm in zip(self.conv, self.ssm, strict=True):
            conv.index_fill_(0, entries, 0)
            ssm.index_fill_(0, entries, 0)


@dataclass
class SplitState:
    """The state of one forward over two groups of sequences that treat it differently: the
    first `head_seqs` (prompt chunks, whose rows advance their entries in place: WRITE) and the
    rest (a verify's sequences and plain decodes, in the verify mode: DEFER or ROWS). A step
    that verifies beside a prompt chunk runs as one forward: every layer but the GDN layers'
    mixing (conv, delta rule, gated norm) runs once over all rows, and the mixing runs once per
    group, over its own rows (`head_rows` packed first, at most `head_width` a sequence; the
    rest at most `tail_width`). Run as two forwards, such a step read the weights twice. Only
    the tail is committed (`StateSlots.commit`)."""

    head: GDNState
    tail: GDNState
    head_seqs: int
    head_rows: int
    head_width: int
    tail_width: int
    # (the query_start_loc they were built from, the layouts): every GDN layer of the forward
    # asks, and each layout derives its index tensors once (`RowLayout`)
    _layouts: tuple | None = field(default=None, init=False, repr=False)

    @classmethod
    def of(
        cls,
        pool: GDNState,
        read: torch.Tensor,
        mode: StateMode,
        rows: torch.Tensor | None,
        head_seqs: int,
        head_rows: int,
        head_width: int,
        tail_width: int,
    ) -> SplitState:
        """Views of `pool` for one such forward: the first `head_seqs` entries of `read` in
        WRITE mode, the rest in the verify's `mode` (ROWS: `rows` [tail sequences, width])."""
        return cls(
            pool.view(read[:head_seqs], StateMode.WRITE),
            pool.view(read[head_seqs:], mode, rows if mode is StateMode.ROWS else None),
            head_seqs,
            head_rows,
            head_width,
            tail_width,
        )

    def layouts(self, query_start_loc: torch.Tensor, num_rows: int) -> tuple[RowLayout, ...]:
        """The two groups' row layouts, each over its own rows from 0 (the packed rows of
        `query_start_loc` [B+1], the head's first); built once a forward."""
        if self._layouts is not None and self._layouts[0] is query_start_loc:
            return self._layouts[1]
        p, n = self.head_seqs, self.head_rows
        head = RowLayout.build(query_start_loc[: p + 1], self.head_width, n)
        tail = RowLayout.build(query_start_loc[p:] - n, self.tail_width, num_rows - n)
        self._layouts = (query_start_loc, (head, tail))
        return head, tail
