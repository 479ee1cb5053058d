"""DFlash drafter: one forward of the block drafter (`models/dflash.py`) proposes up to
block_size - 1 drafts per sequence, conditioned on the target's hidden states.

The drafter's context K/V lives in its own paged KV layers, addressed by the target's block
tables. Every target forward writes it for all its rows, at the forward's end and inside its
program (the runner's `HiddenTaps` sink, `DFlashDraftModel.write_context`): the seed's
`commit_verified_ctx` with no host work and no launch of its own. Rows of rejected drafts are
written too, past the committed length; they are never read (a draft reads only rows before the
sequence's last token), and the step that computes those positions' committed tokens writes
them again. So every computed row of every sequence has its context row, prefill and plain
requests included: a prefix-cache hit's pages hold theirs, and the drafter keeps no per-sequence
state (`stateless`: a step that drafts nothing is a plain decode step).

`propose` embeds each sequence's block `[last token, MASK x (B - 1)]` at positions n-1 .. n+B-2
(n tokens; the target has computed rows 0 .. n-2, exactly the context), gathers the context K/V
from the pages, runs the draft layers over all sequences at once and reads the drafts from block
rows 1 .. k through the target's head: one drafter forward per step, whatever the depth. Drafts
are greedy (one-hot q): lossless at any temperature. They stay on the device (`DeviceDrafts`):
the verify reads them there, and the host first at its verdicts, so the host schedules and packs
the verify while the drafter's forward runs. On CUDA the drafter forward replays
captured programs (`DraftGraphs`, keyed by padded sequence count and a power-of-two context
bucket), captured at start-up up to a width (`STARTUP_CONTEXT_ROWS`), wider ones on first use.

Drafting ahead (CUDA graphs; opt-in, `METRALE_DFLASH_AHEAD=1`): a verify step's program leaves,
on the device, everything the next draft needs: the context rows of the accepted drafts (its
forward wrote them) and the target's pick at each row, from which the accepted count and the
bonus token follow. So right after the verify program, before the host waits for the verdicts
(`ModelRunner.after_verify`), the next step's drafts are computed on the device for every
sequence of the step (`_draft_ahead`), and their forward runs while the host reads the verdicts,
emits and schedules. The next `propose` takes them where the sequence's context is the one they
were drafted from (a copy of their context lengths tells, read once they are long done), and
drafts the rest as above. Only when most of the step's sequences verified drafts (as the MTP
drafter chains ahead): otherwise D-Cut drafts few of them next, and drafting ahead for all would
be device work for nothing.

Off by default: on the H200 (the shipped model, batch 8) its verify steps took 2.3 ms against
1.75 ms without it. The drafter's forward was hidden behind the host's verify packing already,
and working out the accepted blocks is a dozen eager launches on a host-bound step; it pays
once that work is inside the draft program.
"""

from __future__ import annotations

import logging
import time

import torch

from metrale.engine.device_tokens import DeviceClock, DeviceDrafts, HostCopy
from metrale.engine.graphs import capture
from metrale.engine.kv_cache import DUMMY_PAGE
from metrale.engine.sequence import Sequence
from metrale.engine.staging import to_device_packed
from metrale.knobs import knobs
from metrale.speculative.drafter import Draft, Verdict

log = logging.getLogger(__name__)


class DFlashDrafter:
    name = "dflash"
    needs_hidden = False  # its context rows are written by the target's forward itself
    stateless = True  # so D-Cut prices its drafting's host work, and depth 0 is a plain step

    def __init__(self, runner, max_seqs: int) -> None:
        """`max_seqs`: the engine's `max_num_seqs` (the widest batch a graph serves)."""
        if runner.dflash is None:
            raise ValueError("the DFlash drafter needs a runner loaded with a DFlash model")
        self.runner = runner
        self.model = runner.dflash
        self.cfg = self.model.config
        self.kv = runner.dflash_kv  # [layers, 2, pages, page_size, Hkv, D]
        graphs = runner.graphs
        self.graphs = None
        if graphs is not None and not knobs().no_dflash_graphs:
            # a draft's context is the sequence's tokens but its last: at most the model
            # length (the programs' own length reaches past it by the lookahead and the
            # prefill programs' width, which no draft reads)
            self.graphs = DraftGraphs(self, max_seqs, runner.max_model_len - 1, graphs.pool)
            if knobs().dflash_ahead:
                runner.after_verify = self._draft_ahead
                runner.after_verify_drafts_only = True
        # the drafts made ahead by the last verify (`_draft_ahead`): (their rows, a host copy
        # of each row's context length, seq_id -> row)
        self._ahead: tuple[DeviceDrafts, HostCopy, dict[int, int]] | None = None
        self.drafted_ahead = 0  # drafts `propose` took from them (a count for tests and logs)

    def observe(self, verdicts: list[Verdict]) -> None:
        """Nothing to learn: the target's forward wrote the context rows."""

    @torch.inference_mode()
    def _draft_ahead(self, entries, shape, tokens: torch.Tensor) -> None:
        """The next step's drafts of the sequences of a verify step the target just replayed as
        program `shape` (ragged, or with prompt chunks: a dense target's prefill program, a
        hybrid's mixed one; `entries` in row order, `tokens` the target's pick at each sampling
        row: a sampling entry's last 1 + k), queued on the device before the host reads the
        verdicts: each sequence's accepted drafts are its leading drafts equal to the target's
        picks, its bonus token the pick after them, its context every row up to it. Sequences
        that do not draft, or whose rows are not exactly a decode's or a verify's (prompt
        chunks), are left out."""
        self._ahead = None
        if self.graphs is None:
            return
        try:
            self._ahead = self._drafted_ahead(entries, tokens)
        except Exception:  # noqa: BLE001 (a speed-up only: never fail the verify step for it)
            # (`propose` drafts them as usual; a capture of a new draft program that fails,
            # out of memory, would otherwise end every sequence of the step)
            log.exception("DFlash drafting ahead failed; drafting in propose")

    def _drafted_ahead(self, entries, tokens: torch.Tensor):
        """`_draft_ahead`'s work: its drafts, or None."""
        # (seq, its first row, its first pick, k): a sampling entry's picks follow the last
        # sampling entry's, its rows the last entry's (prompt chunks that do not sample have
        # rows and no pick)
        live, row, pick = [], 0, 0
        for e in entries:
            seq, k = e.seq, len(e.drafts)
            params = seq.params
            if (
                e.samples
                and params.speculative
                and params.num_drafts != 0
                and e.num_rows == 1 + k
                and seq.num_computed_tokens == seq.num_tokens - 1
            ):
                live.append((seq, row, pick, k))
            row += e.num_rows
            pick += 1 + k if e.samples else 0
        drafted = sum(k > 0 for *_, k in live)
        if not live or 2 * drafted < len(live):
            return None
        depth = max(k for *_, k in live)
        tables, width = padded_tables([seq.block_table for seq, *_ in live])
        first_rows, first_picks, ks, counts, tables_t = to_device_packed(
            [
                [r for _, r, _, _ in live],
                [p for _, _, p, _ in live],
                [k for *_, k in live],
                [seq.num_tokens for seq, *_ in live],  # its tokens before this step
                tables,
            ],
            self.runner.device,
        )
        ids, lens = accepted_blocks(
            self.runner.replayed_ids,
            tokens,
            first_rows,
            first_picks,
            ks,
            counts,
            depth,
            self.cfg.mask_token_id,
            self.cfg.block_size,
        )
        # queued before the drafter's forward: reading it does not wait for that
        context = HostCopy(lens)
        # the longest context: every draft accepted
        longest = max(seq.num_tokens + k for seq, *_, k in live)
        out = self.graphs.run(ids, lens, tables_t.view(len(live), width), longest)
        if out is None:
            return None
        index = {seq.seq_id: n for n, (seq, *_) in enumerate(live)}
        return DeviceDrafts(out), context, index

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        live = [
            (i, seq, min(k, self.cfg.block_size - 1))
            for i, (seq, k) in enumerate(zip(seqs, max_drafts, strict=True))
            # its context complete: every row before its last token computed
            if k > 0 and seq.num_computed_tokens == seq.num_tokens - 1
        ]
        if not live:
            return drafts
        live = self._take_ahead(live, drafts)
        if not live:
            return drafts
        b, device = self.cfg.block_size, self.runner.device
        lens = [seq.num_tokens - 1 for _, seq, _ in live]  # context rows: 0 .. n - 2
        tables, width = padded_tables([seq.block_table for _, seq, _ in live])
        # each block: [last token, MASK x (B - 1)]
        mask = [self.cfg.mask_token_id] * (b - 1)
        ids = [t for (_, seq, _), n in zip(live, lens) for t in seq.tokens(n, n + 1) + mask]
        started = DeviceClock.now(device)
        ids, lens_t, tables_t = to_device_packed([ids, lens, tables], device)
        ids, tables_t = ids.view(len(live), b), tables_t.view(len(live), width)
        tokens = None
        if self.graphs is not None:
            tokens = self.graphs.run(ids, lens_t, tables_t, max(lens))
        if tokens is None:
            tokens = self.draft_tokens(ids, lens_t, tables_t, max(max(lens), 1))
        # no host read: the verify takes them on the device, the host at its verdicts
        rows = DeviceDrafts(tokens, started)
        for n, (i, _, k) in enumerate(live):
            drafts[i] = Draft(rows.row(n, k))
        return drafts

    def _take_ahead(self, live: list, drafts: list[Draft]) -> list:
        """Fill `drafts` of the `live` (index, seq, depth) entries whose drafts the last verify
        made ahead from the context they have now; returns the others."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return live
        rows, lens, index = ahead
        context, rest = None, []
        for i, seq, k in live:
            n = index.get(seq.seq_id)
            if n is not None:
                if context is None:
                    context = lens.rows()  # long done: the verdicts waited for the step
                if context[n] == seq.num_tokens - 1:
                    drafts[i] = Draft(rows.row(n, k))
                    self.drafted_ahead += 1
                    continue
            rest.append((i, seq, k))
        return rest

    def draft_tokens(self, ids, lens, tables, context: int) -> torch.Tensor:
        """The drafts [S, B - 1] of blocks `ids` [S, B] after contexts of `lens` [S] rows (block
        tables [S, W]), gathering `context` >= max(lens) rows of K/V per sequence."""
        s, b = ids.shape
        page, width = self.runner.page_size, tables.shape[1]
        positions = lens[:, None] + torch.arange(b, device=ids.device)  # [S, B]: n-1 .. n+B-2
        kv_pos = torch.arange(context, device=ids.device)
        page_of = tables.gather(1, (kv_pos // page).clamp(max=width - 1).expand(s, -1))
        valid = kv_pos[None, :] < lens[:, None]
        ctx_slots = torch.where(valid, page_of * page + kv_pos % page, 0)
        flat = self.kv.view(self.cfg.num_layers, 2, -1, *self.kv.shape[-2:])
        zero = ~valid[:, :, None, None]
        keys = [flat[i, 0][ctx_slots].masked_fill(zero, 0.0) for i in range(self.cfg.num_layers)]
        values = [flat[i, 1][ctx_slots].masked_fill(zero, 0.0) for i in range(self.cfg.num_layers)]
        vocab = self.runner.vocab  # the target's embedding and head (whole ones on rank 0)
        block = vocab.embed_tokens(ids) * self.cfg.input_embedding_scale
        hidden = self.model(block, positions, keys, values, valid)[:, 1:]  # [S, B - 1, H]
        logits = self.model.logits(hidden.reshape(-1, hidden.shape[-1]), vocab)
        return logits.argmax(dim=-1).view(s, b - 1)

    def release(self, seq: Sequence) -> None:
        """Nothing to drop but a draft made ahead (the context rows are in the sequence's own
        pages, and a preempted sequence computes them again)."""
        if self._ahead is not None:
            self._ahead[2].pop(seq.seq_id, None)


def padded_tables(tables: list[list[int]]) -> tuple[list[int], int]:
    """The block tables padded to the longest with the dummy page, flat, and that width."""
    width = max(len(t) for t in tables)
    return [p for t in tables for p in t + [DUMMY_PAGE] * (width - len(t))], width


def accepted_blocks(
    input_ids: torch.Tensor,
    picks: torch.Tensor,
    first_rows: torch.Tensor,
    first_picks: torch.Tensor,
    ks: torch.Tensor,
    counts: torch.Tensor,
    depth: int,
    mask_token: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device, after a verify: each sequence's next block `[bonus, MASK x (B - 1)]`
    [S, B] and its context length [S] (its tokens but the bonus).

    Sequence s's rows start at row `first_rows[s]` of `input_ids`: its last token, then its
    `ks[s]` drafts; `picks` holds the target's token after each of them from `first_picks[s]`
    on; it had `counts[s]` tokens. Its accepted drafts are the leading ones equal to the pick
    before them, the bonus the pick after the last accepted."""
    step = torch.arange(depth + 1, device=picks.device)
    # (a sequence shallower than `depth` reads past its rows: masked by `ks`, clamped in range)
    rows = (first_rows[:, None] + step).clamp(max=input_ids.shape[0] - 1)
    chosen = picks[(first_picks[:, None] + step).clamp(max=picks.shape[0] - 1)]  # [S, depth + 1]
    proposed = input_ids[rows][:, 1:]  # [S, depth]: the drafts
    equal = (proposed == chosen[:, :-1]) & (step[None, :-1] < ks[:, None])
    accepted = equal.long().cumprod(dim=1).sum(dim=1)
    bonus = chosen.gather(1, accepted[:, None])
    mask = bonus.new_full((bonus.shape[0], block_size - 1), mask_token)
    return torch.cat([bonus, mask], dim=1), counts + accepted


def context_bucket(rows: int) -> int:
    """The context rows a graphed draft gathers: a power of two, at least 64."""
    return max(64, 1 << (max(rows, 1) - 1).bit_length())


def seqs_bucket(count: int) -> int:
    """The sequences a graphed draft runs: a power of two (the drafter's forward is a few
    launch-bound layers: padding costs less than more programs would)."""
    return 1 << (max(count, 1) - 1).bit_length()


# Start-up captures every program whose gathered context (sequences x context bucket) is at most
# this many rows, so that no capture lands in a running batch (one takes about 50 ms on the
# H200: it stalled the step, and D-Cut priced drafting by that step's host time); wider ones
# are captured on first use.
STARTUP_CONTEXT_ROWS = 64 * 1024


class DraftGraphs:
    """The drafter forward as CUDA graphs keyed by (padded sequence count, context bucket):
    one replay per step instead of a few hundred small launches. Inputs are copied into a
    static workspace; padding sequences have no context and dummy-page tables."""

    def __init__(self, drafter: DFlashDrafter, max_seqs: int, max_context: int, pool) -> None:
        """`max_context`: the most context rows a draft gathers (a sequence's tokens but its
        last)."""
        self.drafter, self.pool = drafter, pool
        self.max_seqs = seqs_bucket(max_seqs)
        self.max_context = context_bucket(max_context)
        device, b = drafter.runner.device, drafter.cfg.block_size
        pages = -(-self.max_context // drafter.runner.page_size) + 1
        self.ids = torch.zeros(self.max_seqs, b, dtype=torch.long, device=device)
        self.lens = torch.zeros(self.max_seqs, dtype=torch.long, device=device)
        self.tables = torch.full((self.max_seqs, pages), DUMMY_PAGE, device=device)
        self._programs: dict[tuple[int, int], tuple] = {}
        start = time.perf_counter()
        n = 1
        while n <= self.max_seqs:
            context = 64
            while context <= self.max_context and n * context <= STARTUP_CONTEXT_ROWS:
                self._program(n, context)
                context *= 2
            n *= 2
        log.info(
            "captured %d DFlash draft programs in %.1f s",
            len(self._programs),
            time.perf_counter() - start,
        )

    def _program(self, n: int, context: int) -> tuple:
        """The (graph, drafts) of `n` sequences gathering `context` rows, captured if new
        (on inputs of no context, on the dummy page)."""
        key = (n, context)
        if key not in self._programs:
            self.ids.zero_()
            self.lens.zero_()
            self.tables.fill_(DUMMY_PAGE)

            def fn():
                return self.drafter.draft_tokens(
                    self.ids[:n], self.lens[:n], self.tables[:n], context
                )

            self._programs[key] = capture(fn, self.pool, self.ids.device)
        return self._programs[key]

    def run(self, ids, lens, tables, longest: int) -> torch.Tensor | None:
        """Drafts [S, B - 1] from the program for this batch (their own tensor), or None past
        the workspace."""
        count, n, context = ids.shape[0], seqs_bucket(ids.shape[0]), context_bucket(longest)
        if n > self.max_seqs or context > self.max_context:
            return None
        graph, out = self._program(n, context)
        self.ids[:count].copy_(ids, non_blocking=True)
        self.ids[count:n].zero_()
        self.lens[:count].copy_(lens, non_blocking=True)
        self.lens[count:n].zero_()
        self.tables[:n].fill_(DUMMY_PAGE)
        self.tables[:count, : tables.shape[1]].copy_(tables, non_blocking=True)
        graph.replay()
        # a copy: the drafts stay on the device until the verify, and this program's next
        # replay may come first (a propose retried one sequence at a time after a failure)
        return out[:count].clone()
