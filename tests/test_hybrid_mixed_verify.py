"""A hybrid target's step that verifies beside a prompt chunk runs as one forward
(`gdn_state.SplitState`: the prompt chunks' GDN mixing advances their state in place, the verify
rows' in the verify mode, everything else once over all rows), where it ran as two (reading the
weights twice). In float32, on the CPU and (GPU-marked) on CUDA without programs (the fused
Triton path): the tokens, logprobs and committed states equal those of the two forwards, and the
tokens those of plain decoding."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM
from metrale.engine import replay as replay_mod
from metrale.engine.runner import ModelRunner
from metrale.models.gdn_state import SplitState
from metrale.speculative.replay import ReplayDrafter
from tests.test_hybrid_engine import PROMPTS, greedy, hybrid_dir, llm_for  # noqa: F401

# prompts arrive while others verify: the third and later ones are admitted mid-run
ARRIVALS = [PROMPTS[0], PROMPTS[4], PROMPTS[2], PROMPTS[1] * 2, PROMPTS[3]]


def _forwards(monkeypatch) -> list[tuple[bool, bool, bool]]:
    """Record each eager forward: (it verifies drafts, it holds a prompt chunk, it ran on a
    SplitState)."""
    calls = []
    forward = ModelRunner._forward

    def spy(self, batch, *args, **kwargs):
        hidden, state = forward(self, batch, *args, **kwargs)
        drafts = any(e.drafts for e in batch.entries)
        chunk = any(not e.drafts and e.num_rows > 1 for e in batch.entries)
        calls.append((drafts, chunk, isinstance(state, SplitState)))
        return hidden, state

    monkeypatch.setattr(ModelRunner, "_forward", spy)
    return calls


def _run(path, truth, variant, async_scheduling, device):
    llm = LLM(
        path,
        device=device,
        dtype="float32",
        cuda_graphs=False,  # on CUDA: a prefill program would take the prompt chunks
        drafter=ReplayDrafter(truth, 0.6, vocab_size=320, seed=11),
        spec={"num_drafts": 3, "dcut": False},
        max_num_batched_tokens=20,
        max_num_seqs=3,  # the later prompts wait for a slot: admitted beside verifies
        hybrid_verify_state=variant,
        async_scheduling=async_scheduling,
    )
    params = greedy(18, logprobs=2)
    outs = llm.generate(ARRIVALS, params, use_tqdm=False)
    return llm, outs


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _logprobs(outs):
    return [
        [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        for o in outs
    ]


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "cuda"]
)
@pytest.mark.parametrize("variant", ["write_on_accept", "per_row_slots"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_verify_beside_a_prompt_chunk_is_one_forward_equal_to_two(
    hybrid_dir,  # noqa: F811
    monkeypatch,
    variant,
    async_scheduling,
    device,
):
    plain = llm_for(hybrid_dir).generate(ARRIVALS, greedy(18, logprobs=2), use_tqdm=False)
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(ARRIVALS, plain, strict=True)}

    calls = _forwards(monkeypatch)
    one_llm, one = _run(hybrid_dir, truth, variant, async_scheduling, device)
    mixed = [c for c in calls if c[0] and c[1]]
    assert mixed and all(split for _, _, split in mixed)  # one forward each, on a SplitState
    assert not any(split for drafts, chunk, split in calls if not (drafts and chunk))

    # the same steps as two forwards (what a hybrid does where a prefill program runs them)
    calls.clear()
    monkeypatch.setattr(replay_mod, "gdn_prefill_replays", lambda runner, entries: True)
    two_llm, two = _run(hybrid_dir, truth, variant, async_scheduling, device)
    assert not any(c[0] and c[1] for c in calls) and not any(c[2] for c in calls)

    assert _tokens(one) == _tokens(two) == _tokens(plain)
    torch.testing.assert_close(_logprobs(one), _logprobs(two), rtol=0, atol=1e-5)
    tel = one_llm.engine.telemetry.spec
    assert 0 < tel.num_accepted_tokens < tel.num_draft_tokens  # verified, accepted and rejected
    # every slot's committed state is the same after both
    states_one, states_two = one_llm.engine.runner.states, two_llm.engine.runner.states
    for slot in range(3):
        for layer in range(3):
            for a, b in zip(states_one.entry(slot, layer), states_two.entry(slot, layer)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    if device == "cuda":  # and no prefill program: it was eager end to end
        assert one_llm.engine.runner.graphs is None
