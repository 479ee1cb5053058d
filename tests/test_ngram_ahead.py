"""The n-gram drafter drafting ahead on the device (`DeviceNgramTable.draft_ahead`): right after a
verify program, before the host reads the verdicts, the step's committed tokens go into the
table (`ngram_commit`) and the next drafts are looked up there. Against references: the commit
kernel against a Python acceptance; the drafts taken ahead against the reference scan of each
sequence's committed tokens; and, on CPU with the target's programs replaced by stand-ins that
run the forward, engine output equal to plain decoding (greedy, seeded sampling, preemption,
async scheduling, requests that do not speculate), most drafts taken from ahead, and a drafting
ahead that raises failing no sequence. Under Triton's interpreter on CPU; on CUDA where there is
one."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from metrale import LLM, SamplingParams  # noqa: E402
from metrale.kernels.ngram_lookup import ngram_commit_lookup  # noqa: E402
from metrale.speculative import ngram  # noqa: E402
from metrale.speculative.ngram import lookup  # noqa: E402
from metrale.speculative.ngram_device import DeviceNgramTable  # noqa: E402
from tests.ahead_helpers import ahead_case  # noqa: E402
from tests.ngram_helpers import Seq, token_ids  # noqa: E402
from tests.test_spec_dflash import ragged_programs  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not set", allow_module_level=True)


def accepted(drafts: list[int], picks: list[int]) -> int:
    """The leading drafts equal to the target's pick before them."""
    n = 0
    while n < len(drafts) and drafts[n] == picks[n]:
        n += 1
    return n


def test_commit_kernel_writes_the_committed_tokens_and_looks_up_the_rows():
    """`ngram_commit_lookup` against a Python acceptance and the reference scan: each row gets
    its sequence's accepted drafts and bonus token, and its drafts are the scan of the row as
    it then stands (the writes and the scan in one launch)."""
    rng = random.Random(0)
    n_min, n_max, window = 1, 3, 24
    for trial in range(20):
        k_max = rng.choice([1, 3, 7])
        seqs = rng.randint(1, 6)
        capacity = 40
        table = torch.randint(0, 3, (8, capacity), dtype=torch.int32, device=DEVICE)
        want = table.clone()
        ids, picks, meta, want_rows = [], [], [[] for _ in range(6)], []
        for slot in rng.sample(range(8), seqs):
            k = rng.randint(0, k_max)
            rows = [rng.randint(0, 2) for _ in range(1 + k)]  # last token, then k drafts
            chosen = [rng.randint(0, 2) for _ in range(1 + k)]  # the target's pick after each
            length = rng.randint(1, capacity - 1 - k)
            lead = rng.randint(0, 3)  # rows before its drafts (a prompt chunk's, its last token)
            ids += [rng.randint(0, 2) for _ in range(lead)]
            picks += [rng.randint(0, 2) for _ in range(rng.randint(0, 2))]  # other sequences'
            asked = rng.randint(1, k_max)
            values = [slot, len(ids) + 1, len(picks), k, length, asked]
            for column, value in zip(meta, values):
                column.append(value)
            ids += rows
            picks += chosen
            a = accepted(rows[1:], chosen)
            want[slot, length : length + a + 1] = torch.tensor(chosen[: a + 1])
            row = want[slot, : length + a + 1].tolist()
            drafts = lookup(row[-window:], n_min, n_max, asked)
            want_rows.append([len(drafts), length + a + 1, *drafts])
        ids.append(5)  # a padding row of the program, and its pick
        picks.append(6)
        packed = torch.tensor([v for column in meta for v in column], device=DEVICE)
        got = ngram_commit_lookup(
            table,
            packed,
            torch.tensor(ids, device=DEVICE),
            torch.tensor(picks, device=DEVICE),
            n_min,
            n_max,
            window,
            k_max,
        ).tolist()
        assert [row[: 2 + row[0]] for row in got] == want_rows, trial
        assert torch.equal(table, want), trial


def entry(seq: Seq, drafts: list[int]):
    """The fields of a scheduled verify entry `draft_ahead` reads."""
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.params = SamplingParams()
    return SimpleNamespace(seq=seq, drafts=drafts, num_rows=1 + len(drafts), samples=True)


@pytest.mark.parametrize("seed", range(3))
def test_drafts_taken_ahead_are_the_scan_of_the_committed_tokens(seed):
    """Steps of a running batch verified on the device: the drafts taken ahead are the scan of
    each sequence's committed tokens (its K drafts cut to the step's depth); a sequence that
    moved to another slot, or whose tokens are not the ones committed there, gets none; and the
    table stays right for the `propose` that drafts the others."""
    rng = random.Random(seed)
    n_min, n_max, window, k_max = 1, 3, 48, 3
    table = DeviceNgramTable(6, 400, DEVICE, n_min, n_max, window, k_max)
    live = [Seq(i, i, [rng.randrange(4) for _ in range(rng.randrange(2, 60))]) for i in range(6)]
    taken = 0
    for step in range(25):
        caps = [rng.choice([1, 2, 3]) for _ in live]
        found = table.take_ahead(live, caps)
        rest = [i for i, d in enumerate(found) if d is None]
        for i, d in zip(rest, table.propose([live[i] for i in rest], [caps[i] for i in rest])):
            found[i] = d
        for seq, cap, got, ahead in zip(live, caps, found, [i not in rest for i in range(6)]):
            # ahead: the sequence's K drafts cut to the cap; else the scan for its cap
            k = k_max if ahead else cap
            want = lookup(seq.tokens(0, seq.num_tokens)[-window:], n_min, n_max, k)[:cap]
            assert got == want, (step, seq.seq_id, ahead)
        taken += 6 - len(rest)
        # verify: each sequence's drafts (its found ones or random), the target's picks
        entries, picks = [], []
        for seq, got in zip(live, found):
            drafts = got if rng.random() < 0.7 else [rng.randrange(4) for _ in range(len(got))]
            entries.append(entry(seq, drafts))
            chosen = [rng.randrange(4) for _ in range(1 + len(drafts))]
            a = accepted(drafts, chosen)
            chosen[:a] = drafts[:a]  # some accepted
            picks += chosen
        ids = [
            t
            for e in entries
            for t in e.seq.tokens(e.seq.num_tokens - 1, e.seq.num_tokens) + e.drafts
        ]
        assert table.draft_ahead(
            entries, torch.tensor(picks, device=DEVICE), torch.tensor(ids, device=DEVICE), 1
        )
        row = 0
        for e in entries:  # the host's commit: accepted drafts, then the bonus token
            k = len(e.drafts)
            chosen = picks[row : row + 1 + k]
            e.seq.output_token_ids += chosen[: accepted(e.drafts, chosen) + 1]
            row += 1 + k
        if step % 7 == 3:  # a preemption onto another slot: its drafts ahead are not taken
            live[0].slot, live[1].slot = live[1].slot, live[0].slot
            table.release(live[0])
            table.release(live[1])
        if step % 5 == 4:  # tokens since: the sequence is past what was drafted from
            live[2].output_token_ids.append(rng.randrange(4))
    assert taken > 50


# The stand-in engine runs on CPU, its table too: the interpreter runs the kernels there.
cpu_engine = pytest.mark.skipif(DEVICE.type == "cuda", reason="CPU stand-ins (GPU: below)")


def ahead_engine(model_dir, monkeypatch, **kw) -> LLM:
    """An n-gram engine whose decode and verify steps, and steps with prompt chunks, replay
    stand-ins of its programs, and whose drafter drafts ahead on the device table (the
    interpreter's kernels on CPU)."""
    monkeypatch.setattr(ngram, "DEVICE_MIN_SEQS", 2)
    spec = {"method": "ngram", "num_drafts": 3, "dcut": False, **kw.pop("spec", {})}
    llm = LLM(
        model_dir, device="cpu", dtype="float32", spec=spec, max_num_seqs=6, max_model_len=200, **kw
    )
    engine = llm.engine
    ragged_programs(engine, prefill_rows=256)
    drafter = engine.spec.drafter
    if drafter.device_table is None:
        drafter.device_table = DeviceNgramTable(6, 200, DEVICE, 1, 4, 4096, 3)
    drafter.attach(engine.runner)
    hook, llm.ahead_shapes = engine.runner.after_verify, []

    def counted(entries, shape, tokens):
        llm.ahead_shapes.append(type(shape).__name__)
        hook(entries, shape, tokens)

    engine.runner.after_verify = counted
    return llm


PROMPTS = [[(7 * i + 3 * (j % (3 + i))) % 50 + 3 for j in range(12 + 4 * i)] for i in range(8)]


def plain(model_dir, prompts, params, **kw) -> list[list[int]]:
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_seqs=6, max_model_len=200, **kw)
    return token_ids(llm.generate(prompts, params, use_tqdm=False))


@cpu_engine
@pytest.mark.parametrize("case", ["greedy", "seeded", "preemption", "async", "mixed", "dcut"])
def test_output_equals_plain_decoding(tiny_model_dir, monkeypatch, case):
    n = 8
    params, kw = ahead_case(case, n, max_tokens=14, kv_pages=12)
    want = plain(tiny_model_dir, PROMPTS[:n], params)
    llm = ahead_engine(tiny_model_dir, monkeypatch, **kw)
    assert token_ids(llm.generate(PROMPTS[:n], params, use_tqdm=False)) == want
    drafter = llm.engine.spec.drafter
    if case != "dcut":
        assert drafter.drafted_ahead > 0
    if case == "greedy":  # verify steps with a new prompt's chunk (the prefill programs) too
        assert {"RaggedShape", "PrefillShape"} <= set(llm.ahead_shapes)
    if case == "preemption":
        assert llm.engine.telemetry.preemptions > 0
    # nothing left behind: every finished sequence's rows and drafts ahead are forgotten
    table = drafter.device_table
    assert not table._written and (table._ahead is None or not table._ahead[1])


@cpu_engine
def test_most_drafts_come_from_ahead_and_drafts_are_the_scans(tiny_model_dir, monkeypatch):
    """Greedy, requests arriving as others end (verify steps with prompt chunks): most drafts
    come from ahead, and every verified draft is what the scan of the sequence's tokens
    proposes."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=20 + 3 * i, ignore_eos=True) for i in range(8)
    ]
    llm = ahead_engine(tiny_model_dir, monkeypatch)
    runner, verified = llm.engine.runner, []

    runner.execute = scanned(runner.execute, verified)
    llm.generate(PROMPTS[:8], params, use_tqdm=False)
    assert "PrefillShape" in llm.ahead_shapes
    assert len(verified) > 30 and all(verified)
    assert llm.engine.spec.drafter.drafted_ahead > 0.5 * len(verified)


def scanned(execute, verified: list[bool]):
    """`execute` that records, for every sequence a step verifies, whether its drafts are the
    scan of its tokens: the K drafts cut to its depth (drafted ahead), or the scan for its
    depth (drafted in `propose`: the two differ where only a shorter continuation recurs)."""

    def recording(batch, **kw):
        for e in batch.entries:
            if e.drafts:
                tokens = e.seq.tokens(0, e.seq.num_tokens)[-4096:]
                depth, got = len(e.drafts), list(e.drafts)
                ok = got in (lookup(tokens, 1, 4, 3)[:depth], lookup(tokens, 1, 4, depth))
                verified.append(ok)
        return execute(batch, **kw)

    return recording


@cpu_engine
def test_drafting_ahead_that_raises_fails_no_sequence(tiny_model_dir, monkeypatch):
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True) for _ in range(4)]
    want = plain(tiny_model_dir, PROMPTS[:4], params)
    llm = ahead_engine(tiny_model_dir, monkeypatch)
    table = llm.engine.spec.drafter.device_table

    def fails(*args):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(table, "draft_ahead", fails)
    out = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert token_ids(out) == want
    assert llm.engine.retried_batches == 0 and llm.engine.telemetry.spec.verify_steps > 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["greedy", "seeded", "async"])
def test_on_cuda_graphs_drafts_ahead_and_output_is_plain_decodings(case):
    """The shipped model on CUDA graphs (batch-invariant kernels: speculation changes no bit):
    the drafter drafts ahead after its verify programs, most drafts come from there, no program
    is refused, and the output is plain decoding's."""
    from metrale.default_model import default_model_dir

    lines = [f"    total_{i} = compute(values[{i}], offset={i})\n" for i in range(12)]
    prompts = ["def f(values):\n" + "".join(lines[: 4 + i % 8]) for i in range(32)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24 + i % 9, ignore_eos=True)
        if case != "seeded"
        else SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=i)
        for i in range(32)
    ]
    kw = dict(device="cuda", dtype="bfloat16", deterministic=True, max_num_seqs=32)
    plain = LLM(default_model_dir(), **kw, async_scheduling=False)
    want = token_ids(plain.generate(prompts, params, use_tqdm=False))
    spec = {"method": "ngram", "num_drafts": 3, "dcut": False}
    llm = LLM(default_model_dir(), **kw, spec=spec, async_scheduling=case == "async")
    runner, verified = llm.engine.runner, []
    runner.execute = scanned(runner.execute, verified)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want
    assert len(verified) > 100 and all(verified)  # the drafts made on the device are right
    assert llm.engine.spec.drafter.drafted_ahead > 0.5 * len(verified)
    assert runner.graph_refusals == 0


@cpu_engine
def test_the_start_up_calibration_leaves_no_rows_behind(tiny_model_dir, monkeypatch):
    """D-Cut's start-up calibration runs synthetic verify steps through the programs, so the
    hook drafts ahead for their sequences: released like finished ones, they leave nothing in
    the table's books (found in review: a later sequence of the same id and slot was taken for
    one whose row was written, and drafted from the calibration's random tokens)."""
    from metrale.engine.calibrate import measured_cost_model

    llm = ahead_engine(tiny_model_dir, monkeypatch)
    engine = llm.engine
    table = engine.spec.drafter.device_table
    hooked = len(llm.ahead_shapes)
    engine.spec.cost = measured_cost_model(engine, 3, 6, 32)  # as `_calibrate_dcut` on CUDA
    assert len(llm.ahead_shapes) > hooked  # the hook saw the synthetic steps
    assert not table._written and (table._ahead is None or not table._ahead[1])


@cpu_engine
def test_verify_telemetry_survives_a_catch_up_that_raises(tiny_model_dir, monkeypatch):
    """The overlap window records each verify step's shape first: a drafter's catch-up that
    raises there (logged, redone by `propose`) loses no verify step from the telemetry."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=20 + 3 * i, ignore_eos=True) for i in range(8)
    ]
    llm = ahead_engine(tiny_model_dir, monkeypatch)

    def fails(seqs, width):
        raise RuntimeError("catch-up failed")

    monkeypatch.setattr(llm.engine.spec.drafter, "catch_up", fails)
    runner, verifies = llm.engine.runner, [0]
    execute = runner.execute

    def counted(batch, **kw):
        verifies[0] += any(e.drafts for e in batch.entries)
        return execute(batch, **kw)

    runner.execute = counted
    assert token_ids(llm.generate(PROMPTS[:8], params, use_tqdm=False)) == plain(
        tiny_model_dir, PROMPTS[:8], params
    )
    assert llm.engine.telemetry.spec.verify_steps == verifies[0] > 10
