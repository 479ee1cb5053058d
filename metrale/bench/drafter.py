"""`metrale bench --e2e-drafter mtp|ngram`: real tokens/s of a real drafter on a real checkpoint.

The replay drafter of `bench.py` fixes the acceptance to measure the engine; this measures the
model: held-out prompts (`acceptance.heldout_prompts`), greedy, one engine with the drafter, each
batch size run with `SamplingParams(speculative=False)` and with speculation, each timed as the
median of three runs, interleaved with the other mode's, after a warm-up run of each (graphs
captured, caches warm). Reports tokens/s
both ways, the speedup (end to end, and of the decode phase alone: time per output token with the
prefill subtracted), the mean acceptance length, and how many outputs equal the non-speculative
ones (bf16 verify rows round differently from decode rows, so near-ties may flip; float32 never
does).

Time per output token is given two ways. `tpot_ms_*` and `decode_x` time the batch: its decode
phase, first token to the last sequence's last, over the tokens of one sequence.
`request_tpot_ms_*` and `req_tpot_x` are what vLLM's and SGLang's serving benchmarks call TPOT:
each request's own time from its first token to its last over its tokens after the first,
averaged over the requests (the engine's request telemetry: from the step that made its first
token to the one that made its last, whenever the caller got their text). A
closed batch tells them apart: plain decoding ends every sequence at the same step, while with
speculation a sequence whose drafts are often accepted ends early, and the batch's time is its
slowest sequence's.

Those runs are closed batches: the batch ends with its slowest sequence, and a sequence whose
drafts are seldom accepted keeps the others' slots idle while it finishes. A serving engine sees
arrivals instead, so each batch size is also run in steady state (`--steady-requests-per-slot`
N > 0): N x batch requests through `batch` slots, a new request taking each freed slot, the
tokens/s of both modes over the whole run (prefills included, as a server pays them), with
output lengths that vary from request to request.
"""

from __future__ import annotations

import random
import statistics
import sysconfig
import time
from contextlib import contextmanager
from pathlib import Path

from metrale.api import LLM
from metrale.bench.acceptance import heldout_prompts
from metrale.bench.e2e import REPEATS, prefill_seconds
from metrale.bench.timing import (
    capture_line,
    capture_report,
    parallel_options,
    scheduling_label,
)
from metrale.config import SamplingParams
from metrale.engine.calibrate import sync
from metrale.engine.heap import freeze_startup_heap


@contextmanager
def concurrency(llm: LLM, slots: int):
    """At most `slots` sequences run at once (the rest wait, as a server's queue does)."""
    scheduler = llm.engine.scheduler
    before, scheduler.max_num_seqs = scheduler.max_num_seqs, min(slots, scheduler.max_num_seqs)
    try:
        yield
    finally:
        scheduler.max_num_seqs = before


def timed_pair(llm: LLM, prompts, plain_params, spec_params, width: int | None = None):
    """(plain outputs, seconds, speculative outputs, seconds, speculation figures) of the same
    prompts without and with speculation, each the median of `REPEATS` runs, the two modes'
    runs interleaved after a warm-up run of each: the host's speed drifts by tens of percent
    over seconds, and interleaving gives both modes the same drift. The figures: the mean
    acceptance length, the share of the speculative runs' steps that verified drafts (D-Cut
    runs the others as plain steps) and D-Cut's measured host cost of drafting `width` sequences
    (default: every prompt)."""
    engine = llm.engine
    tel = engine.telemetry.spec
    device = engine.runner.device
    llm.generate(prompts, plain_params, use_tqdm=False)  # warm-ups: graphs, caches
    llm.generate(prompts, spec_params, use_tqdm=False)

    def counters() -> list:
        return [
            tel.num_drafts,
            tel.num_accepted_tokens,
            tel.verify_steps,
            engine.telemetry.steps,
            tel.host_gated_plans,
        ]

    decode = engine.telemetry.request.decode  # each request's first token to its last
    times: dict[bool, list[float]] = {False: [], True: []}
    per_request: dict[bool, list[float]] = {False: [], True: []}
    outs, spec_counts = {}, [0] * 5
    for _ in range(REPEATS):
        for speculative, params in ((False, plain_params), (True, spec_params)):
            before = counters()
            total, count = decode.total, decode.count
            sync(device)
            start = time.perf_counter()
            outs[speculative] = llm.generate(prompts, params, use_tqdm=False)
            sync(device)
            times[speculative].append(time.perf_counter() - start)
            finished = decode.count - count
            per_request[speculative].append((decode.total - total) / max(finished, 1))
            if speculative:  # the counters of the speculative runs alone
                spec_counts = [c + a - b for c, a, b in zip(spec_counts, counters(), before)]
    drafts, accepted, verify_steps, steps, gated = spec_counts
    host = engine.spec.host.seconds(width or len(prompts)) if engine.spec is not None else None
    figures = {
        "mean_acceptance_length": 1 + accepted / max(drafts, 1),
        "verify_step_share": verify_steps / max(steps, 1),
        "host_ms_drafting_batch": None if host is None else host * 1e3,
        "host_gated_plans": gated,
    }
    for speculative, name in ((False, "plain"), (True, "spec")):
        figures[f"request_decode_s_{name}"] = statistics.median(per_request[speculative])
    t_plain, t_spec = (statistics.median(times[m]) for m in (False, True))
    return outs[False], t_plain, outs[True], t_spec, figures


def steady_lengths(count: int, max_tokens: int, seed: int) -> list[int]:
    """`count` seeded output lengths in [max_tokens / 2, 3 max_tokens / 2] (`steady_state`)."""
    rng = random.Random(seed)
    return [rng.randint(max(max_tokens // 2, 1), max_tokens * 3 // 2) for _ in range(count)]


def steady_state(llm: LLM, prompts: list[list[int]], slots: int, max_tokens: int) -> dict:
    """Tokens/s with and without speculation when `prompts` stream through `slots` slots.

    Each request asks for a seeded length in [max_tokens / 2, 3 max_tokens / 2], as real
    outputs vary: with equal lengths, plain decoding would finish and admit whole waves of
    requests at once (one prefill step per wave) while speculation, whose sequences finish
    apart, admits them one at a time, and the comparison would measure that artefact."""
    lengths = steady_lengths(len(prompts), max_tokens, seed=slots)

    def params(speculative: bool) -> list[SamplingParams]:
        return [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, speculative=speculative)
            for n in lengths
        ]

    with concurrency(llm, slots):
        _, t_plain, _, t_spec, figures = timed_pair(
            llm, prompts, params(False), params(True), width=slots
        )
    tokens = sum(lengths)
    for name in ("plain", "spec"):  # lengths vary here: no time per token from them
        figures.pop(f"request_decode_s_{name}")
    return {
        "requests": len(prompts),
        "output_tokens": tokens,
        "tokens_per_s_plain": tokens / t_plain,
        "tokens_per_s_spec": tokens / t_spec,
        "speedup": t_plain / t_spec,
        **figures,
    }


def drafter_e2e(args) -> dict:
    """Fields of `args`: model, e2e_drafter, num_drafts, e2e_batch_sizes, max_tokens,
    prompt_tokens, heldout, device, dtype, kv_cache_memory_gb, steady_requests_per_slot."""
    if args.model is None:  # the embedded model and its drafters
        from metrale.default_model import default_model_dir

        args.model = str(default_model_dir())
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.prompt_tokens + args.max_tokens + 64,
        max_num_seqs=max(args.e2e_batch_sizes),
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        spec={"method": args.e2e_drafter, "num_drafts": args.num_drafts},
        deterministic=getattr(args, "deterministic", False),
        async_scheduling=getattr(args, "async_scheduling", True),
        **parallel_options(args),
    )
    try:
        return _drafter_e2e(llm, args)
    finally:
        llm.shutdown()  # (a tensor-parallel engine's workers stop here, not at exit)


def _drafter_e2e(llm: LLM, args) -> dict:
    """`drafter_e2e`'s measurements on the engine it built."""
    heldout = args.heldout or sysconfig.get_paths()["stdlib"]
    per_slot = 4 if args.steady_requests_per_slot is None else args.steady_requests_per_slot
    prompts_all = heldout_prompts(
        Path(heldout),
        llm.tokenizer,
        max(args.e2e_batch_sizes) * max(per_slot, 1),
        args.prompt_tokens,
    )
    freeze_startup_heap()  # one engine for the process: no full collections mid-run
    rows = []
    for batch in args.e2e_batch_sizes:
        prompts = prompts_all[:batch]
        base = dict(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        plain, t_plain, spec, t_spec, figures = timed_pair(
            llm, prompts, SamplingParams(**base, speculative=False), SamplingParams(**base)
        )
        # the decode phase alone: the prefill and first token subtracted from both runs
        t_prefill = prefill_seconds(llm, prompts)
        decode_plain, decode_spec = t_plain - t_prefill, t_spec - t_prefill
        steps = max(args.max_tokens - 1, 1)
        tokens = batch * args.max_tokens
        rows.append(
            {
                "batch": batch,
                "tokens_per_s_plain": tokens / t_plain,
                "tokens_per_s_spec": tokens / t_spec,
                "speedup": t_plain / t_spec,
                "prefill_ms": t_prefill * 1e3,
                "tpot_ms_plain": decode_plain / steps * 1e3,
                "tpot_ms_spec": decode_spec / steps * 1e3,
                "decode_speedup": decode_plain / decode_spec,
                # time per output token as a serving benchmark counts it: each request's own
                # (first token to last), averaged over the requests
                "request_tpot_ms_plain": figures.pop("request_decode_s_plain") / steps * 1e3,
                "request_tpot_ms_spec": figures.pop("request_decode_s_spec") / steps * 1e3,
                **figures,
                "identical_outputs": sum(
                    a.outputs[0].token_ids == b.outputs[0].token_ids
                    for a, b in zip(plain, spec, strict=True)
                )
                / batch,
            }
        )
        if per_slot > 0:
            steady = prompts_all[: batch * per_slot]
            rows[-1]["steady"] = steady_state(llm, steady, batch, args.max_tokens)
    return {
        "model": str(args.model),
        "drafter": args.e2e_drafter,
        "num_drafts": args.num_drafts,
        "device": str(llm.engine.runner.device),
        "dtype": str(llm.engine.runner.dtype),
        "async_scheduling": llm.engine.config.async_scheduling,
        "tensor_parallel_size": llm.engine.config.tensor_parallel_size,
        "expert_parallel": llm.engine.config.expert_parallel,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "heldout": str(heldout),
        "steady_requests_per_slot": per_slot,
        "e2e": rows,
        "graph_capture": capture_report(llm.engine.runner),
    }


def _spec_columns(row: dict) -> str:
    """Share of steps verifying, D-Cut's host cost of drafting the batch (`-` before it measured
    one), and the plans it dropped for it."""
    ms = row["host_ms_drafting_batch"]
    host = "      -" if ms is None else f"{ms:7.3f}"
    return f"{row['verify_step_share']:12.2f}  {host}  {row['host_gated_plans']:5d}"


def format_drafter_e2e(result: dict) -> str:
    lines = [
        f"{result['drafter']} K={result['num_drafts']} on {result['model']} "
        f"({result['device']}, {result['dtype']}, {scheduling_label(result)})",
        "batch  plain_tok_s  spec_tok_s  speedup  tpot_plain_ms  tpot_spec_ms  decode_x  "
        "req_tpot_x  accept_len  identical  verify_share  host_ms  gated",
    ]
    for r in result["e2e"]:
        request_x = r["request_tpot_ms_plain"] / r["request_tpot_ms_spec"]
        lines.append(
            f"{r['batch']:5d}  {r['tokens_per_s_plain']:11.1f}  {r['tokens_per_s_spec']:10.1f}  "
            f"{r['speedup']:7.2f}  {r['tpot_ms_plain']:13.3f}  {r['tpot_ms_spec']:12.3f}  "
            f"{r['decode_speedup']:8.2f}  {request_x:10.2f}  {r['mean_acceptance_length']:10.2f}  "
            f"{r['identical_outputs']:9.2f}  {_spec_columns(r)}"
        )
    capture = result.get("graph_capture") and capture_line(result["graph_capture"])
    if capture:
        lines.append(capture)
    steady = [r for r in result["e2e"] if "steady" in r]
    if steady:
        lines.append(
            f"steady state ({result['steady_requests_per_slot']} requests per slot):\n"
            "slots  requests  plain_tok_s  spec_tok_s  speedup  accept_len  "
            "verify_share  host_ms  gated"
        )
        for r in steady:
            s = r["steady"]
            lines.append(
                f"{r['batch']:5d}  {s['requests']:8d}  {s['tokens_per_s_plain']:11.1f}  "
                f"{s['tokens_per_s_spec']:10.1f}  {s['speedup']:7.2f}  "
                f"{s['mean_acceptance_length']:10.2f}  {_spec_columns(s)}"
            )
    return "\n".join(lines)
