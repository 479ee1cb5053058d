"""Issue 13's H200 check: greedy bf16 output of a shape (or checkpoint) alone, in a batch of 64,
and with speculation (replay drafter at alpha 0.8 and n-gram, D-Cut on, K = 3, at batch 1, 8 and
64), with the deterministic mode off and on. Reports the share of requests whose tokens, and
whose logprobs, equal the plain batch run's bit for bit. JSON to --out. With --sampling, each
request is sampled at temperature 0.8, top-p 0.9 with its own seed instead of greedily (the
seeded half of the issue's targets).

  python scripts/deterministic_check.py --shape qwen3-8b --out DIR [--sampling]
"""

import argparse
import json
from pathlib import Path

import torch

from metrale import LLM, SamplingParams
from metrale.bench.shapes import write_shape
from metrale.speculative.replay import ReplayDrafter


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--modes", default="0,1", help="deterministic off/on, e.g. 0,1 or 1")
    ap.add_argument("--drafters", default="replay,ngram")
    ap.add_argument("--sampling", action="store_true", help="seeded sampling, not greedy")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or write_shape(args.shape, out / "shape")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = []
    for i in range(args.prompts):  # halves repeated, so the n-gram drafter finds matches
        half = torch.randint(min(100, vocab // 4), min(4000, vocab), (8 + i % 24,), generator=g)
        half = half.tolist()
        prompts.append(half * 2)
    report = []
    for det in (bool(int(m)) for m in args.modes.split(",")):
        for name in args.drafters.split(","):
            drafter = ReplayDrafter({}, 0.8, vocab_size=2) if name == "replay" else None
            method = {} if drafter is not None else {"method": name}
            llm = LLM(
                model,
                drafter=drafter,
                load_format="dummy" if args.model is None else "safetensors",
                dtype="bfloat16",
                deterministic=det,
                max_num_seqs=64,
                max_model_len=256,
                kv_cache_memory_gb=16,
                spec={"num_drafts": 3, "dcut": True, **method},
            )

            plain = run(llm, args, prompts, False, 0)
            if drafter is not None:
                drafter.record({tuple(p): o.token_ids for p, o in zip(prompts, plain)}, 0.8)
            row = dict(deterministic=det, drafter=name, sampling=args.sampling)
            alone = [run(llm, args, [p], False, i)[0] for i, p in enumerate(prompts[:8])]
            row["alone_vs_batch64_tokens"] = _share(alone, plain, "token_ids")
            row["alone_vs_batch64_logprobs"] = _share(alone, plain, "logprobs")
            for batch in (1, 8, 64):
                spec = []
                for at in range(0, min(len(prompts), max(batch, 8)), batch):
                    spec += run(llm, args, prompts[at : at + batch], True, at)
                row[f"spec_b{batch}_tokens"] = _share(spec, plain, "token_ids")
                row[f"spec_b{batch}_logprobs"] = _share(spec, plain, "logprobs")
            row["accepted_tokens"] = llm.engine.telemetry.spec.num_accepted_tokens
            # (prefix caching is on: runs after the first start from the cached prompt pages)
            row["prefix_cache_hit_rate"] = round(llm.engine.telemetry.prefix_cache.hit_rate, 3)
            print(json.dumps(row), flush=True)
            report.append(row)
            llm.shutdown()
            del llm
            torch.cuda.empty_cache()
    (out / "deterministic_check.json").write_text(json.dumps(report, indent=1))


def run(llm, args, prompts, speculative, first):
    """`prompts`, the `first`-th of the list on: a request's seed is its place in the list."""
    sampled = dict(temperature=0.8, top_p=0.9) if args.sampling else dict(temperature=0)
    params = [
        SamplingParams(
            **sampled,
            seed=first + i if args.sampling else None,
            max_tokens=args.max_tokens,
            ignore_eos=True,
            logprobs=1,
            speculative=speculative,
        )
        for i in range(len(prompts))
    ]
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _share(got, ref, field):
    same = sum(getattr(a, field) == getattr(b, field) for a, b in zip(got, ref))
    return round(same / len(got), 3)


main()
