"""D-Cut's choice for the next step made while a verify step's forward runs
(`DepthPlanning.plan_ahead`, through `SpeculativeDecoder.while_forward`): the next step takes it
when it plans afresh for the same sequences and caps, never a later step, and never for other
sequences or caps; an engine that plans ahead emits plain decoding's tokens."""

from __future__ import annotations

import random

import pytest

from metrale import LLM, SamplingParams
from metrale.speculative import planning
from metrale.speculative.drafter import Draft
from metrale.speculative.verify_cost import VerifyCostModel
from tests import test_dcut_plan_stands as plan_stands
from tests.ngram_helpers import plain_and_ngram, token_ids
from tests.test_dcut_plan_stands import EvenSlots, _decoding


def _decoder(tiny_model_dir):
    """`test_dcut_plan_stands`'s decoder (rows free, not a probe step), counting D-Cut's
    choices."""
    dec, _ = plan_stands._decoder(tiny_model_dir, EvenSlots())
    choices = []
    real = dec._choice
    dec._choice = lambda seqs, caps: choices.append(len(seqs)) or real(seqs, caps)
    return dec, choices


def test_the_next_step_takes_the_choice_made_ahead(tiny_model_dir):
    dec, choices = _decoder(tiny_model_dir)
    seqs = _decoding(8)
    dec._prepare(seqs)  # plans: the plan stands for `dcut_replan_every` steps
    assert choices == [8]
    for _ in range(dec.cfg.dcut_replan_every - 1):
        dec.plan_ahead(seqs)  # the plan in use does not expire yet: nothing to do
        assert dec._ahead is None
        dec._prepare(seqs)
    assert choices == [8]
    dec.plan_ahead(seqs)  # it expires at the next step: chosen now
    assert dec._ahead is not None and choices == [8, 8]
    dec._prepare(seqs)
    assert choices == [8, 8]  # taken: no choice on the step's own path
    assert dec._ahead is None
    assert [len(s.draft.tokens) if s.draft else 0 for s in seqs] == [3, 0] * 4


def test_a_choice_for_other_sequences_or_caps_is_not_taken(tiny_model_dir):
    dec, choices = _decoder(tiny_model_dir)
    seqs = _decoding(8)
    dec._last_plan = None  # the next step plans afresh
    dec.plan_ahead(seqs)
    dec._prepare(seqs[:6])  # two finished meanwhile
    assert choices == [8, 6]
    dec._last_plan = None
    dec.plan_ahead(seqs)
    seqs[0].params = SamplingParams(max_tokens=len(seqs[0].output_token_ids) + 2)  # cap 1
    dec._prepare(seqs)
    assert choices == [8, 6, 8, 8]


def test_a_choice_made_ahead_is_for_the_step_after_it_alone(tiny_model_dir):
    dec, choices = _decoder(tiny_model_dir)
    seqs = _decoding(8)
    dec._prepare(seqs)
    dec._ahead = (((-1,), (3,)), None)  # a choice nobody takes
    dec._prepare(seqs)  # the plan in use stands: no choice taken
    assert dec._ahead is None


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_engine_planning_ahead_emits_plain_decoding(
    tiny_model_dir, monkeypatch, async_scheduling
):
    rng = random.Random(5)
    prompts = [[rng.randrange(6) + 10 for _ in range(rng.randrange(8, 30))] * 3 for _ in range(6)]
    plain, llm, params = plain_and_ngram(
        tiny_model_dir, prompts, max_tokens=40, max_num_seqs=6, dcut=True,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    taken, made = [], []
    plan_ahead, worth = planning.DepthPlanning.plan_ahead, planning.DepthPlanning._worth_drafting

    def spied_ahead(self, running):
        plan_ahead(self, running)
        made.append(self._ahead is not None)

    def spied_worth(self, seqs, caps):
        taken.append(
            self._ahead is not None
            and self._ahead[0] == (tuple(s.seq_id for s in seqs), tuple(caps))
        )
        return worth(self, seqs, caps)

    monkeypatch.setattr(planning.DepthPlanning, "plan_ahead", spied_ahead)
    monkeypatch.setattr(planning.DepthPlanning, "_worth_drafting", spied_worth)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(spec) == plain
    assert any(made) and any(taken)


class DraftsAll:
    name, needs_hidden, stateless = "all", False, True

    def propose(self, seqs, caps):
        return [Draft([5] * c) for c in caps]

    def observe(self, verdicts) -> None:
        pass

    def release(self, seq) -> None:
        pass


def test_the_plan_after_a_probe_sees_the_probes_verdicts(tiny_model_dir):
    """A probe's verdicts bring back the sequences it cut to depth 0: the plan after it is
    never made ahead, during the probe's forward, before they are observed (found in review:
    4-7 came back only at the next probe)."""
    dec = LLM(
        tiny_model_dir,
        device="cpu",
        drafter=DraftsAll(),
        spec={"num_drafts": 3, "dcut_prior": 0.05, "dcut_probe_every": 4},
    ).engine.spec
    dec.cost = VerifyCostModel.from_points({(1, 4.0): 1.6, (8, 4.0): 1.6})
    seqs = _decoding(8)
    for s in seqs[:4]:  # 0-3 accept well
        for _ in range(10):
            dec.estimator.observe(s.seq_id, [True, True, True])
    for s in seqs[4:]:  # 4-7: their first drafts were rejected
        for _ in range(2):
            dec.estimator.observe(s.seq_id, [False])
    for _ in range(3):  # the plan drafts 0-3 only
        dec._prepare(seqs)
        assert [bool(s.draft) for s in seqs] == [True] * 4 + [False] * 4
    dec._prepare(seqs)  # a probe: 0-3 verify, 4-7 cut to depth 0
    assert dec._probing and [bool(s.draft) for s in seqs] == [True] * 4 + [False] * 4
    dec.plan_ahead(seqs)  # during the probe's forward
    for s in seqs[:4]:  # its verdicts: 4-7's first drafts were the tokens emitted
        dec.estimator.observe(s.seq_id, [True, True, True])
    for s in seqs[4:]:
        dec.estimator.observe(s.seq_id, [True])
    dec._quiet = None
    dec._probing = False  # (`timed_step` resets it after the step)
    dec._prepare(seqs)
    assert any(s.draft for s in seqs[4:])


def test_no_choice_is_made_ahead_for_a_batch_wider_than_the_cap(tiny_model_dir):
    import dataclasses

    dec, choices = _decoder(tiny_model_dir)
    dec.cfg = dataclasses.replace(dec.cfg, dcut_width_cap=4)
    dec._last_plan = None
    dec.plan_ahead(_decoding(8))
    assert dec._ahead is None and not choices
