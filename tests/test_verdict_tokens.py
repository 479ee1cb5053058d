"""A greedy verify's emitted tokens (`SeqVerdict.tokens`) are made when first asked for, at the
commit in the next forward's overlap window; what runs between its verdicts' read and the next
launch (`held_verify.hold`, `Observing.learn_held`) reads their ids alone."""

from __future__ import annotations

from metrale import LLM, SamplingParams
from metrale.engine import held_verify
from metrale.engine.sequence import ScheduledSeq, Sequence
from metrale.engine.step_output import SampledToken, greedy_verdicts


def _entry(seq_id: int, drafts: list[int]) -> ScheduledSeq:
    seq = Sequence(
        seq_id=seq_id,
        request_id=str(seq_id),
        prompt_token_ids=[1, 2, 3],
        params=SamplingParams(max_tokens=50),
        seed=0,
        eos_token_ids=(),
        arrival=0,
    )
    seq.output_token_ids = [4]
    seq.num_computed_tokens = seq.num_tokens - 1
    return ScheduledSeq(seq, 1 + len(drafts), drafts)


def test_greedy_verdict_tokens_are_the_picks_to_the_bonus_made_on_first_use():
    entries = [_entry(0, [7, 8, 9]), _entry(1, [5, 6]), _entry(2, [])]
    picks = [7, 8, 3, 0] + [9, 6, 2] + [11]
    verdicts = greedy_verdicts(entries, picks)
    assert [v.num_accepted for v in verdicts] == [2, 0, 0]
    assert [v.token_ids for v in verdicts] == [[7, 8, 3], [9], [11]]
    assert all(v.built is None for v in verdicts)
    for v in verdicts:
        tokens = v.tokens
        assert all(type(t) is SampledToken and t.seq is v.seq for t in tokens)
        assert [t.token_id for t in tokens] == v.token_ids and v.tokens is tokens


def test_a_held_verify_makes_its_tokens_only_at_its_commit(hf_qwen3_factory, monkeypatch):
    """Between the verdicts' read and the next launch no greedy verdict's tokens are made."""
    model = hf_qwen3_factory("varied", initializer_range=0.2)
    prompts = [[(7 * i + 3 * j) % 40 + 3 for j in range(8 + i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(model, device="cpu").generate(prompts, params, use_tqdm=False)
    llm = LLM(model, device="cpu", spec={"method": "ngram", "num_drafts": 3}, async_scheduling=True)
    held, seen = held_verify.hold, []

    def spied(launched, out, *args, **kwargs):
        result = held(launched, out, *args, **kwargs)
        seen.append(all(v.built is None for v in out.verdicts))
        return result

    monkeypatch.setattr(held_verify, "hold", spied)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert seen and all(seen)
