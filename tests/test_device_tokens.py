"""Drafts kept on the device (`engine/device_tokens.py`): a `DeviceRow` reads like the list of
its values, a prefix of it stays unread, and `span_metadata` writes device drafts into the input
ids exactly where the host list would have put them."""

from __future__ import annotations

import time

import pytest
import torch

from metrale import LLM
from metrale.engine.device_tokens import DeviceClock, DeviceDrafts, DeviceRow, PendingIds


def test_a_row_reads_like_its_list_and_a_prefix_stays_unread():
    drafts = DeviceDrafts(torch.tensor([[5, 6, 7], [8, 9, 10]]))
    row = drafts.row(1, 3)
    prefix = row[:2]
    assert isinstance(prefix, DeviceRow) and len(prefix) == 2 and prefix
    assert drafts._rows is None  # nothing read yet
    assert prefix == [8, 9] and list(prefix) == [8, 9] and prefix[-1] == 9
    assert row[1:] == [9, 10] and [1] + row == [1, 8, 9, 10] and row + [0] == [8, 9, 10, 0]
    assert drafts.row(0, 0) == [] and not drafts.row(0, 0)
    assert row != [8, 9] and row[:0] == [] and row != (8, 9, 10)  # as a list compares
    with pytest.raises(IndexError):
        prefix[2]
    with pytest.raises(ValueError, match="3 tokens"):
        DeviceDrafts(torch.zeros(1, 2, dtype=torch.long)).row(0, 3)
    assert drafts.stall_seconds() == 0.0  # no clock off CUDA


def test_drafts_are_kept_as_proposed_when_the_buffer_is_rewritten(tiny_model_dir):
    """A drafter may rewrite its buffer once a verify took the drafts: the host reads the
    drafts as proposed, and a retried step's input ids take them from there."""
    runner = LLM(tiny_model_dir, device="cpu", dtype="float32").engine.runner
    buffer = torch.tensor([[1, 2], [3, 4]])
    drafts = DeviceDrafts(buffer)
    spans = [([1], 0, PendingIds.of([7], drafts.row(1, 2)))]
    assert runner.span_metadata(spans)[0].tolist() == [7, 3, 4] and drafts.in_use
    buffer.fill_(9)
    assert drafts.row(1, 2) == [3, 4]
    assert runner.span_metadata(spans)[0].tolist() == [7, 3, 4]
    with pytest.raises(ValueError, match="contiguous"):
        DeviceDrafts(buffer[:, :1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_host_copy_follows_the_drafter_and_the_stall_is_timed():
    buffer = torch.arange(12, device="cuda").view(3, 4)
    started = DeviceClock.now(buffer.device)
    torch.cuda._sleep(50_000_000)  # the drafter's device work, tens of milliseconds
    drafts = DeviceDrafts(buffer, started)
    buffer.fill_(-1)
    assert drafts.row(2, 3) == [8, 9, 10] and drafts.rows()[0] == [0, 1, 2, 3]
    assert drafts.stall_seconds() > 0.005  # nothing used them: the whole of its work
    quick = DeviceDrafts(buffer.clone(), DeviceClock.now(buffer.device))
    time.sleep(0.02)  # host work longer than the drafter's
    quick.use()
    assert quick.stall_seconds() < 0.005


def test_span_metadata_writes_device_drafts_where_the_list_would_be(tiny_model_dir):
    runner = LLM(tiny_model_dir, device="cpu", dtype="float32").engine.runner
    source = DeviceDrafts(torch.tensor([[11, 12, 13], [21, 22, 23]]))
    other = DeviceDrafts(torch.tensor([[31, 32]]))
    rows = [source.row(1, 2), other.row(0, 2), source.row(0, 3)]
    heads = [[1, 2, 3], [4], [5, 6]]
    tables = [[1], [2], [3]]
    lazy = [(t, 0, PendingIds.of(h, r)) for t, h, r in zip(tables, heads, rows, strict=True)]
    lazy.insert(1, ([4], 0, [7, 8]))  # a span with no drafts between them
    ids, positions, meta = runner.span_metadata(lazy)
    assert not any(d._rows is not None for d in (source, other))  # no host read
    listed = [(t, 0, h + r.tolist()) for t, h, r in zip(tables, heads, rows, strict=True)]
    listed.insert(1, ([4], 0, [7, 8]))
    want_ids, want_positions, want_meta = runner.span_metadata(listed)
    assert ids.tolist() == want_ids.tolist() == [1, 2, 3, 21, 22, 7, 8, 4, 31, 32, 5, 6, 11, 12, 13]
    assert torch.equal(positions, want_positions)
    assert torch.equal(meta.slot_mapping, want_meta.slot_mapping)


@pytest.mark.parametrize("chunk", [False, True], ids=["decode", "with-a-prompt-chunk"])
@pytest.mark.parametrize("order", [[0, 1, 2, 3], [2, 0, 3, 1], [0, 1, 3]])
def test_last_tokens_on_the_device_fill_decode_rows_in_any_order(tiny_model_dir, order, chunk):
    """A decode step under asynchronous scheduling: each row's token is the step before's
    sample, on the device. In that step's order the rows take one slice copy (a run); in any
    other order, with a sequence gone or a prompt chunk between them, index kernels; the ids are
    the same either way."""
    runner = LLM(tiny_model_dir, device="cpu", dtype="float32").engine.runner
    samples = DeviceDrafts(torch.tensor([[41], [42], [43], [44]]))
    spans = [([i + 1], 5, PendingIds.of([], samples.row(i, 1))) for i in order]
    want = [41 + i for i in order]
    if chunk:
        spans.insert(1, ([9], 0, [7, 8]))
        want[1:1] = [7, 8]
    ids, _, _ = runner.span_metadata(spans)
    assert ids.tolist() == want
    assert samples.in_use and samples._rows is None  # taken on the device, never read


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_record_now_records_on_the_current_stream():
    """`device_tokens.record_now` (an event record without `torch.cuda.current_stream()`'s
    Python): on a side stream the event waits for that stream's work, not the default's."""
    from metrale.engine.device_tokens import record_now

    side = torch.cuda.Stream()
    x = torch.ones(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(50):  # long enough to be unfinished when queried
            x = x @ x / 4096
        event = torch.cuda.Event()
        record_now(event)
    assert not event.query()  # recorded behind the side stream's work
    event.synchronize()
    assert side.query()
    done = torch.cuda.Event()
    record_now(done)  # and on the default stream again, outside the context
    done.synchronize()
