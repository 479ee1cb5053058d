"""The device block tables (`engine/block_tables.py`) hold exactly the host's padded tables, however
the tables change, and a step copies only what changed."""

from __future__ import annotations

import random

import pytest
import torch

from metrale.api import LLM
from metrale.config import SamplingParams
from metrale.engine.block_tables import DeviceBlockTables
from metrale.engine.kv_cache import DUMMY_PAGE
from metrale.engine.staging import to_device_packed
from tests.test_hybrid_engine import hybrid_dir  # noqa: F401 (a module fixture)


def host_padded(tables: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([t + [DUMMY_PAGE] * (width - len(t)) for t in tables], dtype=torch.long)


def step(dev: DeviceBlockTables, rows: list[int], tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    where, pages = dev.changes(rows, tables)
    assert len(where) == len(pages)
    dev.apply(*to_device_packed([where, pages], torch.device("cpu")))
    return dev.gather(torch.tensor(rows), width), len(where)


def test_device_tables_follow_every_kind_of_change():
    rng = random.Random(0)
    slots, pages = 6, 12
    dev = DeviceBlockTables(slots, pages, torch.device("cpu"))
    tables = [[] for _ in range(slots)]
    for _ in range(400):
        s = rng.randrange(slots)
        kind = rng.randrange(5)
        if kind == 0 and len(tables[s]) < pages:  # grown by a page
            tables[s].append(rng.randrange(1, 100))
        elif kind == 1:  # trimmed (a rollback) or freed
            del tables[s][rng.randrange(len(tables[s]) + 1) :]
        elif kind == 2 and tables[s]:  # an entry rewritten in place (a retry's scratch rows)
            tables[s][rng.randrange(len(tables[s]))] = rng.randrange(1, 100)
        elif kind == 3:  # another sequence in the slot, sharing a prefix or not
            keep = rng.randrange(len(tables[s]) + 1)
            tables[s] = tables[s][:keep] + [rng.randrange(1, 100) for _ in range(rng.randrange(3))]
        rows = rng.sample(range(slots), rng.randrange(1, slots + 1))
        chosen = [tables[r] for r in rows]
        if not any(chosen):
            continue
        got, _ = step(dev, rows + [dev.dummy_row], chosen + [[DUMMY_PAGE]])
        assert torch.equal(got, host_padded(chosen + [[DUMMY_PAGE]], got.shape[1]))
        # the whole row: what no table holds any more is back to the dummy page
        for r in rows:
            assert torch.equal(dev.table[r], host_padded([tables[r]], pages)[0])


def test_only_changes_are_copied_and_forget_rewrites_the_row():
    dev = DeviceBlockTables(2, 8, torch.device("cpu"))
    _, n = step(dev, [0, 1], [[5, 6, 7], [9]])
    assert n == 4
    assert step(dev, [0, 1], [[5, 6, 7], [9]])[1] == 0  # nothing changed: nothing copied
    assert step(dev, [0, 1], [[5, 6, 7, 8], [9]])[1] == 1  # one new page
    dev.changes([0], [[1, 2]])  # its triples never reach the device...
    dev.forget([0])
    got, n = step(dev, [0], [[1, 2]])  # ...so the row is written whole
    assert n == 8 and got.tolist() == [[1, 2]]
    assert dev.table[0].tolist() == [1, 2] + [DUMMY_PAGE] * 6


def test_steady_decoding_copies_a_page_per_page_of_tokens():
    """After the prompts, a step copies one table entry per sequence that crossed into a new
    page, not its whole table: the metadata grows with the rows, not with the context."""
    llm = LLM(
        None, dtype="float32", page_size=4, max_num_seqs=4, cuda_graphs=False, prefix_caching=False
    )
    dev = llm.engine.runner.block_tables
    dev.min_entries = 0  # every step on the device tables, however small
    copied = []
    changes = dev.changes

    def spy(rows, tables):
        out = changes(rows, tables)
        copied.append(len(out[0]))
        return out

    dev.changes = spy
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[7] * 40, [8] * 41, [9] * 42, [10] * 43]
    outs = llm.generate(prompts, params, use_tqdm=False)
    decode = copied[1:]  # the first step holds the whole prompts
    assert copied[0] == sum(-(-len(p) // 4) for p in prompts)  # the prompts' pages
    assert max(decode) <= 4 and sum(decode) <= 4 * (24 // 4 + 1)
    # and the tokens are the host tables' (the reference path: no device tables)
    llm.engine.runner.block_tables = None
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_every_step_reads_the_host_tables(tiny_model_dir, hybrid_dir, hybrid):  # noqa: F811
    """Under programs (CPU stand-ins, padding sequences included), speculation, a shared prefix
    and preemption, every metadata the steps build holds exactly the host's padded tables, no
    step fails (a failing batch would be retried one sequence at a time, hiding it), and the
    tokens are plain decoding's."""
    from tests.test_program_shapes import EagerPrograms, record_failures

    model = hybrid_dir if hybrid else tiny_model_dir
    prefix = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    prompts = [prefix + [20 + i] * (3 + 2 * i) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    opts = dict(device="cpu", dtype="float32", page_size=4, max_num_seqs=4)
    plain = LLM(model, **opts).generate(prompts, params, use_tqdm=False)
    want = [o.outputs[0].token_ids for o in plain]
    llm = LLM(model, spec={"method": "ngram", "num_drafts": 3}, num_kv_pages=24, **opts)
    runner = llm.engine.runner
    runner.block_tables.min_entries = 0
    if not hybrid:
        runner.graphs = EagerPrograms(
            runner.model, 4, runner.page_size, pages=runner.block_tables.num_pages
        )
    failures, checked = record_failures(runner), []
    span_metadata = runner.span_metadata

    def checking(spans, rows=None):
        ids, positions, meta = span_metadata(spans, rows)
        width = meta.block_tables.shape[1]
        assert torch.equal(meta.block_tables, host_padded([t for t, _, _ in spans], width))
        checked.append(rows is not None)
        return ids, positions, meta

    runner.span_metadata = checking
    if not hybrid:  # the programs' inputs, sent in one copy (`engine/graph_inputs.py`)
        inputs = runner.graphs.inputs
        send = inputs.send

        def checking_send(flat, device_tables, rows, *args, **kwargs):
            send(flat, device_tables, rows, *args, **kwargs)
            tables = [t for t, _, _ in flat.spans]
            got = inputs.block_tables[: len(tables)]
            assert torch.equal(got, host_padded(tables, got.shape[1]))
            checked.append(rows is not None and device_tables is not None)

        inputs.send = checking_send
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want and not failures
    assert llm.engine.telemetry.preemptions > 0 and sum(checked) > len(checked) // 2


def test_a_packing_that_raises_leaves_the_device_rows_right(monkeypatch):
    """Whatever raises while a step's metadata is packed (a device read of pending drafts
    included), the next step's tables are the host's: nothing half-applied (found by review)."""
    from metrale.engine import step_metadata

    dev = DeviceBlockTables(2, 8, torch.device("cpu"))
    dev.min_entries = 0
    cpu = torch.device("cpu")
    step_metadata.pack_spans([([3, 4], 0, [1] * 5)], 4, cpu, dev, [0])
    grown = [([3, 4, 9], 0, [1] * 9)]
    for broken in ("pending_fills", "to_device_packed"):
        real = getattr(step_metadata, broken)

        def raising(*args, **kwargs):
            raise RuntimeError("interrupted")

        monkeypatch.setattr(step_metadata, broken, raising)
        with pytest.raises(RuntimeError, match="interrupted"):
            step_metadata.pack_spans(grown, 4, cpu, dev, [0])
        monkeypatch.setattr(step_metadata, broken, real)
        _, _, meta = step_metadata.pack_spans(grown, 4, cpu, dev, [0])
        assert torch.equal(meta.block_tables, host_padded([[3, 4, 9]], 3))
        step_metadata.pack_spans([([3, 4], 0, [1] * 5)], 4, cpu, dev, [0])  # back, for the next


def test_packed_slots_are_each_rows_page_and_offset():
    """`pack_spans` writes a span's slots a page-run at a time (`slots_of`): every row's slot is
    still its page's first slot plus its offset there, for spans within a page, across pages,
    empty, and at page ends."""
    from metrale.engine.kv_cache import slots_of
    from metrale.engine.step_metadata import pack_spans

    rng = random.Random(7)
    for _ in range(2000):
        page = rng.choice([1, 2, 4, 16])
        spans = []
        for _ in range(rng.randrange(1, 6)):
            n = rng.randrange(1, 8)
            table = [rng.randrange(200) for _ in range(n)]
            start = rng.randrange(0, n * page)
            spans.append((table, start, [7] * rng.randrange(0, n * page - start + 1)))
        want = [
            [table[p // page] * page + p % page for p in range(start, start + len(tokens))]
            for table, start, tokens in spans
        ]
        for (table, start, tokens), rows in zip(spans, want, strict=True):
            assert slots_of(table, start, start + len(tokens), page) == rows
        if not any(tokens for _, _, tokens in spans):
            continue
        _, positions, meta = pack_spans(spans, page, torch.device("cpu"))
        assert meta.slot_mapping.tolist() == [s for rows in want for s in rows]
        assert positions.tolist() == [
            p for _, start, tokens in spans for p in range(start, start + len(tokens))
        ]
