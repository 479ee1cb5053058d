"""CUDA graphs for the MTP drafter's chained steps and its catch-up.

A chained draft step runs one MTP depth module over one row per sequence, then the target's head
and an argmax: a few dozen small kernels whose launch costs (tens of microseconds each, eagerly)
exceed their run time. Run eagerly, the K - 1 chain steps of a verify cost more than the target's
whole decode step on a small model. So the whole chain (steps 1 .. K - 1) is one program per
(padded sequence count, chain length), captured on first use and replayed: the host uploads the
first drafts, hiddens, base positions and block tables once, and each step's positions, slots and
lengths are computed on the device. Padding rows are one-row sequences on the dummy page.

Inputs are copied into one static workspace that all programs read. The outputs (the draft
columns) live in the graph pool and are consumed before the next replay.

The catch-up after a decode or verify step (1 .. 1 + K committed rows per sequence, through the
first module, then the head's argmax and the next hidden at each sequence's newest row, written
into the drafter's per-slot state) runs as ragged programs (`engine/program_shapes.py`),
captured at start-up like the target's: its rows per sequence vary every step, so one program
per (row bucket, sequence bucket) serves them all. A second variant of each also chains the next
step's drafts from the rows it just computed (drafting ahead), so a verify step's drafter work is
one replay. Prefill chunks, longer than 1 + K rows, catch up eagerly.
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
from metrale.engine.staging import to_device_packed
from metrale.models.attention import AttentionMetadata


class DraftChainGraphs:
    """Chain programs keyed by (padded sequence count, chain steps); catch-up programs by
    ragged shape."""

    def __init__(
        self,
        runner,
        heads,
        max_seqs: int,
        max_model_len: int,
        num_slots: int | None = None,
        slot_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """`max_seqs`: sequences a chain step drafts for; `num_slots`: sequences a catch-up
        covers (every running one). `slot_state`: the drafter's per-slot first draft [N + 1]
        and hidden [N + 1, H], which the catch-up programs update in place (the last entry
        takes the padding sequences' writes)."""
        self.runner, self.heads = runner, heads
        self.page_size = runner.page_size
        self.max_model_len = max_model_len
        self.max_seqs = decode_bucket(max_seqs)
        device, n = runner.device, self.max_seqs
        pages = -(-max_model_len // self.page_size) + 1

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.tokens, self.positions = zeros(n), zeros(n)
        self.starts = torch.arange(n + 1, device=device)  # one row per sequence, always
        self.block_tables = zeros(n, pages)
        self.hidden = zeros(n, runner.model.config.hidden_size, dtype=runner.dtype)
        self.pool = runner.graphs.pool
        self._programs: dict[tuple[int, int], tuple] = {}
        num = num_slots or max_seqs
        self.slot_state = slot_state or (
            zeros(num + 1),
            zeros(num + 1, runner.model.config.hidden_size, dtype=runner.dtype),
        )
        self._catch_up_setup(num_slots or max_seqs, runner.graphs.max_q, pages)

    def _chain(self, tokens, hidden, base, tables, steps: int) -> torch.Tensor:
        """Draft steps 1..`steps` of one-row sequences at positions base + j, whose slots and
        lengths are computed here, on the device, from the block tables: [n, steps]."""
        vocab, page = self.runner.vocab, self.page_size
        width, n = tables.shape[1], tables.shape[0]
        columns = []
        for j in range(1, steps + 1):
            positions = base + j
            column = positions // page
            # NOTE: a sequence chains to the longest depth of the batch; rows past its own pages
            # (its table is padded with the dummy page, and past the table's width nothing is
            # read) write their K/V to the dummy page, and are discarded.
            inside = column < width
            pages = tables.gather(1, column.clamp(max=width - 1)[:, None]).squeeze(1)
            pages = torch.where(inside, pages, DUMMY_PAGE)
            meta = AttentionMetadata(
                slot_mapping=pages * page + positions % page,
                positions=positions,
                query_start_loc=self.starts[: n + 1],
                seq_lens=positions + 1,
                block_tables=tables,
                max_query_len=1,
                max_seq_len=self.max_model_len,
                page_size=page,
            )
            logits_in, hidden = self.heads.for_step(j)(
                tokens, positions, hidden, meta, vocab.embed_tokens
            )
            tokens = vocab.compute_logits(logits_in).argmax(dim=-1)
            columns.append(tokens)
        return torch.stack(columns, dim=1)

    def _chain_fn(self, n: int, steps: int):
        """The chain over the workspace: the host uploads the base positions and tables once
        per chain, not once per step."""

        def run():
            tables, base = self.block_tables[:n], self.positions[:n]
            return self._chain(self.tokens[:n], self.hidden[:n], base, tables, steps)

        return run

    def _program(self, n: int, steps: int):
        key = (n, steps)
        if key not in self._programs:
            # Capture-time inputs: every row a one-row sequence on the dummy page.
            self.tokens.zero_()
            self.positions.zero_()
            self.block_tables.fill_(DUMMY_PAGE)
            self._programs[key] = capture(self._chain_fn(n, steps), self.pool, self.runner.device)
        return self._programs[key]

    def chain(
        self,
        first: torch.Tensor,
        hidden: torch.Tensor,
        positions: list[int],
        tables: list[list[int]],
        steps: int,
    ) -> torch.Tensor | None:
        """Drafts 2 .. 1 + `steps` [C, steps] of C sequences, chained from their first drafts
        `first` [C] and hiddens [C, H] at their newest committed positions `positions` (block
        tables `tables`), in one replay; None when C is past the workspace (the caller then
        runs eagerly). Each sequence is chained `steps` deep: keep the columns it asked for."""
        count = len(positions)
        n = decode_bucket(count)
        if n > self.max_seqs:
            return None
        graph, columns = self._program(n, steps)
        width = max(len(t) for t in tables)
        flat = [p for t in tables for p in t + [DUMMY_PAGE] * (width - len(t))]
        pos_t, tables_t = to_device_packed([positions, flat], self.runner.device)
        self.tokens[:count].copy_(first, non_blocking=True)
        self.hidden[:count].copy_(hidden, non_blocking=True)
        self.positions[:count].copy_(pos_t, non_blocking=True)
        self.block_tables[:n].fill_(DUMMY_PAGE)
        self.block_tables[:count, :width].copy_(tables_t.view(count, width), non_blocking=True)
        # NOTE: padding rows are one-row sequences on the dummy page, as in decode padding.
        self.tokens[count:n].zero_()
        self.positions[count:n].zero_()
        graph.replay()
        return columns[:count]

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
        self.c_owners = zeros(seqs)  # each sequence's slot in `slot_state`
        if seqs >= self.starts.shape[0]:  # the chain ahead runs one row per catch-up sequence
            self.starts = torch.arange(seqs + 1, device=device)
        self._catch_ups: dict[tuple[RaggedShape, int], tuple] = {}
        self.catch_up_replays = 0
        with torch.inference_mode():
            for shape in shapes:
                for steps in {0, max_q - 2}:  # without and with the chain ahead
                    self._catch_up_program(shape, steps)

    def _catch_up_fn(self, shape: RaggedShape, steps: int):
        rows, seqs = shape.rows(), shape.num_seqs
        module, vocab = self.heads.for_step(0), self.runner.vocab

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
                vocab.embed_tokens,
            )
            # each sequence's newest row (padding sequences without rows read a real row)
            last = (starts[1:] - 1).clamp_(min=0)
            firsts = vocab.compute_logits(logits_in, last).argmax(dim=-1)
            hidden = next_hidden.index_select(0, last)
            owners = self.c_owners[:seqs]
            self.slot_state[0].index_copy_(0, owners, firsts)
            self.slot_state[1].index_copy_(0, owners, hidden)
            if not steps:
                return firsts[:, None]
            # NOTE: padding sequences chain from a real row's position on dummy-page tables.
            base = self.c_positions[:rows].index_select(0, last)
            columns = self._chain(firsts, hidden, base, self.c_tables[:seqs], steps)
            return torch.cat([firsts[:, None], columns], dim=1)

        return run

    def _catch_up_program(self, shape: RaggedShape, steps: int):
        program = self._catch_ups.get((shape, steps))
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
            self.c_owners.fill_(self.slot_state[0].shape[0] - 1)
            program = capture(self._catch_up_fn(shape, steps), self.pool, device)
            self._catch_ups[(shape, steps)] = program
        return program

    def catch_up(
        self,
        spans: list[tuple[list[int], int, list[int]]],
        hidden: torch.Tensor,
        slots: list[int],
        ahead: bool,
    ) -> torch.Tensor | None:
        """Run the first module over the spans' rows (`hidden` [R, H], the target's) and write
        each span's first draft and next hidden at its newest row into `slot_state[slots]`. With
        `ahead`, chain the next step's drafts from there too, in the same program, and return
        them [S, K] (draft 1, then the chain), a view the next catch-up rewrites; else [S, 1].
        None when a span is longer than 1 + K rows or there are more spans than slots (the
        caller then runs eagerly)."""
        count, rows = len(spans), hidden.shape[0]
        if count > self.catch_up_seqs or any(len(t) > self.max_q for _, _, t in spans):
            return None
        shape = ragged_shape(count, rows, self.max_q)
        graph, table = self._catch_up_program(shape, self.max_q - 2 if ahead else 0)
        dummy = [DUMMY_PAGE] * -(-self.max_q // self.page_size)
        padded = spans + [(dummy, 0, [0] * n) for n in padding_rows(shape, count, rows)]
        ids, positions, meta = self.runner.span_metadata(padded)
        n, total = shape.num_seqs, shape.rows()
        scratch = self.slot_state[0].shape[0] - 1
        (owners,) = to_device_packed([slots + [scratch] * (n - count)], self.runner.device)
        self.c_tokens[:total].copy_(ids, non_blocking=True)
        self.c_positions[:total].copy_(positions, non_blocking=True)
        self.c_slots[:total].copy_(meta.slot_mapping, non_blocking=True)
        self.c_hidden[:rows].copy_(hidden, non_blocking=True)
        self.c_hidden[rows:total].zero_()
        self.c_starts[: n + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.c_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.c_owners[:n].copy_(owners, non_blocking=True)
        self.c_tables[:n].fill_(DUMMY_PAGE)
        width = meta.block_tables.shape[1]
        self.c_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        graph.replay()
        self.catch_up_replays += 1
        return table[:count]
