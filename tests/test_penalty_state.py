"""The penalties' device state (`engine/penalty_state.py`): a step's counts and prompt masks from
the rows kept on the device equal those `SamplingBatch.build` makes from each row's whole history
(the reference), through commits, tokens left on the device by a step launched ahead, rows gone
stale (a step withdrawn) and reused; and requests with penalties give the synchronous engine's
tokens while their steps run ahead, with and without speculation, dense and hybrid."""

from __future__ import annotations

import random

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.engine.device_tokens import DeviceDrafts
from metrale.engine.logits_pipeline import SamplingBatch, SamplingRow
from metrale.engine.penalty_state import PenaltyState, uses_penalties
from metrale.engine.sequence import Sequence
from tests.test_async_scheduling import _prompts, _run, _same, _target
from tests.test_hybrid_engine import hybrid_dir  # noqa: F401 (a module fixture)

V = 50


def _seq(seq_id: int, params: SamplingParams, rng: random.Random) -> Sequence:
    prompt = [rng.randrange(V) for _ in range(rng.randint(1, 12))]
    seq = Sequence(
        seq_id=seq_id,
        request_id=str(seq_id),
        prompt_token_ids=prompt,
        params=params,
        seed=seq_id,
        eos_token_ids=(),
        arrival=seq_id,
    )
    seq.output_token_ids = [rng.randrange(V) for _ in range(rng.randint(0, 15))]
    return seq


def _both(state: PenaltyState, seqs: list[Sequence], drafts: list[list[int]]):
    """(from the state, from the histories) of one step's rows."""
    rows = state.rows_of(seqs, V)

    def build(with_state: bool) -> SamplingBatch:
        return SamplingBatch.build(
            [
                SamplingRow(
                    params=s.params,
                    seed=1,
                    prompt_token_ids=s.prompt_token_ids,
                    output_token_ids=s.output_token_ids,
                    drafts=d,
                    penalty_row=row,
                )
                for s, d, row in zip(seqs, drafts, rows, strict=True)
            ],
            V,
            torch.device("cpu"),
            state if with_state else None,
        )

    return build(True), build(False)


def _check(state, seqs, drafts) -> None:
    got, ref = _both(state, seqs, drafts)
    assert (got.output_counts is None) == (ref.output_counts is None)
    if ref.output_counts is not None:
        assert torch.equal(got.output_counts, ref.output_counts)
    assert (got.prompt_mask is None) == (ref.prompt_mask is None)
    if ref.prompt_mask is not None:
        # (a row without a repetition penalty is never read through its mask)
        row = 0
        for s, d in zip(seqs, drafts, strict=True):
            rows = slice(row, row + 1 + len(d))
            if s.params.repetition_penalty != 1.0:
                assert torch.equal(got.prompt_mask[rows], ref.prompt_mask[rows])
            row = rows.stop


PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.8, seed=3, presence_penalty=0.5),
    SamplingParams(temperature=0.8, seed=4, frequency_penalty=0.7),
    SamplingParams(temperature=0.0, repetition_penalty=0.9, frequency_penalty=-0.3),
]


@pytest.mark.parametrize("trial", range(6))
def test_state_rows_equal_the_rebuilt_histories_through_commits_and_launches(trial):
    """Random steps: commits of a few tokens, steps launched ahead whose token stays on the
    device (a placeholder in the output), their settling, withdrawals, sequences that end and
    new ones on their freed rows (more than the first allocation: the tensors grow)."""
    rng = random.Random(trial)
    state = PenaltyState(torch.device("cpu"))
    live = [_seq(i, PARAMS[i % len(PARAMS)], rng) for i in range(12)]
    next_id = 12
    for _ in range(25):
        drafts = [[rng.randrange(V) for _ in range(rng.randint(0, 3))] for _ in live]
        _check(state, live, drafts)
        action = rng.choice(["commit", "launch", "withdraw", "swap"])
        if action == "commit":  # a synchronous step's tokens (a placeholder settled first)
            for s in live:
                s.inflight = None  # settled: the placeholder holds its token's value already
                s.output_token_ids += [rng.randrange(V) for _ in range(rng.randint(1, 4))]
            state.committed(live)
        elif action == "launch":  # one token each, left on the device
            tokens = torch.tensor([[rng.randrange(V)] for _ in live])
            source = DeviceDrafts(tokens)
            for i, s in enumerate(live):
                s.inflight = None  # the step before settled (its placeholder holds its value)
                s.output_token_ids.append(0)
                s.inflight = source.row(i, 1)
            state.launched(live, list(range(len(live))), tokens)
            # the host's view of the outputs is the placeholders' values from here on
            for s in live:
                s.output_token_ids[-1] = s.inflight.tolist()[0]
        elif action == "withdraw":  # a launched step taken back: its placeholders go
            for s in live:
                s.drop_inflight()
        else:  # some end, others arrive (on the freed rows)
            for s in rng.sample(live, 3):
                live.remove(s)
                state.release(s)
            for _ in range(rng.randint(3, 6)):
                live.append(_seq(next_id, PARAMS[next_id % len(PARAMS)], rng))
                next_id += 1
    assert state.rebuilds > 0


def test_rows_for_requests_without_penalties_are_the_zero_row():
    state = PenaltyState(torch.device("cpu"))
    rng = random.Random(0)
    plain = _seq(0, SamplingParams(temperature=0.0), rng)
    assert state.rows_of([plain], V) == [0] and state.counts is None
    _check(state, [plain, _seq(1, PARAMS[2], rng)], [[], [1, 2]])


def test_a_prompt_token_outside_the_vocabulary_is_a_clear_error():
    state = PenaltyState(torch.device("cpu"))
    seq = _seq(0, SamplingParams(repetition_penalty=1.2), random.Random(0))
    seq.prompt_token_ids = [3, V + 5]
    with pytest.raises(ValueError, match="prompt_token_ids: token id 55"):
        state.rows_of([seq], V)


def _penalised(i: int) -> SamplingParams:
    kind = i % 4
    base = dict(max_tokens=14 + i, ignore_eos=True)
    if kind == 0:
        return SamplingParams(temperature=0.0, repetition_penalty=1.4, **base)
    if kind == 1:
        return SamplingParams(temperature=0.8, seed=10 + i, presence_penalty=0.8, **base)
    if kind == 2:
        return SamplingParams(temperature=0.9, seed=i, top_p=0.9, frequency_penalty=1.1, **base)
    return SamplingParams(temperature=0.0, **base)


@pytest.mark.parametrize("target", ["dense", "hybrid"])
@pytest.mark.parametrize("spec", [None, "ngram"])
def test_requests_with_penalties_run_ahead_with_the_synchronous_tokens(request, target, spec):
    path = _target(request, target)
    prompts = [p * 2 for p in _prompts(8, seed=11)]
    params = [_penalised(i) for i in range(8)]
    kw = {} if spec is None else {"spec": {"method": spec, "num_drafts": 3}}
    _, ref = _run(path, prompts, params, **kw)
    llm, outs = _run(path, prompts, params, async_scheduling=True, **kw)
    _same(outs, ref)
    assert llm.engine._ahead.launches_ahead > 0
    assert llm.engine.sync_seqs == 0
    # each row built once, when its sequence came: every later step only added its tokens
    penalised = sum(uses_penalties(p) for p in params)
    assert llm.engine.runner.penalties.rebuilds == penalised
    # the plain engine's tokens too: penalties see the drafts before each verify row
    if spec is not None:
        _same(outs, _run(path, prompts, params)[1])


def test_penalised_requests_survive_preemption_and_aborts_ahead(tiny_model_dir):
    """A KV pool too small for every request (preemptions, recomputed rows), and aborts
    mid-run: the survivors' tokens are the synchronous engine's, with no row left over."""
    prompts = _prompts(6, seed=12)
    params = [_penalised(i) for i in range(6)]
    kw = dict(num_kv_pages=12, page_size=16)
    _, ref = _run(tiny_model_dir, prompts, params, **kw)
    llm = LLM(tiny_model_dir, device="cpu", async_scheduling=True, **kw)
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp, final_only=True)
    outs, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        steps += 1
        if steps == 6:
            engine.abort_request("1")
    assert engine.telemetry.preemptions > 0
    for i in (0, 2, 3, 4, 5):
        got, want = outs[str(i)].outputs[0], ref[i].outputs[0]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    assert not engine.runner.penalties._rows  # every row went back


def test_penalised_greedy_output_equals_transformers_with_the_penalties(tiny_model_dir):
    """Independent of the state: greedy decoding with all three penalties, vLLM's semantics
    (repetition over prompt and output, presence and frequency over the output), applied to
    transformers' logits step by step; the engine runs ahead, with n-gram speculation."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompts = [p * 2 for p in _prompts(3, seed=13)]
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        ignore_eos=True,
        repetition_penalty=1.5,
        presence_penalty=0.4,
        frequency_penalty=0.3,
    )
    llm = LLM(tiny_model_dir, device="cpu", spec={"method": "ngram", "num_drafts": 3})
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.engine._ahead.launches_ahead > 0
    # each row built once, when its sequence came: every later step only added its tokens
    assert llm.engine.runner.penalties.rebuilds == len(prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(sp.max_tokens):
                x = hf(torch.tensor([tokens])).logits[0, -1].float()
                output = tokens[len(prompt) :]
                counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=x.numel())
                seen = counts > 0
                seen[torch.tensor(prompt)] = True
                x = torch.where(seen, torch.where(x > 0, x / 1.5, x * 1.5), x)
                x = x - 0.3 * counts - 0.4 * (counts > 0)
                tokens.append(int(x.argmax()))
        assert out.outputs[0].token_ids == tokens[len(prompt) :]


def test_a_count_update_that_raises_leaves_its_rows_to_be_rebuilt(monkeypatch):
    """Found in review: `committed` moved a row's count before its add was queued, so an add
    that raised left the row claiming tokens it never counted, wrong for good."""
    rng = random.Random(3)
    state = PenaltyState(torch.device("cpu"))
    seqs = [_seq(i, PARAMS[2], rng) for i in range(3)]
    _check(state, seqs, [[], [], []])
    for s in seqs:
        s.output_token_ids += [rng.randrange(V) for _ in range(3)]
    real = state._add

    def failing(*a):
        raise RuntimeError("the copy failed")

    monkeypatch.setattr(state, "_add", failing)
    with pytest.raises(RuntimeError):
        state.committed(seqs)
    monkeypatch.setattr(state, "_add", real)
    _check(state, seqs, [[], [], []])  # rebuilt, not wrong
    # the same for a launched step's tokens
    tokens = torch.tensor([[rng.randrange(V)] for _ in seqs])
    source = DeviceDrafts(tokens)
    for i, s in enumerate(seqs):
        s.output_token_ids.append(int(tokens[i, 0]))
        s.inflight = source.row(i, 1)
    monkeypatch.setattr(state, "_add", failing)
    with pytest.raises(RuntimeError):
        state.launched(seqs, [0, 1, 2], tokens)
    monkeypatch.setattr(state, "_add", real)
    _check(state, seqs, [[], [], []])


def test_rows_stop_at_one_a_slot(caplog):
    """The tensors grow to one row a scheduler slot and the zero row, no further (doubling
    past it would hold up to twice the memory); more sequences than slots is a bug, said, and
    served."""
    rng = random.Random(4)
    state = PenaltyState(torch.device("cpu"), max_rows=5)
    seqs = [_seq(i, PARAMS[2], rng) for i in range(5)]
    _check(state, seqs, [[]] * 5)
    assert state.counts.shape[0] == 6
    state.release(seqs[0])
    _check(state, [*seqs[1:], _seq(9, PARAMS[3], rng)], [[]] * 5)  # the freed row is reused
    _check(state, [*seqs[1:], _seq(9, PARAMS[3], rng), _seq(10, PARAMS[2], rng)], [[]] * 6)
    assert state.counts.shape[0] > 6 and "more than 5 sequences hold rows" in caplog.text
