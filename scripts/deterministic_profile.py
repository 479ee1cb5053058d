"""Where the deterministic mode's decode step spends its time (issue 13): the qwen3-8b shape at
one batch size, plain decoding, profiled with the mode off and on; device time per kernel family.

  python scripts/deterministic_profile.py --batch 64 --context 1024
"""

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from metrale import LLM, SamplingParams
from metrale.bench.shapes import write_shape


def family(name: str) -> str:
    for key in (
        "invariant_matmul",
        "paged_attention",
        "combine_splits",
        "gemm",
        "gemv",
        "rmsnorm",
        "silu",
        "rotary",
        "argmax",
        "cutlass",
        "nvjet",
        "sm90",
    ):
        if key in name.lower():
            return key
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default="/tmp/detprof")
    args = ap.parse_args()
    model = write_shape("qwen3-8b", __import__("pathlib").Path(args.out) / "shape")
    prompts = [[100 + (i * 7 + j) % 3000 for j in range(args.context)] for i in range(args.batch)]
    for det in (False, True):
        llm = LLM(
            model,
            load_format="dummy",
            dtype="bfloat16",
            deterministic=det,
            max_num_seqs=args.batch,
            max_model_len=args.context + 64,
            kv_cache_memory_gb=24,
            max_num_batched_tokens=8192,
        )
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        engine = llm.engine
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        while (
            any(s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.scheduler.running)
            or engine.scheduler.waiting
        ):
            engine.step()  # the prompts' prefill, outside the profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(32):
                engine.step()
        while engine.has_unfinished_requests():
            engine.step()
        totals = defaultdict(float)
        for e in prof.key_averages():
            if e.device_type.name == "CUDA":
                totals[family(e.key)] += e.self_device_time_total / 1e3
        print(f"deterministic={det} batch={args.batch} context={args.context} (ms over 32 steps)")
        for k, v in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"  {k:20s} {v:9.1f}")
        top = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:8]
        for e in top:
            print(f"    {e.self_device_time_total / 1e3:8.1f} ms  {e.count:6d}x  {e.key[:90]}")
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()


main()
