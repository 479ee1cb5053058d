"""Summarise a `benchmarks/step_trace.py` JSON: per mode, its steps grouped by the kinds of batch
they ran (verify, decode, mixed; launched ahead or not), with their mean wall time, width, host
phases and what the host-cost gate priced."""

import collections
import json
import sys

PHASES = ("schedule", "prepare", "execute", "_commit", "observe", "propose", "_planned")


def kinds(step: dict) -> str:
    names = {" ".join(w for w in b.split() if not w[0].isdigit()) for b in step["batches"]}
    return " + ".join(sorted(names)) or "none"


def main(path: str) -> None:
    with open(path) as f:
        result = json.load(f)
    for mode, run in result.items():
        groups = collections.defaultdict(list)
        for step in run["steps"]:
            groups[kinds(step)].append(step)
        print(f"== {mode}: {run['total_ms']:.1f} ms, {len(run['steps'])} steps")
        for kind, steps in sorted(groups.items(), key=lambda kv: -sum(s["ms"] for s in kv[1])):
            ms = [s["ms"] for s in steps]
            phases = " ".join(
                f"{p}={sum(s.get(p, 0) for s in steps) / len(steps):.2f}" for p in PHASES
            )
            gates = [g for s in steps for g in s.get("gates", []) if g.get("verify_ms")]
            priced = ""
            if gates:
                verify = sum(g["verify_ms"] for g in gates) / len(gates)
                plain = sum(g["plain_ms"] or 0 for g in gates) / len(gates)
                priced = f" gate_verify={verify:.2f} gate_plain={plain:.2f}"
            width = sum(s["width"] for s in steps) / len(steps)
            print(
                f"  {kind:40s} n={len(steps):4d} total={sum(ms):8.1f} "
                f"mean={sum(ms) / len(ms):6.2f} width={width:5.1f} {phases}{priced}"
            )


if __name__ == "__main__":
    main(sys.argv[1])
