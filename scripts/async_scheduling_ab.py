"""Plain decoding with and without `async_scheduling`, in one process, alternated: time per output
token and tokens/s at each batch size, and whether the outputs are identical.

    python scripts/async_scheduling_ab.py --model metrale/assets/default-model --out r.json
    python scripts/async_scheduling_ab.py --shape qwen3-8b --batch-sizes 1,16,64 --out r.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

from metrale.api import LLM
from metrale.bench.acceptance import heldout_prompts
from metrale.bench.shapes import write_shape
from metrale.config import SamplingParams
from metrale.engine.calibrate import sync


def timed(llm: LLM, prompts, params, repeats: int) -> tuple[list, float]:
    llm.generate(prompts, params, use_tqdm=False)  # warm
    times = []
    for _ in range(repeats):
        sync(llm.engine.runner.device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync(llm.engine.runner.device)
        times.append(time.perf_counter() - start)
    return outs, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--shape", default=None)
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="async-ab.json")
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    dummy = args.model is None
    path = args.model or write_shape(args.shape, Path(tempfile.mkdtemp()) / "shape")
    common = dict(
        load_format="dummy" if dummy else "safetensors",
        max_model_len=args.prompt_tokens + args.max_tokens + 64,
        max_num_seqs=max(sizes),
        kv_cache_memory_gb=8.0,
    )
    engines = {
        "sync": LLM(path, **common, async_scheduling=False),
        "async": LLM(path, **common, async_scheduling=True),
    }
    tok = engines["sync"].tokenizer
    if dummy:
        rng = random.Random(0)
        vocab = engines["sync"].engine.vocab_size
        prompts_all = [
            [rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(max(sizes))
        ]
    else:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        prompts_all = heldout_prompts(stdlib, tok, max(sizes), args.prompt_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for b in sizes:
        prompts = prompts_all[:b]
        seconds: dict[str, list[float]] = {"sync": [], "async": []}
        outs = {}
        for _ in range(2):  # alternated: the host's speed drifts between runs
            for name, llm in engines.items():
                outs[name], t = timed(llm, prompts, params, args.repeats)
                seconds[name].append(t)
        t_sync, t_async = (statistics.median(seconds[n]) for n in ("sync", "async"))
        same = sum(
            a.outputs[0].token_ids == c.outputs[0].token_ids
            for a, c in zip(outs["sync"], outs["async"], strict=True)
        )
        stepper = engines["async"].engine._ahead
        row = {
            "batch": b,
            "ms_per_token_sync": t_sync / args.max_tokens * 1e3,
            "ms_per_token_async": t_async / args.max_tokens * 1e3,
            "tokens_per_s_sync": b * args.max_tokens / t_sync,
            "tokens_per_s_async": b * args.max_tokens / t_async,
            "speedup": t_sync / t_async,
            "identical_outputs": same / b,
            "launches_ahead_share": stepper.launches_ahead / max(stepper.launches, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps({"model": str(path), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
