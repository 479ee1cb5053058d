"""The graphed step path of a hybrid target, on CPU: `GraphRunner` with its capture replaced by
"run the captured function again on every replay", so that the path the H200 takes (depth groups
padded to bucket counts with dummy sequences on the dummy state entry, state entries read from
the workspace, a write-on-accept commit over the padded batch, per-row slots) is checked against
plain decoding without a GPU. `tests/test_hybrid_engine.py`'s gpu test runs the real graphs."""

from __future__ import annotations

import pytest
import torch

from metrale.engine import graphs
from metrale.speculative.replay import ReplayDrafter
from tests.test_hybrid_engine import PROMPTS, greedy, hybrid_dir, llm_for  # noqa: F401


class RerunGraph:
    """Stands in for a captured CUDA graph: a replay reruns the function and writes its results
    into the outputs the capture returned, as a real replay rewrites them in place."""

    def __init__(self, fn, outputs) -> None:
        self.fn, self.outputs = fn, outputs
        self.replays = 0

    def replay(self) -> None:
        outputs = self.fn()
        self.replays += 1
        if outputs is None:  # a graphed commit
            return
        hidden, logits, state = outputs
        self.outputs[0].copy_(hidden)
        self.outputs[1].copy_(logits)
        if state is not None:
            self.outputs[2].pending, self.outputs[2].pending_conv = (
                state.pending,
                state.pending_conv,
            )


@pytest.fixture
def fake_graphs(monkeypatch):
    made: list[RerunGraph] = []

    def capture(fn, pool, device):
        graph = RerunGraph(fn, fn())
        made.append(graph)
        return graph, graph.outputs

    monkeypatch.setattr(graphs, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    return made


def graphed(llm, ragged: bool = False):
    """`llm` with a graph runner: row-table programs, or (`ragged`) the ragged programs the
    paged kernel gets on the GPU (decode programs of width 1, verify programs of width 1 + K,
    keyed by row and sequence buckets alone)."""
    runner = llm.engine.runner
    runner.graphs = graphs.GraphRunner(
        runner.model,
        None if ragged else 64,
        llm.engine.max_model_len + llm.engine.lookahead,
        runner.page_size,
        runner.device,
        paged_kernel=ragged,
        state_pool=runner.states.pool,
        max_q=llm.engine.config.spec.num_drafts + 1 if llm.engine.spec is not None else 1,
        max_seqs=llm.engine.config.max_num_seqs,
        verify_mode=runner.states.verify_mode,
    )
    return llm


@pytest.mark.parametrize("ragged", [False, True], ids=["row-table", "ragged"])
@pytest.mark.parametrize("variant", ["write_on_accept", "per_row_slots"])
def test_graphed_hybrid_steps_equal_plain_decoding(
    hybrid_dir,  # noqa: F811
    fake_graphs,
    variant,
    ragged,
):
    plain = llm_for(hybrid_dir).generate(PROMPTS, greedy(20))
    want = [o.outputs[0].token_ids for o in plain]
    truth = {tuple(p): w for p, w in zip(PROMPTS, want, strict=True)}
    decode = graphed(llm_for(hybrid_dir), ragged)
    assert [o.outputs[0].token_ids for o in decode.generate(PROMPTS, greedy(20))] == want
    drafter = ReplayDrafter(truth, 0.6, vocab_size=320, seed=3)
    spec = graphed(
        llm_for(
            hybrid_dir,
            drafter=drafter,
            spec={"num_drafts": 3},
            hybrid_verify_state=variant,
        ),
        ragged,
    )
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(20))] == want
    tel = spec.engine.telemetry.spec
    assert 0 < tel.num_accepted_tokens < tel.num_draft_tokens
    # the steps really replayed programs, with padded depth groups among them
    assert sum(g.replays for g in fake_graphs) > 20
    cache = spec.engine.runner.graphs.cache
    assert cache.stats()["misses"] > 1
    if ragged:  # keyed by buckets: decode programs of width 1, verify programs of width 1 + K
        widths = {key[0].max_q: key[1][1] for key in cache._programs}
        assert widths == {1: graphs.StateMode.WRITE, 4: spec.engine.runner.states.verify_mode}


def test_commit_graphs_are_bounded_by_the_program_cache(hybrid_dir, fake_graphs):  # noqa: F811
    """A commit graph belongs to one program; once programs are evicted their commits go too,
    so the commit graphs never outnumber the cache's cap by more than the one just captured."""
    plain = llm_for(hybrid_dir).generate(PROMPTS, greedy(12))
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, plain, strict=True)}
    llm = graphed(
        llm_for(hybrid_dir, spec={"num_drafts": 3}, drafter=ReplayDrafter(truth, 0.5, 320))
    )
    runner = llm.engine.runner.graphs
    runner.cache.cap = 2
    out = llm.generate(PROMPTS, greedy(12))
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert runner.cache.evictions > 0
    assert 0 < len(runner._commits) <= runner.cache.cap + 1
