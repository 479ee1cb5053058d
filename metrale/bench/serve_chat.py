"""`metrale bench serve --multi-turn`: multi-turn chat traffic, the workload prefix caching is
for. Every client's conversation opens with the same system prompt of `--system-prompt-len`
tokens; it then sends `--num-turns` user turns of `--input-len` random words, each request
carrying the whole conversation so far (system prompt, earlier turns, the replies it got), and
waits for each reply before the next turn. All clients start at once, or with
`--think-time S` spread over S seconds, each then pausing a random time (exponential, mean S)
before each next turn, as people do: turns then arrive spread out, as a server sees them, rather
than in waves of every client at once.

Requests go to `/v1/completions` with the conversation as a plain transcript (any OpenAI-
compatible server takes it, and every streamed chunk is a token, so TTFT is the first chunk's
arrival). Greedy, `--output-len` tokens per reply (`--ignore-eos` to make them all that long).
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from metrale.bench.serve_bench import (
    _WORDS,
    one_request,
    percentile,
    served_model,
    spec_counters,
)


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def system_prompt(num_tokens: int, rng: random.Random, tokenizer=None) -> str:
    """Random words of about `num_tokens` tokens: exactly sized (the fewest words reaching it)
    with the server's tokenizer, else one word per token."""
    if tokenizer is None:
        return words(rng, num_tokens)
    pool = [rng.choice(_WORDS) for _ in range(4 * num_tokens + 8)]
    low, high = 1, len(pool)  # the fewest words whose text has >= num_tokens tokens
    while low < high:
        mid = (low + high) // 2
        if len(tokenizer.encode(" ".join(pool[:mid]))) >= num_tokens:
            high = mid
        else:
            low = mid + 1
    return " ".join(pool[:low])


def transcript(system: str, turns: list[tuple[str, str]], user: str) -> str:
    """The conversation as one prompt: system prompt, (user, reply) pairs, the new user turn."""
    parts = [f"System: {system}\n"]
    for question, reply in turns:
        parts.append(f"User: {question}\nAssistant:{reply}\n")
    parts.append(f"User: {user}\nAssistant:")
    return "".join(parts)


async def conversation(http: httpx.AsyncClient, args, client: int, system: str) -> list[dict]:
    rng = random.Random(f"{args.seed}-{client}")
    turns: list[tuple[str, str]] = []
    results = []
    if args.think_time > 0:  # clients start spread over one think time
        await asyncio.sleep(rng.uniform(0, args.think_time))
    for turn in range(args.num_turns):
        if turn and args.think_time > 0:  # the user reads the reply, types the next turn
            await asyncio.sleep(rng.expovariate(1 / args.think_time))
        user = words(rng, args.input_len)
        result = await one_request(http, args, transcript(system, turns, user))
        results.append({**result, "client": client, "turn": turn})
        if not result["ok"]:
            break
        turns.append((user, result["text"]))
    return results


async def run_chat(args, tokenizer=None):
    """(one result per request, with its client, turn and reply text; the run's seconds; the
    server's counters before and after; the system prompt's words and tokens)."""
    if args.num_clients < 1 or args.num_turns < 1:
        raise ValueError("--num-clients and --num-turns must be >= 1")
    system = system_prompt(args.system_prompt_len, random.Random(args.seed), tokenizer)
    info = {"system_prompt_words": len(system.split())}
    if tokenizer is not None:
        info["system_prompt_tokens"] = len(tokenizer.encode(system))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.num_clients, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=args.base_url,
        headers=headers,
        timeout=httpx.Timeout(args.timeout),
        limits=limits,
    ) as http:
        if args.served_model is None:
            args.served_model = await served_model(http)
        before = await spec_counters(http)
        start = time.perf_counter()
        groups = await asyncio.gather(
            *(conversation(http, args, c, system) for c in range(args.num_clients))
        )
        duration = time.perf_counter() - start
        after = await spec_counters(http)
    return [r for group in groups for r in group], duration, before, after, info


def by_turn_ttft(results: list[dict]) -> list[float | None]:
    """Median TTFT (ms) of each turn's requests: turn 0 finds only the system prompt cached."""
    turns = max((r["turn"] for r in results), default=-1) + 1
    out = []
    for t in range(turns):
        value = percentile([r["ttft"] for r in results if r["ok"] and r["turn"] == t], 50)
        out.append(None if value is None else value * 1e3)
    return out
