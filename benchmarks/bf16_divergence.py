"""Where do plain and speculative greedy outputs part on a random-weight shape, by dtype?

Float32 should never part (the tests pin it); bf16 may, where a verify's q-row matmuls round
differently from a 1-row decode's and the random model's argmax is a near-tie. Prints, per
dtype, the first divergent position of each request and the replay acceptance length.
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

from metrale import LLM, SamplingParams
from metrale.bench.shapes import write_shape
from metrale.speculative.replay import ReplayDrafter

shape = sys.argv[1] if len(sys.argv) > 1 else "tiny"
device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
model_dir = write_shape(shape, Path(tempfile.mkdtemp()) / shape)
rng = random.Random(0)
for dtype in ("float32", "bfloat16"):
    drafter = ReplayDrafter({}, 1.0, 2)
    llm = LLM(
        model_dir,
        drafter=drafter,
        device=device,
        dtype=dtype,
        load_format="dummy",
        max_model_len=256,
        spec={"num_drafts": 3, "dcut": False},
    )
    drafter.vocab_size = llm.engine.vocab_size
    prompts = [[rng.randrange(llm.engine.vocab_size) for _ in range(32)] for _ in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    drafter.record({tuple(p): o for p, o in zip(prompts, plain)})
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    first = [
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(plain, spec)
    ]
    print(
        dtype,
        "first divergence:",
        first,
        "acceptance length:",
        round(llm.engine.telemetry.spec.mean_acceptance_length, 2),
    )
    del llm
