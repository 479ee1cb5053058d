"""The hybrid engine with every fused path of the hybrid target forced on under Triton's
interpreter (`METRALE_FORCE_FUSED_KERNELS=1`: MoE routing and grouped experts, the GDN glue and
kernels, the attention glue, each MoE block folding the next norm): plain and speculative greedy
output equal the torch path's, in both verify-state variants, with the gates made in the
delta-rule kernel or not. Slow under the interpreter, so small; on CUDA the gpu tests run the
same paths natively.

The whole of `tests/test_hybrid_engine.py` runs this way too (slowly):
`METRALE_FORCE_FUSED_KERNELS=1 python -m pytest tests/test_hybrid_engine.py`.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from metrale.knobs import knobs
from metrale.models import qwen3_next_gdn, qwen3_next_moe
from metrale.speculative.replay import ReplayDrafter
from tests.test_hybrid_engine import PROMPTS, greedy, hybrid_dir, llm_for  # noqa: F401

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"
)


@pytest.fixture
def forced(monkeypatch):
    """force(gates) -> a Counter of the fused paths' entry points, as they run."""
    calls: Counter = Counter()

    def spy(module, name):
        real = getattr(module, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    def force(gates: bool) -> Counter:
        monkeypatch.setenv("METRALE_FORCE_FUSED_KERNELS", "1")
        if not gates:  # the torch delta rule: the layer hands it g and beta from `prepare`
            monkeypatch.setenv("METRALE_NO_GDN_TRITON", "1")
        knobs.cache_clear()
        spy(qwen3_next_moe, "route")
        spy(qwen3_next_gdn, "GateInputs")
        return calls

    yield force
    monkeypatch.undo()
    knobs.cache_clear()


@pytest.mark.parametrize(
    "variant, gates", [("write_on_accept", False), ("per_row_slots", True)], ids=str
)
def test_fused_paths_give_the_torch_output(hybrid_dir, forced, variant, gates):  # noqa: F811
    prompts = [PROMPTS[1], PROMPTS[3] * 2]  # 11 and 42 rows: the recurrent and chunked prefill
    plain = llm_for(hybrid_dir).generate(prompts, greedy(10))
    want = [o.outputs[0].token_ids for o in plain]
    truth = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    calls = forced(gates)
    fused = llm_for(hybrid_dir).generate(prompts, greedy(10))
    assert [o.outputs[0].token_ids for o in fused] == want
    assert calls["route"] > 0 and (calls["GateInputs"] > 0) == gates
    spec_llm = llm_for(
        hybrid_dir,
        drafter=ReplayDrafter(truth, 0.6, vocab_size=320, seed=5),
        spec={"num_drafts": 3},
        hybrid_verify_state=variant,
    )
    spec = spec_llm.generate(prompts, greedy(10))
    assert [o.outputs[0].token_ids for o in spec] == want
    tel = spec_llm.engine.telemetry.spec
    assert 0 < tel.num_accepted_tokens < tel.num_draft_tokens
