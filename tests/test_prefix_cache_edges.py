"""Edge cases of automatic prefix caching (review): aborts while sharing pages, n > 1, prompt
lengths at page and model-length edges, failures while holding shared pages (dense) and the
hybrid state rebuild's scratch pages, verifies cut short by a stop, drafter (MTP, DFlash) KV in
cached pages, hybrid snapshot pins with a one-entry pool."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.engine import prefix_cache as pc
from metrale.speculative.replay import ReplayDrafter
from tests.prefix_cache_helpers import Watch, greedy, shared_prompts, token_ids
from tests.test_hybrid_engine import hybrid_dir  # noqa: F401 (fixture)

PAGE = 4


def dense(path, **kw) -> LLM:
    return LLM(path, device="cpu", page_size=PAGE, **kw)


def assert_pool_whole(llm: LLM) -> None:
    alloc = llm.engine.allocator
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting
    assert alloc.num_free == alloc.num_usable
    assert all(alloc.refs(p) == 0 for p in range(1, alloc.num_pages))
    cache = alloc.cache
    if cache is not None:
        assert cache.num_idle == cache.num_cached  # every cached page idle, none held
        if cache.snapshots is not None:
            assert not any(cache.snapshots._pins)


def drive(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Add `requests` at once, step until done; the token ids of every output (all sequences of
    each request) by request id (aborted requests: their last output, if any)."""
    engine = llm.engine
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            final[out.request_id] = [o.token_ids for o in out.outputs]
    return final


# ---- aborts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["mid-prefill", "mid-decode"])
def test_abort_while_sharing_pages(tiny_model_dir, phase):
    """Requests sharing a cached prefix; two aborted while they map cached pages, mid-prefill
    or mid-decode: the others' outputs equal the uncached ones, and every page returns."""
    prompts = shared_prompts(4 * PAGE + 1, 5, seed=11)
    prompts = [p + list(range(50, 50 + 3 * PAGE)) for p in prompts]  # long enough to chunk
    reqs = {f"r{i}": (p, greedy(6)) for i, p in enumerate(prompts)}
    kw = dict(max_num_batched_tokens=12, max_num_seqs=4)
    want = drive(dense(tiny_model_dir, prefix_caching=False, **kw), reqs)
    llm = dense(tiny_model_dir, **kw)
    Watch(llm)
    llm.generate([prompts[0]], greedy(2), use_tqdm=False)  # caches the prefix
    engine, aborted = llm.engine, []
    real_step = engine.step

    def step():
        for seq in list(engine.scheduler.running):
            maps_cached = any(engine.allocator.cache.holds(p) for p in seq.block_table)
            in_phase = seq.is_prefilling == (phase == "mid-prefill")
            if len(aborted) < 2 and seq.request_id != "r0" and maps_cached and in_phase:
                aborted.append(seq.request_id)
                engine.abort_request(seq.request_id)
        return real_step()

    engine.step = step
    got = drive(llm, reqs)
    assert len(aborted) == 2
    for rid in set(reqs) - set(aborted):
        assert got[rid] == want[rid]
    assert llm.engine.telemetry.prefix_cache.hits > 0
    assert_pool_whole(llm)


# ---- n > 1 ----------------------------------------------------------------------------------


def test_parallel_sampling_shares_one_prompt(tiny_model_dir):
    """n = 3 seeded samples of prompts sharing a cached prefix: with caching the same tokens as
    without, and every page returns."""
    prompts = shared_prompts(3 * PAGE, 3, seed=5)
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=6, ignore_eos=True)
    off = dense(tiny_model_dir, prefix_caching=False, max_num_batched_tokens=16)
    on = dense(tiny_model_dir, max_num_batched_tokens=16)
    Watch(on)
    on.generate(prompts[:1], greedy(1), use_tqdm=False)
    want = [[c.token_ids for c in o.outputs] for o in off.generate(prompts, params)]
    got = [[c.token_ids for c in o.outputs] for o in on.generate(prompts, params)]
    assert got == want
    assert on.engine.telemetry.prefix_cache.hits > 0
    assert_pool_whole(on)


# ---- prompt lengths -------------------------------------------------------------------------


def test_prompt_lengths_at_the_edges(tiny_model_dir):
    """One token, exactly k pages, k pages + 1, and max_model_len - 1 tokens (a full last
    page), each run three times (the later runs hit): the output equals the uncached one and
    the hits count only full pages short of the last token."""
    max_len = 6 * PAGE
    base = list(range(30, 30 + max_len))
    prompts = [base[:1], base[: 2 * PAGE], base[: 2 * PAGE + 1], base[: max_len - 1]]
    kw = dict(max_model_len=max_len, max_num_batched_tokens=8)
    off = dense(tiny_model_dir, prefix_caching=False, **kw)
    on = dense(tiny_model_dir, **kw)
    Watch(on)
    stats = on.engine.telemetry.prefix_cache
    for p in prompts:
        n = min(5, max_len - len(p))
        want = token_ids(off.generate([p], greedy(n), use_tqdm=False))
        for _ in range(3):
            before = stats.hits
            assert token_ids(on.generate([p], greedy(n), use_tqdm=False)) == want
            assert stats.hits - before <= (len(p) - 1) // PAGE * PAGE
    assert stats.hits > 0
    assert_pool_whole(on)


# ---- a verify cut short by a stop -------------------------------------------------------------


def test_rows_of_dropped_drafts_are_never_cached(tiny_model_dir, monkeypatch):
    """A verify whose accepted drafts run past a stop token: the emitter drops the tokens after
    the stop, while the rows were computed; no page holding those rows is offered to the cache
    (every page named is a full page of the sequence's own tokens)."""
    prompt = [123, 158, 55, 372, 205, 248, 82, 49, 37]  # tiny: 37 x 11, then 171 (greedy)
    ref = token_ids(dense(tiny_model_dir, prefix_caching=False).generate([prompt], greedy(20)))[0]
    assert 171 in ref
    named = []
    real_hash = pc.page_hash
    monkeypatch.setattr(
        pc,
        "page_hash",
        lambda parent, tokens, extra=b"": (
            named.append(len(tokens)) or real_hash(parent, tokens, extra)
        ),
    )
    drafter = ReplayDrafter({tuple(prompt): ref}, 1.0, vocab_size=512)
    llm = dense(tiny_model_dir, drafter=drafter, spec={"num_drafts": 4})
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[171])
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: ref.index(171) + 1]
    assert set(named) == {PAGE}, named


# ---- drafter KV in cached pages -----------------------------------------------------------------


def mtp_rows_at_finish(llm: LLM) -> dict[str, torch.Tensor]:
    """Record, as each sequence ends, its MTP layer's K rows for its committed positions."""
    rows: dict[str, torch.Tensor] = {}
    layer = llm.engine.runner.mtp.attention_layers[0]
    finish = llm.engine._finish

    def record(seqs):
        for s in seqs:
            slots = [
                s.block_table[p // PAGE] * PAGE + p % PAGE
                for p in range(min(s.num_computed_tokens, s.num_tokens - 1))
            ]
            k = layer.kv_cache[0].reshape(-1, *layer.kv_cache.shape[-2:])
            rows[s.request_id] = k[torch.tensor(slots)].clone()
        return finish(seqs)

    llm.engine._finish = record
    return rows


def mtp_llm(path, caching: bool) -> LLM:
    return dense(path, prefix_caching=caching, spec={"method": "mtp", "num_drafts": 3})


def mtp_run(llm: LLM, requests: list[tuple[str, list[int], SamplingParams]]):
    for rid, prompt, params in requests:
        llm.engine.add_request(rid, prompt, params)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()


@pytest.mark.parametrize(
    "case", ["next-token-differs", "first-did-not-speculate", "first-finished-there"]
)
def test_mtp_rows_of_a_hit_are_what_the_sequence_would_write(tiny_mtp_dir, case):
    """The MTP layer's KV rows that a hit maps are the rows this sequence would have written
    without caching (so its drafts are the uncached ones; at the positions of accepted drafts a
    page holds its writer's chain rows, see `DraftKV`, which this tiny head never has): a page
    serves a drafting sequence only where its writer wrote them. Three pages that cannot: (1) the
    MTP row at position p is computed from the token at p + 1, so the last row of a page encodes
    its writer's next token, which the page's name does not cover: a sequence with another next
    token recomputes that page; (2) a sequence with `speculative=False` never runs the MTP
    catch-up: its pages serve no drafting sequence, until one recomputes them and its copies
    take their names; (3) a sequence's last step is never caught up (the drafter never sees a
    finished sequence), so the page that step filled is recomputed by the next turn."""
    prefix = shared_prompts(2 * PAGE, 1, seed=3)[0]  # two full pages
    first_params = greedy(6)
    if case == "next-token-differs":
        first, second = prefix + [11, 12, 13], prefix + [21, 22, 23]
    elif case == "first-did-not-speculate":
        first, second = prefix + [11, 12, 13], prefix + [11, 12, 13]
        first_params = SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True, speculative=False
        )
    else:  # the first ends having filled its last page in its last step; the second extends it
        first = prefix + [11, 12, 13]
        second = None  # its prompt + output, set below
    # warm the pool with unrelated content, so stale rows are another request's, not zeros
    other = ("other", [400 + i for i in range(6 * PAGE)], greedy(4))
    ref = mtp_llm(tiny_mtp_dir, False)
    out = drive(ref, {"a": (first, first_params)})["a"][0]
    if second is None:
        assert (len(first) + len(out) - 1) % PAGE == 0, "the last step must fill a page"
        second = first + out + [31, 32]
    want = mtp_rows_at_finish(ref)
    mtp_run(ref, [("b", second, greedy(4))])
    llm = mtp_llm(tiny_mtp_dir, True)
    got = mtp_rows_at_finish(llm)
    mtp_run(llm, [other, ("a", first, first_params)])
    stats = llm.engine.telemetry.prefix_cache

    def hit_rows(rid: str) -> int:
        before = stats.hits
        mtp_run(llm, [(rid, second, greedy(4))])
        n = stats.hits - before  # the rows the hit mapped
        diff = (got[rid][:n] - want["b"][:n]).abs().flatten(1).amax(1)  # per position
        assert bool((diff < 1e-4).all()), (
            f"MTP K rows differ at positions {(diff >= 1e-4).nonzero().flatten().tolist()}"
        )
        return n

    n = hit_rows("b")
    if case == "next-token-differs":
        assert n == PAGE  # the second page's last row encodes 11, not 21
    elif case == "first-did-not-speculate":
        assert n == 0
        assert hit_rows("c") == 2 * PAGE  # b's copies took the pages' names
    else:
        assert n == (len(first) + len(out) - 1) - PAGE  # all but the page its last step filled
    # pages whose names went to drafting copies were given back, none lost
    assert_pool_whole(llm)


def test_dflash_context_rows_of_every_hit_are_present():
    """DFlash's context rows are written by the target's forward (every row of every sequence),
    so every cached page holds them, and a drafting sequence takes the whole hit: (1) pages of a
    sequence with `speculative=False` and (2) the page a sequence's last step filled, which a
    drafter that wrote its rows in `observe` never had. The hit's rows are the ones the
    sequence would write."""
    from metrale.default_model import default_model_dir

    model = default_model_dir()
    spec = {"method": "dflash", "num_drafts": 4, "dcut": False}
    no_spec = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, speculative=False)
    p1 = shared_prompts(2 * PAGE, 1, seed=8, vocab=4000)[0] + [101, 102, 103]
    p2 = shared_prompts(2 * PAGE, 1, seed=9, vocab=4000)[0] + [201, 202, 203]
    other = ("other", [1000 + i for i in range(8 * PAGE)], greedy(4))

    def context_rows(llm, rows):
        kv = llm.engine.runner.dflash_kv  # [layers, 2, pages, page, H, D]
        finish = llm.engine._finish

        def record(seqs):
            for s in seqs:
                slots = [
                    s.block_table[p // PAGE] * PAGE + p % PAGE
                    for p in range(min(s.num_computed_tokens, s.num_tokens - 1))
                ]
                flat = kv[0, 0].reshape(-1, *kv.shape[-2:])
                rows[s.request_id] = flat[torch.tensor(slots)].clone()
            return finish(seqs)

        llm.engine._finish = record

    ref = dense(model, prefix_caching=False, spec=spec, dtype="float32")
    want: dict = {}
    context_rows(ref, want)
    out = drive(ref, {"a1": (p1, no_spec), "a2": (p2, greedy(6))})
    assert (len(p2) + len(out["a2"][0]) - 1) % PAGE == 0  # a2's last step fills a page
    second = {"b1": p1 + [104], "b2": p2 + out["a2"][0] + [105], "c1": p1 + [104]}
    mtp_run(ref, [(rid, p, greedy(4)) for rid, p in second.items() if rid != "c1"])
    want["c1"] = want["b1"]
    llm = dense(model, spec=spec, dtype="float32")
    got: dict = {}
    context_rows(llm, got)
    mtp_run(llm, [other, ("a1", p1, no_spec), ("a2", p2, greedy(6))])
    bad, hits = {}, {}
    for rid, p in second.items():
        before = llm.engine.telemetry.prefix_cache.hits
        mtp_run(llm, [(rid, p, greedy(4))])
        n = hits[rid] = llm.engine.telemetry.prefix_cache.hits - before
        diff = (got[rid][:n] - want[rid][:n]).abs().flatten(1).amax(1)
        bad[rid] = (diff >= 1e-3).nonzero().flatten().tolist()
    assert bad == {"b1": [], "b2": [], "c1": []}, f"hit rows whose DFlash context K differs: {bad}"
    # b1: a1's pages (it did not draft); b2: a2's, with the page its last step filled
    assert hits == {"b1": 2 * PAGE, "b2": len(p2) + len(out["a2"][0]) - 1, "c1": 2 * PAGE}


# ---- failures -------------------------------------------------------------------------------


def fail_when(llm: LLM, monkeypatch, request_id: str, after: int = 0) -> list[bool]:
    """Make every forward that holds `request_id` raise once `after` such forwards ran; returns
    a list that records, at each failure, whether the failing sequence mapped a cached page
    that another block table held too."""
    engine, runner = llm.engine, llm.engine.runner
    real = runner.execute
    seen, shared = [0], []

    def execute(batch, **kw):
        mine = [e.seq for e in batch.entries if e.seq.request_id == request_id]
        if mine:
            seen[0] += 1
            if seen[0] > after:
                alloc = engine.allocator
                shared.append(
                    alloc.cache is not None
                    and any(alloc.cache.holds(p) and alloc.refs(p) > 1 for p in mine[0].block_table)
                )
                raise RuntimeError(f"injected failure in {request_id}")
        return real(batch, **kw)

    monkeypatch.setattr(runner, "execute", execute)
    return shared


def test_dense_failure_while_holding_shared_pages(tiny_model_dir, monkeypatch):
    """A sequence that fails mid-decode while it maps cached pages other running sequences also
    map: only it ends; the others' outputs equal the uncached ones; the pool comes back."""
    prompts = shared_prompts(4 * PAGE + 2, 4, seed=21)
    reqs = {f"r{i}": (p, greedy(10)) for i, p in enumerate(prompts)}
    want = drive(dense(tiny_model_dir, prefix_caching=False), reqs)
    llm = dense(tiny_model_dir)
    Watch(llm)
    llm.generate([prompts[0]], greedy(1), use_tqdm=False)
    shared = fail_when(llm, monkeypatch, "r2", after=3)
    got = drive(llm, reqs)
    assert shared and shared[0]  # it failed while mapping pages others held too
    assert llm.engine.telemetry.prefix_cache.hits > 0
    assert got["r2"][0] != want["r2"][0]  # it ended early, with an error
    for rid in ("r0", "r1", "r3"):
        assert got[rid] == want[rid]
    assert_pool_whole(llm)


def hybrid_llm(path, **kw) -> LLM:
    return LLM(path, device="cpu", dtype="float32", page_size=PAGE, **kw)


def test_hybrid_failure_rebuild_needs_no_free_pages(hybrid_dir, monkeypatch):  # noqa: F811
    """On a hybrid target a failed batch rebuilds each other sequence's state; with caching
    the rebuild writes its rows into scratch pages (`take_scratch`), pages_for(done) - keep of
    them, taken from the free pool. With a full pool the innocent sequence is preempted and
    recomputed later (it ended with a MemoryError before), as without caching it goes on."""
    prompts = shared_prompts(3 * PAGE + 1, 3, seed=2)
    kw = dict(max_model_len=48, num_kv_pages=21, max_num_seqs=3)  # 1 page free at the failure
    outs = {}
    for caching in (False, True):
        llm = hybrid_llm(hybrid_dir, prefix_caching=caching, **kw)
        fail_when(llm, monkeypatch, "r1", after=6)
        outs[caching] = drive(llm, {f"r{i}": (p, greedy(12)) for i, p in enumerate(prompts)})
        assert_pool_whole(llm)
        monkeypatch.undo()
    assert len(outs[False]["r0"][0]) == 12  # without caching the innocent r0 goes on
    assert outs[True]["r0"] == outs[False]["r0"], "r0 ended: MemoryError in take_scratch"
    assert outs[True]["r2"] == outs[False]["r2"]


# ---- hybrid targets -------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["write_on_accept", "per_row_slots"])
def test_hybrid_abort_n_and_a_one_entry_snapshot_pool(hybrid_dir, variant):  # noqa: F811
    """Hybrid: n = 2 seeded samples and greedy requests over a shared prefix with n-gram drafts,
    a one-entry snapshot pool (pinned by one sequence, so saves are skipped), and aborts
    mid-prefill and mid-decode: the rest equal the uncached output and every pin and page
    returns."""
    prompts = shared_prompts(3 * PAGE + 2, 5, seed=13)
    sampled = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)
    reqs = {f"r{i}": (p, sampled if i % 2 else greedy(8)) for i, p in enumerate(prompts)}
    kw = dict(
        hybrid_verify_state=variant,
        spec={"method": "ngram", "num_drafts": 3},
        max_num_batched_tokens=10,
        max_num_seqs=4,
    )
    want = drive(hybrid_llm(hybrid_dir, prefix_caching=False, **kw), reqs)
    llm = hybrid_llm(hybrid_dir, prefix_cache_snapshots=1, **kw)
    Watch(llm)
    llm.generate(prompts[:1], greedy(2), use_tqdm=False)
    engine, aborted = llm.engine, {}
    real_step = engine.step

    def step():  # abort one pinned sequence mid-prefill and one mid-decode
        for seq in list(engine.scheduler.running):
            phase = "prefill" if seq.is_prefilling else "decode"
            if seq.request_id != "r0" and seq.state_pin >= 0 and phase not in aborted:
                aborted[phase] = seq.request_id
                engine.abort_request(seq.request_id)
        return real_step()

    engine.step = step
    got = drive(llm, reqs)
    assert set(aborted) == {"prefill", "decode"}, aborted
    for rid in set(reqs) - set(aborted.values()):
        assert got[rid] == want[rid], rid
    assert llm.engine.telemetry.prefix_cache.snapshots_restored > 0
    assert_pool_whole(llm)
