"""The n-gram drafter on the device (`kernels.ngram_lookup`, `speculative.ngram_device`) against
the reference scan `ngram.lookup`: the same drafts for every sequence of a batch, through the
table's incremental upkeep (new prompts, growing outputs, slots reused, preemption onto another
slot), and an engine drafting on the device emits what plain decoding emits. Under Triton's
interpreter on CPU; on CUDA where there is one."""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton")

from metrale.api import LLM  # noqa: E402
from metrale.config import SamplingParams  # noqa: E402
from metrale.speculative import ngram  # noqa: E402
from metrale.speculative.ngram import NgramDrafter, lookup  # noqa: E402
from metrale.speculative.ngram_device import DeviceNgramTable  # noqa: E402
from tests.ngram_helpers import Seq  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not set", allow_module_level=True)


def reference(seq: Seq, k: int, n_min: int, n_max: int, window: int) -> list[int]:
    return lookup(seq.tokens(0, seq.num_tokens)[-window:], n_min, n_max, k)


@pytest.mark.parametrize("n_min,n_max,window", [(1, 4, 4096), (2, 3, 64), (1, 1, 16), (3, 5, 40)])
def test_device_drafts_equal_the_reference_scan(n_min, n_max, window):
    rng = random.Random(n_min * 100 + n_max + window)
    table = DeviceNgramTable(12, 600, DEVICE, n_min, n_max, window, 7)
    seqs, ks = [], []
    for i in range(12):
        vocab = rng.choice([2, 3, 5, 50])  # small vocabularies recur, a large one rarely
        length = rng.choice([0, 1, 2, 3, 5, 17, 100, 300, 599])
        seqs.append(Seq(i, 11 - i, [rng.randrange(vocab) for _ in range(length)]))
        ks.append(rng.choice([0, 1, 3, 7]))
    got = table.propose(seqs, ks)
    want = [reference(s, k, n_min, n_max, window) for s, k in zip(seqs, ks, strict=True)]
    assert got == want
    assert any(want), "the cases must include matches"


def test_the_table_follows_growing_sequences_reused_slots_and_preemption():
    """Steps of a running batch: outputs grow by a few tokens, sequences finish and new ones take
    their slots, one comes back on another slot after a preemption; every step's drafts equal
    the reference scan of each sequence's whole history."""
    rng = random.Random(7)
    n_min, n_max, window = 1, 3, 48
    table = DeviceNgramTable(6, 400, DEVICE, n_min, n_max, window, 4)
    live = [Seq(i, i, [rng.randrange(4) for _ in range(rng.randrange(1, 60))]) for i in range(6)]
    next_id = 6
    for step in range(40):
        ks = [rng.choice([1, 3, 4]) for _ in live]
        want = [reference(s, k, n_min, n_max, window) for s, k in zip(live, ks, strict=True)]
        assert table.propose(live, ks) == want, f"step {step}"
        for s in live:
            s.output_token_ids += [rng.randrange(4) for _ in range(rng.randrange(1, 5))]
        if step % 7 == 3:  # a sequence finishes: a new one takes its slot
            gone = live.pop(rng.randrange(len(live)))
            table.release(gone)
            live.append(Seq(next_id, gone.slot, [rng.randrange(4) for _ in range(30)]))
            next_id += 1
        if step % 11 == 5:  # preempted and back on another slot (its tokens kept)
            a, b = rng.sample(range(len(live)), 2)
            table.release(live[a])
            live[a].slot, live[b].slot = live[b].slot, live[a].slot


def test_a_sequence_without_a_row_drafts_nothing_and_harms_no_row():
    table = DeviceNgramTable(2, 16, DEVICE, 1, 2, 16, 2)
    ok = Seq(0, 0, [1, 2, 1, 2, 1])
    too_long = Seq(1, 1, [1] * 17)  # past the capacity
    no_slot = Seq(2, -1, [1, 1, 1])
    assert table.propose([ok, too_long, no_slot], [2, 2, 2]) == [[2, 1], [], []]
    assert table.propose([ok], [2]) == [[2, 1]]


def test_the_drafter_uses_the_device_for_wide_batches_only(monkeypatch):
    drafter, slots = NgramDrafter(1, 3, 64), ngram.DEVICE_MIN_SEQS
    assert drafter.use_device(slots, 128, DEVICE, 2) or DEVICE.type == "cpu"
    if drafter.device_table is None:  # CPU without the forced interpreter: the host path
        table = DeviceNgramTable(slots, 128, DEVICE, 1, 3, 64, 2)
        monkeypatch.setattr(drafter, "device_table", table, raising=False)
    calls = []
    propose = drafter.device_table.propose
    monkeypatch.setattr(
        drafter.device_table, "propose", lambda s, k: calls.append(len(s)) or propose(s, k)
    )
    seqs = [Seq(i, i, [i % 3, 1, i % 3, 1, i % 3]) for i in range(slots)]
    wide = drafter.propose(seqs, [2] * len(seqs))
    narrow = drafter.propose(seqs[:1], [2])
    assert calls == [len(seqs)]
    assert [d.tokens for d in wide] == [reference(s, 2, 1, 3, 64) for s in seqs]
    assert narrow[0].tokens == wide[0].tokens


def test_a_few_sequences_draft_where_their_tokens_already_are(monkeypatch):
    """A probe of a wide batch asks for a few sequences whose tokens the device table holds
    (`catch_up` wrote their prompts there) and whose host indexes were never grown: they draft
    on the device, not by indexing hundreds of tokens on the host; a few whose host indexes are
    current stay on the host. The drafts are the reference scan's either way."""
    slots = ngram.DEVICE_MIN_SEQS
    drafter = NgramDrafter(1, 3, 512)
    table = DeviceNgramTable(slots + 1, 512, DEVICE, 1, 3, 512, 3)
    monkeypatch.setattr(drafter, "device_table", table, raising=False)
    calls = []
    propose = table.propose
    monkeypatch.setattr(table, "propose", lambda s, k: calls.append(len(s)) or propose(s, k))
    rng = random.Random(5)
    seqs = [Seq(i, i, [rng.randrange(5) for _ in range(200)]) for i in range(slots)]
    drafter.catch_up(seqs, width=len(seqs))  # a wide batch's prompts: into the table
    assert calls == [] and not drafter._indexes
    few = seqs[:3]
    got = drafter.propose(few, [3, 3, 3])
    assert calls == [3], "the few drafted on the device"
    assert [d.tokens for d in got] == [reference(s, 3, 1, 3, 512) for s in few]
    assert not drafter._indexes, "and indexed nothing on the host"
    # host indexes as current as the table: a few look-ups on the host, no launch
    for s in few:
        drafter._index(s).extend(s.tokens(0, s.num_tokens))
    again = drafter.propose(few, [3, 3, 3])
    assert calls == [3]
    assert [d.tokens for d in again] == [d.tokens for d in got]
    # a long sequence the host indexed and the table lacks does not make the others index on
    # the host (its lag is no credit against theirs; found in review)
    long = Seq(99, slots, [rng.randrange(5) for _ in range(500)])
    drafter._index(long).extend(long.tokens(0, long.num_tokens))
    mixed = [long, *seqs[3:6]]
    got = drafter.propose(mixed, [3] * 4)
    assert calls == [3, 4], "the table is where the three lagging ones' tokens are"
    assert [d.tokens for d in got] == [reference(s, 3, 1, 3, 512) for s in mixed]
    assert set(drafter._indexes) == {0, 1, 2, 99}


@pytest.fixture
def forced_device(knob_env):
    """The engine's n-gram drafter on the device even on CPU (the interpreter)."""
    knob_env(METRALE_FORCE_FUSED_KERNELS="1")


def test_an_engine_drafting_on_the_device_emits_plain_decoding(
    tiny_model_dir, forced_device, monkeypatch
):
    monkeypatch.setattr(ngram, "DEVICE_MIN_SEQS", 2)
    rng = random.Random(3)
    # repetitive prompts, so the drafts are often right
    prompts = [[rng.randrange(6) + 10 for _ in range(rng.randrange(8, 40))] * 2 for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(device=str(DEVICE), dtype="float32", max_num_seqs=4, max_model_len=160)
    plain = LLM(tiny_model_dir, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_model_dir, **kw, spec={"method": "ngram", "num_drafts": 3})
    table = llm.engine.spec.drafter.device_table
    assert table is not None
    widths = []
    propose = table.propose
    monkeypatch.setattr(table, "propose", lambda s, k: widths.append(len(s)) or propose(s, k))
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.telemetry.spec.num_draft_tokens > 0
    assert widths and max(widths) >= 3  # the device drafted for batches of several sequences


def test_lagging_host_indexes_catch_up_in_a_narrow_batch(monkeypatch):
    """The tail of a wide batch: a few sequences whose tokens the table holds and whose host
    indexes lag draft on the device once, and their host indexes are caught up behind the next
    forwards (`catch_up`, a budget of tokens a call), after which they draft on the host with
    no launch; a sequence longer than the window is indexed from the window's start. The drafts
    are the reference scan's throughout. In a wide batch the table serves them: no host work."""
    monkeypatch.setattr(ngram, "LAG_CATCH_UP_TOKENS", 150)
    window = 256
    drafter = NgramDrafter(1, 3, window)
    table = DeviceNgramTable(20, 700, DEVICE, 1, 3, window, 3)
    monkeypatch.setattr(drafter, "device_table", table, raising=False)
    calls = []
    propose = table.propose
    monkeypatch.setattr(table, "propose", lambda s, k: calls.append(len(s)) or propose(s, k))
    rng = random.Random(11)
    seqs = [Seq(i, i, [rng.randrange(4) for _ in range(n)]) for i, n in enumerate([200, 600])]
    table.write(seqs, [s.num_tokens for s in seqs])  # what a wide batch's steps left there
    want = [reference(s, 3, 1, 3, window) for s in seqs]
    assert [d.tokens for d in drafter.propose(seqs, [3, 3])] == want
    assert calls == [2] and drafter.lagging
    drafter.catch_up(seqs, width=ngram.DEVICE_MIN_SEQS)  # wide: nothing indexed
    assert not drafter.lagging and not drafter._indexes
    drafter.propose(seqs, [3, 3])
    assert calls == [2, 2] and drafter.lagging
    for _ in range(3):  # 200 + 259 tokens (the window and n_max) at 150 a call: 4 calls
        drafter.catch_up([], width=2)
    assert drafter.lagging
    drafter.catch_up([], width=2)
    assert not drafter.lagging
    assert [drafter._indexes[s.seq_id].length for s in seqs] == [200, 600]
    assert drafter._indexes[1].offset == 600 - window - 3
    for s in seqs:
        s.output_token_ids += [rng.randrange(4) for _ in range(5)]
    got = drafter.propose(seqs, [3, 3])
    assert calls == [2, 2], "drafted on the host"
    assert [d.tokens for d in got] == [reference(s, 3, 1, 3, window) for s in seqs]


def test_an_engine_whose_batch_narrows_catches_its_host_indexes_up(
    tiny_model_dir, forced_device, monkeypatch
):
    """A batch drafting on the device narrows below `DEVICE_MIN_SEQS` as its sequences finish:
    the ones left draft on the device for their lag only until their host indexes are caught up
    behind the forwards, and then on the host; the output is plain decoding's."""
    monkeypatch.setattr(ngram, "DEVICE_MIN_SEQS", 4)
    monkeypatch.setattr(ngram, "HOST_LAG_MAX", 8)
    rng = random.Random(5)
    prompts = [[rng.randrange(6) + 10 for _ in range(rng.randrange(20, 40))] * 2 for _ in range(5)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 8, 10, 40, 40)
    ]
    kw = dict(device=str(DEVICE), dtype="float32", max_num_seqs=5, max_model_len=160)
    plain = LLM(tiny_model_dir, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_model_dir, **kw, spec={"method": "ngram", "num_drafts": 3, "dcut": False})
    drafter = llm.engine.spec.drafter
    narrow = []
    propose = drafter.device_table.propose

    def spied(seqs, ks):
        if len(seqs) < 4:
            narrow.append(len(seqs))
        return propose(seqs, ks)

    monkeypatch.setattr(drafter.device_table, "propose", spied)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.telemetry.spec.num_draft_tokens > 0
    # the two left draft 30-odd steps alone: on the device once or twice, then on the host
    assert 1 <= len(narrow) <= 3, narrow
    assert not drafter.lagging and not drafter._indexes
