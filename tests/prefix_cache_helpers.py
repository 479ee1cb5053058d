"""Helpers of the prefix-caching tests: prompts that share prefixes, a watch that checks the
cache's invariants after every engine step, and a forward that fails one request's steps."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import torch

from metrale import LLM, SamplingParams


def shared_prompts(prefix_len: int, count: int, seed: int, vocab: int = 300) -> list[list[int]]:
    """`count` prompts that start with one prefix of `prefix_len` tokens: the prefix alone, the
    prefix and one more token, and the prefix with suffixes of 1 to 13 tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    prompts = [list(prefix), prefix + [rng.randrange(3, vocab)]]
    while len(prompts) < count:
        prompts.append(prefix + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 14))])
    return prompts


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


class Watch:
    """After every step of `llm`'s engine: a page that a running sequence may still write (from
    the one holding its first uncommitted row on) is in no other block table and not cached;
    reference counts equal block-table membership; the KV of a cached page (the target's and a
    drafter's own layers) never changes while it stays cached under one name."""

    def __init__(self, llm: LLM) -> None:
        self.engine = engine = llm.engine
        self.checks = 0
        self._seen: dict[int, tuple[bytes, list[torch.Tensor]]] = {}
        runner = engine.runner
        self._pools = [runner.kv_cache]
        if runner.mtp is not None:
            self._pools += [layer.kv_cache for layer in runner.mtp.attention_layers]
        inner, evict = engine.step, engine.allocator.cache.evict

        def evicted() -> int:
            page = evict()
            self._seen.pop(page, None)  # out of the cache: it may be written (and named) anew
            return page

        engine.allocator.cache.evict = evicted
        forget = engine.allocator.cache._forget

        def forgotten(page: int) -> None:
            forget(page)  # its name went to another copy: it may be written (and named) anew
            self._seen.pop(page, None)

        engine.allocator.cache._forget = forgotten

        def step():
            outputs = inner()
            self.check()
            return outputs

        engine.step = step

    def _page(self, page: int) -> list[torch.Tensor]:
        # the target's pool is [layers, 2, pages, ...]; an MTP layer's [2, pages, ...]
        return [p[:, :, page] if p.dim() == 6 else p[:, page] for p in self._pools]

    def check(self) -> None:
        alloc = self.engine.allocator
        cache, size = alloc.cache, alloc.page_size
        held: Counter[int] = Counter()
        for seq in self.engine.scheduler.running:
            held.update(seq.block_table)
            for page in seq.block_table[seq.num_computed_tokens // size :]:
                assert alloc.refs(page) == 1, f"page {page} is shared while being written"
                assert not cache.holds(page), f"page {page} is cached while being written"
        for page in range(1, alloc.num_pages):
            assert alloc.refs(page) == held[page], f"page {page}: refs {alloc.refs(page)}"
        for page, name in cache._name_of.items():
            kept = self._seen.get(page)
            now = self._page(page)
            if kept is not None and kept[0] == name:
                for before, after in zip(kept[1], now, strict=True):
                    assert torch.equal(before, after), f"cached page {page} was written"
            else:
                self._seen[page] = (name, [t.clone() for t in now])
        self.checks += 1


def fail_request(monkeypatch, llm: LLM, request_id: str, after: int) -> None:
    """Make a hybrid target's forward raise part-way (in layer 2's `forward_fold`, after the
    layers before it advanced their state) in every step whose batch holds `request_id`, from
    the `after`-th call of that layer in such steps on: the request fails mid-generation, then
    whenever it runs. A spy on the runner's `execute` notes each step's requests;
    `monkeypatch.undo()` restores both."""
    runner = llm.engine.runner
    layer = runner.model.model.layers[2]
    real_execute, real_layer = runner.execute, layer.forward_fold
    current: list[str] = []
    calls = itertools.count()

    def execute(batch, **kw):
        current[:] = [e.seq.request_id for e in batch.entries]
        return real_execute(batch, **kw)

    def failing_layer(*args, **kwargs):
        if request_id in current and next(calls) >= after:
            raise RuntimeError("NaN in layer 2")
        return real_layer(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", execute)
    monkeypatch.setattr(layer, "forward_fold", failing_layer)
