"""Running a step as a captured program: pad the batch to a program's shape, fill the
workspace, replay, and return the real rows' outputs. The runner falls back to its eager
forward when these return None.

Three kinds of program (`program_shapes.py`): row-table programs (targets without the paged
kernel), ragged programs (decode and verify steps), and prefill programs (steps with prompt
chunks; a hybrid target's keyed by rows per sequence too).
"""

from __future__ import annotations

import itertools

import torch

from metrale.engine.kv_cache import DUMMY_PAGE
from metrale.engine.program_shapes import (
    decode_bucket,
    fill_rows,
    gdn_mixed_shape,
    gdn_prefill_shape,
    padding_rows,
    prefill_shape,
    ragged_shape,
)
from metrale.engine.sequence import Batch, ScheduledSeq
from metrale.engine.staging import to_device_packed
from metrale.speculative.row_table import RowTable


def spans_of(batch: Batch) -> list[tuple[list[int], int, list[int]]]:
    return [(e.seq.block_table, e.seq.num_computed_tokens, e.token_ids()) for e in batch.entries]


def table_rows(runner, entries: list[ScheduledSeq]) -> list[int] | None:
    """Each entry's row of the runner's device block tables (its sequence's slot), or None
    when the runner keeps none or an entry has no slot there (a batch built by hand)."""
    tables = runner.block_tables
    if tables is None:
        return None
    rows = [e.seq.slot for e in entries]
    return rows if rows and min(rows) >= 0 and max(rows) < tables.dummy_row else None


def _padded(rows: list[int] | None, runner, count: int) -> list[int] | None:
    """`rows` and `count` padding sequences' rows (the dummy row)."""
    return None if rows is None else rows + [runner.block_tables.dummy_row] * count


def replay_decode(runner, batch: Batch):
    """(hidden [T, H], logits [T, V], hybrid state view, state entries) of a decode or verify
    batch's rows from a captured program, or None when the cache refuses its table.

    Row-table programs: the sequences of each depth are padded to a bucket count
    (`decode_bucket`) with dummy sequences on the dummy page, so that the program key is a few
    bucketed counts per depth rather than every mix of depths."""
    if runner.graphs.ragged:
        return _replay_ragged(runner, batch)
    spans, depths, real_rows = [], [], []
    padded: list[ScheduledSeq | None] = []
    dev_rows = table_rows(runner, batch.entries)
    row = 0
    for q, group in itertools.groupby(batch.entries, key=lambda e: e.num_rows):
        group = list(group)
        for e in group:
            spans.append((e.seq.block_table, e.seq.num_computed_tokens, e.token_ids()))
            real_rows.extend(range(row, row + q))
            row += q
        # NOTE: padding rows write their K/V to the dummy page and see only it.
        dummy_table = [DUMMY_PAGE] * -(-q // runner.page_size)
        for _ in range(decode_bucket(len(group)) - len(group)):
            spans.append((dummy_table, 0, [0] * q))
            row += q
        padded += group + [None] * (decode_bucket(len(group)) - len(group))
        depths += [q] * decode_bucket(len(group))
    state = None
    if runner.states is not None:
        state = runner.states.plan_addresses(padded, any(e.drafts for e in batch.entries))
    table = RowTable.from_dispatch(range(len(depths)), depths)
    if dev_rows is not None:
        dummy = runner.block_tables.dummy_row
        dev_rows = [dummy if e is None else e.seq.slot for e in padded]
    ran = run_program(runner, table, spans, state, rows=dev_rows)
    if ran is None:
        return None
    hidden, logits, state_view = ran
    if len(real_rows) == hidden.shape[0]:
        return hidden.clone(), logits, state_view, padded
    (index,) = to_device_packed([real_rows], runner.device)
    return hidden.index_select(0, index), logits.index_select(0, index), state_view, padded


def _replay_ragged(runner, batch: Batch):
    """`replay_decode` for a ragged program (`program_shapes.RaggedShape`): the real rows come
    first, in batch order; padding sequences on the dummy page (and a hybrid's dummy state
    entry) follow. A hybrid target's decode step (one row per sequence) takes a program of
    width 1, its verify step one of width 1 + K: its delta rule runs every sequence over the
    program's width."""
    spans = spans_of(batch)
    dev_rows = table_rows(runner, batch.entries)
    num_rows, num_seqs = batch.num_rows, len(spans)
    hybrid = runner.states is not None
    width = 1 if hybrid and num_rows == num_seqs else runner.graphs.max_q
    shape = ragged_shape(num_seqs, num_rows, width)
    spans += _pads(runner, padding_rows(shape, num_seqs, num_rows), runner.graphs.max_q)
    entries: list[ScheduledSeq | None] = list(batch.entries)
    state = None
    if hybrid:
        entries += [None] * (shape.num_seqs - num_seqs)
        state = runner.states.plan_addresses(entries, num_rows > num_seqs, width=shape.max_q)
    dev_rows = _padded(dev_rows, runner, len(spans) - num_seqs)
    ran = run_program(runner, shape, spans, state, rows=dev_rows)
    if ran is None:
        return None
    runner.replayed_shape = shape  # the workspace holds this program's rows now
    hidden, logits, state_view = ran
    return _kept_hidden(hidden, num_rows), logits[:num_rows], state_view, entries


def replay_prefill(runner, batch: Batch, sample_rows: list[int]):
    """(hidden [T, H] of the batch's rows, logits [len(sample_rows), V], None, entries) of a
    step with prompt chunks from a prefill program, or None when there is no prefill program as
    wide as the step.
    The real rows come first, in batch order; one padding sequence on the dummy page takes the
    padding rows, and the other padding sequences none."""
    graphs = runner.graphs
    num_rows = batch.num_rows
    if num_rows > graphs.prefill_rows:
        return None
    if runner.states is not None:
        return _replay_gdn_prefill(runner, batch, sample_rows)
    spans = spans_of(batch)
    dev_rows = table_rows(runner, batch.entries)
    real = len(spans)
    shape = prefill_shape(len(spans), num_rows, graphs.max_q)
    pad = shape.rows() - num_rows
    spans.append(([DUMMY_PAGE] * max(-(-pad // runner.page_size), 1), 0, [0] * pad))
    spans += [([DUMMY_PAGE], 0, [])] * (shape.num_seqs - len(spans))
    samples = sample_rows + [0] * (shape.samples - len(sample_rows))
    dev_rows = _padded(dev_rows, runner, len(spans) - real)
    ran = run_program(runner, shape, spans, sample_rows=samples, rows=dev_rows)
    if ran is None:
        return None
    runner.replayed_shape = shape
    hidden, logits, _ = ran
    hidden = _kept_hidden(hidden, num_rows)
    return hidden, logits[: len(sample_rows)], None, list(batch.entries)


def _replay_gdn_prefill(runner, batch: Batch, sample_rows: list[int]):
    """`replay_prefill` for a hybrid target (`program_shapes.GDNPrefillShape`): the real rows
    first, in batch order, then padding sequences of at most the program's width on the dummy
    page and the dummy state entry, so that the GDN layers' [seqs, width] view holds every
    sequence. The program advances each real sequence's state entry in place (WRITE), as the
    eager forward does; entries of fresh sequences are zeroed, and those resuming from a prefix
    snapshot loaded, before it runs (`StateSlots.addresses`)."""
    entries: list[ScheduledSeq | None] = list(batch.entries)
    # Drafts (a verify's state mode), or a sequence wider than any program: eagerly.
    if any(e.drafts for e in batch.entries) or not gdn_prefill_replays(runner, batch.entries):
        return None
    longest = max(e.num_rows for e in batch.entries)
    spans = spans_of(batch)
    dev_rows = table_rows(runner, batch.entries)
    num_rows, num_seqs = batch.num_rows, len(spans)
    shape = gdn_prefill_shape(num_seqs, num_rows, longest, runner.graphs.prefill_widths)
    pads = fill_rows(shape.rows() - num_rows, shape.num_seqs - num_seqs, shape.width)
    spans += _pads(runner, pads, shape.width)
    entries += [None] * len(pads)
    state = runner.states.plan_addresses(entries, False, width=shape.width)
    samples = sample_rows + [0] * (shape.samples - len(sample_rows))
    dev_rows = _padded(dev_rows, runner, len(pads))
    ran = run_program(runner, shape, spans, state, samples, rows=dev_rows)
    if ran is None:
        return None
    hidden, logits, _ = ran
    return _kept_hidden(hidden, num_rows), logits[: len(sample_rows)], None, entries


def gdn_prefill_replays(runner, entries: list[ScheduledSeq]) -> bool:
    """Whether a hybrid target's prefill program takes these entries (no drafts): the runner
    keeps programs, and the rows and each sequence's rows fit the widest."""
    graphs = runner.graphs
    if graphs is None or not graphs.prefill_widths:
        return False
    rows = sum(e.num_rows for e in entries)
    longest = max(e.num_rows for e in entries)
    return rows <= graphs.prefill_rows and longest <= graphs.prefill_widths[-1]


def split_mixed(runner, batch: Batch):
    """How a hybrid target runs a step: (the batch, how many prompt chunks it holds first beside
    a verify, run in one forward on a `SplitState`: 0 for any other step; the mixed program
    that runs them, or None: eagerly; or the parts to run apart). A verify's state mode is for
    its rows alone: the chunks advance their state in place. One forward (a mixed program, or
    eagerly) unless only a prefill program would take the chunks, or under tensor parallelism
    (the workers address one state mode a forward)."""
    prefill = [e for e in batch.entries if not e.drafts and e.num_rows > 1]
    if (
        not prefill
        or len(prefill) == len(batch.entries)
        or not any(e.drafts for e in batch.entries)
    ):
        return batch, 0, None, None
    rest = [e for e in batch.entries if e.drafts or e.num_rows == 1]
    shape = None if runner.tp_size > 1 else mixed_shape(runner, prefill, rest)
    if runner.tp_size > 1 or (shape is None and gdn_prefill_replays(runner, prefill)):
        return batch, 0, None, [Batch(prefill), Batch(rest)]
    return Batch(prefill + rest), len(prefill), shape, None


def mixed_shape(runner, head: list[ScheduledSeq], tail: list[ScheduledSeq]):
    """The mixed program (`program_shapes.GDNMixedShape`) of a hybrid step whose prompt chunks
    `head` run beside the verify `tail`, or None where the runner keeps none that takes it."""
    graphs = runner.graphs
    if graphs is None or graphs.mixed is None:
        return None
    shape = gdn_mixed_shape(
        [e.num_rows for e in head],
        len(tail),
        sum(e.num_rows for e in tail),
        graphs.prefill_widths,
        graphs.max_q,
    )
    ws = graphs.mixed.workspace
    if shape is None or shape.rows() > graphs.mixed.max_rows or shape.num_seqs > ws.seqs:
        return None
    return shape


def replay_gdn_mixed(runner, batch: Batch, head_seqs: int, shape, sample_rows: list[int]):
    """`replay_decode`'s result for a hybrid step whose first `head_seqs` entries are prompt
    chunks and the rest a verify, from its mixed program `shape` (`split_mixed`), or None
    (eagerly then). The program's rows: the chunks, then padding sequences of the prefill
    shape's width; the verify's sequences, then the ragged shape's padding sequences. The real
    rows and the sampling rows are gathered from there in batch order."""
    head, tail = batch.entries[:head_seqs], batch.entries[head_seqs:]
    head_rows, tail_rows = sum(e.num_rows for e in head), sum(e.num_rows for e in tail)
    head_pads = fill_rows(
        shape.head.rows() - head_rows, shape.head.num_seqs - len(head), shape.head.width
    )
    tail_pads = padding_rows(shape.tail, len(tail), tail_rows)
    spans = spans_of(Batch(head)) + _pads(runner, head_pads, shape.head.width)
    spans += spans_of(Batch(tail)) + _pads(runner, tail_pads, shape.tail.max_q)
    heads = head + [None] * len(head_pads)
    tails = tail + [None] * len(tail_pads)
    state = runner.states.plan_split(heads, tails, shape.tail.max_q)
    gap = shape.head.rows() - head_rows  # the head's padding rows, before the tail's rows
    real = [*range(head_rows), *range(shape.head.rows(), shape.head.rows() + tail_rows)]
    samples = [r if r < head_rows else r + gap for r in sample_rows]
    samples += [0] * (shape.samples - len(samples))
    dev_rows = table_rows(runner, batch.entries)
    if dev_rows is not None:
        dummy = runner.block_tables.dummy_row
        dev_rows = [dummy if e is None else e.seq.slot for e in heads + tails]
    ran = run_program(runner, shape, spans, state, samples, rows=dev_rows)
    if ran is None:
        return None
    hidden, logits, state_view = ran
    (index,) = to_device_packed([real], runner.device)
    # a drafter's hook reads the step's rows in batch order, as other programs leave them
    runner.replayed_shape = shape
    runner.replayed_ids = runner.replayed_ids.index_select(0, index)
    return hidden.index_select(0, index), logits[: len(sample_rows)], state_view, heads + tails


def _pads(runner, rows: list[int], width: int) -> list:
    """Padding sequences of these rows on the dummy page (tables `width` rows long)."""
    table = [DUMMY_PAGE] * -(-width // runner.page_size)
    return [(table, 0, [0] * r) for r in rows]


def _kept_hidden(hidden: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The program's hidden states of the first `num_rows` rows, copied: its next replay
    rewrites them."""
    return hidden[:num_rows].clone()


def run_program(
    runner,
    key,
    spans,
    state=None,
    sample_rows: list[int] | None = None,
    rows: list[int] | None = None,
):
    """(hidden, logits, state view) of the program for `key` (a row table, ragged or prefill
    shape) over the padded `spans`, or None when the cache refuses it (the step runs eagerly).
    `rows`: the spans' rows of the device block tables (as `ModelRunner.span_metadata` takes
    them)."""
    graphs = runner.graphs
    flat = graphs.inputs.flatten(spans, runner.page_size)
    tables = runner.block_tables if rows is not None else None
    try:
        ran = graphs.run(key, flat, tables, rows, state, sample_rows)
    except ValueError:  # refused: too wide for the workspace
        runner.graph_refusals += 1
        return None
    # (the program's input ids: a drafter's hook reads its real rows before the next step)
    runner.replayed_ids = graphs.input_ids[: len(flat.input_ids)]
    return ran
