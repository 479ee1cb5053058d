"""A forward that yields non-finite logits for one sequence (no exception: a NaN or an inf out
of the target) ends that sequence alone with finish_reason "error" at the step that would have
emitted from them, its earlier tokens those of plain decoding; the other sequences' outputs are
plain decoding's, and the page pool ends idle. Found in review: the engine emitted the argmax of
a NaN row (token 0) and went on to finish "length". Dense and hybrid targets, greedy and
seeded sampling, plain decoding (synchronous and asynchronous) and speculation, the poisoned
row a prompt's last or a row inside a verify."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.engine.commit import NONFINITE
from tests.test_hybrid_engine import hybrid_dir  # noqa: F401 (a module fixture)

# the first request's prompt is longer than the others reach: only it meets the poisoned position
PROMPTS = [[5, 17, 30, 42, 9, 11, 3, 8, 21, 5, 17, 30, 6, 2, 40, 9], [7, 8, 9, 10, 7], [3, 4, 5, 6]]
LONG = 24


def poison_position(llm, position: int, value: float) -> None:
    """Every row at `position` gets non-finite final hidden states (so its logits are too)."""
    model = llm.engine.runner.model
    forward = model.forward

    def poisoned(ids, positions, *args, **kwargs):
        hidden = forward(ids, positions, *args, **kwargs)
        bad = (positions == position).unsqueeze(-1)
        return torch.where(bad, torch.full_like(hidden, value), hidden)

    model.forward = poisoned


def params(temperature: float, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=3, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize(
    "target, spec, async_on",
    [
        ("dense", None, True),
        ("dense", None, False),
        ("dense", "ngram", True),
        ("dense", "mtp", True),
        ("hybrid", None, True),
        ("hybrid", "ngram", True),
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("where", ["prompt", "decode"])
def test_nonfinite_logits_end_only_their_sequence(
    request, target, spec, async_on, temperature, where
):
    fixture = {
        "dense": "tiny_mtp_dir" if spec == "mtp" else "tiny_model_dir",
        "hybrid": "hybrid_dir",
    }
    path = request.getfixturevalue(fixture[target])
    kw = dict(device="cpu", dtype="float32", page_size=4, async_scheduling=async_on)
    # the long request runs past the poisoned position; the others end before it
    each = [params(temperature, LONG), params(temperature, 6), params(temperature, 6)]
    want = LLM(path, **kw).generate(PROMPTS, each, use_tqdm=False)
    if spec is not None:
        kw["spec"] = {"method": spec, "num_drafts": 3, "dcut": False}
    llm = LLM(path, **kw)
    position = len(PROMPTS[0]) - 1 if where == "prompt" else len(PROMPTS[0]) + 12
    poison_position(llm, position, float("nan") if temperature else float("inf"))
    outs = llm.generate(PROMPTS, each, use_tqdm=False)
    bad, plain = outs[0].outputs[0], want[0].outputs[0]
    assert bad.finish_reason == "error" and bad.error == NONFINITE, (bad.finish_reason, bad)
    # the tokens before the poisoned row's are plain decoding's; none from it
    kept = position + 1 - len(PROMPTS[0])
    assert bad.token_ids == plain.token_ids[:kept]
    for got, ref in zip(outs[1:], want[1:], strict=True):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        assert got.outputs[0].finish_reason == ref.outputs[0].finish_reason == "length"
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.allocator.num_free == engine.allocator.num_usable


def poison_embedding_once(llm, position: int) -> None:
    """NaN embeddings at `position`, in one forward: that row's K/V is NaN in every layer."""
    model = llm.engine.runner.model
    forward, left = model.forward, [1]

    def poisoned(ids, positions, *args, **kwargs):
        hook = None
        if left[0] and bool((positions == position).any()):
            left[0] = 0
            bad = (positions == position).unsqueeze(-1)

            def nan_rows(module, args, out):
                return torch.where(bad, torch.full_like(out, float("nan")), out)

            hook = model.model.embed_tokens.register_forward_hook(nan_rows)
        try:
            return forward(ids, positions, *args, **kwargs)
        finally:
            if hook is not None:
                hook.remove()

    model.forward = poisoned


@pytest.mark.parametrize("async_on", [True, False])
def test_pages_of_a_broken_row_never_reach_the_prefix_cache(tiny_model_dir, async_on):
    """Review: the asynchronous engine offers a step's full pages to the prefix cache when it
    launches it, before its verdicts are read; a page holding the NaN row's K/V stayed cached,
    and every later request sharing that prefix failed too. Now its names are taken back."""
    prompt = PROMPTS[0]
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", page_size=4, async_scheduling=async_on)
    llm = LLM(tiny_model_dir, **kw)
    poison_embedding_once(llm, len(prompt) - 1)  # the last prompt row: it fills a page
    first = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
    assert first.finish_reason == "error"
    later = llm.generate([prompt + [1, 2, 3]], p, use_tqdm=False)[0]
    fresh = LLM(tiny_model_dir, **kw).generate([prompt + [1, 2, 3]], p, use_tqdm=False)[0]
    assert later.outputs[0].finish_reason == "length"
    assert later.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert later.num_cached_tokens < len(prompt)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_forced_acceptance_never_accepts_past_a_broken_row(tiny_model_dir, temperature):
    """The bench's forced acceptance draws the matches: a draft row whose pick was not finite
    was accepted, and its -1 reached the detokenizer (the step raised). Review."""
    from metrale.bench.forced import ForcedAcceptance

    spec = {"method": "ngram", "num_drafts": 3, "dcut": False}
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", page_size=4, spec=spec)
    llm.engine.runner.forced_acceptance = ForcedAcceptance(1.0)
    poison_position(llm, len(PROMPTS[0]) + 5, float("nan"))
    p = SamplingParams(temperature=temperature, seed=1, max_tokens=16, ignore_eos=True)
    out = llm.generate([PROMPTS[0]], p, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "error" and len(out.token_ids) == 6


def test_a_broken_sequence_keeps_the_text_of_its_tokens(tiny_model_dir):
    """Its text held back for a stop string that never completed is released with the error,
    as at any end but a stop: the text covers the tokens (review: it was empty)."""
    p = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=["\x00never"])
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", page_size=4)
    poison_position(llm, len(PROMPTS[0]) + 6, float("nan"))
    out = llm.generate([PROMPTS[0]], p, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "error" and len(out.token_ids) == 7
    assert out.text == llm.get_tokenizer().decode(out.token_ids)


@pytest.mark.parametrize("async_on", [True, False])
def test_a_chunked_prompt_s_pages_are_withdrawn_too(tiny_model_dir, async_on):
    """The non-finite row may be in an earlier prompt chunk than the row that samples (its K/V
    poisons the chunks after it): every page the sequence computed loses its name, not the
    last step's alone (found in review)."""
    prompt = PROMPTS[0]
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    kw = dict(
        device="cpu",
        dtype="float32",
        page_size=4,
        async_scheduling=async_on,
        max_num_batched_tokens=8,
    )
    llm = LLM(tiny_model_dir, **kw)
    poison_embedding_once(llm, 1)  # in the first chunk
    assert llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].finish_reason == "error"
    later = llm.generate([prompt + [1, 2, 3]], p, use_tqdm=False)[0]
    fresh = LLM(tiny_model_dir, **kw).generate([prompt + [1, 2, 3]], p, use_tqdm=False)[0]
    assert later.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert later.num_cached_tokens == 0


def test_pages_computed_before_a_preemption_are_withdrawn_too(tiny_model_dir):
    """Re-admitted after a preemption, a sequence hits its own pages; a non-finite row among
    them must leave the cache with the rest (found in review: withdrawn from the last
    admission's hit on, they stayed, and a later request with that prefix failed)."""
    kw = dict(device="cpu", dtype="float32", page_size=4, async_scheduling=False)
    kw["max_num_batched_tokens"] = 8
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(tiny_model_dir, **kw)
    engine = llm.engine
    poison_embedding_once(llm, 1)
    engine.add_request("a", PROMPTS[0], p)
    engine.step()  # the first chunk: its two pages (row 1 among them) are offered
    seq = engine.requests["a"].seqs[0]
    engine.scheduler.preempt(seq)  # as the scheduler does to its newest sequence
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert seq.num_cached_tokens == 8  # re-admitted on its own pages
    assert outs[-1].outputs[0].finish_reason == "error"
    later = llm.generate([PROMPTS[0] + [1, 2, 3]], p, use_tqdm=False)[0]
    fresh = LLM(tiny_model_dir, **kw).generate([PROMPTS[0] + [1, 2, 3]], p, use_tqdm=False)[0]
    assert later.outputs[0].token_ids == fresh.outputs[0].token_ids
