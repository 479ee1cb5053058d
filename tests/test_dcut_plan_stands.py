"""D-Cut plans depths before drafting (controller._prepare); the plan is planned again after
drafting only when a sequence came back with fewer drafts than planned but some, and the target's
programs need a canonical verify table (row-table programs: hybrid targets); with ragged programs
or none, any mix of depths runs, and the shorter drafts are verified as drafted. One that came
back with none decodes plainly beside the others, whose planned depths stand: no second planning
(it cost as much as the first, about 0.15 ms a drafting step at batch 8 on the H200's host)."""

from __future__ import annotations

import dataclasses

import pytest

from metrale import LLM
from metrale.speculative.drafter import Draft
from metrale.speculative.verify_cost import VerifyCostModel
from tests.test_dcut_quiet_width import _seq


class EvenSlots:
    """Drafts `depth` tokens (or its cap) for even slots and nothing for odd ones."""

    name, needs_hidden, stateless = "even", False, True

    def __init__(self, depth: int | None = None) -> None:
        self.depth = depth

    def propose(self, seqs, caps):
        return [
            Draft(
                [5] * (cap if self.depth is None else min(cap, self.depth))
                if s.slot % 2 == 0
                else []
            )
            for s, cap in zip(seqs, caps, strict=True)
        ]

    def observe(self, verdicts) -> None:
        pass

    def release(self, seq) -> None:
        pass


def _decoding(count: int):
    seqs = [_seq(i) for i in range(count)]
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1  # past its prompt: it decodes
    return seqs


def _decoder(tiny_model_dir, drafter):
    dec = LLM(
        tiny_model_dir,
        device="cpu",
        drafter=drafter,
        spec={"num_drafts": 3, "dcut_prior": 0.9, "dcut_probe_every": 1000},
    ).engine.spec
    dec.cost = VerifyCostModel.from_points({(1, 4.0): 1.0, (8, 4.0): 1.0})  # rows are free
    dec._steps = 1  # not a probe step
    cuts = []
    real = dec._cut
    dec._cut = lambda *args: (cuts.append(args), real(*args))
    return dec, cuts


def test_sequences_without_drafts_leave_the_plan_standing(tiny_model_dir):
    dec, cuts = _decoder(tiny_model_dir, EvenSlots())
    seqs = _decoding(8)
    assert dec._prepare(seqs) == []
    assert not cuts
    assert [len(s.draft.tokens) if s.draft else 0 for s in seqs] == [3, 0] * 4


@pytest.mark.parametrize("any_depths", [False, True])
def test_shorter_drafts_are_planned_again_for_canonical_tables(tiny_model_dir, any_depths):
    dec, cuts = _decoder(tiny_model_dir, EvenSlots(depth=1))
    assert dec.any_depths  # CPU: no programs
    dec.any_depths = any_depths
    seqs = _decoding(8)
    assert dec._prepare(seqs) == []
    assert len(cuts) == (0 if any_depths else 1)
    assert [len(s.draft.tokens) if s.draft else 0 for s in seqs] == [1, 0] * 4
    assert dec._proposed == {s.seq_id: (1, [5]) for s in seqs if s.slot % 2 == 0}


def test_a_plan_wider_than_the_width_cap_stands_while_sequences_come_and_go(tiny_model_dir):
    """Above `dcut_width_cap` a plan is one depth for all; it stands for `dcut_replan_every`
    steps while the batch stays that wide, even as its sequences change (planning a batch of 64
    cost about 0.3 ms a step on the H200's host, and steady state changes the batch every few
    steps), and is planned again after that."""
    llm = LLM(
        tiny_model_dir,
        device="cpu",
        drafter=EvenSlots(),
        spec={
            "num_drafts": 3,
            "dcut_prior": 0.9,
            "dcut_probe_every": 1000,
            "dcut_width_cap": 2,
            "dcut_replan_every": 3,
        },
    )
    dec = llm.engine.spec
    dec.cost = VerifyCostModel.from_points({(1, 4.0): 1.0, (8, 4.0): 1.0})
    plans = []
    real = dec._worth_drafting
    dec._worth_drafting = lambda *args: (plans.append(args), real(*args))[1]
    seqs = _decoding(6)
    capped = [3, 3, 1, 3]  # one sequence near its max_tokens
    want = [[3, 3, 3, 3], capped, capped, capped]
    batches = [seqs[:4], seqs[1:5], seqs[2:6], seqs[:4]]
    for step, (running, depths_wanted) in enumerate(zip(batches, want), start=1):
        dec._steps = step
        picked, depths, planned = dec._planned(running, [3] * 4 if step == 1 else capped)
        assert planned and [s.seq_id for s in picked] == [s.seq_id for s in running]
        # step 1's depth for all, each within its cap; planned again at step 4, where the
        # sequence near its max_tokens keeps its cap and does not pin the others at it
        assert depths == depths_wanted
    assert len(plans) == 2  # steps 1 and 4: the plan of step 1 stood for steps 2 and 3


def test_a_plan_stands_while_sequences_leave_and_none_joins(tiny_model_dir):
    """Under `dcut_width_cap` a plan stands for `dcut_replan_every` steps while sequences only
    leave (the tail of a closed batch re-planned at every departure) and the batch stays more
    than half as wide; the depths of those left are the plan's, non-increasing along their
    slots. An arrival, or a batch that halved, plans again."""
    dec, _ = _decoder(tiny_model_dir, EvenSlots())
    dec.cost = VerifyCostModel.from_points({(1, 4.0): 1.6, (8, 4.0): 1.6})  # rows cost
    plans = []
    real = dec._worth_drafting
    dec._worth_drafting = lambda *args: (plans.append(args), real(*args))[1]
    seqs = _decoding(8)
    for i, s in enumerate(seqs):  # acceptance falling with the slot: deeper at low slots
        dec.estimator.observe_many([(s.seq_id, [True] * (3 - i // 3) + [False])] * 20)

    def step(n: int, running) -> dict[int, int]:
        dec._steps = n
        picked, depths, planned = dec._planned(running, [3] * len(running))
        assert planned
        return {s.seq_id: d for s, d in zip(picked, depths, strict=True)}

    first = step(1, seqs)
    assert len(plans) == 1 and len(set(first.values())) > 1, first
    left = [s for s in seqs if s.seq_id not in (1, 6)]
    assert step(2, left) == {i: d for i, d in first.items() if i not in (1, 6)}
    assert len(plans) == 1, "two left: the plan stands"
    by_slot = [first.get(s.seq_id, 0) for s in sorted(left, key=lambda s: s.slot)]
    assert by_slot == sorted(by_slot, reverse=True)
    step(3, [*left, _decoding(9)[8]])  # one joins: planned again (7 sequences)
    assert len(plans) == 2
    step(4, left[:4])  # and stands while they leave ...
    assert len(plans) == 2
    step(5, left[:3])  # ... until the batch is no more than half as wide
    assert len(plans) == 3


def test_a_sequence_back_on_another_slot_is_planned_anew(tiny_model_dir):
    """A sequence preempted (a departure: the plan stands) that comes back on a lower slot
    joins anew: its old depth there would break the depths' order along the slots (found in
    review)."""
    dec, _ = _decoder(tiny_model_dir, EvenSlots())
    dec.any_depths = False  # canonical tables (with any mix of depths the order is free)
    dec.cost = VerifyCostModel.from_points({(1, 4.0): 1.6, (8, 4.0): 1.6})
    seqs = _decoding(8)
    for i, s in enumerate(seqs):  # acceptance falling with the slot: deeper at low slots
        dec.estimator.observe_many([(s.seq_id, [True] * (3 - i // 3) + [False])] * 20)
    dec._steps = 1
    first = dict((s.seq_id, d) for s, d in zip(*dec._planned(seqs, [3] * 8)[:2], strict=True))
    assert first[0] > first[6] > 0, first
    running = [s for s in seqs if s.seq_id not in (0, 6)]  # 0 finished, 6 preempted
    dec._steps = 2
    dec._planned(running, [3] * len(running))
    seqs[6].slot = 0  # back on the slot 0 left
    back = [seqs[6], *running]
    dec._steps = 3
    picked, depths, planned = dec._planned(back, [3] * len(back))
    assert planned
    depth_of = dict((s.seq_id, d) for s, d in zip(picked, depths, strict=True))
    by_slot = [depth_of.get(s.seq_id, 0) for s in sorted(back, key=lambda s: s.slot)]
    assert by_slot == sorted(by_slot, reverse=True), by_slot


class OneShort:
    """Drafts its cap for every sequence but slot 0's, which gets one token (an n-gram's short
    match)."""

    name, needs_hidden, stateless = "one-short", False, True

    def propose(self, seqs, caps):
        return [Draft([5] * (1 if s.slot == 0 else cap)) for s, cap in zip(seqs, caps, strict=True)]

    def observe(self, verdicts) -> None:
        pass

    def release(self, seq) -> None:
        pass


def test_one_short_draft_does_not_pin_a_wide_batch_at_its_depth(tiny_model_dir):
    """Above `dcut_width_cap` every sequence is verified at one depth; a sequence that drafted
    fewer tokens is padded up to it (its extra rows buy nothing), not the whole batch cut down
    to that sequence's drafts (which made a batch of 64 in a stream of requests verify at depth
    1 most steps: some sequence always drafted one token, or had one left)."""
    dec, cuts = _decoder(tiny_model_dir, OneShort())
    dec.any_depths = False  # canonical tables: the short draft makes the cut plan again
    dec.cfg = dataclasses.replace(dec.cfg, dcut_width_cap=4)
    seqs = _decoding(8)
    assert dec._prepare(seqs) == []
    assert len(cuts) == 1
    assert [len(s.draft.tokens) for s in seqs] == [3] * 8
    assert seqs[0].draft.tokens == [5, 5, 5]  # padded by repeating its last token


def _wide_cut(tiny_model_dir, any_depths: bool, first: int, others: int, cost=None):
    """Eight decoding sequences above a width cap of 4, slot 0 having drafted `first` tokens and
    the others `others` (caps 3), through the cut after drafting (`_cut`): the sequences."""
    dec, _ = _decoder(tiny_model_dir, OneShort())
    dec.any_depths = any_depths
    dec.cfg = dataclasses.replace(dec.cfg, dcut_width_cap=4)
    if cost is not None:
        dec.cost = cost
    seqs = _decoding(8)
    live = [(s, Draft([5] * (first if s.slot == 0 else others))) for s in seqs]
    dec._cut(live, {s.seq_id: 3 for s in seqs})
    return seqs


@pytest.mark.parametrize("any_depths", [False, True])
def test_a_wide_cut_pads_a_short_draft_only_for_canonical_tables(tiny_model_dir, any_depths):
    """After drafting (`_cut`, e.g. at a probe step), a wide batch's one depth pads a shorter
    draft where the programs need one depth mix (row-table programs), and leaves it as drafted
    where any mix runs (ragged programs): padded rows there bought nothing."""
    seqs = _wide_cut(tiny_model_dir, any_depths, first=1, others=3)
    assert len(seqs[0].draft.tokens) == (1 if any_depths else 3)
    assert [len(s.draft.tokens) for s in seqs[1:]] == [3] * 7


@pytest.mark.parametrize("any_depths", [False, True])
def test_a_wide_cut_prices_only_the_rows_each_sequence_drafted(tiny_model_dir, any_depths):
    """Where any mix of depths runs (ragged programs), a wide batch's one depth costs only the
    rows each sequence drafted: seven one-token n-gram matches beside one of three do not make
    the third draft look seven rows dear (`dcut._choose`'s `any_depths`)."""
    cost = VerifyCostModel.from_points({(8, 2.0): 1.05, (8, 3.0): 1.2, (8, 5.0): 5.0})
    seqs = _wide_cut(tiny_model_dir, any_depths, first=3, others=1, cost=cost)
    # priced as padded rows a second level costs 8 rows for one draft: depth 1 for all
    assert len(seqs[0].draft.tokens) == (3 if any_depths else 1)
    assert [len(s.draft.tokens) for s in seqs[1:]] == [1] * 7


@pytest.mark.parametrize("any_depths", [False, True])
def test_a_verify_step_is_recorded_in_the_order_it_was_dispatched(tiny_model_dir, any_depths):
    """The verify key telemetry records the dispatch `plan` made: each sequence its own depth,
    deepest first, where any mix of depths runs; the canonical deal for row-table programs."""
    from types import SimpleNamespace

    from metrale.speculative.verify_key import verify_batch_order, verify_graph_key

    dec, _ = _decoder(tiny_model_dir, EvenSlots())
    dec.any_depths = any_depths
    seqs = _decoding(5)
    depths = [1, 3, 0, 2, 1]  # four verified (the canonical arm's width), rising along slots
    verified = [
        SimpleNamespace(seq=s, drafts=[5] * d) for s, d in zip(seqs, depths, strict=True) if d
    ]
    dec._record_verify(verified)
    slots = [e.seq.slot for e in verified]
    order, dealt = verify_batch_order(slots, [len(e.drafts) for e in verified], not any_depths)
    pairs = [(slots[i], d + 1) for i, d in zip(order, dealt, strict=True)]
    assert dec.telemetry.verify_keys == {verify_graph_key(pairs, True, dec.write_on_accept)}
    if any_depths:  # each keeps its own depth
        assert sorted(pairs) == sorted((s, d + 1) for s, d in zip(slots, [1, 3, 2, 1], strict=True))
    else:  # dealt deepest first along ascending slots
        assert [d for _, d in pairs] == [4, 3, 2, 2] and slots == sorted(slots)
