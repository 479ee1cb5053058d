"""Engine-side hardening (issue 18): a plugged-in drafter that raises in any hook fails only its
own sequence (and never loses a finished request's output); Python API input of the wrong type
gives a ValueError naming the field and leaves nothing queued; config edges."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from metrale import LLM, SamplingParams
from metrale.speculative.drafter import Draft

PROMPTS = [[(5 * i + 3 * j) % 200 + 3 for j in range(6 + i)] for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


class Raises:
    """Drafts [1, 2] for everyone; raises in `hook` for the sequence of prompt `victim`."""

    name, needs_hidden = "raises", False

    def __init__(self, hook: str, victim: int) -> None:
        self.hook, self.victim = hook, victim

    def _check(self, hook, seqs) -> None:
        if hook == self.hook and any(s.prompt_token_ids == PROMPTS[self.victim] for s in seqs):
            raise RuntimeError(f"{hook} broke")

    def propose(self, seqs, caps):
        self._check("propose", seqs)
        return [Draft([1, 2][:k]) for k in caps]

    def observe(self, verdicts):
        self._check("observe", [v.seq for v in verdicts])

    def release(self, seq):
        self._check("release", [seq])


@pytest.mark.parametrize("hook", ["propose", "observe", "release"])
@pytest.mark.parametrize("alone", [True, False])
def test_a_drafter_raising_in_any_hook_fails_only_its_sequence(tiny_model_dir, hook, alone):
    prompts = PROMPTS[:1] if alone else PROMPTS
    want = LLM(tiny_model_dir, device="cpu").generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(tiny_model_dir, device="cpu", drafter=Raises(hook, 0), spec={"num_drafts": 2})
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert len(outs) == len(prompts)  # every request has its final output
    first = outs[0].outputs[0]
    if hook == "release":  # the sequence was leaving anyway: its output stands
        assert first.finish_reason == "length" and first.token_ids == want[0].outputs[0].token_ids
    else:
        assert first.finish_reason == "error"
    for got, ref in zip(outs[1:], want[1 : len(prompts)], strict=True):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.allocator.num_free == engine.allocator.num_usable
    # the engine goes on serving
    again = llm.generate(PROMPTS[1:2], GREEDY, use_tqdm=False)
    assert again[0].outputs[0].token_ids == want[1].outputs[0].token_ids


class BadShape(Raises):
    """Proposes `bad` for the sequence of prompt 0, a well-formed draft for the others."""

    def __init__(self, bad) -> None:
        super().__init__("none", 0)
        self.bad = bad

    def propose(self, seqs, caps):
        return [
            self.bad if s.prompt_token_ids == PROMPTS[0] else Draft([1, 2][:k])
            for s, k in zip(seqs, caps, strict=True)
        ]


@pytest.mark.parametrize(
    "bad, fails",
    [
        (Draft(__import__("torch").tensor([1, 2])), True),  # failed the whole step (review)
        ([1, 2], True),  # not a Draft
        (Draft((1, 2)), False),  # a tuple is a sequence of ids: taken
    ],
)
def test_a_malformed_draft_fails_only_its_sequence(tiny_model_dir, bad, fails):
    want = LLM(tiny_model_dir, device="cpu").generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(tiny_model_dir, device="cpu", drafter=BadShape(bad), spec={"num_drafts": 2})
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    first = outs[0].outputs[0]
    if fails:
        assert first.finish_reason == "error" and "Draft" in first.error
    else:
        assert first.token_ids == want[0].outputs[0].token_ids
    for got, ref in zip(outs[1:], want[1:], strict=True):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable


def _bad_q(kind: str, vocab: int):
    torch = __import__("torch")
    q = torch.full((2, vocab), 1.0 / vocab)
    if kind == "nan":
        q[1, 3] = float("nan")
    elif kind == "negative":
        q[0, 0] = -0.5
    elif kind == "no-mass":
        q[1] = 0.0
    return {"1-d": q[0], "wrong-vocab": q[:, :-1]}.get(kind, q)


@pytest.mark.parametrize("kind", ["1-d", "wrong-vocab", "nan", "negative", "no-mass"])
def test_a_malformed_draft_distribution_fails_only_its_sequence(tiny_model_dir, kind):
    """A q the engine cannot draw from (it draws a q draft's tokens itself) ends its sequence
    with the reason, not the step: before, a wrong shape failed the step and was isolated by
    running it again one sequence at a time, and a [1, V] q was broadcast to every draft."""
    vocab = json.loads((Path(tiny_model_dir) / "config.json").read_text())["vocab_size"]
    want = LLM(tiny_model_dir, device="cpu").generate(PROMPTS, GREEDY, use_tqdm=False)
    drafter = BadShape(Draft([1, 2], _bad_q(kind, vocab)))
    llm = LLM(tiny_model_dir, device="cpu", drafter=drafter, spec={"num_drafts": 2})
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    first = outs[0].outputs[0]
    assert first.finish_reason == "error" and "probs" in first.error
    for got, ref in zip(outs[1:], want[1:], strict=True):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    assert llm.engine.retried_batches == 0
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable


@pytest.mark.parametrize(
    "params, field",
    [
        ({"temperature": 0.0, "bogus": 1}, "bogus"),  # a dict with an unknown field
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"n": 100000}, "n"),
        ("greedy", "sampling_params"),  # not a SamplingParams at all
    ],
)
def test_wrong_python_input_names_the_field_and_queues_nothing(tiny_model_dir, params, field):
    llm = LLM(tiny_model_dir, device="cpu")
    with pytest.raises(ValueError, match=field):
        # the second request is the bad one: the first must not stay queued
        llm.generate(PROMPTS[:2], [GREEDY, params], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests


def test_a_dict_of_fields_is_a_sampling_params(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu")
    want = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    got = llm.generate(PROMPTS[:1], {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True})
    assert got[0].outputs[0].token_ids == want


def test_an_eos_id_outside_the_vocabulary_is_dropped(tiny_model_dir, tmp_path, caplog):
    """A tokenizer EOS the model's vocabulary lacks is ignored with a warning; `min_tokens`
    requests (which ban EOS ids) still run."""
    import json
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["eos_token_id"] = [cfg.get("eos_token_id") or 0, 99999]
    (model / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level("WARNING"):
        llm = LLM(model, device="cpu")
    assert 99999 not in llm.engine.eos_token_ids and "99999" in caplog.text
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4)
    assert len(llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids) >= 4


def test_a_text_prompt_past_the_vocabulary_is_refused_when_added(hf_qwen3_factory):
    """A tokenizer larger than the model's vocabulary: a text prompt that encodes to an id the
    embedding lacks is refused as a token-id prompt is (found in review: one rank failed it
    mid-step, two read it as a zero row and answered), and nothing of the call is queued."""
    llm = LLM(hf_qwen3_factory("vocab256", vocab_size=256), device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    special = llm.tokenizer.encode("<|im_start|>")
    assert max(special) >= 256
    with pytest.raises(
        ValueError, match=r"^prompts\[1\]: prompt: its text encodes to token id 257, outside"
    ):
        llm.generate(["def f():", "<|im_start|>user hi"], params, use_tqdm=False)
    assert not llm.engine.requests
    assert len(llm.generate(["def f():"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_a_hybrid_without_attention_layers_runs(tmp_path, tokenizer_dir):
    """An all-GDN Qwen3-Next (no full-attention layer) keeps no KV pool and generates what
    transformers generates."""
    import shutil

    import torch

    from tests.test_qwen3_next import TINY_NEXT, randomize, transformers

    cfg = transformers.Qwen3NextConfig(
        **{**TINY_NEXT, "vocab_size": 320, "layer_types": ["linear_attention"] * 4}
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3NextForCausalLM(cfg).eval()
    randomize(hf, seed=3)
    hf.save_pretrained(tmp_path / "m", safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp_path / "m" / name)
    prompt = [5, 17, 30, 42, 9]
    llm = LLM(tmp_path / "m", device="cpu", dtype="float32")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ids = list(prompt)
    with torch.no_grad():  # transformers' generate cannot size an all-linear cache: no cache
        for _ in range(12):
            ids.append(int(hf(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    assert out[0].outputs[0].token_ids == ids[len(prompt) :]
    assert llm.engine.runner.kv_cache.shape[0] == 0  # no attention layer, no KV


def test_a_chunk_one_short_of_the_end_reserves_the_lookahead():
    """Every (chunk budget, page size) pair up to 16 x 16 and every prompt length: once a step
    leaves a sequence one token short of its end (it drafts next, before the scheduler runs
    again), its block table already covers the drafter's lookahead rows."""
    from metrale.engine.kv_cache import PageAllocator
    from metrale.engine.scheduler import Scheduler
    from metrale.engine.sequence import Sequence

    lookahead = 3
    for page in range(1, 17):
        for budget in range(1, 17):
            for length in range(2, 3 * budget + 3):
                alloc = PageAllocator(1 + -(-(length + lookahead) // page) + 1, page)
                sched = Scheduler(alloc, 1, budget, lookahead=lookahead)
                seq = Sequence(0, "r", list(range(length)), GREEDY, 0, (0,), 0)
                sched.add(seq)
                while seq.num_computed_tokens < length - 1:
                    (entry,) = sched.schedule().entries
                    seq.num_computed_tokens += entry.num_rows
                    if seq.num_computed_tokens >= length - 1:
                        covered = len(seq.block_table) * page
                        assert covered >= length - 1 + lookahead, (page, budget, length)


@pytest.mark.parametrize("drafter", ["ngram", "mtp", "dflash"])
def test_lookahead_across_chunk_and_page_boundaries(drafter, tmp_path):
    """Prefill chunks that stop one token short of the prompt's end exactly on a page boundary
    (the next step drafts before the scheduler runs): every (chunk budget, page size) pair up to
    16 x 16, with every drafter, generates plain greedy output and fails nothing."""
    from metrale.default_model import random_model_dir
    from tests.test_spec_dflash import write_dflash

    model = random_model_dir()  # a tiny random Qwen3 with an MTP head
    spec = {"method": drafter, "num_drafts": 3, "dcut": False}
    if drafter == "dflash":
        spec["model"] = str(write_dflash(model, tmp_path / "d", layers=(0, 1)))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for page in (1, 16):
        for budget in (4, 16):  # a verify needs 1 + K rows
            # the last prefill chunk stops one short of the end, on a page boundary
            length = 2 * math.lcm(budget, page) + 1
            prompt = [(7 * j) % 200 + 3 for j in range(length)]
            opts = dict(page_size=page, max_num_batched_tokens=budget, device="cpu")
            want = LLM(model, **opts).generate([prompt], params, use_tqdm=False)
            got = LLM(model, spec=spec, **opts).generate([prompt, prompt[:-1]], params)
            assert got[0].outputs[0].finish_reason == "length", (page, budget)
            assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids, (page, budget)


def test_a_greedy_request_keeps_a_q_drafters_tokens(tiny_model_dir):
    """A greedy row judges the argmax, lossless for any token, so a q is not used there and the
    drafter's own tokens are verified (drawn from a soft q instead, an oracle's 92 of 92
    accepted drafts fell to 56 of 216: found in review)."""
    torch = __import__("torch")
    vocab = json.loads((Path(tiny_model_dir) / "config.json").read_text())["vocab_size"]
    want = LLM(tiny_model_dir, device="cpu").generate(PROMPTS, GREEDY, use_tqdm=False)
    ref = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, want, strict=True)}

    class SoftOracle(Raises):
        def __init__(self) -> None:
            super().__init__("none", 0)

        def propose(self, seqs, caps):
            out = []
            for s, k in zip(seqs, caps, strict=True):
                n = len(s.output_token_ids)
                tokens = ref[tuple(s.prompt_token_ids)][n : n + k]
                q = torch.full((len(tokens), vocab), 0.4 / (vocab - 1))
                q[range(len(tokens)), tokens] = 0.6
                out.append(Draft(tokens, q))
            return out

    llm = LLM(tiny_model_dir, device="cpu", drafter=SoftOracle(), spec={"num_drafts": 3})
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    tel = llm.engine.telemetry.spec
    assert 0 < tel.num_accepted_tokens == tel.num_draft_tokens


def test_a_draft_distribution_with_autograd_on_is_drawn_from_as_without(tiny_model_dir):
    """A q a drafter built with autograd on (a model run outside `torch.no_grad()`) failed its
    sampled request in the draws' in-place sampling (review): it is the same q without it."""
    torch = __import__("torch")
    vocab = json.loads((Path(tiny_model_dir) / "config.json").read_text())["vocab_size"]
    q = torch.softmax(torch.randn(2, vocab, generator=torch.Generator().manual_seed(0)), -1)
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True)
    outs = []
    for table in (q, q.clone().requires_grad_()):
        drafter = BadShape(Draft([1, 2], table))
        llm = LLM(tiny_model_dir, device="cpu", drafter=drafter, spec={"num_drafts": 2})
        outs.append(llm.generate(PROMPTS[:1], sampled, use_tqdm=False)[0].outputs[0])
    assert outs[1].finish_reason == "length", outs[1].error
    assert outs[1].token_ids == outs[0].token_ids


def test_a_request_that_fails_while_added_leaves_no_count_behind(tiny_model_dir):
    """A grammar matcher raising for the second of n sequences (an engine failure, not a bad
    field) used to leave the engine counting the first as running under a grammar: its
    masks' work on every step, and no step ahead of the one before for good (review)."""
    llm = LLM(tiny_model_dir, device="cpu")
    engine = llm.engine
    real, calls = engine.grammars.matcher, []

    def matcher(spec):
        calls.append(spec)
        if len(calls) == 2:
            raise RuntimeError("the matcher failed")
        return real(spec)

    engine.grammars.matcher = matcher
    params = SamplingParams(n=2, max_tokens=3, structured={"choice": ["ab", "cd"]})
    with pytest.raises(RuntimeError, match="the matcher failed"):
        engine.add_request("r1", [1, 2, 3], params)
    assert engine.runner.structured_seqs == 0 and engine.sync_seqs == 0
    assert "r1" not in engine.requests and not engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length"
    assert engine._ahead.launches_ahead > 0  # still running ahead
