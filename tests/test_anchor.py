"""The bench's plain-PyTorch anchor computes the same model as the engine: with nothing cached,
its decode step of token t picks the engine's first greedy token after the prompt [t]."""

from __future__ import annotations

import torch

from metrale import LLM, SamplingParams
from metrale.bench.anchor import StaticCacheDecode


def test_anchor_step_is_the_engines_model(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu")
    tokens = [5, 17, 123, 250]
    params = SamplingParams(temperature=0, max_tokens=1)
    outs = llm.generate([[t] for t in tokens], params, use_tqdm=False)
    expected = [o.outputs[0].token_ids[0] for o in outs]
    with torch.inference_mode():
        anchor = StaticCacheDecode(llm.engine.runner.model, len(tokens), 0, capture=False)
        anchor.ids.copy_(torch.tensor(tokens))
        picks = anchor._step()
    assert picks.tolist() == expected
