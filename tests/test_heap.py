"""The start-up heap is frozen out of the cyclic collector once per process, and an engine's own
objects stay collectable: a dropped engine is freed (a frozen engine would keep its KV pool and
graphs until the process ends)."""

from __future__ import annotations

import gc
import weakref

from metrale import LLM
from metrale.engine import heap


def test_engines_stay_collectable_after_the_heap_is_frozen(tiny_model_dir):
    first = LLM(tiny_model_dir, device="cpu")
    assert heap._frozen and gc.get_freeze_count() > 0
    frozen = gc.get_freeze_count()
    second = LLM(tiny_model_dir, device="cpu", spec={"method": "ngram", "num_drafts": 2})
    assert gc.get_freeze_count() == frozen  # once per process, not once per engine
    refs = [weakref.ref(llm.engine.runner.model) for llm in (first, second)]
    del first, second
    gc.collect()
    assert all(ref() is None for ref in refs)
