"""`python -m metrale.bench.structured`: whether structured output holds, and what it costs.

- Validity (`--outputs N`, the shipped model by default): N greedy outputs under JSON schemas on
  held-out prompts, with and without speculation: the share that validate (jsonschema) and the
  share identical between the two runs.
- Cost (`--batch-sizes`): time per output token of plain decoding with and without a JSON-schema
  constraint (one that never completes within `--max-tokens`, so every row is masked every
  step), and the speculative speedup with and without it, at each batch size.

`--shape NAME` runs random weights of a published shape instead (cost only: their text means
nothing). JSON on stdout and in `--out`.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

from metrale.api import LLM
from metrale.bench.acceptance import heldout_prompts
from metrale.bench.e2e import timed_generate
from metrale.bench.shapes import write_shape
from metrale.config import SamplingParams
from metrale.engine.heap import freeze_startup_heap

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "id": {"type": "integer", "minimum": 0, "maximum": 10**6},
            "tags": {"type": "array", "items": {"enum": ["io", "net", "db"]}, "maxItems": 3},
        },
        "required": ["name", "id", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "lines": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
            "kind": {"enum": ["func", "class", "module"]},
        },
        "required": ["ok", "kind"],
        "additionalProperties": False,
    },
]
# Inside a string every step (which only a control character would end), so every row is
# masked and nothing completes early.
LONG_STRING = {
    "type": "object",
    "properties": {"text": {"type": "string", "pattern": "^[a-z ]*\u0001$"}},
    "required": ["text"],
}


def validity(llm: LLM, prompts: list, max_tokens: int) -> dict:
    """The share of outputs under `SCHEMAS` that validate, with and without speculation, the
    share identical, and the speculative speedup under the schemas beside the one of free text
    on the same prompts (each the median of timed runs)."""
    import jsonschema

    def run(spec: bool, structured: bool):
        outs, seconds = [], 0.0
        for i, schema in enumerate(SCHEMAS):
            extra = {"structured": {"json": schema}} if structured else {}
            params = SamplingParams(
                temperature=0.0, max_tokens=max_tokens, speculative=spec, **extra
            )
            part, t = timed_generate(llm, prompts[i :: len(SCHEMAS)], params)
            outs += [(schema, o) for o in part]
            seconds += t
        return outs, seconds

    runs = {(spec, s): run(spec, s) for spec in (False, True) for s in (False, True)}

    def valid(schema, text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    plain, fast = runs[False, True][0], runs[True, True][0]
    n = len(plain)
    return {
        "outputs": n,
        "valid_plain": sum(valid(s, o.outputs[0].text) for s, o in plain) / n,
        "valid_speculative": sum(valid(s, o.outputs[0].text) for s, o in fast) / n,
        "identical": sum(
            a.outputs[0].token_ids == b.outputs[0].token_ids
            for (_, a), (_, b) in zip(plain, fast, strict=True)
        )
        / n,
        "speedup_schema": runs[False, True][1] / runs[True, True][1],
        "speedup_free": runs[False, False][1] / runs[True, False][1],
    }


def cost(llm: LLM, prompts: list, batch: int, max_tokens: int) -> dict:
    base = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    times = {}
    for name, extra in (("free", {}), ("schema", {"structured": {"json": LONG_STRING}})):
        for spec in (False, True):
            params = SamplingParams(**base, **extra, speculative=spec)
            times[name, spec] = timed_generate(llm, prompts[:batch], params)[1]
    tokens = batch * max_tokens
    return {
        "batch": batch,
        "ms_per_token_free": times["free", False] / max_tokens * 1e3,
        "ms_per_token_schema": times["schema", False] / max_tokens * 1e3,
        "masked_over_free": times["schema", False] / times["free", False],
        "speedup_free": times["free", False] / times["free", True],
        "speedup_schema": times["schema", False] / times["schema", True],
        "tokens_per_s_schema_spec": tokens / times["schema", True],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m metrale.bench.structured")
    ap.add_argument("--model", default=None, help="checkpoint (default: the shipped model)")
    ap.add_argument("--shape", default=None, help="random weights of a named shape (cost only)")
    ap.add_argument("--spec", default="mtp", help="drafter: mtp or ngram")
    ap.add_argument("--num-drafts", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--outputs", type=int, default=200, help="validity outputs (0: skip)")
    ap.add_argument("--batch-sizes", default="", help="cost: comma-separated batch sizes")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    if args.shape:
        model, load = write_shape(args.shape, Path("/tmp/metrale-structured-shape")), "dummy"
        spec = {"method": "ngram", "num_drafts": args.num_drafts}
    else:
        from metrale.default_model import default_model_dir

        model, load = args.model or str(default_model_dir()), "safetensors"
        spec = {"method": args.spec, "num_drafts": args.num_drafts}
    llm = LLM(
        model,
        device=args.device,
        load_format=load,
        max_model_len=128 + 4 * args.max_tokens,
        max_num_seqs=max(sizes + [64]),
        spec=spec,
    )
    prompts = heldout_prompts(
        Path(sysconfig.get_paths()["stdlib"]),
        llm.tokenizer,
        max(args.outputs, max(sizes, default=1)),
        64,
    )
    freeze_startup_heap()
    result = {"model": str(model), "spec": spec, "device": args.device}
    if args.outputs and not args.shape:
        result["validity"] = validity(llm, prompts[: args.outputs], 4 * args.max_tokens)
    result["cost"] = [cost(llm, prompts, b, args.max_tokens) for b in sizes]
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
