"""Summarise a step_trace JSON: per mode, steps grouped by the kinds of batch they ran."""
import collections, json, sys
r = json.load(open(sys.argv[1]))
for mode, v in r.items():
    groups = collections.defaultdict(list)
    for s in v["steps"]:
        kinds = " + ".join(sorted({" ".join(w for w in b.split() if not w[0].isdigit()) for b in s["batches"]})) or "none"
        groups[kinds].append(s)
    print(f"== {mode}: {v['total_ms']:.1f} ms, {len(v['steps'])} steps")
    for k, ss in sorted(groups.items(), key=lambda kv: -sum(s["ms"] for s in kv[1])):
        ms = [s["ms"] for s in ss]
        ph = {p: sum(s.get(p, 0) for s in ss) / len(ss) for p in ("schedule", "prepare", "execute", "_commit", "observe", "propose", "_planned")}
        g = [x for s in ss for x in s.get("gates", []) if x.get("verify_ms")]
        gv = sum(x["verify_ms"] for x in g) / len(g) if g else 0
        gp = sum(x["plain_ms"] or 0 for x in g) / len(g) if g else 0
        widths = sum(s["width"] for s in ss) / len(ss)
        print(f"  {k:40s} n={len(ss):4d} total={sum(ms):8.1f} mean={sum(ms)/len(ms):6.2f} width={widths:5.1f} " + " ".join(f"{p}={t:.2f}" for p, t in ph.items()) + (f" gate_verify={gv:.2f} gate_plain={gp:.2f}" if g else ""))
