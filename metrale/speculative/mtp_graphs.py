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
one replay. Prompt chunks catch up in programs of the target's prefill shapes (captured at
start-up too), in pieces when a step holds more rows than the widest.
"""

from __future__ import annotations

import torch

from metrale.engine.graphs import capture
from metrale.engine.kv_cache import DUMMY_PAGE
from metrale.engine.program_shapes import (
    PrefillShape,
    RaggedShape,
    all_prefill_shapes,
    all_ragged_shapes,
    decode_bucket,
    padding_rows,
    prefill_shape,
    ragged_shape,
)
from metrale.engine.staging import to_device_packed
from metrale.models.attention import AttentionMetadata
from metrale.speculative.verify import accepted_from_tokens


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
        self.max_positions = runner.model.model.rotary.cos.shape[0]  # the rotary table
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

    def _chain(self, tokens, hidden, base, tables, steps: int, live=None) -> torch.Tensor:
        """Draft steps 1..`steps` of one-row sequences at positions base + j, whose slots and
        lengths are computed here, on the device, from the block tables: [n, steps]. `live`
        [n] bool: the sequences whose rows are written (the others write to the dummy page)."""
        vocab, page = self.runner.vocab, self.page_size
        width, n = tables.shape[1], tables.shape[0]
        columns = []
        for j in range(1, steps + 1):
            # NOTE: a sequence chains to the longest depth of the batch (a chain ahead, to K - 1
            # whatever its caps); rows past its own pages (its table is padded with the dummy
            # page, and past the table's width nothing is read) or past the positions the
            # rotary table holds (the model length) write their K/V to the dummy page, at a
            # clamped position, and their drafts are never proposed.
            positions = (base + j).clamp(max=self.max_positions - 1)
            column = positions // page
            inside = (column < width) & (base + j < self.max_positions)
            if live is not None:
                inside &= live
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
        """The catch-up programs read the target's workspace (`GraphRunner`): its rows,
        positions, slots, sequences, tables and hiddens, as the target's own ragged program
        left them, or as `catch_up` loads them; their own inputs are the tokens and three
        numbers per sequence."""
        self.max_q, self.catch_up_seqs = max_q, num_slots
        self.target = self.runner.graphs
        t = self.target

        def fits(shape) -> bool:  # the workspace may be smaller (`graph_max_rows`, a hybrid's)
            return shape.num_seqs <= t.seq_lens.shape[0] and shape.rows() <= t.input_ids.shape[0]

        shapes = [shape for shape in all_ragged_shapes(num_slots, max_q) if fits(shape)]
        # Steps with prompt chunks catch up in programs of the target's prefill shapes (the
        # target's own steps of up to `prefill_rows` rows replay them), chaining nothing ahead.
        self.prefill_rows = t.prefill_rows
        prefill = [s for s in all_prefill_shapes(num_slots, self.prefill_rows, max_q) if fits(s)]
        every = shapes + prefill or [RaggedShape(1, 1, 1)]
        rows, seqs = max(s.rows() for s in every), max(s.num_seqs for s in every)
        device = self.runner.device
        # the committed token after each row: the target's pick there
        self.c_tokens = torch.zeros(rows, dtype=torch.long, device=device)
        # per sequence: its entry in `slot_state`; how many of its leading rows the chain
        # already wrote (those accepted are not written again); 1 when every row is committed
        # (a catch-up from the verdicts) rather than up to the first rejected draft
        self.c_books = torch.zeros(3, seqs, dtype=torch.long, device=device)
        self.row_index = torch.arange(rows, device=device)
        if seqs >= self.starts.shape[0]:  # the chain ahead runs one row per catch-up sequence
            self.starts = torch.arange(seqs + 1, device=device)
        self._catch_ups: dict[tuple[RaggedShape, int], tuple] = {}
        self.catch_up_replays = 0
        self.verified_replays = 0  # of them, catch-ups that followed the target's own program
        # the drafts the last catch-up chained ahead, and how many such catch-ups ran
        self.ahead = torch.zeros(seqs, max(max_q - 1, 1), dtype=torch.long, device=device)
        self.ahead_replays = 0
        with torch.inference_mode():
            for shape in shapes:
                for steps in {0, max_q - 2}:  # without and with the chain ahead
                    self._catch_up_program(shape, steps)
            for shape in prefill:
                self._catch_up_program(shape, 0)

    def _accepted(self, starts, rows: int, q: int) -> torch.Tensor:
        """[S] each sequence's committed rows past its first: up to its first draft that is
        not the target's pick at the row before it, or all of them where `c_books[2]` says so."""
        seqs, tokens = starts.shape[0] - 1, self.c_tokens[:rows]
        accepted = accepted_from_tokens(starts, tokens, self.target.input_ids, q)
        every = (starts[1:] - starts[:-1] - 1).clamp_(min=0)
        return torch.where(self.c_books[2, :seqs] > 0, every, accepted)

    def _catch_up_fn(self, shape: RaggedShape | PrefillShape, steps: int):
        rows, seqs, q = shape.rows(), shape.num_seqs, shape.max_q
        module, vocab, page = self.heads.for_step(0), self.runner.vocab, self.page_size
        t = self.target

        def run():
            starts = t.query_start_loc[: seqs + 1]
            first_row = starts[:-1]
            accepted = self._accepted(starts, rows, q)
            keep = torch.minimum(accepted, self.c_books[1, :seqs])
            # each row's sequence and place in it; rows outside keep..accepted write no K/V
            row = self.row_index[:rows]
            owner = torch.searchsorted(starts[1:], row, right=True).clamp_(max=seqs - 1)
            j = row - first_row[owner]
            # a sequence that does not draft with MTP (its entry is the scratch one) writes
            # nothing to its pages, as the eager drafter never would
            owners = self.c_books[0, :seqs]
            live = owners != self.slot_state[0].shape[0] - 1
            fed = (j >= keep[owner]) & (j <= accepted[owner]) & live[owner]
            positions = t.positions[:rows]
            slots = torch.where(fed, t.slots[:rows], DUMMY_PAGE * page + positions % page)
            tables = t.block_tables[:seqs]
            meta = AttentionMetadata(
                slot_mapping=slots,
                positions=positions,
                query_start_loc=starts,
                seq_lens=t.seq_lens[:seqs],
                block_tables=tables,
                max_query_len=q,
                max_seq_len=self.max_model_len,
                page_size=page,
            )
            tokens = self.c_tokens[:rows]
            logits_in, next_hidden = module(
                tokens, positions, t.hidden[:rows], meta, vocab.embed_tokens
            )
            # each sequence's newest committed row (padding sequences without rows: a real one)
            last = (first_row + accepted).clamp_(max=rows - 1)
            firsts = vocab.compute_logits(logits_in, last).argmax(dim=-1)
            hidden = next_hidden.index_select(0, last)
            self.slot_state[0].index_copy_(0, owners, firsts)
            self.slot_state[1].index_copy_(0, owners, hidden)
            if not steps:
                return firsts[:, None]
            # NOTE: padding sequences chain from a real row's position on dummy-page tables.
            base = positions.index_select(0, last)
            columns = self._chain(firsts, hidden, base, tables, steps, live)
            # out of the graph pool: no other program's replay (a second catch-up, a hybrid's
            # commit) can rewrite it before `propose` reads it
            self.ahead[:seqs].copy_(torch.cat([firsts[:, None], columns], dim=1))
            return self.ahead[:seqs]

        return run

    def _catch_up_program(self, shape: RaggedShape | PrefillShape, steps: int):
        program = self._catch_ups.get((shape, steps))
        if program is None:
            # Capture-time inputs: every sequence on the dummy page, its rows at 0..k-1.
            # NOTE: this rewrites the target's workspace: never between a target program and
            # a catch-up that reads what it left (`catch_up_verified` captures nothing).
            self.target.fill_dummy(shape)
            self.target.hidden.zero_()
            self.c_tokens.zero_()
            self.c_books.zero_()
            self.c_books[0].fill_(self.slot_state[0].shape[0] - 1)
            self.c_books[2].fill_(1)
            program = capture(self._catch_up_fn(shape, steps), self.pool, self.runner.device)
            self._catch_ups[(shape, steps)] = program
        return program

    def catch_up(
        self,
        spans: list[tuple[list[int], int, list[int]]],
        hidden: torch.Tensor,
        slots: list[int],
        ahead: bool,
    ) -> int | None:
        """Run the first module over the spans' rows (`hidden` [R, H], the target's) and write
        each span's first draft and next hidden at its newest row into `slot_state[slots]`. With
        `ahead`, chain the next step's drafts from there too, in the same program, into
        `ahead` [S, K] (draft 1, then the chain; the next chaining catch-up rewrites it).
        Returns the replay's stamp (`current`). Spans longer than 1 + K rows (prompt chunks) take
        a prefill-shaped program, which chains nothing ahead. None when they are too long for
        any or there are more spans than slots (the caller then runs eagerly). The spans are
        loaded into the target's workspace, which its step no longer needs."""
        count, rows = len(spans), hidden.shape[0]
        if count > self.catch_up_seqs:
            return None
        if all(len(t) <= self.max_q for _, _, t in spans):
            shape = ragged_shape(count, rows, self.max_q)
            dummy = [DUMMY_PAGE] * -(-self.max_q // self.page_size)
            padded = spans + [(dummy, 0, [0] * n) for n in padding_rows(shape, count, rows)]
        elif rows <= self.prefill_rows and not ahead:
            # real rows first; the first padding sequence takes every padding row
            shape = prefill_shape(count, rows, self.max_q)
            pad = shape.rows() - rows
            dummy = [DUMMY_PAGE] * max(-(-pad // self.page_size), 1)
            padded = spans + [(dummy, 0, [0] * pad)]
            padded += [([DUMMY_PAGE], 0, [])] * (shape.num_seqs - len(padded))
        else:
            return None
        program = self._catch_ups.get((shape, self.max_q - 2 if ahead else 0))
        if program is None:  # past the workspace: capturing it would not help
            return None
        graph, _ = program
        ids, positions, meta = self.runner.span_metadata(padded)
        n, total = shape.num_seqs, shape.rows()
        t, scratch = self.target, self.slot_state[0].shape[0] - 1
        t.load(
            ids,
            positions,
            meta.slot_mapping,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
        )
        t.hidden[:rows].copy_(hidden, non_blocking=True)
        t.hidden[rows:total].zero_()
        self.c_tokens[:total].copy_(ids, non_blocking=True)
        self._load_books([slots + [scratch] * (n - count), [0] * n, [1] * n])
        return self._replay(graph, ahead)

    def catch_up_verified(
        self,
        shape: RaggedShape | PrefillShape,
        tokens: torch.Tensor,
        owners: list[int],
        keeps: list[int],
        every: list[int],
        ends: list[tuple[int, int]],
        ahead: bool,
    ) -> int | None:
        """The catch-up of a step the target just replayed as program `shape` (ragged, or
        prefill-shaped: with prompt chunks), before the host knows what was accepted: the
        program reads the step's rows, tables and hiddens where the target's program left them.
        `tokens`: the target's pick at each sampling row, on the device (every row of a ragged
        program samples; a prefill program's sampling rows are in the workspace's
        `sample_rows`). A row that does not sample is followed by the next row's token, or at
        the end of a chunk the prompt goes on after, by the token `ends` gives ((row, token)).
        Per sequence: its entry in `slot_state` (`owners`), the chain's rows it keeps (`keeps`),
        and whether every row is committed (`every`: 1) or the program works out the accepted
        drafts (0). Returns what `catch_up` returns, for every sequence of the step; None when
        no program was captured for the shape (capturing now would overwrite the workspace)."""
        program = self._catch_ups.get((shape, self.max_q - 2 if ahead else 0))
        if program is None:
            return None
        graph, _ = program
        pad = shape.num_seqs - len(owners)
        scratch = self.slot_state[0].shape[0] - 1
        books = [owners + [scratch] * pad, keeps + [0] * pad, every + [1] * pad]
        if isinstance(shape, RaggedShape):
            self.c_tokens[: tokens.shape[0]].copy_(tokens, non_blocking=True)
            self._load_books(books)
        else:
            t, total = self.target, shape.rows()
            self.c_tokens[: total - 1].copy_(t.input_ids[1:total], non_blocking=True)
            at, end_tokens = self._load_books(books, [[r for r, _ in ends], [k for _, k in ends]])
            self.c_tokens.index_copy_(0, at, end_tokens)
            self.c_tokens.index_copy_(0, t.sample_rows[: tokens.shape[0]], tokens)
        self.verified_replays += 1
        return self._replay(graph, ahead)

    def _load_books(self, books: list[list[int]], extra: list[list[int]] = ()) -> list:
        """Upload the three per-sequence numbers (and `extra` lists, returned on the device)."""
        n = len(books[0])
        device = self.runner.device
        packed, *rest = to_device_packed([[v for b in books for v in b], *extra], device)
        self.c_books[:, :n].copy_(packed.view(3, n), non_blocking=True)
        return rest

    def _replay(self, graph, ahead: bool) -> int:
        """Replay a catch-up program; returns the stamp of the drafts in `ahead` (which
        `current` tells apart from a later chaining catch-up's, which rewrites them)."""
        graph.replay()
        self.catch_up_replays += 1
        self.ahead_replays += ahead
        return self.ahead_replays

    def current(self, stamp) -> bool:
        """Whether drafts `catch_up` chained ahead with `stamp` are still in `ahead`."""
        return stamp == self.ahead_replays
