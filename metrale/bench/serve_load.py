"""Load the OpenAI-compatible server as tests/test_server.py does, on any device: 64 concurrent
streaming clients, 4 completions each, speculation on; report requests/s and tokens/s and check
every greedy text against LLM.generate of the same request alone. Last stdout line: JSON.

    python -m metrale.bench.serve_load [--model DIR] [--device cuda] [--spec ngram]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import threading
import time

import httpx
import uvicorn

from metrale import LLM, SamplingParams
from metrale.server import build


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--spec", default="ngram")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()

    n = args.clients * args.requests_per_client
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(3, 24))] for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    alone = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=1)
    expected = [o.outputs[0].text for o in alone.generate(prompts, params, use_tqdm=False)]
    del alone

    app, loop = build(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.clients,
        spec={"method": args.spec, "num_drafts": 3},
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)

    async def client(http: httpx.AsyncClient, ids: list[int]) -> list[tuple[int, str]]:
        out = []
        for i in ids:
            body = {
                "prompt": prompts[i],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            }
            text = ""
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text += json.loads(line[6:])["choices"][0]["text"]
            out.append((i, text))
        return out

    async def run():
        limits = httpx.Limits(max_connections=args.clients)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits
        ) as http:
            return await asyncio.gather(
                *(client(http, list(range(c, n, args.clients))) for c in range(args.clients))
            )

    start = time.perf_counter()
    results = [r for group in asyncio.run(run()) for r in group]
    seconds = time.perf_counter() - start
    mismatches = sum(text != expected[i] for i, text in results)
    spec = loop.engine.telemetry.spec
    server.should_exit = True
    report = {
        "device": str(loop.engine.runner.device),
        "requests": n,
        "seconds": seconds,
        "requests_per_s": n / seconds,
        "tokens_per_s": n * args.max_tokens / seconds,
        "mismatches_vs_llm_generate": mismatches,
        "mean_acceptance_length": spec.mean_acceptance_length,
    }
    print(
        f"{n} streamed requests from {args.clients} clients on {report['device']}: "
        f"{report['requests_per_s']:.1f} requests/s, {report['tokens_per_s']:.1f} tokens/s, "
        f"{mismatches} mismatches"
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
