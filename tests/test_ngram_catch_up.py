"""The n-gram drafter catching up while a step's forward runs (`NgramDrafter.catch_up`, called
through `ModelRunner.while_forward_runs`): a new prompt is indexed behind its prefill, not at its
first draft. Its drafts stay exactly the reference scan's, host index and device table alike,
placeholders of tokens in flight are never indexed, and an engine that catches up emits plain
decoding's tokens, synchronous and asynchronous, even when the catch-up raises."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest
import torch

from metrale.api import LLM
from metrale.config import SamplingParams
from metrale.speculative import ngram
from metrale.speculative.ngram import CATCH_UP_MIN, HOST_BACKLOG_MAX, NgramDrafter, lookup

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class Seq:
    """The fields of `engine.sequence.Sequence` the drafter reads."""

    seq_id: int
    slot: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    inflight: object = None  # a token in flight: `output_token_ids` ends with its placeholder
    is_finished: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self, start: int, stop: int) -> list[int]:
        return (self.prompt_token_ids + self.output_token_ids)[start:stop]


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
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("longest", [40, 2 * HOST_BACKLOG_MAX])
def test_narrow_steps_draft_where_the_backlog_says_as_the_scan(seed, longest, monkeypatch):
    """Below `DEVICE_MIN_SEQS`, a batch of long prompts drafts from the device table and one of
    short prompts (6 of at most 39 tokens lag less than `HOST_BACKLOG_MAX` all told) from the
    host index, as sequences come and go; every draft is the reference scan's."""
    drafter = _device_drafter(1000)
    calls = []
    propose = drafter.device_table.propose
    monkeypatch.setattr(
        drafter.device_table, "propose", lambda s, k: calls.append(len(s)) or propose(s, k)
    )
    _steps(drafter, 6, seed, longest=longest)
    if longest > HOST_BACKLOG_MAX:
        assert calls, "prompts long enough must draft on the device"
    else:
        assert not calls and drafter._indexes, "short prompts must draft on the host"


@needs_kernel
def test_a_batch_of_prompts_long_all_told_is_caught_up_in_the_table():
    """Eight prompts of a third of `HOST_BACKLOG_MAX` each: the batch lags more than it all
    told, so the catch-up writes the table (as `propose` will draft from it), not eight host
    indexes."""
    drafter = _device_drafter(1000)
    n = HOST_BACKLOG_MAX // 3
    seqs = [Seq(i, i, [(i + j) % 7 for j in range(n)]) for i in range(8)]
    drafter.catch_up(seqs, len(seqs))
    assert not drafter._indexes
    assert all(drafter.device_table.behind(s, n) == 0 for s in seqs)
    got = [d.tokens for d in drafter.propose(seqs, [3] * 8)]
    assert got == [reference(s, 3, 1000) for s in seqs]
    assert not drafter._indexes


def test_narrow_steps_choose_by_the_host_backlog():
    drafter = NgramDrafter(1, 3, 4096)
    drafter.device_table = object()  # (only its presence is read here)
    assert not drafter._on_device(1, HOST_BACKLOG_MAX - 1)
    assert drafter._on_device(1, HOST_BACKLOG_MAX)
    assert drafter._on_device(ngram.DEVICE_MIN_SEQS, 0)
    drafter.device_table = None
    assert not drafter._on_device(ngram.DEVICE_MIN_SEQS, HOST_BACKLOG_MAX)


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
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", max_num_seqs=4, max_model_len=200)
    plain = LLM(tiny_model_dir, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(
        tiny_model_dir,
        **kw,
        spec={"method": "ngram", "num_drafts": 3, "dcut": False},
        async_scheduling=async_scheduling,
    )
    drafter = llm.engine.spec.drafter
    first_backlog: dict[int, int] = {}
    propose = drafter.propose

    def spied(seqs, caps):
        for seq in seqs:
            index = drafter._indexes.get(seq.seq_id)
            first_backlog.setdefault(seq.seq_id, seq.num_tokens - (index.length if index else 0))
        return propose(seqs, caps)

    monkeypatch.setattr(drafter, "propose", spied)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
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


@needs_kernel
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_engine_drafts_long_prompts_on_the_device_in_narrow_batches(
    tiny_model_dir, monkeypatch, async_scheduling
):
    """The engine's drafter (on the device even on CPU: the interpreter) takes a narrow batch
    of long prompts to the device table, and emits plain decoding's tokens."""
    from metrale.knobs import knobs

    monkeypatch.setenv("METRALE_FORCE_FUSED_KERNELS", "1")
    knobs.cache_clear()
    monkeypatch.setattr(ngram, "HOST_BACKLOG_MAX", 100)
    try:
        prompts = _prompts(3)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        kw = dict(device=str(DEVICE), dtype="float32", max_num_seqs=4, max_model_len=200)
        plain = LLM(tiny_model_dir, **kw).generate(prompts, params, use_tqdm=False)
        llm = LLM(
            tiny_model_dir,
            **kw,
            spec={"method": "ngram", "num_drafts": 3, "dcut": False},
            async_scheduling=async_scheduling,
        )
        drafter = llm.engine.spec.drafter
        assert drafter.device_table is not None
        calls = []
        propose = drafter.device_table.propose
        monkeypatch.setattr(
            drafter.device_table, "propose", lambda s, k: calls.append(len(s)) or propose(s, k)
        )
        spec = llm.generate(prompts, params, use_tqdm=False)
    finally:
        knobs.cache_clear()
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert calls and max(calls) < ngram.DEVICE_MIN_SEQS
    assert llm.engine.telemetry.spec.num_accepted_tokens > 0
