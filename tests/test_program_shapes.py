"""Ragged programs (dense targets): every step of up to max_num_seqs sequences of 1..1+K rows
pads to a shape the graph workspace holds, with few distinct shapes; and a step run through the
ragged padding (padding sequences on the dummy page after the real rows) gives exactly the
output of plain decoding, with speculation at mixed depths. Prefill programs likewise for steps
with prompt chunks. CPU: an eager stand-in replays the program (capture itself needs CUDA; the
GPU tests run the real one)."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.engine.graph_inputs import GraphInputs
from metrale.engine.graphs import ProgramCache
from metrale.engine.program_shapes import (
    PrefillShape,
    RaggedShape,
    all_prefill_shapes,
    all_ragged_shapes,
    default_max_rows,
    dense_prefill_row_bucket,
    max_ragged_seqs,
    padding_rows,
    prefill_program_rows,
    prefill_shape,
    ragged_shape,
)
from metrale.models.attention import AttentionMetadata
from metrale.speculative.replay import ReplayDrafter

CONFIGS = [(1, 1), (8, 1), (64, 1), (8, 4), (64, 4), (48, 8), (33, 2), (70, 2), (130, 5)]


@pytest.mark.parametrize("max_seqs,max_q", CONFIGS)
def test_every_step_fits_a_few_ragged_shapes(max_seqs, max_q):
    """The cache is sized as `GraphRunner` sizes it by default (33 sequences at K = 1 and 130
    at K = 4 once needed more rows than the row-table bound gave)."""
    cache = ProgramCache(
        lambda t, extra: None,
        default_max_rows(max_seqs, max_q, ragged=True),
        min_seqs=max_ragged_seqs(max_seqs, max_q),
    )
    shapes = set()
    for seqs in range(1, max_seqs + 1):
        for rows in range(seqs, seqs * max_q + 1):
            shape = ragged_shape(seqs, rows, max_q)
            pads = padding_rows(shape, seqs, rows)
            assert shape.rows() >= rows and sum(pads) == shape.rows() - rows
            assert all(0 <= p <= max_q for p in pads)
            assert sum(shape.layout()) == shape.rows() and max(shape.layout()) <= max_q
            cache.get(shape)  # never refused
            shapes.add(shape)
    # a handful of row buckets per sequence bucket, not one program per mix of depths
    seq_buckets = {s.num_seqs for s in shapes}
    assert len(shapes) <= len(seq_buckets) * (2 * max_q - 1)
    assert sorted(shapes) == all_ragged_shapes(max_seqs, max_q)  # what start-up captures


def test_ragged_shape_refuses_impossible_steps():
    with pytest.raises(ValueError):
        ragged_shape(2, 9, 4)
    with pytest.raises(ValueError):
        ragged_shape(3, 2, 4)


class EagerPrograms:
    """A CPU stand-in for `GraphRunner` in ragged mode: runs the forward the program would."""

    ragged = True

    def __init__(
        self, model, max_q: int, page_size: int, prefill_rows: int = 0, pages: int = 64
    ) -> None:
        """`pages`: the block tables' width, as the runner's device tables hold them."""
        self.model, self.max_q, self.page_size = model, max_q, page_size
        self.prefill_rows = prefill_rows
        self.shapes: list[RaggedShape | PrefillShape] = []
        self.inputs = GraphInputs(1024, 64, pages, torch.device("cpu"))
        self.input_ids = self.inputs.input_ids

    def run(self, shape, flat, device_tables=None, table_rows=None, state=None, rows=None):
        assert state is None and len(flat.input_ids) == shape.rows()
        assert len(flat.seq_lens) == shape.num_seqs
        assert (rows is None) == isinstance(shape, RaggedShape)
        self.shapes.append(shape)
        self.inputs.send(flat, device_tables, table_rows, sample_rows=rows)
        n, s, ins = shape.rows(), shape.num_seqs, self.inputs
        meta = AttentionMetadata(
            slot_mapping=ins.slots[:n],
            positions=ins.positions[:n],
            query_start_loc=ins.query_start_loc[: s + 1],
            seq_lens=ins.seq_lens[:s],
            block_tables=ins.block_tables[:s],
            max_query_len=shape.max_q,
            max_seq_len=flat.max_seq_len,
            page_size=self.page_size,
        )
        hidden = self.model(ins.input_ids[:n], ins.positions[:n], meta)
        if rows is not None:
            assert len(rows) == shape.samples
            rows = ins.sample_rows[: len(rows)]
        return hidden, self.model.compute_logits(hidden, rows), None


def record_failures(runner) -> list[Exception]:
    """The exceptions of `runner`'s steps, as they are raised: a failing step is re-run one
    sequence at a time, whose output would hide the failure."""
    failures, execute = [], runner.execute

    def recording(batch, **kw):
        try:
            return execute(batch, **kw)
        except Exception as e:
            failures.append(e)
            raise

    runner.execute = recording
    return failures


def test_ragged_padding_is_lossless_with_mixed_depths(tiny_model_dir):
    prompts = [[(5 * i + 7 * j) % 300 + 3 for j in range(4 + 3 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(tiny_model_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    reference = [o.outputs[0].token_ids for o in plain]
    drafter = ReplayDrafter(dict(zip(map(tuple, prompts), reference, strict=True)), 0.6, 300)
    llm = LLM(tiny_model_dir, device="cpu", drafter=drafter, spec={"num_drafts": 3})
    runner = llm.engine.runner
    runner.graphs = EagerPrograms(
        runner.model, 4, runner.page_size, pages=runner.block_tables.num_pages
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    shapes = runner.graphs.shapes
    assert any(s.rows() > s.num_seqs for s in shapes), "no verify went through the programs"
    assert llm.engine.telemetry.spec.num_accepted_tokens > 0


@pytest.mark.parametrize("max_seqs,max_q", CONFIGS)
def test_every_prefill_step_fits_a_captured_shape(max_seqs, max_q):
    """Every step of up to `max_seqs` sequences and 256 rows pads to a shape captured at
    start-up, whose spare sequence takes the padding rows and whose gathered logits hold every
    sampling row (1 + K per sequence at most)."""
    captured = set(all_prefill_shapes(max_seqs, 256, max_q))
    for seqs in range(1, min(max_seqs, 256) + 1):
        for rows in sorted({seqs, seqs + 1, 2 * seqs + 3, 100, 129, 200, 255, 256}):
            if not seqs <= rows <= 256:
                continue
            shape = prefill_shape(seqs, rows, max_q)
            assert shape in captured, (seqs, rows)
            assert shape.rows() >= rows and shape.num_seqs > seqs
            assert shape.samples >= min(rows, seqs * max_q)
            assert sum(shape.layout()) == shape.rows()
    with pytest.raises(ValueError):
        prefill_shape(3, 2, 4)


def test_dense_prefill_row_buckets_pad_a_quarter_at_most_past_128_rows():
    """A dense prefill program's row bucket holds the step's rows, is its own bucket (so the
    start-up capture meets it), pads to a power of two up to 128 rows and by less than a
    quarter past that (a step of a few hundred rows is arithmetic-bound: padding 268 rows to 512
    nearly doubled a verify step with a prompt beside it), and every power of two is one (the
    widest program, `prefill_program_rows`, is a bucket)."""
    last = 0
    for rows in range(1, 4097):
        bucket = dense_prefill_row_bucket(rows)
        assert rows <= bucket and dense_prefill_row_bucket(bucket) == bucket
        assert bucket >= last  # more rows never take a smaller program
        last = bucket
        if rows <= 128:
            assert bucket == max(16, 1 << (rows - 1).bit_length())
        else:
            assert 4 * bucket < 5 * rows
    assert dense_prefill_row_bucket(268) == 320
    for b in range(4, 13):
        assert dense_prefill_row_bucket(1 << b) == max(16, 1 << b)
    rows = sorted({s.rows() for s in all_prefill_shapes(64, 2048, 4)})
    assert rows == sorted({dense_prefill_row_bucket(n) for n in range(1, 2049)})


@pytest.mark.parametrize("max_seqs", [1, 3, 8, 100, 160, 200, 256, 300])
def test_prefill_steps_of_many_sequences_fit_a_captured_shape(max_seqs):
    """Row buckets between powers of two: a step of 129-256 sequences and 129-224 rows pads to
    a 160-224-row program of the 256-sequence bucket, which start-up must have captured too
    (it paired each sequence bucket with its most sequences, and so only rows from 256)."""
    limit, max_q = 512, 4
    captured = set(all_prefill_shapes(max_seqs, limit, max_q))
    for seqs in range(1, max_seqs + 1):
        for rows in sorted({seqs, seqs + 1, 129, 161, 200, 224, 225, 300, 512}):
            if seqs <= rows <= limit:
                assert prefill_shape(seqs, rows, max_q) in captured, (seqs, rows)


@pytest.mark.parametrize("num_drafts, max_model_len", [(0, None), (3, None), (3, 80)])
def test_prefill_programs_are_lossless_with_arrivals(tiny_model_dir, num_drafts, max_model_len):
    """Prompts of several lengths arriving while others decode (chunked, mixed with decode and
    verify rows), through prefill programs as wide as the runner allows (with a short model
    length too: a program's padding rows sit at positions 0 .. rows - 1, past the model length,
    which the rotary table must reach): the output equals eager
    plain decoding, no step failed (a failing batch is re-run sequence by sequence, which would
    hide it), and steps with prompt chunks did run as prefill programs."""
    # longest first: the first step admits several prompts at once, whatever the drafting
    # schedule (how D-Cut drafts decides when later ones arrive)
    prompts = [[(5 * i + 7 * j) % 300 + 3 for j in range(4 + 9 * i)] for i in reversed(range(7))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(tiny_model_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    reference = [o.outputs[0].token_ids for o in plain]
    kwargs = dict(device="cpu", max_num_seqs=3, max_model_len=max_model_len)
    kwargs["max_num_batched_tokens"] = 40 if max_model_len is None else 2048
    if num_drafts:
        drafter = ReplayDrafter(dict(zip(map(tuple, prompts), reference, strict=True)), 0.6, 300)
        llm = LLM(tiny_model_dir, drafter=drafter, spec={"num_drafts": num_drafts}, **kwargs)
    else:
        llm = LLM(tiny_model_dir, **kwargs)
    runner = llm.engine.runner
    rows = prefill_program_rows(runner.prefill_limit)
    assert rows == (32 if max_model_len is None else 2048)  # by default the whole budget
    runner.graphs = EagerPrograms(
        runner.model, num_drafts + 1, runner.page_size, rows, runner.block_tables.num_pages
    )
    failures = record_failures(runner)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert not failures
    assert [o.outputs[0].token_ids for o in outs] == reference
    prefills = [s for s in runner.graphs.shapes if isinstance(s, PrefillShape)]
    assert prefills and all(s.rows() <= rows for s in prefills)
    if max_model_len is not None:  # a step of several prompts: wider than any one sequence
        assert any(s.rows() > max_model_len for s in prefills)
