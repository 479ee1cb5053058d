"""The program cache of verify graphs on its own, with a fake build step: LRU bound and
eviction, hits and misses, workspace sized over sizing_tables(max_rows), refusals that name both
numbers."""

from __future__ import annotations

import pytest

from metrale.engine.graphs import CACHE_CAP, ProgramCache, Workspace, kv_bucket
from metrale.speculative.row_table import RowTable, Run, sizing_tables


def table(text: str) -> RowTable:
    return RowTable.parse(text)


def test_build_once_then_hit():
    built = []
    cache = ProgramCache(lambda t, extra: built.append((str(t), extra)) or len(built), 32)
    assert cache.get(table("4x2 1x1!")) == 1
    assert cache.get(table("4x2 1x1!")) == 1
    assert cache.get(table("4x2 1x1!"), extra=256) == 2  # another KV bucket: another program
    assert built == [("4x2 1x1!", None), ("4x2 1x1!", 256)]
    assert cache.stats() == {"hits": 1, "misses": 2, "evictions": 0, "cached": 2}


def test_lru_eviction_at_the_cap():
    cache = ProgramCache(lambda t, extra: str(t), 64, cap=3)
    for text in ("2x1!", "3x1!", "4x1!"):
        cache.get(table(text))
    cache.get(table("2x1!"))  # refresh: 3x1! is now the least recently used
    cache.get(table("5x1!"))
    assert cache.cached() == 3 and cache.evictions == 1
    misses = cache.misses
    cache.get(table("2x1!"))
    assert cache.misses == misses  # kept
    cache.get(table("3x1!"))
    assert cache.misses == misses + 1  # was evicted, built again


def test_default_cap_is_256():
    cache = ProgramCache(lambda t, extra: None, 600)
    assert cache.cap == CACHE_CAP == 256
    for n in range(1, 300):
        cache.get(table(f"1x{n}" if n > 1 else "1x1!"))
    assert cache.cached() == 256 and cache.evictions == 299 - 256


@pytest.mark.parametrize("max_rows", [4, 5, 9, 16, 40])
def test_workspace_is_sized_over_the_sizing_tables(max_rows):
    cache = ProgramCache(lambda t, extra: None, max_rows)
    tables = sizing_tables(max_rows)
    assert cache.workspace == Workspace(
        max(t.rows() for t in tables), max(t.num_seqs for t in tables)
    )
    assert cache.workspace.rows == max_rows


def test_refusals_name_both_numbers():
    cache = ProgramCache(lambda t, extra: None, 16)
    with pytest.raises(ValueError, match=r"17 rows is past the 16"):
        cache.get(table("1x17"))
    # 16 rows fit, but 16 one-row sequences need more sequence slots than runs of 2 do
    with pytest.raises(ValueError, match=r"16 sequences of workspace; the build sized 16 and 8"):
        cache.get(table("1x16"))
    assert cache.cached() == 0 and cache.misses == 0


def test_kv_bucket():
    assert kv_bucket(1, 4096) == 128
    assert kv_bucket(129, 4096) == 256
    assert kv_bucket(3000, 4096) == 4096
    assert kv_bucket(3000, 3100) == 3100


def test_decode_bucket():
    from metrale.engine.program_shapes import decode_bucket

    assert [decode_bucket(n) for n in (1, 2, 3, 5, 8, 9, 17, 64, 65)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        24,
        64,
        72,
    ]


@pytest.mark.parametrize("max_seqs,q", [(1, 1), (5, 2), (16, 4), (64, 1), (64, 4), (64, 8)])
def test_padded_steps_are_never_refused(max_seqs, q):
    """Every mix of depths 1..q over up to max_seqs sequences, padded as the runner pads it
    (deepest first, each depth's group to `decode_bucket`), fits the cache sized for it."""
    import random

    from metrale.engine.program_shapes import decode_bucket, max_padded_rows

    cache = ProgramCache(lambda t, extra: None, max_padded_rows(max_seqs, q))
    rng = random.Random(max_seqs * 100 + q)
    mixes = [{q: max_seqs}, {1: max_seqs}] + [
        {d: rng.randrange(0, max_seqs + 1) for d in range(1, q + 1)} for _ in range(300)
    ]
    # the worst case: a few sequences at every depth, each group one past a bucket
    mixes.append({d: 9 for d in range(1, q + 1)})
    for mix in mixes:
        while sum(mix.values()) > max_seqs:  # trim to the batch size
            d = max(mix, key=mix.get)
            mix[d] -= 1
        runs = [(d, decode_bucket(n)) for d, n in sorted(mix.items(), reverse=True) if n]
        if not runs:
            continue
        cache.get(RowTable(tuple(Run(d, n, n > 1) for d, n in runs)))
