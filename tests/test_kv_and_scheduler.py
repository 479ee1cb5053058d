"""The page pool and the scheduler on their own: no page is ever lost or shared, budgets and
limits hold every step, and a random workload of arrivals, aborts and finishes always returns the
pool to empty."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.config import SamplingParams
from metrale.engine.kv_cache import DUMMY_PAGE, PageAllocator
from metrale.engine.scheduler import Scheduler
from metrale.engine.sequence import Sequence
from metrale.models.attention import AttentionMetadata, TorchPagedAttention


def make_seq(i: int, prompt_len: int) -> Sequence:
    return Sequence(i, f"r{i}", list(range(prompt_len)), SamplingParams(), 0, (), arrival=i)


def test_allocator_reserve_trim_free_and_lookahead():
    alloc = PageAllocator(num_pages=9, page_size=4)
    seq = make_seq(0, 10)
    alloc.reserve(seq, 10 + 3)  # 10 rows plus 3 lookahead rows -> 4 pages
    assert len(seq.block_table) == 4 and DUMMY_PAGE not in seq.block_table
    assert alloc.num_free == 4
    alloc.trim(seq, 11)  # a rollback: 11 rows need 3 pages
    assert len(seq.block_table) == 3 and alloc.num_free == 5
    other = make_seq(1, 1)
    assert not alloc.can_fit(other, 4 * 6)
    alloc.free(seq)
    assert alloc.num_free == alloc.num_usable == 8


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.integers(0, 3), st.booleans()), min_size=1, max_size=12
    ),
    st.integers(6, 30),
    st.integers(1, 5),
    st.integers(4, 48),
)
def test_scheduler_invariants_under_random_workloads(reqs, num_pages, max_seqs, budget):
    alloc = PageAllocator(num_pages=num_pages, page_size=4)
    sched = Scheduler(alloc, max_num_seqs=max_seqs, max_num_batched_tokens=budget, lookahead=2)
    seqs = [make_seq(i, plen) for i, (plen, _, _) in enumerate(reqs)]
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_unfinished() and steps < 2000:
        steps += 1
        batch = sched.schedule()
        rows = [e.num_rows for e in batch.entries]
        assert sum(rows) <= budget and all(r >= 1 for r in rows)
        assert len(sched.running) <= max_seqs
        tables = [p for s in sched.running for p in s.block_table]
        assert len(tables) == len(set(tables)) and DUMMY_PAGE not in tables  # no page shared
        assert len(tables) + alloc.num_free == alloc.num_usable  # no page lost
        for e in batch.entries:
            end = e.seq.num_computed_tokens + e.num_rows
            assert len(e.seq.block_table) * 4 >= end  # every written row has a page
        finished = list(batch.failed)
        for e in batch.entries:
            e.seq.num_computed_tokens += e.num_rows
            if e.samples:
                i = e.seq.seq_id
                e.seq.output_token_ids.append(1)
                if len(e.seq.output_token_ids) > reqs[i][1] or (reqs[i][2] and steps % 3 == 0):
                    finished.append(e.seq)
        sched.finish(finished)
    assert not sched.has_unfinished()
    assert alloc.num_free == alloc.num_usable


def test_fcfs_admission_and_budget():
    alloc = PageAllocator(num_pages=100, page_size=4)
    sched = Scheduler(alloc, max_num_seqs=2, max_num_batched_tokens=10)
    a, b, c = make_seq(0, 6), make_seq(1, 8), make_seq(2, 3)
    for s in (c, a, b):  # added out of order; arrival decides
        sched.add(s)
    batch = sched.schedule()
    assert [(e.seq.seq_id, e.num_rows) for e in batch.entries] == [(0, 6), (1, 4)]
    assert sched.waiting == [c]  # max_num_seqs reached


def test_a_sequence_the_pool_can_never_hold_fails_as_its_own_error():
    """Past admission's checks (a scheduler used on its own): a prompt larger than the whole pool
    fails alone, marked as the request's fault (the server's 400), and frees what it held."""
    alloc = PageAllocator(num_pages=5, page_size=4)
    sched = Scheduler(alloc, max_num_seqs=2, max_num_batched_tokens=64)
    big, small = make_seq(0, 40), make_seq(1, 3)
    for s in (big, small):
        sched.add(s)
    batch = sched.schedule()
    assert batch.failed == [big] and [e.seq for e in batch.entries] == [small]
    assert big.error.startswith("sequence needs ") and big.error_by_request
    assert not small.error_by_request and small.error is None


def test_paged_attention_matches_dense_causal_attention():
    torch.manual_seed(0)
    heads, kv_heads, dim, page = 4, 2, 8, 4
    backend = TorchPagedAttention()
    cache = torch.zeros(2, 16, page, kv_heads, dim)
    # two sequences: 5 new rows after 3 cached ones (pages 3, 7), and 1 new row after 6 (5, 2)
    tables = torch.tensor([[3, 7], [5, 2]])
    lens, new = [8, 7], [5, 1]
    full_k = [torch.randn(n, kv_heads, dim) for n in lens]
    full_v = [torch.randn(n, kv_heads, dim) for n in lens]
    q = [torch.randn(n, heads, dim) for n in new]
    for b in range(2):  # pre-fill the cached rows
        cached = lens[b] - new[b]
        slots = torch.tensor([tables[b, p // page] * page + p % page for p in range(cached)])
        flat = cache.view(2, -1, kv_heads, dim)
        flat[0][slots], flat[1][slots] = full_k[b][:cached], full_v[b][:cached]
    positions = [p for b in range(2) for p in range(lens[b] - new[b], lens[b])]
    slots = [
        tables[b, p // page] * page + p % page
        for b in range(2)
        for p in range(lens[b] - new[b], lens[b])
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        positions=torch.tensor(positions),
        query_start_loc=torch.tensor([0, 5, 6]),
        seq_lens=torch.tensor(lens),
        block_tables=tables,
        max_query_len=5,
        max_seq_len=8,
        page_size=page,
    )
    backend.prepare(meta)
    out = backend.forward(
        torch.cat(q),
        torch.cat([full_k[b][lens[b] - new[b] :] for b in range(2)]),
        torch.cat([full_v[b][lens[b] - new[b] :] for b in range(2)]),
        cache,
        meta,
        dim**-0.5,
    )
    expected = []
    for b in range(2):
        k = full_k[b].repeat_interleave(heads // kv_heads, dim=1)
        v = full_v[b].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[b], k) * dim**-0.5
        qpos = torch.arange(lens[b] - new[b], lens[b])[:, None]
        scores = scores.masked_fill(torch.arange(lens[b])[None, :] > qpos, float("-inf"))
        expected.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)
    assert cache[:, 0].abs().sum() == 0  # nothing was written to the dummy page


def test_a_batch_phase_follows_the_entries_the_scheduler_appends():
    """`Batch.phase` is kept once worked out (it is read several times a step), yet follows the
    entry list as the scheduler builds it, and a new list."""
    from metrale.engine.sequence import Batch, Phase, ScheduledSeq

    decoding, prompt = make_seq(0, 4), make_seq(1, 6)
    decoding.num_computed_tokens = 3
    batch = Batch(entries=[ScheduledSeq(decoding, 1)])
    assert batch.phase is Phase.DECODE
    batch.entries.append(ScheduledSeq(prompt, 6))
    assert batch.phase is Phase.MIXED
    batch.entries = [ScheduledSeq(prompt, 3)]
    assert batch.phase is Phase.PREFILL
    batch.entries = [ScheduledSeq(decoding, 3, [7, 8])]
    assert batch.phase is Phase.VERIFY
