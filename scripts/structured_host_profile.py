"""Host time of structured outputs on the H200 (issue 20): the grammar masks and emission per
run, free text against a JSON schema, at batch 1 and 64, qwen3-8b shape with random weights."""

import json
import sysconfig
import time
from pathlib import Path

import torch

import metrale.engine.runner as runner_mod
from metrale import LLM, SamplingParams
from metrale.bench.acceptance import heldout_prompts
from metrale.bench.shapes import write_shape
from metrale.bench.structured import LONG_STRING
from metrale.engine.emitter import Emitter

model = write_shape("qwen3-8b", Path("/tmp/q8shape"))
llm = LLM(model, device="cuda", load_format="dummy", max_model_len=512, max_num_seqs=64)
prompts = heldout_prompts(Path(sysconfig.get_paths()["stdlib"]), llm.tokenizer, 64, 64)
acc = {"mask": 0.0, "emit": 0.0, "calls": 0}
real_apply = runner_mod.apply_grammar_masks


def apply(*a):
    t = time.perf_counter()
    real_apply(*a)
    acc["mask"] += time.perf_counter() - t
    acc["calls"] += 1


runner_mod.apply_grammar_masks = apply
real_emit = Emitter.emit


def emit(self, *a):
    t = time.perf_counter()
    r = real_emit(self, *a)
    acc["emit"] += time.perf_counter() - t
    return r


Emitter.emit = emit
res = {}
for B in (1, 64):
    for name, extra in (("free", {}), ("schema", {"structured": {"json": LONG_STRING}})):
        p = SamplingParams(
            temperature=0, max_tokens=64, ignore_eos=True, speculative=False, **extra
        )
        llm.generate(prompts[:B], p, use_tqdm=False)
        for k in acc:
            acc[k] = 0
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts[:B], p, use_tqdm=False)
        torch.cuda.synchronize()
        total = time.perf_counter() - t
        res[f"{name}-B{B}"] = {
            "total_ms": total * 1e3,
            "mask_ms": acc["mask"] * 1e3,
            "emit_ms": acc["emit"] * 1e3,
            "mask_calls": acc["calls"],
        }
        print(name, B, res[f"{name}-B{B}"], flush=True)
# the mask path alone, synced

torch.cuda.synchronize()
print(json.dumps(res))
