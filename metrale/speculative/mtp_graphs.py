"""CUDA graphs for the MTP drafter's chained steps and its catch-up.

A chained draft step runs one MTP depth module over one row per sequence, then the target's head
and an argmax: a few dozen small kernels whose launch costs (tens of microseconds each, eagerly)
exceed their run time. Run eagerly, the K - 1 chain steps of a verify cost more than the target's
whole decode step on a small model. Each (depth module, padded sequence count) is captured once
and replayed; padding rows are one-row sequences on the dummy page, like decode padding.

Inputs are copied into one static workspace that all programs read: draft tokens, positions,
slots, the block tables and the chain's hidden states. The outputs (draft ids, next hiddens)
live in the graph pool and are consumed before the next replay.

The catch-up after a decode or verify step (1 .. 1 + K committed rows per sequence, through the
first module, then the head's argmax and the next hidden at each sequence's newest row) runs as
ragged programs (`engine/program_shapes.py`), captured at start-up like the target's: its rows
per sequence vary every step, so one program per (row bucket, sequence bucket) serves them all.
Prefill chunks, longer than 1 + K rows, catch up eagerly.
"""

from __future__ import annotations

import torch

from metrale.engine.graphs import capture
from metrale.engine.kv_cache import DUMMY_PAGE
from metrale.engine.program_shapes import (
    RaggedShape,
    all_ragged_shapes,
    capture_layout,
    decode_bucket,
    padding_rows,
    ragged_shape,
)
from metrale.models.attention import AttentionMetadata


class DraftChainGraphs:
    """Programs keyed by (depth module index, padded sequence count)."""

    def __init__(
        self, runner, heads, max_seqs: int, max_model_len: int, num_slots: int | None = None
    ) -> None:
        """`max_seqs`: sequences a chain step drafts for; `num_slots`: sequences a catch-up
        covers (every running one)."""
        self.runner, self.heads = runner, heads
        self.page_size = runner.page_size
        self.max_model_len = max_model_len
        self.max_seqs = decode_bucket(max_seqs)
        device, n = runner.device, self.max_seqs
        pages = -(-max_model_len // self.page_size) + 1

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.tokens, self.positions, self.slots = zeros(n), zeros(n), zeros(n)
        self.starts = torch.arange(n + 1, device=device)  # one row per sequence, always
        self.seq_lens = zeros(n)
        self.block_tables = zeros(n, pages)
        self.hidden = zeros(n, runner.model.config.hidden_size, dtype=runner.dtype)
        self.pool = runner.graphs.pool
        self._programs: dict[tuple[int, int], tuple] = {}
        self._catch_up_setup(num_slots or max_seqs, runner.graphs.max_q, pages)

    def _step_fn(self, module_index: int, n: int):
        module = self.heads.depths[module_index]
        model = self.runner.model

        def run():
            meta = AttentionMetadata(
                slot_mapping=self.slots[:n],
                positions=self.positions[:n],
                query_start_loc=self.starts[: n + 1],
                seq_lens=self.seq_lens[:n],
                block_tables=self.block_tables[:n],
                max_query_len=1,
                max_seq_len=self.max_model_len,
                page_size=self.page_size,
            )
            logits_in, next_hidden = module(
                self.tokens[:n], self.positions[:n], self.hidden[:n], meta, model.model.embed_tokens
            )
            return model.compute_logits(logits_in).argmax(dim=-1), next_hidden

        return run

    def _program(self, module_index: int, n: int):
        key = (module_index, n)
        if key not in self._programs:
            # Capture-time inputs: every row a one-row sequence on the dummy page.
            self.tokens.zero_()
            self.positions.zero_()
            self.slots.fill_(DUMMY_PAGE * self.page_size)
            self.seq_lens.fill_(1)
            self.block_tables.fill_(DUMMY_PAGE)
            self._programs[key] = capture(
                self._step_fn(module_index, n), self.pool, self.runner.device
            )
        return self._programs[key]

    def step(
        self,
        module_index: int,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        spans: list[tuple[list[int], int, list[int]]],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(draft ids [C], next hidden [C, H]) of one chained step over C sequences (`spans`:
        block table, position, one placeholder token each), or None when C is past the
        workspace (the caller then runs eagerly)."""
        count = len(spans)
        n = decode_bucket(count)
        if n > self.max_seqs:
            return None
        graph, (drafts, next_hidden) = self._program(module_index, n)
        _, positions, meta = self.runner.span_metadata(spans)
        self.tokens[:count].copy_(tokens, non_blocking=True)
        self.hidden[:count].copy_(hidden, non_blocking=True)
        self.positions[:count].copy_(positions, non_blocking=True)
        self.slots[:count].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:count].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n].fill_(DUMMY_PAGE)
        width = meta.block_tables.shape[1]
        self.block_tables[:count, :width].copy_(meta.block_tables, non_blocking=True)
        # NOTE: padding rows write their K/V to the dummy page and see only it.
        self.tokens[count:n].zero_()
        self.positions[count:n].zero_()
        self.slots[count:n].fill_(DUMMY_PAGE * self.page_size)
        self.seq_lens[count:n].fill_(1)
        graph.replay()
        return drafts[:count].clone(), next_hidden[:count].clone()

    # ---- the catch-up ---------------------------------------------------------------------

    def _catch_up_setup(self, num_slots: int, max_q: int, pages: int) -> None:
        self.max_q, self.catch_up_seqs = max_q, num_slots
        shapes = all_ragged_shapes(num_slots, max_q)
        rows, seqs = max(s.rows() for s in shapes), max(s.num_seqs for s in shapes)
        device, dtype = self.runner.device, self.runner.dtype

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.c_tokens, self.c_positions, self.c_slots = zeros(rows), zeros(rows), zeros(rows)
        self.c_hidden = zeros(rows, self.runner.model.config.hidden_size, dtype=dtype)
        self.c_starts, self.c_lens = zeros(seqs + 1), zeros(seqs)
        self.c_tables = zeros(seqs, pages)
        self._catch_ups: dict[RaggedShape, tuple] = {}
        self.catch_up_replays = 0
        with torch.inference_mode():
            for shape in shapes:
                self._catch_up_program(shape)

    def _catch_up_fn(self, shape: RaggedShape):
        rows, seqs = shape.rows(), shape.num_seqs
        module, model = self.heads.for_step(0), self.runner.model

        def run():
            starts = self.c_starts[: seqs + 1]
            meta = AttentionMetadata(
                slot_mapping=self.c_slots[:rows],
                positions=self.c_positions[:rows],
                query_start_loc=starts,
                seq_lens=self.c_lens[:seqs],
                block_tables=self.c_tables[:seqs],
                max_query_len=shape.max_q,
                max_seq_len=self.max_model_len,
                page_size=self.page_size,
            )
            logits_in, next_hidden = module(
                self.c_tokens[:rows],
                self.c_positions[:rows],
                self.c_hidden[:rows],
                meta,
                model.model.embed_tokens,
            )
            # each sequence's newest row (padding sequences without rows read a real row)
            last = (starts[1:] - 1).clamp_(min=0)
            firsts = model.compute_logits(logits_in, last).argmax(dim=-1)
            return firsts, next_hidden.index_select(0, last)

        return run

    def _catch_up_program(self, shape: RaggedShape):
        program = self._catch_ups.get(shape)
        if program is None:
            # Capture-time inputs: every sequence on the dummy page, its rows at 0..k-1.
            layout = shape.layout()
            self.c_tokens.zero_()
            self.c_hidden.zero_()
            self.c_tables.fill_(DUMMY_PAGE)
            starts, positions = capture_layout(layout)
            device = self.runner.device
            self.c_starts[: len(starts)] = torch.tensor(starts, device=device)
            self.c_lens[: len(layout)] = torch.tensor(layout, device=device)
            self.c_positions[: len(positions)] = torch.tensor(positions, device=device)
            self.c_slots.fill_(DUMMY_PAGE * self.page_size)
            self.c_slots[: len(positions)] += self.c_positions[: len(positions)] % self.page_size
            program = capture(self._catch_up_fn(shape), self.pool, device)
            self._catch_ups[shape] = program
        return program

    def catch_up(
        self, spans: list[tuple[list[int], int, list[int]]], hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(first drafts [S], next hidden [S, H] at each span's newest row) of the first module
        over the spans' rows (`hidden` [R, H], the target's), or None when a span is longer than
        1 + K rows or there are more spans than slots (the caller then runs eagerly)."""
        count, rows = len(spans), hidden.shape[0]
        if count > self.catch_up_seqs or any(len(t) > self.max_q for _, _, t in spans):
            return None
        shape = ragged_shape(count, rows, self.max_q)
        graph, (firsts, last_hidden) = self._catch_up_program(shape)
        dummy = [DUMMY_PAGE] * -(-self.max_q // self.page_size)
        padded = spans + [(dummy, 0, [0] * n) for n in padding_rows(shape, count, rows)]
        ids, positions, meta = self.runner.span_metadata(padded)
        n, total = shape.num_seqs, shape.rows()
        self.c_tokens[:total].copy_(ids, non_blocking=True)
        self.c_positions[:total].copy_(positions, non_blocking=True)
        self.c_slots[:total].copy_(meta.slot_mapping, non_blocking=True)
        self.c_hidden[:rows].copy_(hidden, non_blocking=True)
        self.c_hidden[rows:total].zero_()
        self.c_starts[: n + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.c_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.c_tables[:n].fill_(DUMMY_PAGE)
        width = meta.block_tables.shape[1]
        self.c_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        graph.replay()
        self.catch_up_replays += 1
        return firsts[:count].clone(), last_hidden[:count].clone()
