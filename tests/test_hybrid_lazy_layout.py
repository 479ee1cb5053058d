"""The lazy GDN RowLayout on the fused paths (forced under Triton's interpreter), in the
combination tests/test_hybrid_fused.py leaves out (write-on-accept with the Triton delta rule,
whose decode layout derives no index) and with staggered arrivals, so steps mix prompt chunks,
decode rows and verify rows (the hybrid runner splits those into two `execute` calls)."""

from __future__ import annotations

import os

import pytest

from metrale.knobs import knobs
from metrale.speculative.replay import ReplayDrafter
from tests.test_hybrid_engine import PROMPTS, greedy, hybrid_dir, llm_for  # noqa: F401

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"
)


def _staggered(llm, prompts, params):
    engine, finals = llm.engine, {}
    for step in range(400):
        if step < len(prompts):
            engine.add_request(f"r{step}", prompts[step], params)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
        if step >= len(prompts) and not engine.has_unfinished_requests():
            break
    return [finals[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("variant", ["write_on_accept", "per_row_slots"])
def test_fused_paths_with_staggered_arrivals_equal_torch(hybrid_dir, monkeypatch, variant):  # noqa: F811
    prompts = [PROMPTS[1], PROMPTS[3] * 2, PROMPTS[0], PROMPTS[2]]
    params = greedy(8)
    want = _staggered(llm_for(hybrid_dir), prompts, params)
    monkeypatch.setenv("METRALE_FORCE_FUSED_KERNELS", "1")
    knobs.cache_clear()
    try:
        got = _staggered(llm_for(hybrid_dir), prompts, params)
        assert got == want
        truth = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
        spec = llm_for(
            hybrid_dir,
            drafter=ReplayDrafter(truth, 0.6, vocab_size=320, seed=5),
            spec={"num_drafts": 3},
            hybrid_verify_state=variant,
        )
        assert _staggered(spec, prompts, params) == want
    finally:
        monkeypatch.undo()
        knobs.cache_clear()
