"""D-Cut's acceptance estimates take a held verify's verdicts later (`AcceptanceEstimator.defer`):
every read sees what it would have seen had they been applied at once, and the engine applies them
in the next forward's overlap window when nothing read them before."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale import LLM, SamplingParams
from metrale.speculative.estimator import AcceptanceEstimator

matches = st.lists(st.booleans(), max_size=4)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("observe"), st.lists(st.tuples(st.integers(0, 4), matches), max_size=4)),
        st.tuples(st.just("defer"), st.lists(st.tuples(st.integers(0, 4), matches), max_size=4)),
        st.tuples(st.just("forget"), st.integers(0, 4)),
        st.tuples(st.just("estimate"), st.integers(0, 5)),
        st.tuples(st.just("len"), st.none()),
        st.tuples(st.just("flush"), st.none()),
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, pooled=st.booleans())
def test_deferred_observations_read_as_if_applied_at_once(ops, pooled):
    """Any interleaving of deferred and immediate observations, forgets and reads: each read of
    the deferring estimator equals that of one that applies every observation at once."""
    late = AcceptanceEstimator(max_positions=3, prior=0.4, max_sequences=3, pooled_prior=pooled)
    now = AcceptanceEstimator(max_positions=3, prior=0.4, max_sequences=3, pooled_prior=pooled)
    for op, arg in ops:
        if op in ("observe", "defer"):
            getattr(late, "defer" if op == "defer" else "observe_many")(arg)
            now.observe_many(arg)
        elif op == "forget":
            late.forget(arg)
            now.forget(arg)
        elif op == "estimate":
            assert late.estimate(arg, 3) == now.estimate(arg, 3)
        elif op == "len":
            assert len(late) == len(now)
        else:
            late.flush()
            assert not late.pending
    for sid in range(6):
        assert late.estimate(sid, 3) == now.estimate(sid, 3)
    assert not late.pending


def test_defer_keeps_nothing_for_an_empty_step_and_flushes_in_order():
    est = AcceptanceEstimator(max_positions=2, prior=0.5)
    est.defer([])
    assert not est.pending
    est.defer([(1, [True, True])])
    est.defer([(1, [False])])
    assert est.pending
    ref = AcceptanceEstimator(max_positions=2, prior=0.5)
    ref.observe(1, [True, True])
    ref.observe(1, [False])
    est.flush()
    assert not est.pending and est.estimate(1, 2) == ref.estimate(1, 2)


@pytest.fixture(scope="module")
def varied(hf_qwen3_factory):
    return hf_qwen3_factory("varied", initializer_range=0.2)  # its outputs repeat at times


def test_a_held_verifys_verdicts_reach_the_estimates_in_the_next_window(varied):
    """With D-Cut, a held verify's verdicts are deferred when read and applied inside the next
    step's overlap window (not on the critical path between the two forwards) whenever no plan
    read the estimates first; the output is the plain engine's."""
    prompts = [[(7 * i + 3 * j) % 40 + 3 for j in range(8 + i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(varied, device="cpu").generate(prompts, params, use_tqdm=False)
    spec = {"method": "ngram", "num_drafts": 3, "dcut": True}
    llm = LLM(varied, device="cpu", spec=spec, async_scheduling=True)
    engine = llm.engine
    estimator, runner = engine.spec.estimator, engine.runner
    in_window, window = [], [False]
    flush, overlap = estimator.flush, runner._overlap

    def spied() -> None:
        if estimator.pending and window[0]:
            in_window.append(1)
        flush()

    def spied_overlap(*args, **kwargs):
        # (the window: the work `execute` runs while its forward does)
        window[0] = True
        try:
            return overlap(*args, **kwargs)
        finally:
            window[0] = False

    estimator.flush, runner._overlap = spied, spied_overlap
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert engine._ahead.held_verifies > 0
    assert in_window, "no deferred verdicts were applied in an overlap window"
