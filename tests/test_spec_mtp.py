"""The MTP drafter (random heads in both checkpoint layouts) leaves greedy output unchanged:
alone, in a batch of 16 with D-Cut depths, and with preemption; a checkpoint without heads is
refused with a clear error."""

from __future__ import annotations

import shutil

import pytest

from metrale import LLM, SamplingParams
from metrale.config import ModelConfig
from metrale.models.mtp import write_mtp_weights
from tests.test_spec_lossless import make_prompts, params_for


@pytest.fixture(scope="module", params=["qwen3_next", "deepseek"])
def mtp_model_dir(request, tiny_model_dir, tmp_path_factory):
    dst = tmp_path_factory.mktemp(f"mtp-{request.param}") / "model"
    shutil.copytree(tiny_model_dir, dst)
    write_mtp_weights(dst, ModelConfig.from_hf(dst), request.param, num_layers=1, seed=4)
    return dst


@pytest.mark.parametrize("canonical_arm", [True, False], indirect=True, ids=["canonical", "own"])
def test_mtp_drafter_is_lossless(mtp_model_dir, canonical_arm):
    prompts = make_prompts(seed=2)
    params = [params_for(i) for i in range(len(prompts))]
    ref = LLM(mtp_model_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in ref]
    for engine in (
        dict(spec={"method": "mtp", "num_drafts": 3}),
        dict(
            spec={"method": "mtp", "num_drafts": 2, "dcut": False},
            page_size=4,
            num_kv_pages=40,
            max_num_batched_tokens=40,
        ),
    ):
        llm = LLM(mtp_model_dir, device="cpu", **engine)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert llm.engine.telemetry.spec.num_draft_tokens > 0
        assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable
        assert not llm.engine.spec.drafter._pos  # every sequence's drafter state released
    assert llm.engine.telemetry.preemptions > 0
    alone = LLM(mtp_model_dir, device="cpu", spec={"method": "mtp", "num_drafts": 4})
    out = alone.generate([prompts[3]], [params[3]], use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[3]


def test_mtp_chain_stops_where_the_pages_do(mtp_model_dir):
    """A last prefill chunk reserves no rows past its tokens, and the chain writes MTP KV at
    p + 1 .. p + k - 1 before the verify's rows are reserved: it must stop at the sequence's
    pages (it raised IndexError, ending the sequence with an error)."""
    llm = LLM(mtp_model_dir, device="cpu", spec={"method": "mtp", "num_drafts": 3}, page_size=4)
    engine = llm.engine
    engine.add_request("r", list(range(3, 14)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # the prefill: 11 tokens, the first output token sampled, the catch-up run
    seq = engine.requests["r"].seqs[0]
    assert seq.num_tokens == 12
    covered = 3  # pages holding rows 0..11: the chain may write no row past 11
    table = seq.block_table
    seq.block_table = table[:covered]
    try:
        (draft,) = engine.spec.drafter.propose([seq], [3])
    finally:
        seq.block_table = table
    # p = 10: the chain writes p + 1 = 11 only, so two drafts at most
    assert 1 <= len(draft.tokens) <= 2


def test_mtp_needs_heads(tiny_model_dir):
    with pytest.raises(ValueError, match="no MTP weights"):
        LLM(tiny_model_dir, device="cpu", spec={"method": "mtp"})


def test_seeded_sampling_with_mtp_is_reproducible(tiny_model_dir, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_model_dir, dst)
    write_mtp_weights(dst, ModelConfig.from_hf(dst), "qwen3_next", seed=1)
    sp = SamplingParams(temperature=0.8, seed=9, max_tokens=12)
    a = LLM(dst, device="cpu", spec={"method": "mtp"}).generate([[4, 5, 6]], sp, use_tqdm=False)
    b = LLM(dst, device="cpu", spec={"method": "mtp"}).generate([[4, 5, 6]], sp, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


@pytest.mark.parametrize("shift", ["0", "1", "-2"])
def test_single_sequence_refeed_knobs_stay_lossless(mtp_model_dir, monkeypatch, caplog, shift):
    from metrale.knobs import knobs

    for name, value in (
        ("METRALE_MTP_CATCHUP", "1"),
        ("METRALE_MTP_REFEED_ACCEPTED", "1"),
        ("METRALE_MTP_REFEED_SHIFT", shift),
        ("METRALE_MTP_REFEED_DEBUG", "1"),
    ):
        monkeypatch.setenv(name, value)
    knobs.cache_clear()
    try:
        prompts = make_prompts(seed=5)[:4]
        params = [params_for(i) for i in range(4)]
        expected = [
            o.outputs[0].token_ids
            for o in LLM(mtp_model_dir, device="cpu").generate(prompts, params, use_tqdm=False)
        ]
        llm = LLM(
            mtp_model_dir, device="cpu", spec={"method": "mtp", "num_drafts": 3, "mtp_max_seqs": 1}
        )
        assert llm.engine.spec.drafter.refeed
        with caplog.at_level("INFO", logger="metrale.speculative.mtp"):
            outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert "MTP_REFEED" in caplog.text
        # in multi-sequence mode the knobs are inert
        multi = LLM(mtp_model_dir, device="cpu", spec={"method": "mtp", "mtp_max_seqs": 2})
        assert not multi.engine.spec.drafter.refeed
    finally:
        monkeypatch.undo()
        knobs.cache_clear()


def _running_seq(seq_id: int, max_tokens: int, outputs: int):
    from metrale.engine.sequence import Sequence

    seq = Sequence(
        seq_id,
        f"r{seq_id}",
        [5, 6, 7],
        SamplingParams(temperature=0, max_tokens=max_tokens),
        0,
        (),
        arrival=seq_id,
        slot=seq_id,
    )
    seq.output_token_ids = [9] * outputs
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def test_dcut_padding_stays_within_each_cap(monkeypatch):
    """The canonical deal may pad a draft to a deeper shared depth; never past the sequence's
    cap, or an accepted padded row would emit past `max_tokens` (and write KV past
    `max_model_len`)."""
    from types import SimpleNamespace

    from metrale.config import SpecConfig
    from metrale.speculative import planning
    from metrale.speculative.controller import SpeculativeDecoder
    from metrale.speculative.drafter import Draft
    from metrale.telemetry import SpecTelemetry

    class Fixed:
        name, needs_hidden = "fixed", False

        def propose(self, seqs, caps):
            return [Draft([11] * c) for c in caps]

    seqs = [_running_seq(i, max_tokens=10, outputs=o) for i, o in enumerate([2, 7, 8, 3])]
    # caps: min(K = 4, max_tokens - outputs - 1) = 4, 2, 1, 4
    deep = SimpleNamespace(order=[0, 1, 2, 3], depths=[4, 4, 4, 4])
    monkeypatch.setattr(planning, "plan", lambda inputs, cost, cap, **kw: deep)
    spec = SpeculativeDecoder(
        SpecConfig(num_drafts=4), Fixed(), SpecTelemetry(), context_len=64, vocab_size=32
    )
    spec.prepare(seqs)
    assert [len(s.draft.tokens) for s in seqs] == [4, 2, 1, 4]


def test_finished_sequences_are_not_observed():
    """A sequence that finished this step still has its RUNNING status while the step's
    verdicts go out; the drafter must not be fed its rows."""
    from metrale.config import SpecConfig
    from metrale.speculative.controller import SpeculativeDecoder
    from metrale.speculative.drafter import Verdict
    from metrale.telemetry import SpecTelemetry

    seen = []

    class Recorder:
        name, needs_hidden = "recorder", False

        def observe(self, verdicts):
            seen.extend(v.seq.seq_id for v in verdicts)

    done, going = _running_seq(0, 10, 9), _running_seq(1, 10, 3)
    done.finish_reason = "length"
    spec = SpeculativeDecoder(SpecConfig(num_drafts=2), Recorder(), SpecTelemetry(), 64, 32)
    spec.observe(
        [
            Verdict(
                seq=s,
                drafts=[],
                num_accepted=0,
                emitted=[9],
                matches=[],
                hidden=None,
                first_position=s.num_tokens - 2,
                picks=[],
            )
            for s in (done, going)
        ]
    )
    assert seen == [1]
