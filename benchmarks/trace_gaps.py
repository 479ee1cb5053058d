"""Where the device idles in a torch.profiler Chrome trace (`profile_e2e --trace`), and what the
host was doing meanwhile: the device's busy share of the run, then its idle time attributed to the
innermost metrale Python frame active at each idle microsecond (a sampling profile restricted to
the time the GPU waits for the host), and the longest gaps with their host stacks.

    python benchmarks/trace_gaps.py traces/spec.json.gz [--top 25] [--gaps 8]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    spans = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in DEVICE_CATS
    )
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def frame_name(e: dict) -> str:
    name = e["name"]
    # "metrale/engine/runner.py(123): execute" -> "engine/runner.py:execute"
    if "metrale/" in name and "): " in name:
        where, func = name.split("): ", 1)
        path = where.split("metrale/", 1)[1].split("(")[0]
        return f"{path}:{func}"
    return name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--gaps", type=int, default=8)
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    args = ap.parse_args()
    events = load(args.trace)
    busy = busy_intervals(events)
    if not busy:
        raise SystemExit("no device events in the trace")
    first, last = busy[0][0], busy[-1][1]
    busy_us = sum(b - a for a, b in busy)
    gaps = [
        (busy[i][1], busy[i + 1][0])
        for i in range(len(busy) - 1)
        if busy[i + 1][0] - busy[i][1] >= args.min_gap_us
    ]
    idle_us = sum(b - a for a, b in gaps)
    print(
        f"device span {(last - first) / 1e3:.2f} ms, busy {busy_us / 1e3:.2f} ms "
        f"({busy_us / (last - first):.0%}), idle in gaps >= {args.min_gap_us:g} us: "
        f"{idle_us / 1e3:.2f} ms in {len(gaps)} gaps"
    )
    frames = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), frame_name(e))
        for e in events
        if e.get("cat") == "python_function" and "metrale/" in e.get("name", "")
    )
    starts = [f[0] for f in frames]
    longest = max((f[1] - f[0] for f in frames), default=0.0)

    def outermost_first(active) -> list[tuple[float, str]]:
        """(duration, name) of the active frames, the longest (outermost) first."""
        return sorted(((f[1] - f[0], f[2]) for f in active), key=lambda a: -a[0])

    def stack_at(t: float) -> list[tuple[float, str]]:
        """The metrale frames active at t, outermost first."""
        i = bisect.bisect_right(starts, t)
        lo = bisect.bisect_left(starts, t - longest)
        return outermost_first(f for f in frames[lo:i] if f[1] >= t)

    by_frame: collections.Counter = collections.Counter()
    by_path: collections.Counter = collections.Counter()
    # One sweep over the idle microseconds in time order, the frames active at each kept as
    # they start and end (`stack_at` per microsecond rescanned every frame since the run's
    # start: minutes for a batch-64 speculative trace)
    nxt, active = 0, []
    for a, b in gaps:
        t = a + 0.5
        while t < b:
            while nxt < len(frames) and frames[nxt][0] <= t:
                active.append(frames[nxt])
                nxt += 1
            active = [f for f in active if f[1] >= t]
            if active:
                stack = outermost_first(active)
                by_frame[stack[-1][1]] += 1
                by_path[" > ".join(s[1] for s in stack[-3:])] += 1
            else:
                by_frame["(no metrale frame)"] += 1
            t += 1.0
    print(f"\nidle us by innermost metrale frame (top {args.top}):")
    for name, us in by_frame.most_common(args.top):
        print(f"{us:9d}  {name}")
    print(f"\nidle us by the last three frames (top {args.top}):")
    for name, us in by_path.most_common(args.top):
        print(f"{us:9d}  {name}")
    print(f"\nlongest {args.gaps} gaps:")
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[: args.gaps]:
        stack = [s[1] for s in stack_at((a + b) / 2)]
        print(f"{b - a:8.1f} us at {(a - first) / 1e3:8.3f} ms: {' > '.join(stack[-6:])}")


if __name__ == "__main__":
    main()
