"""Speculation's lookahead rows never cost a sequence its run: with a KV pool just big enough for
plain decoding, every drafter (n-gram, MTP, DFlash) on dense and hybrid targets gives the plain
output and finish reason, where the lookahead (K rows past each step) made the scheduler fail a
sequence near its end, or admission refuse its prompt (found in review). The lookahead is cut to
the rows the sequence can ever write, the pool and the model length (`Scheduler._reach`)."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams
from tests.test_hybrid_engine import hybrid_dir, hybrid_mtp_dir  # noqa: F401 (fixtures)
from tests.test_spec_dflash import write_dflash

PAGE = 4
POOL = dict(page_size=PAGE, num_kv_pages=5)  # 4 usable pages: 16 rows

# (prompt, max_tokens): the rows plain decoding needs, and what the pool makes of it
REQUESTS = [
    (([5, 9, 13] * 8)[:10], 6),  # 15 rows: the lookahead reached 17, its last steps failed
    (([7, 11] * 8)[:14], 2),  # 15 rows: admission asked for 14 + 1 + K and refused it
    # the pool ends it (finish "length" at `context_len`) at the token plain reaches
    (([3, 4, 5, 6] * 4)[:8], None),
]


def outputs(model_dir, **engine) -> list[tuple[list[int], str]]:
    llm = LLM(model_dir, device="cpu", dtype="float32", **POOL, **engine)
    spec = llm.engine.telemetry.spec
    outs = []
    for prompt, max_tokens in REQUESTS:  # one at a time: the pool fits one
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        outs.append((out.token_ids, out.finish_reason))
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable
    if "spec" in engine:
        assert spec.num_draft_tokens > 0  # it did speculate
    return outs


@pytest.mark.parametrize("method", ["ngram", "mtp", "dflash"])
def test_dense_pool_for_plain_decoding_fits_speculation(tiny_mtp_dir, method, tmp_path):
    want = outputs(tiny_mtp_dir)
    assert [reason for _, reason in want] == ["length", "length", "length"]
    spec = {"method": method, "num_drafts": 3, "dcut": False}
    if method == "dflash":
        spec["model"] = str(write_dflash(tiny_mtp_dir, tmp_path / "d"))
    assert outputs(tiny_mtp_dir, spec=spec) == want


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_hybrid_pool_for_plain_decoding_fits_speculation(hybrid_mtp_dir, method):  # noqa: F811
    want = outputs(hybrid_mtp_dir)
    assert [reason for _, reason in want] == ["length", "length", "length"]
    assert outputs(hybrid_mtp_dir, spec={"method": method, "num_drafts": 3, "dcut": False}) == want
