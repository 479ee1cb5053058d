"""Invariants of ARCHITECTURE.md that no test pinned (found by an audit of its list):

- rollback: no KV row past a sequence's committed rows (a rejected draft's, a row the chain
  wrote ahead) is ever read: poisoned with NaN after every step, the output is still plain
  decoding's; poisoning the last committed row instead does change it (the poison reaches the
  attention, so the first check can fail);
- one host sync a step: a steady step reads the device once, the verdicts' copy
  (`engine/step_output.py`), synchronous or asynchronous, plain or speculative;
- preemption: the newest running sequence goes first, is recomputed from its first token, and
  goes back ahead of later arrivals, nothing being admitted by the step that preempted.
"""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from metrale import LLM, SamplingParams
from metrale.engine.kv_cache import PageAllocator
from metrale.engine.scheduler import Scheduler
from metrale.engine.sequence import Sequence
from tests.test_spec_lossless import make_prompts, params_for, replay


def poison_rows(engine, back: int = 0) -> int:
    """NaN into every KV row of each running sequence from `num_computed_tokens - back` to the
    end of its pages (the K and V of every layer); returns the rows poisoned."""
    page = engine.config.page_size
    poisoned = 0
    for seq in engine.scheduler.running:
        start = max(seq.num_computed_tokens - back, 0)
        end = len(seq.block_table) * page
        slots = [seq.block_table[p // page] * page + p % page for p in range(start, end)]
        if not slots:
            continue
        cache = engine.runner.kv_cache  # [layers, 2, pages, page_size, kv heads, head dim]
        cache.view(*cache.shape[:2], -1, *cache.shape[-2:])[:, :, torch.tensor(slots)] = float(
            "nan"
        )
        poisoned += len(slots)
    return poisoned


def run_poisoned(model_dir, prompts, params, drafter, back: int) -> tuple[list, int]:
    llm = LLM(model_dir, device="cpu", drafter=drafter, spec={"num_drafts": 4})
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    outs, poisoned = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
        poisoned += poison_rows(engine, back)
    return [outs[f"r{i}"] for i in range(len(prompts))], poisoned


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.9])
def test_rows_past_the_committed_ones_are_never_read(tiny_model_dir, alpha):
    prompts = make_prompts()[:8]
    params = [params_for(i) for i in range(8)]
    plain = LLM(tiny_model_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    want = [o.outputs[0].token_ids for o in plain]
    got, poisoned = run_poisoned(tiny_model_dir, prompts, params, replay(prompts, want, alpha), 0)
    assert poisoned > 0 and got == want
    # the control: the last committed row is read, and the poison then shows
    got, _ = run_poisoned(tiny_model_dir, prompts, params, replay(prompts, want, alpha), 1)
    assert got != want


SYNCS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.cpu,
}


class HostReads(TorchFunctionMode):
    """Counts the tensor calls that read device memory on the host, by where metrale made them."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCS:
            ours = [f for f in traceback.extract_stack()[:-1] if "/metrale/" in f.filename]
            self.seen[ours[-1].filename.rsplit("/metrale/", 1)[1] if ours else "?"] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_drafts": 3, "dcut": False}])
@pytest.mark.parametrize("async_on", [True, False])
def test_a_steady_step_reads_the_device_once(tiny_model_dir, spec, async_on):
    kw = {"spec": spec} if spec else {}
    llm = LLM(tiny_model_dir, device="cpu", async_scheduling=async_on, **kw)
    engine = llm.engine
    for i, prompt in enumerate(make_prompts()[:8]):
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        engine.add_request(f"r{i}", prompt * 3, params)
    for _ in range(6):  # past the prefill
        engine.step()
    reads = HostReads()
    steps = 5
    with reads:
        for _ in range(steps):
            engine.step()
    assert engine.has_unfinished_requests()  # every counted step was a decode or a verify
    assert sum(reads.seen.values()) <= steps, reads.seen
    assert set(reads.seen) <= {"engine/step_output.py", "engine/device_tokens.py"}, reads.seen


def test_the_newest_is_preempted_first_and_recomputes_ahead_of_later_arrivals():
    allocator = PageAllocator(num_pages=4, page_size=4)
    scheduler = Scheduler(allocator, max_num_seqs=8, max_num_batched_tokens=64)

    def sequence(i: int, n: int) -> Sequence:
        return Sequence(i, f"r{i}", list(range(3, 3 + n)), SamplingParams(), 0, (), arrival=i)

    seqs = [sequence(i, 4) for i in range(allocator.num_usable)]
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()  # each prompt fills its one page
    assert [e.seq for e in batch.entries] == seqs and allocator.num_free == 0
    for e in batch.entries:
        e.seq.num_computed_tokens += e.num_rows
        e.seq.output_token_ids.append(1)
    late = sequence(99, 2)
    scheduler.add(late)
    batch = scheduler.schedule()  # the oldest needs a second page: the newest go
    assert batch.preempted == seqs[:0:-1] and [e.seq for e in batch.entries] == [seqs[0]]
    assert all(seq.num_computed_tokens == 0 for seq in batch.preempted)
    assert scheduler.waiting == [seqs[1], seqs[2], late]
    assert late not in [e.seq for e in batch.entries]
