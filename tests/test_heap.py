"""The start-up heap is frozen out of the cyclic collector once per process, by the entry points
(server, benches, `generate`, `chat`), never by the library: a program's own objects in reference
cycles stay collectable when it builds an engine, and engines made after a freeze are freed when
dropped (a frozen engine would keep its KV pool and graphs until the process ends)."""

from __future__ import annotations

import gc
import weakref

from metrale import LLM
from metrale.engine import heap


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_building_an_engine_freezes_nothing(tiny_model_dir):
    held = Cycle()
    ref, frozen = weakref.ref(held), gc.get_freeze_count()
    llm = LLM(tiny_model_dir, device="cpu")
    assert gc.get_freeze_count() == frozen
    del held
    gc.collect()
    assert ref() is None and llm.engine is not None


def test_engines_stay_collectable_after_the_heap_is_frozen(tiny_model_dir):
    heap.freeze_startup_heap()
    assert heap._frozen and gc.get_freeze_count() > 0
    frozen = gc.get_freeze_count()
    first = LLM(tiny_model_dir, device="cpu")
    second = LLM(tiny_model_dir, device="cpu", spec={"method": "ngram", "num_drafts": 2})
    heap.freeze_startup_heap()
    assert gc.get_freeze_count() == frozen  # once per process, not once per call
    refs = [weakref.ref(llm.engine.runner.model) for llm in (first, second)]
    del first, second
    gc.collect()
    assert all(ref() is None for ref in refs)
