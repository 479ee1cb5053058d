"""Hybrid target, prefix caching, a full pool: a failed batch rebuilds each other sequence's
state, and a rebuild whose rows sit in shared pages needs scratch pages. When the pool cannot
lend them, that sequence is preempted (recomputed later) instead of ending with a MemoryError:
only the sequence that caused the failure ends, the others give exactly the output of a roomy
uncached run (found in review)."""

from __future__ import annotations

import pytest

from metrale import LLM
from tests.prefix_cache_helpers import Watch, fail_request, greedy, shared_prompts, token_ids
from tests.test_hybrid_engine import hybrid_dir, hybrid_mtp_dir  # noqa: F401 (fixtures)

PAGE = 4
SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_drafts": 3},
    "mtp": {"method": "mtp", "num_drafts": 3},
}


def llm_for(path, **kw) -> LLM:
    return LLM(path, device="cpu", dtype="float32", page_size=PAGE, **kw)


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_rebuild_without_scratch_preempts_not_fails(hybrid_mtp_dir, spec, monkeypatch):  # noqa: F811
    prompts = shared_prompts(3 * PAGE, 5, seed=2)
    want = token_ids(
        llm_for(hybrid_mtp_dir, prefix_caching=False).generate(prompts, greedy(12), use_tqdm=False)
    )
    options = dict(max_num_batched_tokens=8, max_num_seqs=4, num_kv_pages=18)  # full when it fails
    if SPECS[spec] is not None:
        options["spec"] = SPECS[spec]
    llm = llm_for(hybrid_mtp_dir, **options)
    llm.generate(prompts[:1], greedy(2), use_tqdm=False)  # caches the shared prefix
    Watch(llm)
    engine = llm.engine
    preempt, refused = engine.scheduler.preempt, []
    monkeypatch.setattr(engine.scheduler, "preempt", lambda s: refused.append(s) or preempt(s))
    fail_request(monkeypatch, llm, "req-3", after=8)  # prompts[2], mid-generation
    outs = llm.generate(prompts, greedy(12), use_tqdm=False)
    monkeypatch.undo()
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons == ["length", "length", "error", "length", "length"]
    assert [o for i, o in enumerate(token_ids(outs)) if i != 2] == want[:2] + want[3:]
    assert refused  # a rebuild found too few free pages for its scratch
    alloc = engine.allocator
    assert alloc.num_free == alloc.num_usable and not any(alloc.cache.snapshots._pins)
    if spec == "mtp":
        assert not engine.spec.drafter._pos  # every sequence's drafter state released
