"""`metrale bench serve --base-url URL`: an OpenAI-API load generator, usable against any
OpenAI-compatible server (metrale's, vLLM's, ...), so the numbers compare with vLLM's
`bench serve`. Streamed completions at a request rate (Poisson arrivals, seeded) or all at once,
optionally capped in concurrency; prompts from a file (one per line) or random words; or
multi-turn chat over a shared system prompt (`--multi-turn`, `serve_chat.py`). Reports TTFT,
TPOT, ITL and end-to-end latency percentiles, requests/s and output tokens/s, and, where the
server exports them, the speculative counters' acceptance and the prefix cache's hit rate over
the run. With `--model`/`--shape` instead of `--base-url` it starts `metrale serve` itself, and
with `--compare-prefix-caching` runs the load twice, with and without caching
(`serve_launch.py`)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from metrale.cli_config import arg_type

PERCENTILES = (50, 90, 99)
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "for",
    "on",
    "that",
    "with",
    "as",
    "are",
    "this",
    "be",
    "at",
    "by",
    "it",
    "from",
    "or",
    "an",
]


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def make_prompts(args, rng: random.Random) -> list[str]:
    if args.prompt_file:
        lines = [ln for ln in Path(args.prompt_file).read_text().splitlines() if ln.strip()]
        if not lines:
            raise ValueError(f"--prompt-file {args.prompt_file}: no prompts in it")
        return [lines[i % len(lines)] for i in range(args.num_prompts)]
    return [
        " ".join(rng.choice(_WORDS) for _ in range(args.input_len)) for _ in range(args.num_prompts)
    ]


async def one_request(http: httpx.AsyncClient, args, prompt: str) -> dict:
    body = {
        "model": args.served_model,
        "prompt": prompt,
        "max_tokens": args.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    arrivals, tokens, text = [], 0, []
    try:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                # the server's reason with its status (vLLM's benchmark keeps the error text)
                return {"ok": False, "status": resp.status_code, "reason": await _reason(resp)}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):  # a token chunk (its text may be empty: a held byte)
                    arrivals.append(time.perf_counter())
                    text.append(chunk["choices"][0].get("text") or "")
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return {"ok": False, "status": type(e).__name__}
    end = time.perf_counter()
    if not arrivals:
        return {"ok": False, "status": "no tokens"}
    tokens = tokens or len(arrivals)
    ttft = arrivals[0] - start
    return {
        "ok": True,
        "ttft": ttft,
        "e2e": end - start,
        "tpot": (end - start - ttft) / (tokens - 1) if tokens > 1 else None,
        "itl": [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)],
        "tokens": tokens,
        "text": "".join(text),
    }


def _failures(failed: list[dict]) -> list[str]:
    """One line per failure status: its count and the server's first reason (a reason may name
    a per-request number, so reasons are not grouped)."""
    by_status: dict[str, list[dict]] = {}
    for r in failed:
        by_status.setdefault(str(r["status"]), []).append(r)
    lines = []
    for status, rs in sorted(by_status.items()):
        reason = next((r["reason"] for r in rs if r.get("reason")), "")
        lines.append(f"{status} x{len(rs)}" + (f": {reason}" if reason else ""))
    return lines


async def _reason(resp: httpx.Response) -> str:
    """An error response's message: OpenAI's `error.message`, else its first 200 characters."""
    try:
        body = (await resp.aread()).decode(errors="replace")
    except httpx.HTTPError:
        return ""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body
    return " ".join(str(message).split())[:200]


COUNTERS = (
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
)


async def spec_counters(http: httpx.AsyncClient) -> dict[str, float]:
    """The speculative and prefix-cache counters from /metrics (metrale's or vLLM's names),
    where the server exports them."""
    try:
        text = (await http.get("/metrics")).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        metric, _, value = line.partition(" ")
        for prefix in ("metrale:", "vllm:"):
            for name in COUNTERS:
                if metric.split("{")[0] in (prefix + name, prefix + name + "_total"):
                    out[name] = out.get(name, 0.0) + float(value)
    return out


def counter_rates(before: dict, after: dict) -> dict:
    """Over the run: the drafts' acceptance rate and the prefix cache's hit rate (None where
    the server exports no such counters or nothing moved)."""

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    drafted, queries = delta(COUNTERS[0]), delta(COUNTERS[2])
    return {
        "spec_acceptance_rate": delta(COUNTERS[1]) / drafted if drafted else None,
        "prefix_cache_queries": queries if COUNTERS[2] in after else None,
        "prefix_cache_hits": delta(COUNTERS[3]) if COUNTERS[3] in after else None,
        "prefix_cache_hit_rate": delta(COUNTERS[3]) / queries if queries else None,
    }


async def run_load(args, tokenizer=None) -> tuple[dict, dict]:
    """Run the workload against `args.base_url`: (the report, each request's reply text by
    key). `tokenizer`: the server's, when known (it sizes the multi-turn system prompt)."""
    if not args.multi_turn:
        results, duration, before, after = await _random_load(args)
        report = summarise(args, results, duration, before, after)
        return report, {i: r.get("text") for i, r in enumerate(results)}
    from metrale.bench.serve_chat import by_turn_ttft, run_chat

    results, duration, before, after, info = await run_chat(args, tokenizer)
    report = summarise(args, results, duration, before, after)
    report.update(
        workload="multi-turn",
        num_clients=args.num_clients,
        num_turns=args.num_turns,
        think_time_s=args.think_time,
        p50_ttft_ms_by_turn=by_turn_ttft(results),
        **info,
    )
    return report, {(r["client"], r["turn"]): r.get("text") for r in results}


async def served_model(http: httpx.AsyncClient) -> str:
    """The first model `/v1/models` lists, or a ValueError naming the way out."""
    reply = await http.get("/v1/models")
    try:
        return reply.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(
            f"{reply.url}: no model listed (HTTP {reply.status_code}); give --served-model"
        ) from None


async def _random_load(args):
    if not args.request_rate > 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise ValueError("--request-rate must be > 0 and --max-concurrency >= 1")
    rng = random.Random(args.seed)
    prompts = make_prompts(args, rng)
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.timeout)
    # as many connections as requests may be in flight: waiting for a pooled connection would
    # count in TTFT (httpx's default pool holds 100)
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=timeout, limits=limits
    ) as http:
        if args.served_model is None:
            args.served_model = await served_model(http)
        before = await spec_counters(http)

        async def launch(prompt: str) -> dict:
            async with limit:
                return await one_request(http, args, prompt)

        start, tasks = time.perf_counter(), []
        for prompt in prompts:
            tasks.append(asyncio.create_task(launch(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await spec_counters(http)
    return results, duration, before, after


def summarise(args, results: list[dict], duration: float, before: dict, after: dict) -> dict:
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    report: dict = {
        "workload": "random",
        "base_url": args.base_url,
        "model": args.served_model,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "failures": _failures([r for r in results if not r["ok"]]),
        "duration_s": duration,
        "request_rate": None if args.request_rate == float("inf") else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "requests_per_s": len(ok) / duration,
        "output_tokens_per_s": tokens / duration,
    }
    series = {
        "ttft": [r["ttft"] for r in ok],
        "tpot": [r["tpot"] for r in ok if r["tpot"] is not None],
        "itl": [gap for r in ok for gap in r["itl"]],
        "e2e": [r["e2e"] for r in ok],
    }
    for name, values in series.items():
        report[f"mean_{name}_ms"] = sum(values) / len(values) * 1e3 if values else None
        for p in PERCENTILES:
            value = percentile(values, p)
            report[f"p{p}_{name}_ms"] = None if value is None else value * 1e3
    report.update(counter_rates(before, after))
    return report


def format_report(report: dict) -> str:
    lines = [
        f"{report['completed']}/{report['num_prompts']} requests in {report['duration_s']:.2f} s: "
        f"{report['requests_per_s']:.2f} req/s, {report['output_tokens_per_s']:.1f} output tok/s"
    ]
    lines.append("metric   mean     p50      p90      p99   (ms)")
    for name in ("ttft", "tpot", "itl", "e2e"):
        cells = [report[f"mean_{name}_ms"]] + [report[f"p{p}_{name}_ms"] for p in PERCENTILES]
        lines.append(
            f"{name:6s}" + "".join("      -" if c is None else f" {c:8.2f}" for c in cells)
        )
    if report["spec_acceptance_rate"] is not None:
        lines.append(f"speculative acceptance rate: {report['spec_acceptance_rate']:.3f}")
    if report.get("prefix_cache_hit_rate") is not None:
        lines.append(f"prefix cache hit rate: {report['prefix_cache_hit_rate']:.3f}")
    if report.get("p50_ttft_ms_by_turn"):
        cells = " ".join("-" if v is None else f"{v:.1f}" for v in report["p50_ttft_ms_by_turn"])
        lines.append(f"ttft p50 by turn (ms): {cells}")
    if report["failures"]:
        lines.append(f"failures: {', '.join(report['failures'])}")
    return "\n".join(lines)


# (a 0 `--output-len` failed every request with a 400 that named no flag: found in review)
_COUNT = arg_type(int, lambda v: v > 0, "a positive integer")
_SECONDS = arg_type(float, lambda v: 0 < v < float("inf"), "a positive number of seconds")


def add_serve_bench_args(p) -> None:
    p.add_argument("--base-url", default=None, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="instead: start `metrale serve` on this model")
    p.add_argument(
        "--shape", default=None, help="instead: start it on random weights of this bench shape"
    )
    p.add_argument(
        "--server-args",
        default="",
        help='more `metrale serve` flags, one string (e.g. "--kv-cache-memory-gb 40")',
    )
    p.add_argument(
        "--compare-prefix-caching",
        action="store_true",
        help="run twice (servers started here), with and without prefix caching",
    )
    p.add_argument(
        "--launch-timeout", type=float, default=900.0, help="seconds a started server may take"
    )
    p.add_argument(
        "--multi-turn",
        action="store_true",
        help="multi-turn chat: clients share a system prompt, each resends its conversation",
    )
    p.add_argument("--num-clients", type=int, default=64, help="multi-turn: conversations")
    p.add_argument("--num-turns", type=int, default=4, help="multi-turn: user turns each")
    p.add_argument(
        "--system-prompt-len", type=int, default=2000, help="multi-turn: shared prompt tokens"
    )
    p.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="multi-turn: mean seconds a client pauses before each next turn (0: none)",
    )
    p.add_argument("--served-model", default=None, help="model name (default: /v1/models' first)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=_COUNT, default=100, help="requests to send")
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: all)"
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--prompt-file", default=None, help="one prompt per line (else random words)")
    p.add_argument(
        "--input-len", type=_COUNT, default=64, help="words per random prompt (or user turn)"
    )
    p.add_argument("--output-len", type=_COUNT, default=64, help="max_tokens per request")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM, metrale)")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and arrivals")
    p.add_argument("--timeout", type=_SECONDS, default=600.0, help="seconds per request at most")
    p.add_argument("--out", default=None, help="also write the JSON report here")


def main(args) -> int:
    from metrale.bench.serve_launch import format_comparison, run

    try:
        report = run(args)
    except httpx.TransportError as e:  # refused, unresolvable, timed out: no traceback
        url = getattr(args, "base_url", None) or "the launched server"
        raise ValueError(f"cannot reach the server at {url}: {e!r}") from None
    compared = "with_prefix_caching" in report
    print(format_comparison(report) if compared else format_report(report))
    text = json.dumps(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    runs = [report]
    if compared:
        runs = [report["with_prefix_caching"], report["without_prefix_caching"]]
    return 0 if all(r["completed"] for r in runs) else 1
