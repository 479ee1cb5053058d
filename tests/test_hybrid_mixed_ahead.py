"""Drafting ahead after a hybrid target's mixed programs (a verify beside prompt chunks in one
forward, `GDNMixedShape`): the n-gram drafter (on its device table) and DFlash make the next
drafts right after the program, from the real rows it leaves in batch order
(`ModelRunner.replayed_ids`), as after a ragged program; MTP catches up from the verdicts.

CPU, float32, with the fake capture of `test_hybrid_prefill_graphs` (a "graph" reruns its
function) and the Triton interpreter's kernels. Each test compares with plain eager decoding token
for token and checks that drafts were made ahead after mixed programs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from metrale import SamplingParams  # noqa: E402
from metrale.engine.model_setup import attach_dflash  # noqa: E402
from metrale.engine.program_shapes import GDNMixedShape  # noqa: E402
from metrale.speculative import dflash as dflash_mod  # noqa: E402
from metrale.speculative import ngram  # noqa: E402
from metrale.speculative.ngram_device import DeviceNgramTable  # noqa: E402
from tests.test_dflash_ahead import fake_capture  # noqa: E402
from tests.test_hybrid_engine import llm_for, write_hybrid  # noqa: E402
from tests.test_hybrid_prefill_graphs import VARIANTS, fake_graphs, graphed  # noqa: E402, F401
from tests.test_ngram_ahead import scanned  # noqa: E402
from tests.test_spec_dflash import write_dflash  # noqa: E402

# prompts of different lengths: later ones are admitted, a chunk at a time, while earlier ones
# verify
PROMPTS = [[(7 * i + 3 * (j % (3 + i))) % 20 + 3 for j in range(10 + 5 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory, tokenizer_dir):
    """A hybrid of 24 tokens: its output repeats often enough for n-gram drafts to be accepted."""
    return write_hybrid(tmp_path_factory.mktemp("hybrid24"), tokenizer_dir, seed=3, vocab_size=24)


def params(n: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=10 + 3 * (i % 4), ignore_eos=True)
        for i in range(n)
    ]


def plain(model_dir) -> list[list[int]]:
    outs = llm_for(model_dir).generate(PROMPTS, params(len(PROMPTS)), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run(llm, made_ahead) -> tuple[list[list[int]], int, int]:
    """Greedy output, with every draft made ahead after a mixed program checked: the length the
    drafter worked out for each of its sequences (`made_ahead()`: (sequence, tokens it has once
    the step is committed)) must be the sequence's own at the next step. Returns the output,
    the sequences checked, and how many of those had accepted drafts in the mixed program."""
    runner = llm.engine.runner
    hook, execute = runner.after_verify, runner.execute
    pending, books = [], {"checked": 0, "accepted": 0}

    def after_verify(entries, shape, tokens):
        hook(entries, shape, tokens)
        if isinstance(shape, GDNMixedShape):
            pending[:] = [(seq, n, seq.num_tokens) for seq, n in made_ahead(entries)]

    def recording(batch, **kw):
        for seq, want, before in pending:
            if not seq.is_finished:
                assert seq.num_tokens == want, "a draft made ahead from the wrong rows"
                books["checked"] += 1
                books["accepted"] += want > before + 1
        pending.clear()
        return execute(batch, **kw)

    if hook is not None:
        runner.after_verify = after_verify
    runner.execute = recording
    outs = llm.generate(PROMPTS, params(len(PROMPTS)), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], books["checked"], books["accepted"]


def ngram_made_ahead(table):
    def made(entries):
        if table._ahead is None:
            return []
        copy, index = table._ahead
        rows = copy.rows()
        return [(seq, rows[n][1]) for n, seq, _ in index.values()]

    return made


def dflash_made_ahead(drafter):
    def made(entries):
        if drafter._ahead is None:
            return []
        _, context, index = drafter._ahead
        lens, seqs = context.rows(), {e.seq.seq_id: e.seq for e in entries}
        return [(seqs[i], lens[n] + 1) for i, n in index.items()]

    return made


def engine(model_dir, variant: str, spec: dict):
    return graphed(
        llm_for(
            model_dir,
            spec={"num_drafts": 3, "dcut": False, **spec},
            hybrid_verify_state=variant,
            max_num_batched_tokens=32,
            max_num_seqs=4,
        )
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_ngram_drafts_ahead_after_mixed_programs(small_vocab, fake_graphs, monkeypatch, variant):  # noqa: F811
    want = plain(small_vocab)
    monkeypatch.setattr(ngram, "DEVICE_MIN_SEQS", 2)
    llm = engine(small_vocab, variant, {"method": "ngram"})
    drafter = llm.engine.spec.drafter
    drafter.device_table = DeviceNgramTable(4, 200, torch.device("cpu"), 1, 4, 4096, 3)
    drafter.attach(llm.engine.runner)
    runner, verified = llm.engine.runner, []
    runner.execute = scanned(runner.execute, verified)
    got, checked, accepted = run(llm, ngram_made_ahead(drafter.device_table))
    assert got == want
    assert all(verified)  # every draft is the scan of its sequence's tokens
    assert checked > 0 and accepted > 0 and drafter.drafted_ahead > 0
    assert runner.watch.eager == [] and llm.engine.retried_batches == 0
    tel = llm.engine.telemetry.spec
    assert 0 < tel.num_accepted_tokens < tel.num_draft_tokens


@pytest.mark.parametrize("variant", VARIANTS)
def test_dflash_drafts_ahead_after_mixed_programs(
    small_vocab,
    fake_graphs,  # noqa: F811
    monkeypatch,
    tmp_path,
    variant,  # noqa: F811
):
    """DFlash reads its context from pages the target's forward wrote, mixed programs
    included; the drafts it makes ahead after one are those `propose` makes without it."""
    want = plain(small_vocab)
    path = write_dflash(small_vocab, tmp_path / "d", layers=(1, 1))
    monkeypatch.setattr(dflash_mod, "capture", fake_capture)
    monkeypatch.setattr(dflash_mod, "STARTUP_CONTEXT_ROWS", 512)
    drafts = []
    for ahead in (False, True):
        llm = engine(small_vocab, variant, {"method": "dflash", "model": str(path)})
        # the target's taps sized for the programs' rows, as when the engine builds its graphs
        attach_dflash(llm.engine.runner, llm.engine.config, 3)
        drafter = llm.engine.spec.drafter
        drafter.graphs = dflash_mod.DraftGraphs(drafter, 4, 256, None)
        runner, seen = llm.engine.runner, []
        execute = runner.execute

        def recording(batch, execute=execute, seen=seen, **kw):
            seen += [(e.seq.request_id, e.seq.num_tokens, tuple(e.drafts)) for e in batch.entries]
            return execute(batch, **kw)

        runner.execute = recording
        if ahead:
            runner.after_verify = drafter._draft_ahead
            runner.after_verify_drafts_only = True
        got, checked, accepted = run(llm, dflash_made_ahead(drafter))
        assert got == want
        assert runner.watch.eager == [] and llm.engine.retried_batches == 0
        assert any(isinstance(c[0], GDNMixedShape) for c in runner.watch.calls)
        if ahead:
            assert checked > 0 and accepted > 0 and drafter.drafted_ahead > 0
        drafts.append(seen)
    assert drafts[0] == drafts[1]
