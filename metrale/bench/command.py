"""`metrale bench`: step times against the weight-bytes roofline, the verify cost curve, and
end-to-end speed with and without speculation at a known acceptance, in one process.

- Roofline: the weights' bytes over the memory bandwidth measured here by a device-to-device copy
  (a batch-1 token's experts; per batch also the experts the batch reads, `batch_roofline_*`).
  On CUDA, `launches_batch1` counts the kernels of one batch-1 decode step (profiler).
- Decode and verify: B sequences with `context` cached tokens each run q rows per sequence (their
  last token plus q - 1 drafts) through the engine's step (forward, acceptance, the host copy);
  the verify cost curve is T(q) / T(1) per B, in the JSON shape `VerifyCostModel.from_json` reads.
- End to end: generate without speculation and record the continuations, then replay them as
  drafts corrupted with probability 1 - alpha (`--dcut`: D-Cut plans the depths, from the verify
  cost curve just measured; without it every verify has K drafts), timing the second of two
  runs of each (graphs captured, caches warm); the speedup is set against the ideal
  (1 - alpha^(K+1)) / (1 - alpha) x T(1) / T(K+1).
- Steady state (`--steady-requests-per-slot N`): also N x B requests of varied lengths streamed
  through B slots at the same acceptance (`_steady`), as a server sees them: a closed batch
  ends with its slowest sequence, and with speculation its sequences finish apart, so its tail
  runs narrow verify steps that a stream of arrivals would fill.

It prints a table, writes JSON (also the last stdout line) and a PNG plot. Tiny shapes run on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from metrale.api import LLM
from metrale.bench.anchor import anchor_step_times
from metrale.bench.drafter import concurrency, steady_lengths, steady_state
from metrale.bench.e2e import end_to_end, random_prompts
from metrale.bench.forced import forcing
from metrale.bench.profile_step import step_launches
from metrale.bench.shapes import batch_weight_bytes, write_shape
from metrale.bench.timing import (
    bandwidth,
    capture_line,
    capture_report,
    parallel_options,
    scheduling_label,
    weight_bytes,
)
from metrale.config import SamplingParams
from metrale.engine.calibrate import step_times
from metrale.engine.heap import freeze_startup_heap
from metrale.hub import resolve_model
from metrale.speculative.replay import ReplayDrafter
from metrale.speculative.verify_cost import VerifyCostModel


def main(args) -> int:
    """`metrale bench`: the acceptance report, a real drafter's end-to-end run, or the step,
    verify and replayed end-to-end measurements; JSON into --out and as the last stdout line."""
    if args.shape is not None:  # (each of these ran on something else, said nowhere: review)
        if args.model is not None:
            raise ValueError(
                "--shape and --model: give one (random weights of a shape, or a model)"
            )
        if args.acceptance or args.e2e_drafter:
            given = "--acceptance" if args.acceptance else "--e2e-drafter"
            raise ValueError(
                f"{given} runs a model's own drafter on held-out text: give --model (or "
                "neither, for the embedded model), not --shape"
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.acceptance:
        from metrale.bench.acceptance import format_report, run_acceptance

        return _report(out / "acceptance.json", run_acceptance(args), format_report)
    if args.e2e_drafter:
        from metrale.bench.drafter import drafter_e2e, format_drafter_e2e

        return _report(out / "drafter_e2e.json", drafter_e2e(args), format_drafter_e2e)
    result = run(args)
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    result["plot"] = str(out / "bench.png") if plot(result, out / "bench.png") else None
    print(table(result))
    print(json.dumps(result))
    return 0


def _report(path: Path, result: dict, text) -> int:
    """Write `result` as JSON to `path`, print `text(result)` then the JSON line."""
    path.write_text(json.dumps(result, indent=2))
    print(text(result))
    print(json.dumps(result))
    return 0


def run(args) -> dict:
    device = torch.device(
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    if args.model is None and args.shape is None:  # the embedded model, trained weights
        from metrale.default_model import default_model_dir

        args.model = str(default_model_dir())
    if args.model:
        model_dir = resolve_model(args.model)  # (a Hub id: its snapshot in the local HF cache)
    else:
        model_dir = write_shape(args.shape, Path(args.out) / "shape")
    alphas = list(args.alpha)
    forced = getattr(args, "forced_acceptance", False)
    drafter = ReplayDrafter({}, alphas[0], vocab_size=2)
    llm = LLM(
        model_dir,
        drafter=drafter,
        device=str(device),
        dtype=args.dtype,
        load_format="safetensors" if args.model else "dummy",
        max_model_len=args.context + 2 * args.max_tokens + 64,
        # (the end-to-end batches too: capped at the step table's largest batch, a batch of 64
        # ran one request at a time; found measuring issue 13)
        max_num_seqs=max([*args.batch_sizes, *args.e2e_batch_sizes]),
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        spec={"num_drafts": args.num_drafts, "dcut": getattr(args, "dcut", False)},
        hybrid_verify_state=getattr(args, "hybrid_verify_state", "write_on_accept"),
        mamba_ssm_cache_dtype=getattr(args, "mamba_ssm_cache_dtype", "float32"),
        **parallel_options(args),
        deterministic=getattr(args, "deterministic", False),
        async_scheduling=getattr(args, "async_scheduling", True),
    )
    try:
        return _measure(llm, drafter, args, device, alphas, forced)
    finally:
        llm.shutdown()


def _measure(llm: LLM, drafter, args, device: torch.device, alphas, forced: bool) -> dict:
    """`run`'s measurements on the engine it built."""
    tp = llm.engine.config.tensor_parallel_size
    drafter.vocab_size = llm.engine.vocab_size
    freeze_startup_heap()  # one engine for the process: no full collections mid-run
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    bw = bandwidth(device)
    wbytes = weight_bytes(llm.engine.runner.model)
    roofline = wbytes / bw
    qs = sorted(set(args.q) | {1, args.num_drafts + 1})
    times = step_times(llm.engine, args.batch_sizes, qs, args.context)
    # the anchor runs rank 0's shard alone: no anchor for a tensor-parallel target
    anchor = (
        None
        if tp > 1
        else anchor_step_times(llm.engine.runner.model, args.batch_sizes, args.context)
    )
    result = {
        "shape": args.shape if not args.model else str(args.model),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(llm.engine.runner.dtype),
        "tensor_parallel_size": tp,  # the roofline counts one rank's weights
        "expert_parallel": tp > 1 and llm.engine.config.expert_parallel,
        "context": args.context,
        "bandwidth_GBps": bw / 1e9,
        "weight_bytes": wbytes,
        "roofline_ms": roofline * 1e3,
        "decode": [
            {
                "batch": b,
                "ms": times[b][1] * 1e3,
                "roofline_ratio": times[b][1] / roofline,
                # the roofline of the weights this batch reads (a MoE batch reads more experts)
                "batch_roofline_ms": batch_weight_bytes(llm.engine.runner.model, b) / bw * 1e3,
                "batch_roofline_ratio": times[b][1]
                / (batch_weight_bytes(llm.engine.runner.model, b) / bw),
                # the plain graph-captured PyTorch step of the same weights (`bench/anchor.py`)
                "anchor_ms": None if anchor is None else anchor[b] * 1e3,
                "anchor_ratio": None if anchor is None else times[b][1] / anchor[b],
            }
            for b in args.batch_sizes
        ],
        "verify_cost": {
            "batch_sizes": list(args.batch_sizes),
            "q": qs,
            "ratio": [[times[b][q] / times[b][1] for q in qs] for b in args.batch_sizes],
            "plain_ms": [times[b][1] * 1e3 for b in args.batch_sizes],
        },
        "e2e": [],
        "alpha": alphas,
        "acceptance": "forced" if forced else "replayed",
        "num_drafts": args.num_drafts,
        "dcut": llm.engine.spec.cfg.dcut,
    }
    if result["dcut"]:
        # D-Cut plans the end-to-end runs with the verify cost curve just measured.
        llm.engine.spec.cost = VerifyCostModel.from_json(result["verify_cost"])
    k = args.num_drafts
    per_slot = args.steady_requests_per_slot or 0  # (the grid's default: closed batches only)
    result["steady_requests_per_slot"] = per_slot
    for a in alphas:
        expected = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
        for b in args.e2e_batch_sizes:
            row = end_to_end(llm, drafter, b, args.max_tokens, a, forced)
            nearest = min(args.batch_sizes, key=lambda x: abs(x - b))
            cost = times[nearest][1] / times[nearest][k + 1]
            row["ideal_speedup"] = expected * cost
            # Short generations cut the last verifies short, so the measured acceptance length
            # sits below alpha's; the ideal at the measured length separates that from engine
            # overhead.
            row["ideal_speedup_at_measured_acceptance"] = row["mean_acceptance_length"] * cost
            if per_slot:
                row["steady"] = _steady(llm, drafter, b, per_slot, args.max_tokens, a, forced)
            result["e2e"].append(row)
    runner = llm.engine.runner
    if device.type == "cuda" and tp == 1:  # kernels of one batch-1 decode step (profiler)
        launches = step_launches(llm, 1, args.context)
        result["launches_batch1"] = launches["kernels"]
        result["launches_batch1_by_kernel"] = launches["by_name"]  # where a fusion would pay
    result["graph_refusals"] = runner.graph_refusals
    result["graph_capture"] = capture_report(runner)
    result["deterministic"] = llm.engine.config.deterministic
    result["async_scheduling"] = llm.engine.config.async_scheduling
    result["peak_memory_bytes"] = (
        torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    )
    if runner.states is not None:
        result["hybrid_verify_state"] = llm.engine.config.hybrid_verify_state
        result["state_pool_bytes"] = runner.states.nbytes()
        ssm = runner.states.pool.ssm
        result["ssm_state_dtype"] = str(ssm[0].dtype).removeprefix("torch.") if ssm else None
    return result


def _steady(
    llm: LLM, drafter: ReplayDrafter, slots: int, per_slot: int, max_tokens: int, alpha, forced
) -> dict:
    """`drafter.steady_state` at a replayed or forced acceptance: `per_slot` x `slots` random
    prompts, their plain continuations (as long as the longest request) recorded for the replay
    drafter, then streamed through `slots` slots with and without speculation."""
    prompts = random_prompts(slots * per_slot, llm.engine.vocab_size, seed=1000 + slots)
    longest = max(steady_lengths(len(prompts), max_tokens, seed=slots))
    params = SamplingParams(temperature=0.0, max_tokens=longest, ignore_eos=True, speculative=False)
    with concurrency(llm, slots):
        plain = llm.generate(prompts, params, use_tqdm=False)
    drafter.record({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)}, alpha)
    with forcing(llm.engine.runner, alpha, seed=slots, on=forced):
        return steady_state(llm, prompts, slots, max_tokens)


def replay_collapsed(row: dict) -> bool:
    """Whether a replayed end-to-end row's drafts mostly stopped matching the target: its first
    drafts were accepted at under half of alpha (which a replayed draft that matches is), so
    its speedup says little about the engine at that alpha. False where nothing was verified
    (D-Cut drafted nothing) or the row predates the rate."""
    rate = row.get("first_draft_acceptance")
    return row["acceptance"] == "replayed" and rate is not None and rate < row["alpha"] / 2


def table(result: dict) -> str:
    tp = result.get("tensor_parallel_size", 1)
    split = ", experts split across them" if result.get("expert_parallel") else ""
    ranks = f" x {tp} ranks{split} (roofline of one rank's weights)" if tp > 1 else ""
    lines = [
        f"{result['shape']} on {result['device']}{ranks} "
        f"({result['dtype']}, {scheduling_label(result)}), "
        f"bandwidth {result['bandwidth_GBps']:.0f} GB/s, roofline {result['roofline_ms']:.3f} ms"
    ]
    qs = result["verify_cost"]["q"]
    lines.append(
        "batch  decode_ms  x_roofline  x_batch_roofline  x_anchor  "
        + "  ".join(f"q={q:<3d}" for q in qs)
    )
    for d, ratios in zip(result["decode"], result["verify_cost"]["ratio"]):
        anchor = "       -" if d.get("anchor_ratio") is None else f"{d['anchor_ratio']:8.2f}"
        batch_ratio = d.get("batch_roofline_ratio", d["roofline_ratio"])
        lines.append(
            f"{d['batch']:5d}  {d['ms']:9.3f}  {d['roofline_ratio']:10.2f}  {batch_ratio:16.2f}  "
            f"{anchor}  " + "  ".join(f"{r:5.2f}" for r in ratios)
        )
    capture = result.get("graph_capture") and capture_line(result["graph_capture"])
    if capture:
        lines.append(capture)
    if result.get("launches_batch1") is not None:
        lines.append(f"kernel launches per batch-1 decode step: {result['launches_batch1']}")
    for e in result["e2e"]:
        lines.append(
            f"e2e {e['acceptance']} alpha {e['alpha']} batch {e['batch']}: decode "
            f"{e['tpot_ms_plain']:.2f} -> {e['tpot_ms_spec']:.2f} ms/token, speedup "
            f"{e['decode_speedup']:.2f} (ideal {e['ideal_speedup']:.2f}, "
            f"{e['ideal_speedup_at_measured_acceptance']:.2f} at the measured acceptance); "
            f"end to end {e['tokens_per_s_plain']:.1f} -> {e['tokens_per_s_spec']:.1f} tok/s "
            f"({e['speedup']:.2f}x); acceptance length {e['mean_acceptance_length']:.2f}, "
            f"{e['graph_refusals']} refusals, {e['distinct_verify_keys']} verify keys"
        )
        if replay_collapsed(e):
            why = (
                ": in 16-bit floats a verify row and a decode row round near-ties differently"
                if "16" in result["dtype"]
                else ""
            )
            lines.append(
                f"    (the replayed drafts stopped matching the target{why}: first drafts "
                f"accepted {e['first_draft_acceptance']:.0%} against alpha {e['alpha']}; "
                "--forced-acceptance measures the step at this alpha)"
            )
        if "steady" in e:
            s = e["steady"]
            lines.append(
                f"    steady state, {s['requests']} requests through {e['batch']} slots: "
                f"{s['tokens_per_s_plain']:.1f} -> {s['tokens_per_s_spec']:.1f} tok/s, speedup "
                f"{s['speedup']:.2f}; acceptance length {s['mean_acceptance_length']:.2f}, "
                f"verify steps {s['verify_step_share']:.0%} of steps"
            )
    if "state_pool_bytes" in result:
        peak = result["peak_memory_bytes"]
        lines.append(
            f"hybrid verify state {result['hybrid_verify_state']}: state pool "
            f"{result['state_pool_bytes'] / 2**30:.2f} GiB ({result['ssm_state_dtype']})"
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
    for alpha in result["alpha"]:
        rows = [e for e in e2e if e["alpha"] == alpha]
        batches = [e["batch"] for e in rows]
        left.plot(batches, [e["decode_speedup"] for e in rows], "o-", label=f"alpha {alpha}")
        left.plot(batches, [e["ideal_speedup"] for e in rows], "s--", label=f"ideal {alpha}")
    left.set(
        xscale="log",
        xlabel="batch size",
        ylabel="decode speedup",
        title=f"speculation ({result['acceptance']}), K={result['num_drafts']}",
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
