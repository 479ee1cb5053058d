"""D-Cut's depth-0 "quiet" plan (`planning.DepthPlanning._planned`) ends when the batch becomes
half as wide: drafting may pay in the narrower batch, so the sequences left are planned again at
once instead of waiting for the next probe step."""

from __future__ import annotations

from metrale import LLM, SamplingParams
from metrale.engine.sequence import Sequence
from metrale.speculative.replay import ReplayDrafter
from metrale.speculative.verify_cost import VerifyCostModel


def _seq(i: int) -> Sequence:
    s = Sequence(
        seq_id=i,
        request_id=f"r{i}",
        prompt_token_ids=[1, 2, 3],
        params=SamplingParams(max_tokens=100),
        seed=0,
        eos_token_ids=(),
        arrival=i,
        arrival_time=0.0,
    )
    s.slot = i
    return s


def test_a_quiet_plan_ends_when_the_batch_halves(tiny_model_dir):
    probe_every = 50
    llm = LLM(
        tiny_model_dir,
        device="cpu",
        drafter=ReplayDrafter({}, 0.9, 200),
        spec={"num_drafts": 3, "dcut_probe_every": probe_every, "dcut_prior": 0.9},
    )
    dec = llm.engine.spec
    # verifying 4 rows a sequence: ruinous at batch 8, free at batch 1
    dec.cost = VerifyCostModel.from_points({(1, 4.0): 1.0, (8, 4.0): 40.0})
    seqs = [_seq(i) for i in range(8)]
    dec._steps = 1  # not a probe step
    picked, _, _ = dec._planned(seqs, [3] * 8)
    assert picked == []  # depth 0 everywhere at batch 8: the quiet plan
    # alone, the same sequence (same estimate) would draft:
    fresh = LLM(
        tiny_model_dir,
        device="cpu",
        drafter=ReplayDrafter({}, 0.9, 200),
        spec={"num_drafts": 3, "dcut_probe_every": probe_every, "dcut_prior": 0.9},
    ).engine.spec
    fresh.cost = dec.cost
    fresh._steps = 1
    assert [s.seq_id for s in fresh._planned(seqs[:1], [3])[0]] == [0]
    # seven sequences leave; the one left runs alone for the steps up to the next probe
    starved = 0
    for step in range(2, probe_every):
        dec._steps = step
        picked, _, _ = dec._planned(seqs[:1], [3])
        starved += not picked
    assert starved == 0, f"sequence 0 was not drafted for {starved} steps while alone"


def test_quiet_steps_skip_the_caps_and_the_plan_until_a_probe(tiny_model_dir, monkeypatch):
    """While the depth-0 plan stands, `prepare` is a plain step's: no sequence's caps, no plan,
    no drafter; the probe step plans again, and so does a batch half as wide."""
    import metrale.speculative.controller as controller

    probe_every = 6
    llm = LLM(
        tiny_model_dir,
        device="cpu",
        drafter=ReplayDrafter({}, 0.9, 200),
        spec={"num_drafts": 3, "dcut_probe_every": probe_every, "dcut_prior": 0.9},
    )
    dec = llm.engine.spec
    dec.cost = VerifyCostModel.from_points({(1, 4.0): 1.0, (8, 4.0): 40.0})
    caps, plans = [], []
    real_caps = controller.draft_caps
    monkeypatch.setattr(controller, "draft_caps", lambda *a: caps.append(1) or real_caps(*a))
    real_planned = dec._planned
    monkeypatch.setattr(dec, "_planned", lambda *a: plans.append(1) or real_planned(*a))
    seqs = [_seq(i) for i in range(8)]
    for s in seqs:
        s.num_computed_tokens = 2  # decoding: its last token is the next row
        s.draft = "stale"  # whatever a step before left: every quiet step clears it
    assert dec.prepare(seqs) == [] and dec.asked == 0  # step 1 plans: depth 0 everywhere
    assert len(plans) == 1 and len(caps) == 8
    quiet_steps = 0
    while not dec._probes.is_due(dec._steps + 1):
        caps.clear()
        assert dec.prepare(seqs) == []
        assert caps == [] and len(plans) == 1 and dec.asked == 0 and not dec.observing
        assert all(s.draft is None for s in seqs)
        quiet_steps += 1
    assert quiet_steps >= probe_every - 2
    dec.prepare(seqs)  # the probe step: caps and a plan again
    assert len(caps) == 8 and len(plans) == 2
    # after the probe: quiet again, until the batch halves
    dec._quiet, dec._last_plan = frozenset(s.seq_id for s in seqs), None
    caps.clear()
    dec.prepare(seqs[:5])
    assert caps == [] and len(plans) == 2
    dec.prepare(seqs[:4])  # half as wide: planned again
    assert len(caps) == 4 and len(plans) == 3


def _decoding(seq: Sequence) -> Sequence:
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def _lone_survivor_drafts(tiny_model_dir, neighbours) -> int:
    """Steps, of 20, in which the last of 8 sequences planned at depth 0 drafts once the other
    7 have left, `neighbours` (which cannot draft) running beside it."""
    llm = LLM(
        tiny_model_dir,
        device="cpu",
        drafter=ReplayDrafter({}, 0.9, 200),
        spec={"num_drafts": 3, "dcut_probe_every": 50, "dcut_prior": 0.9},
    )
    dec = llm.engine.spec
    dec.cost = VerifyCostModel.from_points({(1, 4.0): 1.0, (8, 4.0): 40.0})
    spec = [_decoding(_seq(i)) for i in range(8)]
    assert dec.prepare(spec + neighbours) == [] and dec.asked == 0  # quiet at width 8
    drafted = 0
    for _ in range(20):
        dec.prepare(spec[:1] + neighbours)
        drafted += dec.asked > 0
    return drafted


def test_sequences_that_cannot_draft_do_not_keep_a_halved_batch_quiet(tiny_model_dir):
    """The half-width rule counts the sequences that may draft (found in review: the quiet fast
    path counted every running one, so non-speculative neighbours, or new arrivals still
    prefilling long prompts, kept the last drafting sequence at depth 0 until a probe)."""
    plain = []
    for i in range(8):
        s = _decoding(_seq(100 + i))
        s.params = SamplingParams(max_tokens=100, speculative=False)
        plain.append(s)
    assert _lone_survivor_drafts(tiny_model_dir, plain) == 20
    prefilling = []
    for i in range(7):
        s = _seq(200 + i)
        s.prompt_token_ids = list(range(1, 4001))  # a long prompt, its first chunk to come
        prefilling.append(s)
    assert _lone_survivor_drafts(tiny_model_dir, prefilling) == 20
