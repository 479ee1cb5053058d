"""The n-gram drafter's incremental index proposes exactly what the reference scan (`lookup`)
proposes over the last `window` tokens, however the tokens arrive."""

from __future__ import annotations

import random

import pytest

from metrale.speculative.ngram import NgramIndex, lookup


@pytest.mark.parametrize("seed", range(6))
def test_index_equals_the_scan(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 20])
    n_min = rng.randint(1, 2)
    n_max = rng.randint(n_min, 5)
    window = rng.choice([3, 8, 40, 4096])
    index = NgramIndex(n_min, n_max, window)
    tokens: list[int] = []
    while len(tokens) < 300:
        new = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        tokens += new
        index.extend(new)
        for k in (1, 3, 6):
            start = max(0, len(tokens) - window)
            assert index.lookup(k) == lookup(tokens[start:], n_min, n_max, k), (len(tokens), k)


def test_index_on_code_like_text():
    text = [ord(c) for c in "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 2\n" * 3]
    index = NgramIndex(1, 4, 4096)
    for i in range(0, len(text), 7):
        index.extend(text[i : i + 7])
        assert index.lookup(4) == lookup(text[: i + 7], 1, 4, 4)


def test_index_stays_within_the_window():
    """A long sequence: the index keeps at most about two windows of tokens and n-grams, and
    still proposes what the scan over the last window proposes."""
    rng = random.Random(7)
    window, index, tokens = 16, NgramIndex(1, 3, 16), []
    for _ in range(400):
        new = [rng.randrange(4) for _ in range(rng.randint(1, 6))]
        tokens += new
        index.extend(new)
        assert index.length == len(tokens)
        assert len(index.tokens) <= 2 * window + 3 + 6
        assert sum(len(chain) for chain in index.prev) <= 3 * len(index.tokens)
        assert all(len(latest) <= len(index.tokens) for latest in index.latest)
        for k in (1, 4):
            assert index.lookup(k) == lookup(tokens[-window:], 1, 3, k)
