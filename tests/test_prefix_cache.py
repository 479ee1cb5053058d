"""Automatic prefix caching on a dense target (CPU): greedy output with caching equals output
without, token for token, for shared prefixes that end mid-page and on a page boundary, under
chunked prefill, preemption and eviction pressure, with n-gram and MTP speculation; a page is
never shared or cached while a sequence writes it, and a cached page's KV never changes; the
hit counters count exactly the reused pages' tokens; a multi-turn chat on the shipped model runs
far fewer prefill rows with caching."""

from __future__ import annotations

import pytest

from metrale import LLM
from metrale.default_model import default_model_dir
from metrale.engine.kv_cache import PageAllocator
from metrale.engine.prefix_cache import PrefixCache
from metrale.engine.sequence import Sequence
from metrale.telemetry import PrefixCacheTelemetry
from tests.prefix_cache_helpers import Watch, greedy, shared_prompts, token_ids

PAGE = 4


def run_twice(llm: LLM, prompts, n: int = 12) -> list[list[int]]:
    """Every prompt, then every prompt again (the second pass finds the first's pages), then
    each prompt extended by its own output (a second turn)."""
    first = token_ids(llm.generate(prompts, greedy(n), use_tqdm=False))
    again = token_ids(llm.generate(prompts, greedy(n), use_tqdm=False))
    turns = [p + out + [7, 8, 9] for p, out in zip(prompts, first, strict=True)]
    return first + again + token_ids(llm.generate(turns, greedy(n), use_tqdm=False))


ENGINES = {
    "roomy": dict(max_num_batched_tokens=64),
    # chunked prefill, a pool that preempts and reclaims cached pages
    "tight": dict(max_num_batched_tokens=16, num_kv_pages=24, max_num_seqs=6),
}
SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_drafts": 3},
    "mtp": {"method": "mtp", "num_drafts": 3},
}


@pytest.mark.parametrize("prefix_len", [4 * PAGE, 4 * PAGE + 2], ids=["boundary", "mid-page"])
@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("spec", sorted(SPECS))
def test_greedy_output_equals_uncached(tiny_mtp_dir, prefix_len, engine, spec):
    prompts = shared_prompts(prefix_len, 10, seed=prefix_len)
    options = dict(device="cpu", page_size=PAGE, spec=SPECS[spec], **ENGINES[engine])
    expected = run_twice(LLM(tiny_mtp_dir, prefix_caching=False, **options), prompts)
    llm = LLM(tiny_mtp_dir, **options)
    watch = Watch(llm)
    assert run_twice(llm, prompts) == expected
    tel = llm.engine.telemetry
    assert watch.checks > 0 and tel.prefix_cache.hits > 0
    if engine == "tight":
        assert tel.preemptions > 0 and tel.prefix_cache.evicted_pages > 0
    if spec != "plain":
        assert tel.spec.num_draft_tokens > 0
    alloc = llm.engine.allocator
    assert alloc.num_free == alloc.num_usable  # every page free or idle again


def test_dflash_drafts_sequences_admitted_with_a_hit():
    """The shipped model's DFlash drafter: a hit's pages hold their context rows, so a sequence
    admitted with one is drafted as it would be without caching, and its output is unchanged."""
    prompts = shared_prompts(40, 8, seed=1, vocab=4000)
    spec = {"method": "dflash", "num_drafts": 4, "dcut": False}
    drafted, outputs = {}, {}
    for caching in (False, True):
        llm = LLM(default_model_dir(), device="cpu", prefix_caching=caching, spec=spec)
        outputs[caching] = run_twice(llm, prompts)
        drafted[caching] = llm.engine.telemetry.spec.num_draft_tokens
    assert outputs[True] == outputs[False]
    assert llm.engine.telemetry.prefix_cache.hits > 0
    assert drafted[True] >= 0.9 * drafted[False] > 0


def test_off_means_off(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", page_size=PAGE, prefix_caching=False)
    prompts = shared_prompts(3 * PAGE, 4, seed=1)
    run_twice(llm, prompts)
    assert llm.engine.allocator.cache is None
    assert llm.engine.telemetry.prefix_cache.queries == 0


def test_hit_counters_match_reused_pages(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", page_size=PAGE)
    alloc = llm.engine.allocator
    reused = []
    share = alloc.share
    alloc.share = lambda seq, pages: (reused.append(len(pages)), share(seq, pages))[1]
    stats = llm.engine.telemetry.prefix_cache
    a = list(range(10, 32))  # 22 tokens: 5 full pages
    llm.generate([a], greedy(4), use_tqdm=False)
    assert (stats.queries, stats.hits, reused) == (22, 0, [0])
    # the same prompt: 5 pages, 20 tokens (its last 2 run; a full last page would too)
    llm.generate([a], greedy(4), use_tqdm=False)
    assert (stats.queries, stats.hits, reused[-1]) == (44, 20, 5)
    # parts ways inside page 3: pages 0-2 reused
    llm.generate([a[:14] + [99] * 9], greedy(4), use_tqdm=False)
    assert (stats.queries, stats.hits, reused[-1]) == (67, 32, 3)
    # exactly 4 pages long: the last page runs again (a row to sample from)
    llm.generate([a[:16]], greedy(4), use_tqdm=False)
    assert (stats.queries, stats.hits, reused[-1]) == (83, 44, 3)
    assert stats.hits == PAGE * sum(reused)
    assert stats.hit_rate == pytest.approx(44 / 83)


def test_generated_pages_are_cached_for_the_next_turn(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", page_size=PAGE)
    prompt = list(range(40, 50))
    out = token_ids(llm.generate([prompt], greedy(15), use_tqdm=False))[0]
    before = llm.engine.telemetry.prefix_cache.hits
    llm.generate([prompt + out + [5]], greedy(3), use_tqdm=False)
    # prompt (10) + output (15) = 25 tokens; the last output token was never run: 24 rows,
    # 6 full pages, all reused
    assert llm.engine.telemetry.prefix_cache.hits - before == 24


def _seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, str(seq_id), tokens, greedy(1), 0, (), arrival=seq_id)


def test_allocator_reclaims_idle_pages_lru_and_never_held_ones():
    stats = PrefixCacheTelemetry()
    alloc = PageAllocator(7, PAGE, PrefixCache(PAGE, stats))  # 6 usable pages
    cache = alloc.cache
    a = _seq(0, list(range(9)))  # 2 full pages and one token
    hit = cache.match(a)
    assert hit.pages == [] and hit.tokens == 0
    alloc.reserve(a, 9)
    a.num_computed_tokens = 8
    cache.commit(a)
    assert [cache.holds(p) for p in a.block_table] == [True, True, False]
    b = _seq(1, list(range(9)) + [50])
    hit = cache.match(b)
    assert hit.pages == a.block_table[:2] and hit.idle == 0
    alloc.share(b, hit.pages)
    cache.admit(b, hit)
    alloc.reserve(b, 10)
    assert [alloc.refs(p) for p in b.block_table] == [2, 2, 1]
    alloc.free(a)
    assert alloc.num_free == 3  # a's last page; its cached ones are still held by b
    alloc.free(b)
    assert alloc.num_free == 6 and cache.num_idle == 2
    # Taking every page reclaims the idle cached ones last, tail page first.
    c = _seq(2, list(range(100, 124)))
    alloc.reserve(c, 16)
    assert cache.num_cached == 2 and stats.evicted_pages == 0
    alloc.reserve(c, 20)
    assert c.block_table[-1] == hit.pages[1] and stats.evicted_pages == 1
    assert cache.match(_seq(3, list(range(9)))).pages == hit.pages[:1]
    with pytest.raises(MemoryError):
        alloc.reserve(c, 28)


def test_multi_turn_chat_on_the_shipped_model_runs_fewer_prefill_rows():
    """The issue's comparison at CPU scale: a shared system prompt, 4 clients, 3 turns each;
    with caching the same replies come from a fraction of the prompt rows."""
    model = default_model_dir()
    llm_off = LLM(model, device="cpu", prefix_caching=False)
    tok = llm_off.engine.tokenizer
    system = tok.encode("import os\nimport sys\n\n" + "def helper(x):\n    return x + 1\n" * 12)
    users = [[tok.encode(f"# client {c} turn {t}\nvalue = ") for t in range(3)] for c in range(4)]
    replies = {}
    rows = {}
    for caching in (False, True):
        llm = llm_off if not caching else LLM(model, device="cpu")
        history = [list(system) for _ in range(4)]
        got = []
        for turn in range(3):
            prompts = [history[c] + users[c][turn] for c in range(4)]
            outs = token_ids(llm.generate(prompts, greedy(12), use_tqdm=False))
            for c in range(4):
                history[c] = prompts[c] + outs[c]
            got.append(outs)
        replies[caching], rows[caching] = got, llm.engine.telemetry.prefill_tokens
    assert replies[True] == replies[False]
    stats = llm.engine.telemetry.prefix_cache
    assert len(system) > 150 and stats.hit_rate > 0.6
    assert rows[True] < 0.4 * rows[False]
    assert rows[False] - rows[True] == stats.hits


@pytest.mark.gpu
@pytest.mark.parametrize("spec", sorted(SPECS))
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_cuda_graphs_output_equals_uncached(spec, engine):
    """On CUDA, graphed decode, verify and prefill steps (the shipped model with its MTP head):
    caching changes no token."""
    prompts = shared_prompts(2 * 16 + 5, 12, seed=3, vocab=4000)
    options = dict(device="cuda", dtype="float32", spec=SPECS[spec], **ENGINES[engine])
    options.setdefault("max_num_seqs", 8)  # fewer programs to capture
    if engine == "tight":
        options.update(num_kv_pages=30, max_num_batched_tokens=32)
    model = default_model_dir()
    expected = run_twice(LLM(model, prefix_caching=False, **options), prompts)
    llm = LLM(model, **options)
    watch = Watch(llm)
    assert run_twice(llm, prompts) == expected
    assert watch.checks > 0 and llm.engine.telemetry.prefix_cache.hits > 0
