"""The engine measures its own verify cost curve (on CUDA at start-up when D-Cut is on): the
model it builds covers the batch sizes and depths asked for and leaves the KV pool as it was."""

from __future__ import annotations

from metrale import LLM
from metrale.engine.calibrate import measured_cost_model, step_times


def test_measured_cost_model_covers_the_batch_and_frees_its_pages(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", max_num_seqs=20)
    engine = llm.engine
    free = engine.allocator.num_free
    model = measured_cost_model(engine, num_drafts=3, max_seqs=20, context=16)
    assert model._batches == [1, 4, 16, 20]
    for b in (1, 4, 16, 20):
        assert model.step_time(b, b) == 1.0
        # more rows never cost less (the model raises dips to the running maximum)
        assert model.step_time(4 * b, b) >= model.step_time(2 * b, b) >= 1.0
    assert engine.allocator.num_free == free


def test_step_times_are_positive_per_batch_and_depth(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu")
    times = step_times(llm.engine, [1, 3], [1, 4], context=8, reps=2)
    assert set(times) == {1, 3} and all(set(t) == {1, 4} for t in times.values())
    assert all(v > 0 for t in times.values() for v in t.values())
