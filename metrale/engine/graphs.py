"""CUDA graphs for the target's steps: one captured program per key, kept in a bounded LRU cache
(`program_cache.ProgramCache`), all laid out in one workspace of static buffers sized at start-up.

`GraphRunner` captures the target's forward and logits for one (row table or shape, KV bucket,
state mode) key. The reference attention gathers every key up to a fixed length inside the graph,
so with it the key carries the KV length rounded up to a power of two; with the Triton paged
kernel it does not. A hybrid target's programs also read their sequences' state entries from the
workspace (`state_read`, and `state_rows` for a per-row-slot verify), and a write-on-accept
verify program returns the `GDNState` whose pending rows `StateSlots.commit` settles (every
program leaves them in the pool's one `PendingBuffers`, read by its commit before the next
program runs). Prefill
programs (`program_shapes.PrefillShape` for dense targets, `GDNPrefillShape` for hybrids, whose
state they advance in WRITE mode) compute logits only for the rows that sample, and so do a
hybrid's mixed programs (`GDNMixedShape`: a verify beside prompt chunks in one forward, captured on
first use).
"""

from __future__ import annotations

import time

import torch

from metrale.engine.block_tables import DeviceBlockTables
from metrale.engine.graph_inputs import Flat, GraphInputs
from metrale.engine.kv_cache import DUMMY_PAGE
from metrale.engine.program_cache import CACHE_CAP, ProgramCache, capture, kv_bucket
from metrale.engine.program_cache import Workspace as Workspace  # re-exported
from metrale.engine.program_shapes import (
    MIXED_HEAD_SEQS,
    GDNMixedShape,
    GDNPrefillShape,
    PrefillShape,
    RaggedShape,
    all_gdn_prefill_shapes,
    all_prefill_shapes,
    all_ragged_shapes,
    capture_layout,
    default_max_rows,
    gdn_prefill_widths,
    max_ragged_seqs,
    prefill_program_rows,
)
from metrale.engine.state_cache import DUMMY_ENTRY
from metrale.models.attention import AttentionMetadata
from metrale.models.gdn_pending import PendingBuffers
from metrale.models.gdn_state import GDNState, SplitState, StateMode
from metrale.speculative.row_table import RowTable

# Mixed programs kept at most (`GraphRunner.mixed`); a steady load of 64 slots met about a
# dozen keys.
MIXED_PROGRAMS = 16


def ragged_programs(
    max_seqs: int, max_q: int, verify_mode: StateMode | None
) -> list[tuple[RaggedShape, StateMode | None]]:
    """(shape, state mode) of every ragged program. A dense target: one set of shapes (no
    state). A hybrid one: decode shapes of one row per sequence (WRITE), and verify shapes in
    the verify variant's mode: the delta rule pads each sequence to its program's `max_q` rows,
    so a decode step must not run in a verify's width."""
    if verify_mode is None:
        return [(shape, None) for shape in all_ragged_shapes(max_seqs, max_q)]
    programs = [(shape, StateMode.WRITE) for shape in all_ragged_shapes(max_seqs, 1)]
    if max_q > 1:
        programs += [(shape, verify_mode) for shape in all_ragged_shapes(max_seqs, max_q)]
    return programs


class GraphRunner:
    """Captures and replays the target forward (+ logits of every row) on CUDA."""

    def __init__(
        self,
        model,
        max_rows: int | None,
        max_model_len: int,
        page_size: int,
        device: torch.device,
        paged_kernel: bool = False,
        state_pool: GDNState | None = None,
        max_q: int = 1,
        max_seqs: int = 1,
        prefill_rows: int = 0,
        verify_mode: StateMode | None = None,
    ) -> None:
        """`paged_kernel`: the attention reads pages itself (no gather to a fixed length), so
        programs need no KV bucket in their key. `state_pool`: a hybrid target's state.
        `max_q`: the most rows one sequence runs in a step (1 + K); `max_seqs`: sequences.
        With the paged kernel programs are ragged (`program_shapes.py`; a hybrid's verify
        programs run state mode `verify_mode`), and steps with prefill chunks of up to
        `prefill_rows` rows (rounded down to a power of two; 0: none) replay prefill programs (a
        hybrid's keyed by rows per sequence too, in `prefill_widths`, and none wider). `max_rows`
        None: as many rows as any step of `max_seqs` sequences can need, so no step is
        refused. Programs leave their hidden states in the workspace (`hidden`), where a
        drafter's programs read them too (the MTP catch-up)."""
        self.model, self.page_size, self.device = model, page_size, device
        self.state_pool = state_pool
        self.max_model_len = max_model_len
        self.paged_kernel = paged_kernel
        self.ragged = paged_kernel
        self.max_q, self.max_seqs = max_q, max_seqs
        # (shape, state mode) of every program captured at start-up
        shapes = ragged_programs(max_seqs, max_q, verify_mode) if self.ragged else []
        # the largest power of two of rows a prefill program takes (0: steps with prefill
        # chunks run eagerly), within the rows the user allowed a graphed step
        prefill_rows = prefill_program_rows(prefill_rows) if self.ragged else 0
        decode_rows = max_rows or default_max_rows(max_seqs, max_q, self.ragged)
        if max_rows is None:
            max_rows = max(decode_rows, prefill_rows)
        self.prefill_rows = prefill_program_rows(min(prefill_rows, max_rows))
        prefill: list[PrefillShape | GDNPrefillShape]
        if state_pool is None:
            self.prefill_widths: list[int] = []
            prefill = all_prefill_shapes(max_seqs, self.prefill_rows, max_q)
        else:
            # read now: the deterministic mode has set the pool's threshold by then
            self.prefill_widths = gdn_prefill_widths(self.prefill_rows, state_pool.chunk_min_rows)
            prefill = all_gdn_prefill_shapes(max_seqs, self.prefill_rows, self.prefill_widths)
        # a hybrid's prefill programs advance their sequences' state in place (WRITE)
        prefill_mode = None if state_pool is None else StateMode.WRITE
        shapes += [(shape, prefill_mode) for shape in prefill]
        self.cache: ProgramCache = ProgramCache(
            self._capture,
            max_rows,
            # every start-up program stays: none is evicted and captured again mid-run
            cap=max(CACHE_CAP, len(shapes)),
            min_seqs=max(
                [max_ragged_seqs(max_seqs, max_q) if self.ragged else 0]
                + [shape.num_seqs for shape in prefill]
            ),
        )
        self._ragged_shapes = shapes
        # A hybrid's mixed programs (a verify beside prompt chunks, `GDNMixedShape`): keyed by
        # two shapes, too many to capture at start-up, so each is captured the first time a step
        # needs it, and at most MIXED_PROGRAMS are kept.
        self.mixed: ProgramCache | None = None
        if state_pool is not None and max_q > 1 and self.prefill_widths:
            self.mixed = ProgramCache(
                self._capture, max_rows, cap=MIXED_PROGRAMS, min_seqs=self.cache.workspace.seqs
            )
        ws = self.cache.workspace
        pages = -(-max_model_len // page_size) + 1
        if state_pool is not None and verify_mode is StateMode.DEFER and max_q > 1:
            # every write-on-accept program's pending rows, in one place (`PendingBuffers`):
            # as many as the widest verify (a mixed program's tail is a verify shape too)
            rows = max_ragged_seqs(max_seqs, max_q) * max_q
            state_pool.pending_out = PendingBuffers.for_pool(state_pool, rows)

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        # The workspace: static inputs every program reads (one host copy fills them,
        # `graph_inputs.py`), outputs it writes.
        self.inputs = GraphInputs(ws.rows, ws.seqs, pages, device)
        self.input_ids, self.positions = self.inputs.input_ids, self.inputs.positions
        self.slots, self.query_start_loc = self.inputs.slots, self.inputs.query_start_loc
        self.seq_lens, self.block_tables = self.inputs.seq_lens, self.inputs.block_tables
        # Every program writes its logits here (float32 [rows, V]): one buffer instead of one
        # per program (hundreds of MB each at 150k vocabulary). A replay overwrites the last
        # one's logits, which the step has consumed by then. Prefill programs write only their
        # gathered rows, so their width does not grow it.
        vocab = model.head_weight.shape[0]
        # (a mixed program's: the prompt chunks' sampling rows beside a verify's)
        mixed_rows = MIXED_HEAD_SEQS if self.mixed is not None else 0
        logit_rows = max([decode_rows + mixed_rows] + [shape.samples for shape in prefill])
        self.logits = zeros(min(ws.rows, logit_rows), vocab, dtype=torch.float32)
        # Every program leaves its hidden states here too, for the same reason: one returned
        # from the graph stayed in its pool for good (a prefill program's is a few MB), and
        # with them in the way later captures could not reuse what earlier ones freed.
        hidden_size = model.config.hidden_size
        self.hidden = zeros(ws.rows, hidden_size, dtype=model.head_weight.dtype)
        # (in the inputs too: a prefill program's rows whose logits it computes, padding row
        # 0; a hybrid target's state entries, where each sequence starts and where each row's
        # state goes, per-row slots [seqs, rows] laid out for the program's own row width)
        self.sample_rows = self.inputs.sample_rows
        self.state_read, self.state_rows = self.inputs.state_read, self.inputs.state_rows
        self.commit_rows = zeros(ws.seqs)
        # per program key: its write-on-accept commit, captured the first time it runs
        self._commits: dict[tuple[RowTable, tuple], torch.cuda.CUDAGraph] = {}
        self._last_key: tuple[RowTable, tuple] | None = None
        self.pool = torch.cuda.graph_pool_handle()

    def _meta(self, table, bucket: int) -> AttentionMetadata:
        rows, seqs = table.rows(), table.num_seqs
        if isinstance(table, (RaggedShape, PrefillShape, GDNPrefillShape, GDNMixedShape)):
            q = table.max_q  # a hybrid's GDN layers view the rows as [seqs, q]
        else:
            q = max(run.k for run in table.runs)
        return AttentionMetadata(
            slot_mapping=self.slots[:rows],
            positions=self.positions[:rows],
            query_start_loc=self.query_start_loc[: seqs + 1],
            seq_lens=self.seq_lens[:seqs],
            block_tables=self.block_tables[:seqs],
            max_query_len=q,
            max_seq_len=bucket,
            page_size=self.page_size,
        )

    def _capture(self, table: RowTable, extra: tuple[int, StateMode | None]):
        """(graph, hidden [R, H], logits [R, V], hybrid state or None): the hidden states and
        logits are views of the workspace, which every program's replay rewrites, and so are
        a write-on-accept state's pending rows (`PendingBuffers`)."""
        # a rebuilt program has new pending rows: a commit captured for the old one must go
        self._commits.pop((table, extra), None)
        self.fill_dummy(table)
        fn = self._forward_fn(table, *extra)
        graph, (hidden, logits, state) = capture(fn, self.pool, self.device)
        return graph, hidden, logits, state

    def _forward_fn(self, table, bucket: int, mode: StateMode | None):
        rows, seqs = table.rows(), table.num_seqs
        if isinstance(table, GDNMixedShape):
            return self._mixed_fn(table, bucket, mode)
        if isinstance(table, (PrefillShape, GDNPrefillShape)):
            samples = table.samples

            def prefill():
                meta = self._meta(table, bucket)
                ids, positions = self.input_ids[:rows], self.positions[:rows]
                if self.state_pool is None:
                    hidden = self.model(ids, positions, meta)
                else:  # padding sequences read and write the dummy entry alone
                    state = self.state_pool.view(self.state_read[:seqs], StateMode.WRITE)
                    hidden = self.model(ids, positions, meta, state)
                hidden = self.hidden[:rows].copy_(hidden)
                logits = self.model.compute_logits(
                    hidden, self.sample_rows[:samples], out=self.logits[:samples]
                )
                return hidden, logits, None

            return prefill
        # per-row state slots: each sequence's row entries, [seqs, width] (its widest rows)
        width = table.max_q if isinstance(table, RaggedShape) else max(r.k for r in table.runs)

        def run():
            meta = self._meta(table, bucket)
            ids, positions = self.input_ids[:rows], self.positions[:rows]
            if self.state_pool is None:
                hidden, state = self.model(ids, positions, meta), None
            else:
                assert mode is not None
                state_rows = self.state_rows[: seqs * width].view(seqs, width)
                state = self.state_pool.view(
                    self.state_read[:seqs], mode, state_rows if mode is StateMode.ROWS else None
                )
                hidden = self.model(ids, positions, meta, state)
            hidden = self.hidden[:rows].copy_(hidden)
            return hidden, self.model.compute_logits(hidden, out=self.logits[:rows]), state

        return run

    def _mixed_fn(self, table: GDNMixedShape, bucket: int, mode: StateMode):
        """A mixed program's forward: the head's sequences (prompt chunks) on the first state
        entries in WRITE mode, the tail's on the next in the verify's `mode` (its per-row slots,
        [tail seqs, tail width], at the start of `state_rows`); logits of `sample_rows`."""
        rows, samples = table.rows(), table.samples
        hs, ts, width = table.head.num_seqs, table.tail.num_seqs, table.tail.max_q

        def mixed():
            meta = self._meta(table, bucket)
            state = SplitState.of(
                self.state_pool,
                self.state_read[: hs + ts],
                mode,
                self.state_rows[: ts * width].view(ts, width),
                hs,
                table.head.rows(),
                table.head.width,
                width,
            )
            hidden = self.model(self.input_ids[:rows], self.positions[:rows], meta, state)
            hidden = self.hidden[:rows].copy_(hidden)
            logits = self.model.compute_logits(
                hidden, self.sample_rows[:samples], out=self.logits[:samples]
            )
            return hidden, logits, state

        return mixed

    def fill_dummy(self, table: RowTable) -> None:
        """Capture-time inputs: every sequence on the dummy page, its k rows at positions
        0..k-1 (the capture's warm-up really runs: every row must see a key, or its output
        would be 0 / 0 and its K/V would poison the dummy page)."""
        seqs = table.num_seqs
        self.input_ids.zero_()
        self.slots.fill_(DUMMY_PAGE * self.page_size)
        if isinstance(table, (RaggedShape, PrefillShape, GDNPrefillShape, GDNMixedShape)):
            lens = table.layout()
        else:
            lens = [run.k for run in table.runs for _ in range(run.count)]
        starts, positions = capture_layout(lens)
        self.query_start_loc[: seqs + 1] = torch.tensor(starts, device=self.device)
        self.seq_lens[:seqs] = torch.tensor(lens, device=self.device)
        self.positions[: len(positions)] = torch.tensor(positions, device=self.device)
        # NOTE: slots stay inside the dummy page whatever k is (every row's table is dummy).
        self.slots[: len(positions)] += self.positions[: len(positions)] % self.page_size
        self.block_tables.fill_(DUMMY_PAGE)
        self.state_read.fill_(DUMMY_ENTRY)
        self.state_rows.fill_(DUMMY_ENTRY)
        self.sample_rows.zero_()

    def run(
        self,
        table: RowTable,
        flat: Flat,
        device_tables: DeviceBlockTables | None = None,
        rows: list[int] | None = None,
        state: tuple[StateMode, list[int], list[int] | None] | None = None,
        sample_rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, GDNState | None]:
        """Send the step's inputs (`GraphInputs.flatten` of spans laid out as `table` says,
        padding included; `rows`: their rows of `device_tables`, as `pack_spans` takes them)
        into the workspace and replay the table's program; returns the hidden states and
        logits of every row, in the workspace (the next replay of any program overwrites
        them), and a hybrid target's state view. `state`: a hybrid target's
        `StateSlots.plan_addresses` (mode, entries read [B], row entries [B * T] or None). Raises
        ValueError (from the cache) when the table is refused, before anything is sent.
        `sample_rows`: a prefill program's gathered rows (padded to its `samples`), whose
        logits it returns in that order."""
        # Without a bucket, a table the kernel does not cover still runs the reference inside the
        # graph, gathering max_model_len keys: slower, never wrong.
        bucket = (
            self.max_model_len
            if self.paged_kernel
            else kv_bucket(flat.max_seq_len, self.max_model_len)
        )
        mode = None if state is None else state[0]
        self._last_key = (table, (bucket, mode))
        if len(flat.input_ids) != table.rows() or len(flat.seq_lens) != table.num_seqs:
            # (a program reads its shape's rows: the buffers past a step's hold older values)
            raise RuntimeError(
                f"a step of {len(flat.input_ids)} rows and {len(flat.seq_lens)} sequences "
                f"for a program of {table.rows()} and {table.num_seqs}"
            )
        cache = self.mixed if isinstance(table, GDNMixedShape) else self.cache
        # (first: a miss captures the program, which runs it on dummy inputs in the workspace)
        graph, hidden, logits, state_view = cache.get(table, (bucket, mode))
        read, state_rows = (None, None) if state is None else state[1:]
        self.inputs.send(flat, device_tables, rows, read, state_rows, sample_rows)
        graph.replay()
        return hidden, logits, state_view

    def load(self, input_ids, positions, slots, starts, seq_lens, tables) -> None:
        """Copy a step's rows and sequences (padding included), device tensors, into the
        workspace (a drafter's program that reads the target's inputs: the MTP catch-up)."""
        rows, seqs = input_ids.shape[0], seq_lens.shape[0]
        self.input_ids[:rows].copy_(input_ids, non_blocking=True)
        self.positions[:rows].copy_(positions, non_blocking=True)
        self.slots[:rows].copy_(slots, non_blocking=True)
        self.query_start_loc[: seqs + 1].copy_(starts, non_blocking=True)
        self.seq_lens[:seqs].copy_(seq_lens, non_blocking=True)
        self.block_tables[:seqs].fill_(DUMMY_PAGE)
        self.block_tables[:seqs, : tables.shape[1]].copy_(tables, non_blocking=True)

    @torch.inference_mode()
    def capture_ragged(self) -> tuple[int, float]:
        """Capture every ragged and prefill program a step of up to `max_seqs` sequences can
        use, now (start-up) rather than inside running steps: (programs, seconds). Shapes past a
        `max_rows` the user set are skipped: those steps run eagerly."""
        start, captured = time.perf_counter(), 0
        for shape, mode in self._ragged_shapes:
            if shape.rows() > self.cache.max_rows:
                continue
            self.cache.get(shape, (self.max_model_len, mode))
            captured += 1
        torch.cuda.synchronize(self.device)
        return captured, time.perf_counter() - start

    def pool_bytes(self) -> int:
        """Device memory the programs' pool holds now: its segments in the caching allocator
        (what `metrale bench` reports the start-up programs took). A difference of the device's
        free memory read negative after other engines in one process: their programs' pools,
        released meanwhile, gave memory back."""
        pool = tuple(self.pool)
        return sum(
            s["total_size"]
            for s in torch.cuda.memory_snapshot()
            if tuple(s.get("segment_pool_id", ())) == pool
        )

    def holds(self, key) -> bool:
        """Whether a program of this (table, extra) key is cached."""
        return key in self.cache or (self.mixed is not None and key in self.mixed)

    def commit(self, state: GDNState, num_rows: torch.Tensor) -> None:
        """`state.commit(num_rows)` for the program just replayed (write-on-accept), as a graph
        of its own: one launch instead of a few hundred. The first time, the capture's warm-up
        run is the real commit."""
        if self._last_key is None:
            raise RuntimeError("a graphed commit before any replay")
        b = num_rows.shape[0]
        self.commit_rows[:b].copy_(num_rows, non_blocking=True)
        graph = self._commits.get(self._last_key)
        if graph is not None:
            graph.replay()
            return
        rows = self.commit_rows[:b]
        graph, _ = capture(lambda: state.commit(rows), self.pool, self.device)
        self._commits[self._last_key] = graph
        if len(self._commits) > self.cache.cap:  # bounded like the programs: drop evicted ones
            for key in [k for k in self._commits if not self.holds(k)]:
                del self._commits[key]
