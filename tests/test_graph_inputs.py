"""The programs' static inputs filled in one copy (`engine/graph_inputs.py`) hold what the eager
path's `pack_spans` builds for the same spans, whatever the spans: host or device block tables,
drafts still on the device, steps of every size the workspace takes, the ring of host buffers
reused many times over."""

from __future__ import annotations

import random

import pytest
import torch

from metrale.engine import graph_inputs
from metrale.engine.block_tables import DeviceBlockTables
from metrale.engine.device_tokens import DeviceDrafts, PendingIds
from metrale.engine.graph_inputs import RING, TAIL_SPARE, GraphInputs, PinnedRing
from metrale.engine.kv_cache import DUMMY_PAGE
from metrale.engine.staging import to_device_packed
from metrale.engine.step_metadata import pack_spans

CPU = torch.device("cpu")
PAGE, PAGES, SLOTS = 4, 9, 6


def random_spans(rng: random.Random, slots: list[int], tables: list[list[int]], drafts=None):
    """Spans of the sequences in `slots` (their tables grown or rewritten at random), then a
    padding span on the dummy page; some spans' last tokens are drafts on the device."""
    spans = []
    for n, slot in enumerate(slots):
        table = tables[slot]
        if rng.random() < 0.3 and len(table) < PAGES - 1:
            table.append(rng.randrange(1, 50))
        elif rng.random() < 0.1:
            table[:] = [rng.randrange(1, 50) for _ in range(rng.randrange(1, PAGES))]
        rows = rng.randrange(1, 5)
        start = rng.randrange(0, len(table) * PAGE - rows + 1)
        tokens = [rng.randrange(1000) for _ in range(rows)]
        if drafts is not None and rows > 1 and rng.random() < 0.5:
            k = rng.randrange(1, rows)
            tokens = PendingIds.of(tokens[: rows - k], drafts.row(n, k))
        spans.append((list(table), start, tokens))
    spans.append(([DUMMY_PAGE], 0, [0] * rng.randrange(1, 3)))
    return spans


def sent(inputs: GraphInputs, flat, n: int, s: int):
    return (
        inputs.input_ids[:n],
        inputs.positions[:n],
        inputs.slots[:n],
        inputs.query_start_loc[: s + 1],
        inputs.seq_lens[:s],
        inputs.block_tables[:s],
    )


# (a tail of 8 entries: most steps' extras overflow it)
@pytest.mark.parametrize(
    "spare", [TAIL_SPARE, 8 - 2 * 32 - 11 * 8 - 4 * PAGES], ids=["tail", "overflow"]
)
@pytest.mark.parametrize("device_path", [False, True])
def test_the_inputs_match_the_eager_packing_step_after_step(device_path, spare, monkeypatch):
    """Step after step, every input the programs read is what `pack_spans` builds; with a
    short tail, steps whose extras overflow it send them by a second copy."""
    rng = random.Random(device_path)
    monkeypatch.setattr(graph_inputs, "TAIL_SPARE", spare)
    overflows = []
    monkeypatch.setattr(
        graph_inputs,
        "to_device_packed",
        lambda pieces, device: overflows.append(1) or to_device_packed(pieces, device),
    )
    inputs = GraphInputs(rows=32, seqs=8, pages=PAGES, device=CPU)
    tables_here = DeviceBlockTables(SLOTS, PAGES, CPU)
    tables_eager = DeviceBlockTables(SLOTS, PAGES, CPU)
    for dev in (tables_here, tables_eager):
        dev.min_entries = 0 if device_path else 10**9
    tables = [[rng.randrange(1, 50)] for _ in range(SLOTS)]
    for _ in range(3 * RING + 5):  # the ring comes round several times
        slots = rng.sample(range(SLOTS), rng.randrange(1, SLOTS + 1))
        drafts = DeviceDrafts(torch.randint(0, 1000, (len(slots), 4)))
        spans = random_spans(rng, slots, tables, drafts)
        rows = slots + [tables_here.dummy_row]
        flat = inputs.flatten(spans, PAGE)
        # a hybrid's state entries and a prefill program's sampled rows, sometimes
        s = len(spans)
        read = [rng.randrange(100) for _ in range(s)] if rng.random() < 0.5 else None
        per_row = [rng.randrange(100) for _ in range(4 * s)] if rng.random() < 0.5 else None
        samples = [rng.randrange(32) for _ in range(rng.randrange(1, 9))]
        samples = samples if rng.random() < 0.5 else None
        inputs.send(flat, tables_here, rows, read, per_row, samples)
        for buf, want in (
            (inputs.state_read, read),
            (inputs.state_rows, per_row),
            (inputs.sample_rows, samples),
        ):
            if want is not None:
                assert buf[: len(want)].tolist() == want
        # the eager path's copy of the same spans (fresh placeholders: `use` marks a source)
        again = DeviceDrafts(drafts.tensor)
        spans2 = [
            (
                t,
                st,
                PendingIds.of(
                    list(ids[: len(ids) - ids.row.length]), again.row(ids.row.at, ids.row.length)
                )
                if type(ids) is PendingIds
                else ids,
            )
            for t, st, ids in spans
        ]
        ids, positions, meta = pack_spans(spans2, PAGE, CPU, tables_eager, rows)
        n = ids.shape[0]
        got = sent(inputs, flat, n, s)
        assert torch.equal(got[0], ids)
        assert torch.equal(got[1], positions)
        assert torch.equal(got[2], meta.slot_mapping)
        assert torch.equal(got[3], meta.query_start_loc)
        assert torch.equal(got[4], meta.seq_lens)
        width = meta.block_tables.shape[1]
        assert torch.equal(got[5][:, :width], meta.block_tables)
        # past each table, its row reads the dummy page, as the eager padding does
        assert (got[5][:, width:] == DUMMY_PAGE).all()
        assert flat.max_seq_len == meta.max_seq_len
    assert bool(overflows) == (spare < 0)


def test_a_step_past_the_workspace_is_refused_and_its_device_rows_rewritten(monkeypatch):
    inputs = GraphInputs(rows=4, seqs=2, pages=PAGES, device=CPU)
    dev = DeviceBlockTables(SLOTS, PAGES, CPU)
    dev.min_entries = 0
    with pytest.raises(ValueError, match="past the workspace"):
        inputs.send(inputs.flatten([([1, 2], 0, [5] * 5)], PAGE), dev, [0])
    # a failure after the changes were taken, before they reached the table: the row is
    # rewritten in full next time
    flat = inputs.flatten([([1, 2], 0, [5, 6])], PAGE)

    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(dev, "apply", broken)
    with pytest.raises(RuntimeError, match="boom"):
        inputs.send(flat, dev, [0])
    monkeypatch.undo()
    inputs.send(inputs.flatten([([1, 2], 0, [5, 6])], PAGE), dev, [0])
    assert inputs.block_tables[0, :3].tolist() == [1, 2, DUMMY_PAGE]
    assert dev.table[0, :3].tolist() == [1, 2, DUMMY_PAGE]
    # ...and one while the host buffer is written, after the changes were taken (found in
    # review: they were taken outside the guard)
    flat = inputs.flatten([([1, 2, 3], 0, [5, 6])], PAGE)
    flat.fills.indices = [["not an index"]]
    with pytest.raises(ValueError):
        inputs.send(flat, dev, [0])
    inputs.send(inputs.flatten([([1, 2, 3], 0, [5, 6])], PAGE), dev, [0])
    assert inputs.block_tables[0, :4].tolist() == [1, 2, 3, DUMMY_PAGE]


def test_state_entries_of_the_wrong_length_are_refused():
    """A list shorter than the step's sequences would leave an older step's entries where the
    program reads (found in review): refused, as the copies into the buffers refused it."""
    inputs = GraphInputs(rows=8, seqs=4, pages=PAGES, device=CPU)
    spans = [([1], 0, [5]), ([2], 0, [6]), ([DUMMY_PAGE], 0, [0])]
    inputs.send(inputs.flatten(spans, PAGE), None, None, [1, 2, 3])
    for read in ([1, 2], [1, 2, 3, 4]):
        with pytest.raises(RuntimeError, match="3 sequences"):
            inputs.send(inputs.flatten(spans, PAGE), None, None, read)
    with pytest.raises(RuntimeError, match="3 sequences"):  # past the buffer
        inputs.send(inputs.flatten(spans, PAGE), None, None, [1, 2, 3], None, [0] * 9)


def test_the_ring_hands_buffers_out_in_turn():
    ring = PinnedRing(8, CPU, count=3)
    seen = []
    for _ in range(7):
        i, array, tensor = ring.take()
        array[0] = len(seen)
        assert tensor[0].item() == len(seen)  # the numpy view is the tensor's memory
        ring.sent(i)
        seen.append(i)
    assert seen == [0, 1, 2, 0, 1, 2, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_buffer_is_reused_only_after_its_copy_ran():
    device = torch.device("cuda")
    inputs = GraphInputs(rows=8, seqs=2, pages=PAGES, device=device)
    seen = []
    for value in range(3 * RING):
        # a long kernel ahead of each copy: the host runs far ahead of the device, and a host
        # buffer rewritten before its copy ran would show a later step's ids
        torch.cuda._sleep(2_000_000)
        inputs.send(inputs.flatten([([1], 0, [value] * 3)], PAGE), None, None)
        seen.append(inputs.input_ids[:3].clone())
    torch.cuda.synchronize()
    assert [s.tolist() for s in seen] == [[value] * 3 for value in range(3 * RING)]
