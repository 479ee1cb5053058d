"""The MTP drafter's captured programs on CPU: `DraftChainGraphs` with its capture replaced by
"run the captured function again on every replay", so that the graphed chain (one program for
every chain step, positions and slots computed on the device, every sequence chained to the
batch's deepest depth, chained ahead right after the catch-up) and the ragged catch-up are
checked against the eager drafter: the same drafts, step for step. `tests/test_gpu.py` runs the
real graphs on CUDA."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.engine import graphs
from metrale.speculative import mtp_graphs

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):",
]


class RerunGraph:
    def __init__(self, fn, outputs) -> None:
        self.fn, self.outputs = fn, outputs

    def replay(self) -> None:
        fresh = self.fn()
        for out, new in zip(
            self.outputs if isinstance(self.outputs, tuple) else (self.outputs,),
            fresh if isinstance(fresh, tuple) else (fresh,),
            strict=True,
        ):
            out.copy_(new)


def drafts_of(llm: LLM, params, prompts=PROMPTS) -> tuple[list, list]:
    """(outputs, every propose call's drafts) of one generation."""
    drafter, proposed = llm.engine.spec.drafter, []
    propose = drafter.propose

    def recorded(seqs, caps):
        drafts = propose(seqs, caps)
        proposed.append([(s.seq_id - seqs[0].seq_id, d.tokens) for s, d in zip(seqs, drafts)])
        return drafts

    drafter.propose = recorded
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], proposed


@pytest.mark.parametrize("num_drafts, max_num_seqs", [(3, 8), (4, 8), (3, 2)])
def test_graphed_chain_and_catch_up_draft_what_the_eager_drafter_drafts(
    monkeypatch, num_drafts, max_num_seqs
):
    """With 2 slots, prompts arrive while others verify: a step's prompt chunk catches up
    eagerly beside the verify rows' program, and the drafts still equal the eager drafter's."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = {"method": "mtp", "num_drafts": num_drafts, "dcut": False}
    kwargs = dict(device="cpu", dtype="float32", spec=spec, max_num_seqs=max_num_seqs)
    eager = LLM(**kwargs)
    want, want_drafts = drafts_of(eager, params)

    captured: list[RerunGraph] = []

    def capture(fn, pool, device):
        graph = RerunGraph(fn, fn())
        captured.append(graph)
        return graph, graph.outputs

    monkeypatch.setattr(mtp_graphs, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    llm = LLM(**kwargs)
    runner, drafter = llm.engine.runner, llm.engine.spec.drafter
    # the workspace the catch-up programs read (the target's programs are not captured)
    runner.graphs = graphs.GraphRunner(
        runner.model,
        None,
        llm.engine.max_model_len + llm.engine.lookahead,
        runner.page_size,
        runner.device,
        paged_kernel=True,
        max_q=num_drafts + 1,
        max_seqs=8,
    )
    try:
        drafter.chain_graphs = mtp_graphs.DraftChainGraphs(
            runner,
            drafter.heads,
            8,
            llm.engine.max_model_len + llm.engine.lookahead,
            8,
            (drafter._first, drafter._hidden),
        )
    finally:
        runner.graphs = None  # the target's own steps stay eager
    mixed = []  # observes that replayed a catch-up and ran a prompt chunk eagerly
    observe, eager_catch_up = drafter.observe, drafter._catch_up_eager

    def counted(verdicts):
        before = drafter.chain_graphs.catch_up_replays
        mixed.append(False)
        observe(verdicts)
        mixed[-1] = mixed[-1] and drafter.chain_graphs.catch_up_replays > before

    def eager_counted(*args):
        mixed[-1] = True
        eager_catch_up(*args)

    drafter.observe, drafter._catch_up_eager = counted, eager_counted
    got, got_drafts = drafts_of(llm, params)
    assert got == want
    assert got_drafts == want_drafts
    chain = drafter.chain_graphs
    assert chain._programs  # the chain really ran as programs
    assert chain.catch_up_replays > 0
    # most drafts were chained ahead, right after the catch-up, and read back by propose
    assert drafter.drafted_ahead > sum(1 for step in got_drafts for _, d in step if d) // 2
    # several sequences at different depths shared one program, chained to the deepest
    assert any(len({len(d) for _, d in step if d}) > 1 for step in got_drafts)
    assert sum(len(d) for step in got_drafts for _, d in step) > 20
    assert isinstance(chain.block_tables, torch.Tensor)
    assert any(mixed) == (max_num_seqs < len(PROMPTS))
