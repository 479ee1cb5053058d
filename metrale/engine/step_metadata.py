"""A step's metadata: spans of consecutive rows (block table, first position, token ids) packed
into the input ids, positions, KV slots and attention metadata of one forward, with one
host-to-device copy (`staging.to_device_packed`)."""

from __future__ import annotations

import torch

from metrale.engine.block_tables import DeviceBlockTables
from metrale.engine.device_tokens import PendingIds, pending_fills
from metrale.engine.kv_cache import DUMMY_PAGE, slots_of
from metrale.engine.staging import to_device_packed
from metrale.models.attention import AttentionMetadata


def flatten_spans(spans: list[tuple[list[int], int, list[int]]], page: int):
    """(input ids, positions, KV slots, row offsets [B + 1], sequence lengths, pending) of
    spans (block table, first position, token ids) of consecutive rows, `page` rows a page, as
    host lists; `pending`: (the row after it, its drafts) of each span whose drafts are still on
    the device (`PendingIds`), for `device_tokens.pending_fills`."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    seq_lens: list[int] = []
    pending = []
    total = 0
    for table, start, tokens in spans:
        end = start + len(tokens)
        input_ids += tokens
        positions += range(start, end)
        slots += slots_of(table, start, end, page)
        total += len(tokens)
        starts.append(total)
        seq_lens.append(end)
        if type(tokens) is PendingIds:
            pending.append((total, tokens.row))
    return input_ids, positions, slots, starts, seq_lens, pending


def padded_tables(spans, width: int) -> list[int]:
    """The spans' block tables, each padded to `width` with the dummy page, in one list."""
    out: list[int] = []
    for table, _, _ in spans:
        out += table
        out += [DUMMY_PAGE] * (width - len(table))
    return out


def pack_spans(
    spans: list[tuple[list[int], int, list[int]]],
    page: int,
    device: torch.device,
    device_tables: DeviceBlockTables | None = None,
    rows: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Pack spans (block table, first position, token ids) of consecutive rows into
    (input_ids [T], positions [T], metadata) on `device`, `page` rows a page. Drafts still on
    the device (`PendingIds`) are written into the input ids there, with no host read.
    `rows`: each span's row of `device_tables` (its sequence's slot; `dummy_row` for padding):
    the tables are then read there, and only their changes copied, when the step holds
    enough of them to pay (`DeviceBlockTables.serves`)."""
    input_ids, positions, slots, starts, seq_lens, pending = flatten_spans(spans, page)
    fills = pending_fills(pending, input_ids)  # (before `changes`: it may read the device)
    width = max(len(table) for table, _, _ in spans)
    if rows is None or device_tables is None or not device_tables.serves(len(spans), width):
        device_tables = None
    if device_tables is None:
        tables = [padded_tables(spans, width)]
    else:
        tables = [*device_tables.changes(rows, [table for table, _, _ in spans]), rows]
    try:
        packed = to_device_packed(
            [input_ids, positions, slots, starts, seq_lens, *tables, *fills.indices],
            device,
        )
        if device_tables is not None:
            where, pages, rows_t = packed[5:8]
            device_tables.apply(where, pages)
            tables_t = device_tables.gather(rows_t, width)
        else:
            tables_t = packed[5]
    except BaseException:
        if device_tables is not None:
            device_tables.forget(rows)
        raise
    ids_t, pos_t, slots_t, starts_t, lens_t = packed[:5]
    fills.write(ids_t, packed[5 + len(tables) :])
    meta = AttentionMetadata(
        slot_mapping=slots_t,
        positions=pos_t,
        query_start_loc=starts_t,
        seq_lens=lens_t,
        block_tables=tables_t.view(len(spans), width),
        max_query_len=max(len(tokens) for _, _, tokens in spans),
        max_seq_len=max(seq_lens),
        page_size=page,
    )
    return ids_t, meta.positions, meta
