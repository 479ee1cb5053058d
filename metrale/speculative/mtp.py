"""MTP drafter: the checkpoint's multi-token-prediction head(s) chained for K drafts.

After every target forward, `observe` catches the MTP layer up on the rows whose tokens are
now committed (prefill chunks, the last token and the accepted drafts of a verify): the row at
position p takes the target's hidden at p and the committed token at p+1, writes the MTP layer's
KV at p, and the last row's output gives the first draft. `propose` chains the rest: draft j+1
comes from the module fed with draft j and the previous step's own output hidden, one row per
sequence per depth (module `j % num_layers`), writing the MTP KV of positions p+1, p+2, ...

Rows of accepted drafts were already written by the chain, with the drafter's own hidden, and
are kept (one catch-up row per verify, as the reference system does); with one sequence
(`SpecConfig.mtp_max_seqs` = 1), `METRALE_MTP_CATCHUP=1 METRALE_MTP_REFEED_ACCEPTED=1` re-feed
them with the target's hiddens (`METRALE_MTP_REFEED_SHIFT`, `..._DEBUG`: probes, `knobs.py`).
Rows the chain never wrote (prefill, plain decodes, the bonus row) are always fed.

On CUDA with graphs the chain is one captured program, the catch-up a ragged or prefill-shaped
one (`mtp_graphs.py`; in pieces past those); the CPU runs all eagerly.

NOTE: rollback: chain rows of rejected drafts lie past the committed positions; the next
catch-up rewrites them before any row reads them. The MTP KV shares the target's block tables,
so pages follow the sequence. Drafts are greedy (one-hot q): lossless at any temperature.
"""

from __future__ import annotations

import logging

import torch

from metrale.engine.device_tokens import DeviceDrafts, DeviceRow
from metrale.engine.prefix_cache import DraftKV
from metrale.engine.program_shapes import PrefillShape, RaggedShape
from metrale.engine.sequence import Sequence
from metrale.engine.staging import to_device_packed
from metrale.knobs import (
    hidden_fingerprint,
    knobs,
    mtp_catchup_enabled,
    mtp_refeed_accepted_enabled,
)
from metrale.speculative.drafter import Draft, Verdict, may_draft
from metrale.speculative.mtp_graphs import DraftChainGraphs

log = logging.getLogger(__name__)

# Up to this many sequences, drafts chained ahead stay on the device (the verify's input ids
# take them) and the host packs the verify while the chain runs: H100 batch 1, 0.247 -> 0.232
# ms a token. More read them back (batch 8: 0.39 -> 0.43 ms; H200 batch 64: 1.12x -> 0.99x).
AHEAD_ON_DEVICE_SEQS = 4


class MTPDrafter:
    name = "mtp"
    needs_hidden = True
    # it catches up from every step of a sequence that drafts with it, and of no other: the
    # steps of the rest run ahead under asynchronous scheduling (`engine/ahead.py`)
    observes_drafting_only = True

    def __init__(self, runner, max_seqs: int, num_slots: int | None = None) -> None:
        """`max_seqs`: sequences drafted per step at most (the MTP dispatch cap); `num_slots`:
        the engine's sequence slots (`max_num_seqs`; default `max_seqs`)."""
        if runner.mtp is None:
            raise ValueError("the MTP drafter needs a model loaded with its MTP heads")
        self.runner = runner
        self.heads = runner.mtp
        self.max_seqs = max_seqs
        num_slots = num_slots or max_seqs
        k = knobs()
        self.refeed = mtp_catchup_enabled(max_seqs, k) and mtp_refeed_accepted_enabled(max_seqs, k)
        self.refeed_shift = k.mtp_refeed_shift if self.refeed else 0
        self.refeed_debug = k.mtp_refeed_debug and self.refeed
        # Its layer's K/V rows live in the target's pages, each fed the token after its
        # position: a prefix-cache hit maps a page only where they are whole and were fed the
        # same token (the debug refeed shift writes other rows: never shared).
        self.page_kv = DraftKV(may_draft, self._wrote_kv, next_token=True)
        # Per sequence, on the host: [position p of its newest committed row (it predicts the
        # token at p + 2), rows the last chain wrote (positions p + 1 .. p + chain_rows)]. On
        # the device, by state slot: that row's next_hidden and the first draft it predicts, so
        # observe writes and propose reads every sequence's state with one indexed copy.
        self._pos: dict[int, list] = {}
        hidden_size = runner.model.config.hidden_size
        # one entry past the slots: the catch-up programs' padding sequences write there
        self._hidden = torch.zeros(
            num_slots + 1, hidden_size, dtype=runner.dtype, device=runner.device
        )
        self._first = torch.zeros(num_slots + 1, dtype=torch.long, device=runner.device)
        # The next step's drafts, chained ahead by a catch-up program into `chain_graphs.ahead`:
        # seq_id -> (the replay's stamp, its row there, the position it starts from).
        self._ahead_rows: dict[int, tuple] = {}
        # Catch-ups the last step's program ran before the host knew its verdicts
        # (`_catch_up_verified`): seq_id -> (first position of its rows, (stamp, row) of its
        # drafts chained ahead, or None).
        self._verified: dict[int, tuple[int, tuple | None]] = {}
        self.drafted_ahead = 0  # sequence-drafts served from rows chained ahead
        self.ahead_on_device = 0  # of them, left on the device (`AHEAD_ON_DEVICE_SEQS`)
        graphs = runner.graphs
        self.chain_graphs = (
            DraftChainGraphs(
                runner,
                self.heads,
                max_seqs,
                graphs.max_model_len,
                num_slots,
                (self._first, self._hidden),
            )
            if graphs is not None and graphs.paged_kernel and not k.no_mtp_chain_graphs
            else None
        )
        if self.chain_graphs is not None and not (self.refeed_shift or self.refeed_debug):
            runner.after_verify = self._catch_up_verified
            runner.after_verify_drafts_only = False  # it catches up after every step

    def _wrote_kv(self, seq: Sequence) -> bool:
        """Whether its layer's K/V rows are written for every committed row of `seq`."""
        return may_draft(seq) and not self.refeed_shift

    def _forward(self, step: int, spans, hidden: torch.Tensor):
        """One MTP module over spans (block table, first position, tokens at p + 1)."""
        input_ids, positions, meta = self.runner.span_metadata(spans)
        module = self.heads.for_step(step)
        logits_in, next_hidden = module(
            input_ids, positions, hidden, meta, self.runner.vocab.embed_tokens
        )
        return logits_in, next_hidden, meta

    @torch.inference_mode()
    def _catch_up_verified(self, entries, shape, tokens: torch.Tensor):
        """The catch-up of a step that replayed one of the target's programs (`shape`: ragged
        or prefill-shaped), queued before the host reads the verdicts (`after_verify`), run
        from what that program left in the workspace: it works out the accepted drafts from
        `tokens` (the target's pick at each sampling row) and feeds the committed rows; the
        host keeps the books in `observe`. Non-MTP sequences write a scratch entry."""
        graphs, scratch = self.chain_graphs, self._first.shape[0] - 1
        prefill = isinstance(shape, PrefillShape)
        ragged = isinstance(shape, RaggedShape) and shape.max_q == graphs.max_q
        # (a hybrid's mixed program lays its rows out otherwise: caught up from the verdicts)
        if len(entries) > graphs.catch_up_seqs or not (prefill or ragged):
            return  # `observe` catches them up from the verdicts
        owners, keeps, every, eligible, drafted = [], [], [], 0, 0
        ends, row = [], 0  # (last row, the next prompt token) of chunks the prompt goes on after
        for e in entries:
            seq, first = e.seq, e.seq.num_computed_tokens
            row += e.num_rows
            if not e.samples:
                ends.append((row - 1, seq.tokens(first + e.num_rows, first + e.num_rows + 1)[0]))
            if seq.slot < 0 or not may_draft(seq):
                owners.append(scratch)
                keeps.append(0)
                every.append(1)
                continue
            eligible += 1
            drafted += bool(e.drafts)
            owners.append(seq.slot)
            keeps.append(self._chain_kept(seq.seq_id, e.drafts, first))
            every.append(0 if e.drafts else 1)  # without drafts every row is committed
        if not eligible:
            return
        ahead = not prefill and 2 * drafted >= eligible and graphs.max_q > 2
        stamp = graphs.catch_up_verified(shape, tokens, owners, keeps, every, ends, ahead)
        if stamp is None:
            return
        for row, (e, owner) in enumerate(zip(entries, owners, strict=True)):
            if owner != scratch:
                chained = (stamp, row) if ahead else None
                self._verified[e.seq.seq_id] = (e.seq.num_computed_tokens, chained)

    @torch.inference_mode()
    def observe(self, verdicts: list[Verdict]) -> None:
        spans, hiddens, owners = [], [], []
        # Every committed row catches up in one program (ragged, or prefill-shaped with prompt
        # chunks); past those in pieces of a prefill program's rows, in order; where no program
        # takes them, the short spans in one and the rest eagerly; without graphs all eagerly.
        max_q = 0 if self.chain_graphs is None else self.chain_graphs.max_q
        short, eager = [], []  # indices into spans
        verified, self._verified = self._verified, {}
        ahead_rows: dict[int, tuple] = {}
        for v in verdicts:
            seq, rows = v.seq, 0 if v.hidden is None else v.hidden.shape[0]
            if rows == 0 or not may_draft(seq) or seq.slot < 0:
                continue
            done = verified.get(seq.seq_id)
            if done is not None and done[0] == v.first_position:
                # caught up by the step's own program: its newest row is the last committed
                newest = v.first_position + rows - 1
                self._pos[seq.seq_id] = [newest, 0]
                if done[1] is not None:
                    ahead_rows[seq.seq_id] = (*done[1], newest)
                continue
            hidden, first = self._rows_to_feed(v)
            # the committed token after each row's position: prompt, accepted drafts, bonus
            tokens = seq.tokens(first + 1, first + 1 + len(hidden))
            (short if len(tokens) <= max_q else eager).append(len(spans))
            spans.append((seq.block_table, first, tokens))
            hiddens.append(hidden)
            owners.append(seq)
            self._pos[seq.seq_id] = [first + len(tokens) - 1, 0]
        if ahead_rows or spans:
            self._ahead_rows = ahead_rows
        if not spans:
            return
        # a catch-up of the step's own program chained ahead: these must not replay over it
        chain = not ahead_rows and not eager
        every = list(range(len(spans)))
        if max_q and self._catch_up_graphed(verdicts, every, spans, hiddens, owners, chain):
            return  # one program (prompt chunks too, in a prefill-shaped one)
        if max_q and self._catch_up_in_pieces(spans, hiddens, owners):
            return  # more rows than any program: in pieces, one after the other
        if short and not self._catch_up_graphed(verdicts, short, spans, hiddens, owners, False):
            eager = every  # no program takes them: all eagerly, in order
        if eager:
            self._catch_up_eager(
                [spans[i] for i in eager],
                torch.cat([hiddens[i] for i in eager]),
                [owners[i].slot for i in eager],
            )

    def _catch_up_graphed(self, verdicts, short, spans, hiddens, owners, chain: bool) -> bool:
        """The catch-up of the `short` spans as one replay; False when no program takes it.
        Drafts ahead when most of these sequences verified drafts (in steady state the ones
        D-Cut drafts again) and `chain` allows: the chain then runs in the catch-up's own
        program, while the host emits and schedules, and `propose` only reads it back.
        Otherwise (D-Cut leaves most at depth 0) `propose` chains the few it drafts."""
        drafted = sum(1 for v in verdicts if v.drafts)
        ahead = chain and 2 * drafted >= len(short) and self.chain_graphs.max_q > 2
        stamp = self.chain_graphs.catch_up(
            [spans[i] for i in short],
            torch.cat([hiddens[i] for i in short]),
            [owners[i].slot for i in short],
            ahead,
        )
        if stamp is None:
            return False
        if ahead:
            for row, i in enumerate(short):
                seq_id = owners[i].seq_id
                self._ahead_rows[seq_id] = (stamp, row, self._pos[seq_id][0])
        return True

    def _catch_up_in_pieces(self, spans, hiddens, owners) -> bool:
        """The catch-up of more rows than one program holds (an eager step's prompt chunks),
        cut into pieces of at most the prefill programs' rows, replayed in order: a piece of a
        prompt reads the K/V rows the pieces before it wrote, as a chunked prefill does. False
        (nothing ran) when there are no prefill programs to take them."""
        graphs = self.chain_graphs
        limit, most = graphs.prefill_rows, graphs.catch_up_seqs
        if not limit:
            return False
        groups, group, rows = [], [], 0  # group: (span, hidden, slot)
        for (table, first, tokens), hidden, seq in zip(spans, hiddens, owners, strict=True):
            for start in range(0, len(tokens), limit):
                piece = tokens[start : start + limit]
                if group and (rows + len(piece) > limit or len(group) == most):
                    groups.append(group)
                    group, rows = [], 0
                group.append(
                    ((table, first + start, piece), hidden[start : start + limit], seq.slot)
                )
                rows += len(piece)
        groups.append(group)
        for group in groups:
            pieces, rows_of, slots = zip(*group, strict=True)
            if graphs.catch_up(list(pieces), torch.cat(rows_of), list(slots), False) is None:
                # no program of this shape (past the workspace): this piece eagerly, in order
                self._catch_up_eager(list(pieces), torch.cat(rows_of), list(slots))
        return True

    def _catch_up_eager(self, spans, hidden: torch.Tensor, slots: list[int]) -> None:
        """The first module over the spans' rows; each span's first draft and next hidden at
        its newest row go to the drafter's per-slot state."""
        logits_in, next_hidden, meta = self._forward(0, spans, hidden)
        last = meta.query_start_loc[1:] - 1  # [S] each span's newest row
        firsts = self.runner.vocab.compute_logits(logits_in, last).argmax(dim=-1)  # [S]
        index = to_device_packed([slots], self.runner.device)[0]
        self._first.index_copy_(0, index, firsts)
        self._hidden.index_copy_(0, index, next_hidden.index_select(0, last))

    def _rows_to_feed(self, v: Verdict) -> tuple[torch.Tensor, int]:
        """The committed rows to run through the MTP layer: (target hiddens, first position)."""
        state = self._pos.get(v.seq.seq_id)
        current = v.drafts and state is not None and state[0] + 1 == v.first_position
        if current and (self.refeed_shift or self.refeed_debug):
            hidden = v.hidden
            if self.refeed_shift:
                rows = torch.arange(hidden.shape[0], device=hidden.device)
                hidden = hidden[(rows - self.refeed_shift).clamp(0, hidden.shape[0] - 1)]
            if self.refeed_debug:
                for t, h in enumerate(hidden):
                    log.info(
                        "MTP_REFEED pos=%d fp=%016x", v.first_position + t, hidden_fingerprint(h)
                    )
            return hidden, v.first_position
        keep = min(v.num_accepted, self._chain_kept(v.seq.seq_id, v.drafts, v.first_position))
        return v.hidden[keep:], v.first_position + keep

    def _chain_kept(self, seq_id: int, drafts: list[int], first: int) -> int:
        """How many leading rows of a verify from position `first` the chain already wrote
        with the verified drafts (of them, the accepted ones are kept, not fed again): 0 when
        the chain did not start right before `first`, or when accepted rows are re-fed."""
        state = self._pos.get(seq_id)
        if not drafts or state is None or state[0] + 1 != first or self.refeed:
            return 0
        # The chain's rows for accepted drafts hold the right tokens; keep them, as far as
        # the verified drafts are the chain's own (the controller may have replaced them: a
        # grammar's forced tokens).
        keep, chain = 0, state[2] if len(state) > 2 else ()
        if isinstance(drafts, DeviceRow) and drafts.same_values(chain):
            return min(len(drafts), state[1])  # the chain's own row: nothing to read
        while keep < min(len(drafts), state[1]) and drafts[keep] == chain[keep]:
            keep += 1
        return keep

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[Draft]:
        # A state is current only if it sits on the sequence's newest committed row. The chain
        # writes MTP KV at positions p + 1 .. p + k - 1, so k stops where the sequence's pages
        # do (a last prefill chunk reserves no rows past its tokens).
        rows_of = self.runner.page_size
        live = [
            (i, seq, min(k, len(seq.block_table) * rows_of - state[0]), state)
            for i, (seq, k) in enumerate(zip(seqs, max_drafts, strict=True))
            if k > 0
            and (state := self._pos.get(seq.seq_id)) is not None
            and state[0] == seq.num_tokens - 2
        ]
        live = [entry for entry in live if entry[2] > 0][: self.max_seqs]
        drafts: list[Draft] = [Draft([]) for _ in seqs]
        if not live:
            return drafts
        # rows chained ahead by the last catch-up, for sequences still at that position whose
        # program was not replayed since
        ahead, self._ahead_rows = self._ahead_rows, {}
        graphs, rows, table = self.chain_graphs, {}, None
        for _, seq, _, state in live:
            got = ahead.get(seq.seq_id)
            if got is None or got[2] != state[0] or not graphs.current(got[0]):
                continue
            if table is None:
                # Few sequences: left on the device (`AHEAD_ON_DEVICE_SEQS`); else a host
                # read, usually long done (chained while the host emitted the last step)
                few = len(live) <= AHEAD_ON_DEVICE_SEQS
                table = DeviceDrafts(graphs.ahead.clone()) if few else graphs.ahead.tolist()
            if isinstance(table, DeviceDrafts):
                rows[seq.seq_id] = table.row(got[1], table.width)
                self.ahead_on_device += 1
            else:
                rows[seq.seq_id] = table[got[1]]
            self.drafted_ahead += 1
        rest = [entry for entry in live if entry[1].seq_id not in rows]
        if rest:
            for (_, seq, _, _), row in zip(rest, self._chain_now(rest), strict=True):
                rows[seq.seq_id] = row
        table = [rows[seq.seq_id] for _, seq, _, _ in live]
        for (i, _, k, state), row in zip(live, table, strict=True):
            drafts[i] = Draft(row[:k])
            state[1:] = [k - 1, row[: k - 1]]  # the chain's rows and the tokens they hold
        return drafts

    def _chain_now(self, live) -> list[DeviceRow]:
        """The draft rows (1 + steps each) of `live` (index, seq, depth, state) entries, chained
        now, left on the device: the host schedules and packs the verify while they run."""
        device = self.runner.device
        slots = to_device_packed([[seq.slot for _, seq, _, _ in live]], device)[0]
        first = self._first.index_select(0, slots)  # [S] draft 1 of each
        hidden = self._hidden.index_select(0, slots)  # [S, H]
        steps = max(k for _, _, k, _ in live) - 1
        columns = None
        if steps > 0 and self.chain_graphs is not None:
            positions = [state[0] for _, _, _, state in live]
            tables = [seq.block_table for _, seq, _, _ in live]
            columns = self.chain_graphs.chain(first, hidden, positions, tables, steps)
        if steps == 0:
            table = first[:, None]
        elif columns is not None:
            table = torch.cat([first[:, None], columns], dim=1)
        else:
            table = self._eager_chain(live, first, hidden, steps)
        rows = DeviceDrafts(table)
        return [rows.row(n, steps + 1) for n in range(len(live))]

    def _eager_chain(self, live, first: torch.Tensor, hidden: torch.Tensor, steps: int):
        """The chain without graphs (CPU, or past the workspace): each sequence stops at its
        own depth. [S, 1 + steps] draft rows, -1 past a sequence's depth (never verified)."""
        device = self.runner.device
        columns = [first]
        for j in range(1, steps + 1):
            chain = [n for n, (_, _, k, _) in enumerate(live) if k > j]
            # Usually every sequence goes on: then nothing is gathered or scattered.
            index = None if len(chain) == len(live) else to_device_packed([chain], device)[0]
            tokens = columns[-1] if index is None else columns[-1].index_select(0, index)
            h_in = hidden if index is None else hidden.index_select(0, index)
            spans = [(live[n][1].block_table, live[n][3][0] + j, [0]) for n in chain]
            _, positions, meta = self.runner.span_metadata(spans)
            logits_in, next_hidden = self.heads.for_step(j)(
                tokens, positions, h_in, meta, self.runner.vocab.embed_tokens
            )
            column = self.runner.vocab.compute_logits(logits_in).argmax(dim=-1)
            if index is None:
                hidden = next_hidden
            else:
                column = torch.full_like(first, -1).index_copy_(0, index, column)
                hidden = hidden.index_copy(0, index, next_hidden)
            columns.append(column)
        return torch.stack(columns, dim=1)

    def release(self, seq: Sequence) -> None:
        self._pos.pop(seq.seq_id, None)
        self._ahead_rows.pop(seq.seq_id, None)
