"""Prompt-lookup (n-gram) drafter: find the longest recent suffix of the sequence that occurred
earlier in it, and propose the tokens that followed that earlier occurrence.

Host-side and model-free. The search covers at most the last `window` tokens, so a step costs
O(window * n) per sequence however long the sequence grows. Code and chat that quote their
context (identifiers, repeated lines, edits of a given text) are where it shines.
"""

from __future__ import annotations

import numpy as np

from metrale.engine.sequence import Sequence
from metrale.speculative.drafter import Draft, Verdict


def lookup(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix of
    `tokens` of length n_max..n_min; [] when no suffix recurs."""
    length = len(tokens)
    if k <= 0 or length < 2:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # [length - n, n] every n-gram that starts early enough to be followed by a token.
        grams = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((grams == arr[length - n :]).all(axis=1))
        if hits.size:
            # The most recent occurrence best predicts what comes next, but in a repeating tail
            # it is followed by a single token; prefer the latest one followed by k tokens.
            full = hits[hits + n + k <= length]
            start = int(full[-1] if full.size else hits[-1]) + n
            return tokens[start : start + k]
    return []


class NgramDrafter:
    name = "ngram"
    needs_hidden = False

    def __init__(self, n_min: int = 1, n_max: int = 4, window: int = 4096) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"ngram: need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max, self.window = n_min, n_max, window

    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, max_drafts, strict=True):
            start = max(0, seq.num_tokens - self.window)
            drafts.append(
                Draft(lookup(seq.tokens(start, seq.num_tokens), self.n_min, self.n_max, k))
            )
        return drafts

    def observe(self, verdicts: list[Verdict]) -> None:
        pass  # stateless: the sequence's own tokens are the whole model

    def release(self, seq: Sequence) -> None:
        pass
