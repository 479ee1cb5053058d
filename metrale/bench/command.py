"""`metrale bench`: step times against the weight-bytes roofline, the verify cost curve, and
end-to-end speed with and without speculation at a known acceptance, in one process.

- Roofline: the weights' bytes over the memory bandwidth measured here by a device-to-device copy.
- Decode and verify: B sequences with `context` cached tokens each run q rows per sequence (their
  last token plus q - 1 drafts) through the engine's step (forward, acceptance, the host copy);
  the verify cost curve is T(q) / T(1) per B, in the JSON shape `VerifyCostModel.from_json` reads.
- End to end: generate without speculation and record the continuations, then replay them as
  drafts corrupted with probability 1 - alpha (`--dcut`: D-Cut plans the depths, from the verify
  cost curve just measured; without it every verify has K drafts), timing the second of two
  runs of each (graphs captured, caches warm); the speedup is set against the ideal
  (1 - alpha^(K+1)) / (1 - alpha) x T(1) / T(K+1).

It prints a table, writes JSON (also the last stdout line) and a PNG plot. Tiny shapes run on CPU.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

import torch

from metrale.api import LLM
from metrale.config import SamplingParams
from metrale.default_model import write_tokenizer
from metrale.engine.sequence import Batch, ScheduledSeq, Sequence
from metrale.speculative.dcut import VerifyCostModel
from metrale.speculative.replay import ReplayDrafter

# Published config numbers of the Qwen3 family (HF config.json), and a tiny shape for CPU runs.
SHAPES = {
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "qwen3-1.7b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    # Qwen3-Next-80B-A3B's published layout with 64 of its 512 experts (the same experts per
    # token, so the same bytes per token at small batch; 19 GB of bf16 weights instead of 160).
    "qwen3-next-a3b-64e": dict(
        architectures=["Qwen3NextForCausalLM"],
        model_type="qwen3_next",
        hidden_size=2048,
        intermediate_size=5120,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        num_experts=64,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        partial_rotary_factor=0.25,
        rope_theta=10000000.0,
        tie_word_embeddings=False,
    ),
    "qwen3-next-tiny": dict(
        architectures=["Qwen3NextForCausalLM"],
        model_type="qwen3_next",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
}
_COMMON = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=151936,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    torch_dtype="bfloat16",
    eos_token_id=151645,
)


def write_shape(name: str, path: Path) -> Path:
    """A weightless checkpoint directory of a named shape (run with load_format="dummy")."""
    if name not in SHAPES:
        raise ValueError(f"--shape {name!r}: expected one of {sorted(SHAPES)}")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**_COMMON, **SHAPES[name]}, indent=2))
    write_tokenizer(path)
    return path


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device: torch.device, warmup: int = 2, reps: int = 7) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (bytes read plus bytes written)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / median_time(lambda: dst.copy_(src), device, reps=10)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one batch-1 step reads: every weight once (tied ones once), except that
    a sparse MoE block's routed experts count only `num_experts_per_tok` of `num_experts`."""
    hybrid = getattr(getattr(model, "config", None), "hybrid", None)
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        size = p.numel() * p.element_size()
        if hybrid is not None and ".experts." in name + "." and hybrid.num_experts:
            size = size * hybrid.num_experts_per_tok // hybrid.num_experts
        total += size
    return total


def synthetic_batch(llm: LLM, batch: int, context: int, q: int, rng: random.Random) -> Batch:
    """`batch` sequences with `context` computed tokens, each running q rows (last + drafts)."""
    engine, vocab = llm.engine, llm.engine.vocab_size
    entries = []
    for i in range(batch):
        seq = Sequence(
            10**6 + i,
            f"bench-{i}",
            [rng.randrange(vocab) for _ in range(context)],
            SamplingParams(temperature=0.0),
            i,
            (),
            arrival=i,
            slot=i,
        )
        seq.num_computed_tokens = context - 1
        engine.allocator.reserve(seq, context + q)
        entries.append(ScheduledSeq(seq, q, [rng.randrange(vocab) for _ in range(q - 1)]))
    return Batch(entries)


def step_times(llm: LLM, batch_sizes, qs, context: int) -> dict[int, dict[int, float]]:
    rng, out = random.Random(0), {}
    runner, device = llm.engine.runner, llm.engine.runner.device
    for b in batch_sizes:
        out[b] = {}
        for q in qs:
            batch = synthetic_batch(llm, b, context, q, rng)
            out[b][q] = median_time(lambda batch=batch: runner.execute(batch), device)
            for e in batch.entries:
                llm.engine.allocator.free(e.seq)
    return out


def timed_generate(llm: LLM, prompts, params) -> tuple[list, float]:
    """(outputs, seconds) of the second of two identical runs: graphs captured, caches warm."""
    device = llm.engine.runner.device
    llm.generate(prompts, params, use_tqdm=False)
    _sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync(device)
    return outs, time.perf_counter() - start


def end_to_end(llm: LLM, drafter: ReplayDrafter, batch: int, max_tokens: int, alpha: float):
    rng = random.Random(batch)
    prompts = [[rng.randrange(llm.engine.vocab_size) for _ in range(32)] for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    drafter.continuations, drafter.alpha = {}, alpha  # no drafts: plain decoding
    device = llm.engine.runner.device

    plain, t_plain = timed_generate(llm, prompts, params)
    drafter.continuations = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)}
    spec_tel = llm.engine.telemetry.spec
    llm.generate(prompts, params, use_tqdm=False)  # warm-up, outside the counters below
    before = (
        spec_tel.num_drafts,
        spec_tel.num_accepted_tokens,
        spec_tel.verify_steps,
        spec_tel.multi_seq_runs,
        spec_tel.contiguous_runs,
    )
    _sync(device)
    start = time.perf_counter()
    spec = llm.generate(prompts, params, use_tqdm=False)
    _sync(device)
    t_spec = time.perf_counter() - start
    # NOTE: in float32 the two runs match token for token (the tests pin it); in bf16 a verify
    # of q rows rounds differently from a 1-row decode, so near-tied argmaxes of a random-weight
    # model can flip. Report how often, rather than hide it.
    same = sum(
        a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(plain, spec, strict=True)
    )
    tokens = batch * max_tokens
    drafts = spec_tel.num_drafts - before[0]
    return {
        "batch": batch,
        "tokens_per_s_plain": tokens / t_plain,
        "tokens_per_s_spec": tokens / t_spec,
        "speedup": t_plain / t_spec,
        "identical_outputs": same / batch,
        "mean_acceptance_length": 1 + (spec_tel.num_accepted_tokens - before[1]) / max(drafts, 1),
        "verify_steps": spec_tel.verify_steps - before[2],
        # of the runs of several equal-depth sequences in dispatch order, the share on
        # consecutive state slots (what a kernel batching by slot range would need)
        "contiguous_run_share": (spec_tel.contiguous_runs - before[4])
        / max(spec_tel.multi_seq_runs - before[3], 1),
        # over the engine's life so far (every end-to-end run of this bench)
        "distinct_verify_keys": len(spec_tel.verify_keys),
        "graphs": llm.engine.runner.graphs.cache.stats() if llm.engine.runner.graphs else None,
    }


def run(args) -> dict:
    device = torch.device(
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    model_dir = (
        Path(args.model) if args.model else write_shape(args.shape, Path(args.out) / "shape")
    )
    drafter = ReplayDrafter({}, args.alpha, vocab_size=2)
    llm = LLM(
        model_dir,
        drafter=drafter,
        device=str(device),
        dtype=args.dtype,
        load_format="safetensors" if args.model else "dummy",
        max_model_len=args.context + 2 * args.max_tokens + 64,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        spec={"num_drafts": args.num_drafts, "dcut": getattr(args, "dcut", False)},
        hybrid_verify_state=getattr(args, "hybrid_verify_state", "write_on_accept"),
    )
    drafter.vocab_size = llm.engine.vocab_size
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    bw = bandwidth(device)
    wbytes = weight_bytes(llm.engine.runner.model)
    roofline = wbytes / bw
    qs = sorted(set(args.q) | {1, args.num_drafts + 1})
    times = step_times(llm, args.batch_sizes, qs, args.context)
    result = {
        "shape": args.shape if not args.model else str(args.model),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(llm.engine.runner.dtype),
        "context": args.context,
        "bandwidth_GBps": bw / 1e9,
        "weight_bytes": wbytes,
        "roofline_ms": roofline * 1e3,
        "decode": [
            {"batch": b, "ms": times[b][1] * 1e3, "roofline_ratio": times[b][1] / roofline}
            for b in args.batch_sizes
        ],
        "verify_cost": {
            "batch_sizes": list(args.batch_sizes),
            "q": qs,
            "ratio": [[times[b][q] / times[b][1] for q in qs] for b in args.batch_sizes],
        },
        "e2e": [],
        "alpha": args.alpha,
        "num_drafts": args.num_drafts,
        "dcut": llm.engine.spec.cfg.dcut,
    }
    if result["dcut"]:
        # D-Cut plans the end-to-end runs with the verify cost curve just measured.
        llm.engine.spec.cost = VerifyCostModel.from_json(result["verify_cost"])
    a, k = args.alpha, args.num_drafts
    expected = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
    for b in args.e2e_batch_sizes:
        row = end_to_end(llm, drafter, b, args.max_tokens, a)
        nearest = min(args.batch_sizes, key=lambda x: abs(x - b))
        cost = times[nearest][1] / times[nearest][k + 1]
        row["ideal_speedup"] = expected * cost
        # Short generations cut the last verifies short, so the measured acceptance length sits
        # below alpha's; the ideal at the measured length separates that from engine overhead.
        row["ideal_speedup_at_measured_acceptance"] = row["mean_acceptance_length"] * cost
        result["e2e"].append(row)
    runner = llm.engine.runner
    result["graph_refusals"] = runner.graph_refusals
    result["peak_memory_bytes"] = (
        torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    )
    if runner.states is not None:
        result["hybrid_verify_state"] = llm.engine.config.hybrid_verify_state
        result["state_pool_bytes"] = runner.states.nbytes()
    return result


def table(result: dict) -> str:
    lines = [
        f"{result['shape']} on {result['device']} ({result['dtype']}), "
        f"bandwidth {result['bandwidth_GBps']:.0f} GB/s, roofline {result['roofline_ms']:.3f} ms"
    ]
    qs = result["verify_cost"]["q"]
    lines.append("batch  decode_ms  x_roofline  " + "  ".join(f"q={q:<3d}" for q in qs))
    for d, ratios in zip(result["decode"], result["verify_cost"]["ratio"]):
        lines.append(
            f"{d['batch']:5d}  {d['ms']:9.3f}  {d['roofline_ratio']:10.2f}  "
            + "  ".join(f"{r:5.2f}" for r in ratios)
        )
    for e in result["e2e"]:
        lines.append(
            f"e2e batch {e['batch']}: {e['tokens_per_s_plain']:.1f} -> "
            f"{e['tokens_per_s_spec']:.1f} tok/s, speedup {e['speedup']:.2f} "
            f"(ideal {e['ideal_speedup']:.2f}, {e['ideal_speedup_at_measured_acceptance']:.2f} "
            f"at the measured acceptance), acceptance length "
            f"{e['mean_acceptance_length']:.2f}, {e['distinct_verify_keys']} verify keys"
        )
    if "state_pool_bytes" in result:
        peak = result["peak_memory_bytes"]
        lines.append(
            f"hybrid verify state {result['hybrid_verify_state']}: state pool "
            f"{result['state_pool_bytes'] / 2**30:.2f} GiB"
            + ("" if peak is None else f", peak memory {peak / 2**30:.2f} GiB")
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> bool:
    """Speedup and verify cost against batch size; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    e2e = result["e2e"]
    left.plot([e["batch"] for e in e2e], [e["speedup"] for e in e2e], "o-", label="measured")
    left.plot([e["batch"] for e in e2e], [e["ideal_speedup"] for e in e2e], "s--", label="ideal")
    left.set(
        xscale="log",
        xlabel="batch size",
        ylabel="speedup",
        title=f"speculation, alpha={result['alpha']}, K={result['num_drafts']}",
    )
    left.legend()
    cost = result["verify_cost"]
    for j, q in enumerate(cost["q"]):
        right.plot(cost["batch_sizes"], [row[j] for row in cost["ratio"]], "o-", label=f"q={q}")
    right.set(xscale="log", xlabel="batch size", ylabel="step time / q=1", title="verify cost")
    right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
