"""The cases a drafting-ahead test runs (the n-gram and DFlash drafters draft ahead the same
way): sampling parameters and engine options per case."""

from __future__ import annotations

from metrale import SamplingParams


def ahead_case(case: str, n: int, *, max_tokens: int, kv_pages: int):
    """(params, engine options) of `n` requests for `case`: "greedy" (lengths `max_tokens` +
    3i), "seeded" (top-p sampling, a seed each), "preemption" (`kv_pages` KV pages), "async"
    (async scheduling), "mixed" (every third request not speculative), "dcut" (D-Cut on)."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens + 3 * i, ignore_eos=True)
        for i in range(n)
    ]
    kw: dict = {}
    if case == "seeded":
        params = [
            SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20, ignore_eos=True, seed=i)
            for i in range(n)
        ]
    elif case == "preemption":
        kw["num_kv_pages"] = kv_pages
    elif case == "async":
        kw["async_scheduling"] = True
    elif case == "dcut":
        kw["spec"] = {"dcut": True}
    elif case == "mixed":
        for i in range(0, n, 3):
            params[i] = SamplingParams(
                temperature=0.0, max_tokens=max_tokens + 3 * i, ignore_eos=True, speculative=False
            )
    return params, kw
