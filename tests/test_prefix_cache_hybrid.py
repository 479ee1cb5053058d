"""Automatic prefix caching on a hybrid (Qwen3-Next, Gated DeltaNet) target, CPU float32: a hit
resumes the recurrent state from a snapshot at a page boundary, and greedy output with caching
equals output without, token for token, in both `hybrid_verify_state` variants, with n-gram,
replayed and MTP drafts, under chunked prefill, preemption, page eviction and a snapshot pool
too small for every prefix; a forward that fails rebuilds the others' state from their snapshots
without writing a cached page."""

from __future__ import annotations

import pytest

from metrale import LLM
from metrale.speculative.replay import ReplayDrafter
from tests.prefix_cache_helpers import Watch, fail_request, greedy, shared_prompts, token_ids
from tests.test_hybrid_engine import hybrid_dir, hybrid_mtp_dir  # noqa: F401 (fixtures)

PAGE = 4


def llm_for(path, **kw) -> LLM:
    return LLM(path, device="cpu", dtype="float32", page_size=PAGE, **kw)


def run_turns(llm: LLM, prompts, n: int = 10) -> list[list[int]]:
    """Every prompt, then every prompt again, then each extended by its output (a next turn)."""
    first = token_ids(llm.generate(prompts, greedy(n), use_tqdm=False))
    again = token_ids(llm.generate(prompts, greedy(n), use_tqdm=False))
    turns = [p + out + [7, 8, 9] for p, out in zip(prompts, first, strict=True)]
    return first + again + token_ids(llm.generate(turns, greedy(n), use_tqdm=False))


ENGINES = {
    "roomy": dict(max_num_batched_tokens=48),
    # chunked prefill, a pool that preempts and reclaims cached pages, 2 * 3 snapshots
    "tight": dict(max_num_batched_tokens=12, num_kv_pages=22, max_num_seqs=3),
}


@pytest.mark.parametrize("prefix_len", [3 * PAGE, 3 * PAGE + 1], ids=["boundary", "mid-page"])
@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("variant", ["write_on_accept", "per_row_slots"])
@pytest.mark.parametrize("spec", ["plain", "ngram"])
def test_greedy_output_equals_uncached(hybrid_dir, prefix_len, engine, variant, spec):  # noqa: F811
    prompts = shared_prompts(prefix_len, 8, seed=prefix_len)
    options = dict(hybrid_verify_state=variant, **ENGINES[engine])
    if spec == "ngram":
        options["spec"] = {"method": "ngram", "num_drafts": 3}
    expected = run_turns(llm_for(hybrid_dir, prefix_caching=False, **options), prompts)
    llm = llm_for(hybrid_dir, **options)
    watch = Watch(llm)
    assert run_turns(llm, prompts) == expected
    stats, tel = llm.engine.telemetry.prefix_cache, llm.engine.telemetry
    assert watch.checks > 0 and stats.hits > 0 and stats.snapshots_restored > 0
    # (asynchronous scheduling, the default: snapshots saved as their steps are launched)
    assert llm.engine._ahead.launches_ahead > 0
    if engine == "tight":
        assert tel.preemptions > 0 and stats.evicted_pages > 0
        assert stats.snapshots_saved > 2 * llm.engine.config.max_num_seqs  # some were reused
    alloc = llm.engine.allocator
    assert alloc.num_free == alloc.num_usable
    assert not any(alloc.cache.snapshots._pins)  # every sequence let its snapshot go


@pytest.mark.parametrize("variant", ["write_on_accept", "per_row_slots"])
def test_replayed_drafts_stay_lossless(hybrid_dir, variant):  # noqa: F811
    prompts = shared_prompts(2 * PAGE + 3, 6, seed=5)
    plain = llm_for(hybrid_dir, prefix_caching=False)
    want = token_ids(plain.generate(prompts, greedy(14), use_tqdm=False))
    drafter = ReplayDrafter(
        {tuple(p): o for p, o in zip(prompts, want, strict=True)}, 0.5, vocab_size=320, seed=3
    )
    llm = llm_for(
        hybrid_dir,
        drafter=drafter,
        spec={"num_drafts": 3},
        max_num_batched_tokens=16,
        hybrid_verify_state=variant,
    )
    Watch(llm)
    for _ in range(2):
        assert token_ids(llm.generate(prompts, greedy(14), use_tqdm=False)) == want
    tel = llm.engine.telemetry
    assert tel.prefix_cache.snapshots_restored > 0
    assert 0 < tel.spec.num_accepted_tokens < tel.spec.num_draft_tokens


def test_mtp_drafts_stay_lossless(hybrid_mtp_dir):  # noqa: F811
    prompts = shared_prompts(2 * PAGE, 5, seed=9)
    expected = run_turns(llm_for(hybrid_mtp_dir, prefix_caching=False), prompts)
    llm = llm_for(hybrid_mtp_dir, spec={"method": "mtp", "num_drafts": 3})
    Watch(llm)
    assert run_turns(llm, prompts) == expected
    tel = llm.engine.telemetry
    assert tel.prefix_cache.snapshots_restored > 0 and tel.spec.num_draft_tokens > 0
    # MTP's K/V rows in the pages offer them at the commit, and a snapshot with them: this
    # engine stays synchronous (a snapshot saved at a settle held the next step's state)
    assert llm.engine._ahead is None


def test_snapshot_policy_branch_point_then_prompt_end(hybrid_dir):  # noqa: F811
    """The first prompt saves its state at its last page boundary; the second, which parts ways
    with it inside the cached pages, recomputes and saves at the end of the shared pages; the
    third resumes there."""
    llm = llm_for(hybrid_dir)
    stats = llm.engine.telemetry.prefix_cache
    shared = list(range(20, 33))  # 13 tokens: 3 full pages
    llm.generate([shared + [40, 41, 42, 43, 44]], greedy(2), use_tqdm=False)  # 18: saves at 16
    assert (stats.hits, stats.snapshots_saved) == (0, 1)
    llm.generate([shared + [50, 51]], greedy(2), use_tqdm=False)  # 15: KV hit 12, no snapshot
    assert (stats.hits, stats.snapshots_saved) == (0, 2)  # saved at 12 (and 12 is its end too)
    llm.generate([shared + [60, 61, 62]], greedy(2), use_tqdm=False)  # 16: resumes at 12
    assert (stats.hits, stats.snapshots_restored) == (12, 1)


def test_failed_forward_rebuilds_state_from_the_snapshot(hybrid_dir, monkeypatch):  # noqa: F811
    """A forward that raises after some GDN layers advanced their state: the failing sequence
    ends with an error; the others rebuild their state from their snapshots (their KV rows going
    to scratch pages, never a cached one) and give exactly their uncached output."""
    prompts = shared_prompts(3 * PAGE, 5, seed=2)
    want = token_ids(llm_for(hybrid_dir, prefix_caching=False).generate(prompts, greedy(12)))
    llm = llm_for(hybrid_dir, max_num_batched_tokens=8)
    llm.generate(prompts[:1], greedy(2), use_tqdm=False)  # caches the shared prefix
    Watch(llm)
    scratch = []
    take = llm.engine.allocator.take_scratch
    monkeypatch.setattr(
        llm.engine.allocator, "take_scratch", lambda n: scratch.append(n) or take(n)
    )
    fail_request(monkeypatch, llm, "req-3", after=8)  # prompts[2], mid-generation
    outs = llm.generate(prompts, greedy(12), use_tqdm=False)
    monkeypatch.undo()
    assert outs[2].outputs[0].finish_reason == "error"
    assert [o for i, o in enumerate(token_ids(outs)) if i != 2] == want[:2] + want[3:]
    assert scratch and llm.engine.telemetry.prefix_cache.snapshots_restored > 0
    alloc = llm.engine.allocator
    assert alloc.num_free == alloc.num_usable and not any(alloc.cache.snapshots._pins)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["write_on_accept", "per_row_slots"])
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_cuda_graphs_output_equals_uncached(hybrid_dir, variant, engine):  # noqa: F811
    """On CUDA (float32, graphed decode and verify steps restoring snapshots into the state
    pool the programs read): caching changes no token."""
    prompts = shared_prompts(3 * PAGE + 1, 8, seed=4)
    options = dict(
        device="cuda",
        dtype="float32",
        page_size=PAGE,
        hybrid_verify_state=variant,
        spec={"method": "ngram", "num_drafts": 3},
        **{"max_num_seqs": 8, **ENGINES[engine]},
    )
    expected = run_turns(LLM(hybrid_dir, prefix_caching=False, **options), prompts)
    llm = LLM(hybrid_dir, **options)
    Watch(llm)
    assert run_turns(llm, prompts) == expected
    assert llm.engine.telemetry.prefix_cache.snapshots_restored > 0


def test_snapshot_pool_size_is_an_engine_option(hybrid_dir):  # noqa: F811
    """`prefix_cache_snapshots` sizes the pool; 0 leaves a hybrid target without prefix caching
    (a hit needs a state to resume from), and a bad value names the field."""
    sized = llm_for(hybrid_dir, prefix_cache_snapshots=3)
    assert sized.engine.allocator.cache.snapshots.capacity == 3
    assert llm_for(hybrid_dir, prefix_cache_snapshots=0).engine.allocator.cache is None
    with pytest.raises(ValueError, match="prefix_cache_snapshots"):
        llm_for(hybrid_dir, prefix_cache_snapshots=-1)
