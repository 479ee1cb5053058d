"""The n-gram drafter catching up while a step's forward runs (`NgramDrafter.catch_up`, called
through `ModelRunner.while_forward_runs`): a new prompt is indexed behind its prefill, not at its
first draft. Its drafts stay exactly the reference scan's, host index and device table alike,
placeholders of tokens in flight are never indexed, and an engine that catches up emits plain
decoding's tokens, synchronous and asynchronous, even when the catch-up raises."""

from __future__ import annotations

import os
import random

import pytest
import torch

from metrale.api import LLM
from metrale.config import SamplingParams
from metrale.speculative import ngram
from metrale.speculative.ngram import CATCH_UP_MIN, NgramDrafter, lookup
from tests.ngram_helpers import Seq, plain_and_ngram, token_ids

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def reference(seq: Seq, k: int, window: int) -> list[int]:
    return lookup(seq.tokens(0, seq.num_tokens)[-window:], 1, 3, k)


def _steps(drafter: NgramDrafter, width: int, seed: int, longest: int = 90) -> None:
    """Steps of a batch: new prompts, outputs growing by a few tokens, a placeholder in flight
    at some catch-ups, sequences finishing; the drafts of every step equal the reference."""
    rng = random.Random(seed)
    window = drafter.window
    live = [
        Seq(i, i, [rng.randrange(5) for _ in range(rng.randrange(1, longest))]) for i in range(6)
    ]
    next_id = 6
    for step in range(30):
        inflight = step % 3 == 1
        for s in live:
            if inflight:  # a step launched ahead: its token is a placeholder (a wrong one)
                s.output_token_ids.append(4)
                s.inflight = object()
        drafter.catch_up(live, width)
        for s in live:
            if s.inflight is not None:  # settled: the placeholder becomes the real token
                s.output_token_ids[-1] = rng.randrange(5)
                s.inflight = None
        ks = [rng.choice([1, 2, 3]) for _ in live]
        got = [d.tokens for d in drafter.propose(live, ks)]
        assert got == [reference(s, k, window) for s, k in zip(live, ks, strict=True)], step
        for s in live:
            s.output_token_ids += [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
        if step % 5 == 2:  # one finishes; a new prompt takes its slot
            gone = live.pop(rng.randrange(len(live)))
            drafter.release(gone)
            prompt = [rng.randrange(5) for _ in range(rng.randrange(1, longest))]
            live.append(Seq(next_id, gone.slot, prompt))
            next_id += 1


@pytest.mark.parametrize("seed", range(4))
def test_host_index_caught_up_drafts_as_the_scan(seed):
    _steps(NgramDrafter(1, 3, 48), 6, seed)


needs_kernel = pytest.mark.skipif(
    DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no CUDA and TRITON_INTERPRET is not set",
)


def _device_drafter(window: int) -> NgramDrafter:
    pytest.importorskip("triton")
    drafter = NgramDrafter(1, 3, window)
    if not drafter.use_device(8, 1200, DEVICE, 3):  # CPU: the interpreter runs the kernel
        from metrale.speculative.ngram_device import DeviceNgramTable

        drafter.device_table = DeviceNgramTable(8, 1200, DEVICE, 1, 3, window, 3)
    return drafter


@needs_kernel
@pytest.mark.parametrize("seed", range(2))
def test_device_table_caught_up_drafts_as_the_scan(seed, monkeypatch):
    monkeypatch.setattr(ngram, "DEVICE_MIN_SEQS", 2)
    _steps(_device_drafter(48), 6, seed)


@needs_kernel
def test_a_table_write_that_raises_is_written_again(monkeypatch):
    """A catch-up whose copy into the table raises (the overlap logs it) leaves the row to be
    written by the next `propose`, whose drafts are the reference scan's (found in review: the
    row was marked written before the copy)."""
    monkeypatch.setattr(ngram, "DEVICE_MIN_SEQS", 1)
    drafter = _device_drafter(1000)
    table = drafter.device_table
    seq = Seq(0, 0, [(j * 7) % 11 for j in range(300)])
    write, calls = table._write, []

    def fails_once(where, tokens):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        write(where, tokens)

    monkeypatch.setattr(table, "_write", fails_once)
    with pytest.raises(RuntimeError):
        drafter.catch_up([seq], 1)
    assert table.behind(seq, seq.num_tokens) == seq.num_tokens
    seq.output_token_ids.append(seq.prompt_token_ids[150])
    assert drafter.propose([seq], [3])[0].tokens == reference(seq, 3, 1000)


def test_catch_up_indexes_a_backlog_only_and_never_a_placeholder():
    drafter = NgramDrafter(1, 4, 4096)
    prompt = Seq(0, 0, list(range(CATCH_UP_MIN)))
    short = Seq(1, 1, list(range(CATCH_UP_MIN - 1)))
    ahead = Seq(2, 2, list(range(40)), [7], inflight=object())
    done = Seq(3, 3, list(range(40)), is_finished=True)
    drafter.catch_up([prompt, short, ahead, done], 4)
    assert drafter._indexes[0].length == CATCH_UP_MIN
    assert 1 not in drafter._indexes  # behind by less: left to `propose`
    assert drafter._indexes[2].length == 40  # not the placeholder of the token in flight
    assert 3 not in drafter._indexes  # a finished sequence gets no index (it would leak)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # long repetitive prompts: indexing them is the work caught up, and drafts are often right
    return [[rng.randrange(6) + 10 for _ in range(rng.randrange(20, 50))] * 3 for _ in range(5)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_engine_indexes_each_prompt_behind_its_prefill(
    tiny_model_dir, monkeypatch, async_scheduling
):
    """Every sequence's first draft finds its prompt indexed already, and the output is plain
    decoding's."""
    prompts = _prompts(1)
    plain, llm, params = plain_and_ngram(
        tiny_model_dir, prompts, max_tokens=20, max_num_seqs=4, dcut=False,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    drafter = llm.engine.spec.drafter
    first_backlog: dict[int, int] = {}
    propose = drafter.propose

    def spied(seqs, caps):
        for seq in seqs:
            index = drafter._indexes.get(seq.seq_id)
            first_backlog.setdefault(seq.seq_id, seq.num_tokens - (index.length if index else 0))
        return propose(seqs, caps)

    monkeypatch.setattr(drafter, "propose", spied)
    caught: list[bool] = []  # per sequence caught up: whether it was prefilling
    catch_up = drafter.catch_up

    def spied_catch_up(seqs, width):
        caught.extend(seq.is_prefilling for seq in seqs)
        return catch_up(seqs, width)

    monkeypatch.setattr(drafter, "catch_up", spied_catch_up)
    spec = llm.generate(prompts, params, use_tqdm=False)
    # only prompt chunks: a decode or verify step does no catch-up work over its batch
    assert caught and all(caught)
    assert token_ids(spec) == plain
    assert len(first_backlog) == len(prompts)
    # the prompt was indexed during the prefill: the first draft registers only the tokens of
    # the steps since (the first token, and one in flight under async scheduling)
    assert max(first_backlog.values()) <= 2, first_backlog
    assert not drafter._indexes  # every index went with its sequence


def test_a_catch_up_that_raises_is_logged_and_the_draft_does_its_work(
    tiny_model_dir, monkeypatch, caplog
):
    prompts = _prompts(2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", max_num_seqs=4, max_model_len=200)
    plain = LLM(tiny_model_dir, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_model_dir, **kw, spec={"method": "ngram", "num_drafts": 3, "dcut": False})

    def broken(seqs, width):
        raise RuntimeError("catch-up broke")

    monkeypatch.setattr(llm.engine.spec.drafter, "catch_up", broken)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert all(o.outputs[0].finish_reason == "length" for o in spec)
    assert "overlapped with the forward failed" in caplog.text
    assert llm.engine.telemetry.spec.num_drafts > 0  # drafting went on
