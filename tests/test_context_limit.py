"""A KV pool that holds fewer tokens than `max_model_len`: a sequence stops where the pool ends,
with finish_reason "length" as at max_model_len (it used to outgrow the pool and end as an
error, over HTTP a 200 with finish_reason "error"), plain and with each drafter, in the
asynchronous engine, on dense and hybrid targets."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams
from tests.test_hybrid_engine import write_hybrid

PROMPT = [5, 9, 2, 7] * 4  # repeats: n-gram drafts are found and accepted
LONG = SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0.0)
NGRAM = {"method": "ngram", "num_drafts": 3}


@pytest.fixture(scope="module")
def models(tiny_model_dir, tiny_mtp_dir, tmp_path_factory, tokenizer_dir):
    """kind -> (checkpoint, the first 200 tokens after PROMPT from a pool that holds them)."""
    hybrid = write_hybrid(tmp_path_factory.mktemp("hybrid"), tokenizer_dir, seed=3)
    params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)
    out = {}
    for kind, path in (("dense", tiny_model_dir), ("mtp", tiny_mtp_dir), ("hybrid", hybrid)):
        llm = LLM(path, device="cpu", dtype="float32", max_model_len=256)
        out[kind] = path, llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    return out


@pytest.mark.parametrize(
    "kind, options",
    [
        ("dense", {}),
        ("dense", {"spec": NGRAM}),
        ("dense", {"spec": NGRAM, "async_scheduling": True}),
        ("dense", {"async_scheduling": True}),
        ("mtp", {"spec": {"method": "mtp", "num_drafts": 3}}),
        ("hybrid", {}),
        ("hybrid", {"spec": NGRAM}),
    ],
    ids=["plain", "ngram", "ngram-async", "async", "mtp", "hybrid", "hybrid-ngram"],
)
def test_a_sequence_stops_with_length_where_the_pool_ends(models, kind, options):
    path, reference = models[kind]
    llm = LLM(
        path, device="cpu", dtype="float32", max_model_len=256, page_size=4, num_kv_pages=20,
        **options,
    )  # fmt: skip
    engine = llm.engine
    rows = engine.allocator.num_usable * engine.allocator.page_size
    assert engine.context_len == rows + 1 < engine.max_model_len
    out = llm.generate([PROMPT], LONG, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.error is None
    assert len(PROMPT) + len(out.token_ids) == engine.context_len
    assert out.token_ids == reference[: len(out.token_ids)]
    assert engine.allocator.num_free == engine.allocator.num_usable
    # the engine goes on: a short request after it
    again = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert again[0].outputs[0].token_ids == reference[:3]


def test_a_pool_that_holds_max_model_len_changes_nothing(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", max_model_len=64)
    assert llm.engine.context_len == 64


def test_a_prompt_may_fill_the_pool_and_one_past_it_is_refused(tiny_model_dir):
    """The context is what admission checks too: a prompt of the pool's rows gets its one token,
    one token more is refused naming the prompt and the pool's context."""
    llm = LLM(tiny_model_dir, device="cpu", max_model_len=256, page_size=4, num_kv_pages=20)
    rows = llm.engine.context_len - 1
    out = llm.generate([[5] * rows], LONG, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    with pytest.raises(ValueError, match=r"prompt: .* under the \d+-token context the KV pool"):
        llm.generate([[5] * (rows + 1)], LONG, use_tqdm=False)
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable


class _CapsSeen:
    """An n-gram drafter that records each sequence's length and the cap it was asked to draft
    within (a plugged-in drafter, so the engine's caps reach it as they are)."""

    def __init__(self) -> None:
        from metrale.speculative.ngram import NgramDrafter

        self._inner = NgramDrafter(1, 3, 64)
        self.name, self.stateless, self.needs_hidden = "caps-seen", True, False
        self.asked: list[tuple[int, int]] = []

    def propose(self, seqs, caps):
        self.asked += [(seq.num_tokens, cap) for seq, cap in zip(seqs, caps, strict=True)]
        return self._inner.propose(seqs, caps)

    def observe(self, verdicts):
        return self._inner.observe(verdicts)

    def release(self, seq):
        return self._inner.release(seq)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_drafts_are_capped_by_the_pools_context_not_max_model_len(models, async_scheduling):
    """Found in review: the speculative side capped drafts by max_model_len, so near a smaller
    pool's end the drafter was asked for drafts that the scheduler then dropped."""
    path, reference = models["dense"]
    drafter = _CapsSeen()
    llm = LLM(
        path, device="cpu", dtype="float32", max_model_len=256, page_size=4, num_kv_pages=20,
        drafter=drafter, spec={"num_drafts": 3}, async_scheduling=async_scheduling,
    )  # fmt: skip
    context = llm.engine.context_len
    out = llm.generate([PROMPT], LONG, use_tqdm=False)[0].outputs[0]
    assert len(PROMPT) + len(out.token_ids) == context
    assert out.token_ids == reference[: len(out.token_ids)]
    assert drafter.asked and max(n + cap for n, cap in drafter.asked) == context - 1
