"""`metrale bench serve --model DIR | --shape NAME`: start `metrale serve` in a process of its own
(its engine thread never shares the interpreter with the load generator), wait until /health
answers, run the load against it, stop it. `--compare-prefix-caching` does that twice, with
`--prefix-caching` then `--no-prefix-caching`, and reports both runs, the ratio of their TTFT
p50, and how many replies were identical (greedy: all of them should be).

A `--shape` runs random weights of a published shape (`bench/shapes.py`, `--load-format dummy`).
`--server-args` passes any other `metrale serve` flags; `--max-num-seqs` defaults to the load's
concurrency so that every client runs at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from metrale.bench.serve_bench import run_load
from metrale.hub import resolve_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_dir(args) -> tuple[Path, list[str]]:
    """The checkpoint directory to serve and the flags it needs (random weights for a shape)."""
    if args.shape is not None:
        from metrale.bench.shapes import write_shape

        folder = Path(tempfile.mkdtemp(prefix="metrale-shape-"))
        return write_shape(args.shape, folder / args.shape), ["--load-format", "dummy"]
    return resolve_model(args.model), []  # (a Hub id: its snapshot in the local HF cache)


@contextlib.contextmanager
def launched(args, model: Path, flags: list[str]):
    """`metrale serve` of `model` on a free loopback port with `flags` and `--server-args`;
    yields its base URL and stops it after (its log goes to a temporary file, shown if it
    fails)."""
    flags = flags + shlex.split(args.server_args or "")
    if "--max-num-seqs" not in flags:
        flags += ["--max-num-seqs", str(args.num_clients if args.multi_turn else 64)]
    port = _free_port()
    cmd = [sys.executable, "-m", "metrale.cli", "serve", "--model", str(model)]
    cmd += ["--port", str(port), "--no-access-log", *flags]
    fd, log_path = tempfile.mkstemp(prefix="metrale-serve-", suffix=".log")
    print("starting:", shlex.join(cmd), f"(log: {log_path})", file=sys.stderr, flush=True)
    # this metrale, installed or not
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, args.launch_timeout, log_path)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)  # a graceful drain: nothing is in flight by now
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = Path(log_path).read_text()[-4000:]
            if proc.returncode == 2:  # it refused its settings: the caller's error, said as such
                raise ValueError(f"metrale serve refused the settings:\n{tail.strip()}")
            raise RuntimeError(f"metrale serve exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"metrale serve was not healthy after {timeout:.0f} s (log: {log_path})")


def _warm_up(args) -> None:
    """One request unlike the load's (first-use compilation and captures happen here)."""
    body = {"prompt": "warm up " * 32, "max_tokens": 8, "temperature": 0.0}
    if args.served_model is not None:
        body["model"] = args.served_model
    httpx.post(args.base_url + "/v1/completions", json=body, timeout=args.timeout)


def run(args) -> dict:
    """The report of one run against `--base-url` or a server started here, or with
    `--compare-prefix-caching` both runs and their comparison."""
    launching = args.model is not None or args.shape is not None
    if launching == (args.base_url is not None):
        raise ValueError("give --base-url (a running server) or --model/--shape (start one)")
    if args.compare_prefix_caching and not launching:
        raise ValueError("--compare-prefix-caching starts its own servers: give --model/--shape")
    if not launching:
        return asyncio.run(run_load(args))[0]
    from metrale.tokenizer import Tokenizer

    model, flags = _model_dir(args)
    tokenizer = Tokenizer.from_dir(model)  # it sizes the multi-turn system prompt in tokens
    runs = {}
    modes = (True, False) if args.compare_prefix_caching else (None,)
    for caching in modes:
        extra = []
        if caching is not None:
            extra = ["--prefix-caching" if caching else "--no-prefix-caching"]
        with launched(args, model, flags + extra) as url:
            args.base_url, args.served_model = url, None
            _warm_up(args)
            runs[caching] = asyncio.run(run_load(args, tokenizer))
            args.base_url = None
    if not args.compare_prefix_caching:
        return runs[None][0]
    (on, on_replies), (off, off_replies) = runs[True], runs[False]
    same = sum(on_replies.get(key) == text for key, text in off_replies.items())
    return {
        "with_prefix_caching": on,
        "without_prefix_caching": off,
        "ttft_p50_speedup": _ratio(off["p50_ttft_ms"], on["p50_ttft_ms"]),
        "ttft_mean_speedup": _ratio(off["mean_ttft_ms"], on["mean_ttft_ms"]),
        "identical_replies": same,
        "replies": len(off_replies),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def format_comparison(report: dict) -> str:
    from metrale.bench.serve_bench import format_report

    speedup = report["ttft_p50_speedup"]
    return "\n".join(
        [
            "with prefix caching:",
            format_report(report["with_prefix_caching"]),
            "without prefix caching:",
            format_report(report["without_prefix_caching"]),
            f"TTFT p50 without / with caching: {'-' if speedup is None else f'{speedup:.2f}x'}; "
            f"{report['identical_replies']}/{report['replies']} replies identical",
        ]
    )
