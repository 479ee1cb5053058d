"""Write-on-accept against per-row state slots, the delta-rule part alone, on one GPU.

For Qwen3-Next-80B-A3B's GDN layers (36 of them; 32 value heads over 16 key heads of 128) and
batches of B sequences verifying T = K + 1 rows, times one step's state handling over all layers:

  write_on_accept  the verify reads each sequence's entry and writes nothing, then the commit
                   re-runs the accepted rows (a random count per sequence) from the entry and
                   writes it back in place (`GDNState` DEFER + `commit`);
  per_row_slots    the verify writes the state after every row into the sequence's K + 1
                   entries; the commit is a host-side index change (`GDNState` ROWS);

and reports the state pool each needs for B sequences. Both run the Triton kernel of
`kernels/gdn_recurrent.py`, each step captured as one CUDA graph (as the engine replays it), so the
times are GPU time rather than launch overhead. `--sweep` also times the kernel's launch shapes
(value columns per program, warps) for the decode step, and `--prefill-rows` a prefill through
the torch WY reference and both kernels. Run from the repository root:
`PYTHONPATH=. python benchmarks/gdn_verify_variants.py`; one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json

import torch

from metrale.kernels.gdn_chunk import chunk_delta_rule_in_pool
from metrale.kernels.gdn_recurrent import delta_rule_in_pool
from metrale.models.gdn import chunk_gated_delta_rule

LAYERS, HK, HV, DK, DV = 36, 16, 32, 128, 128


def _time(fn, reps: int = 20) -> float:
    """Milliseconds per replay of `fn` captured as a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up: compile and autotune outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def measure(batch: int, rows: int, layers: int, sweep: bool) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=dev, generator=gen, dtype=torch.bfloat16)

    q, k = rand(batch, rows, HK, DK), rand(batch, rows, HK, DK)
    v = rand(batch, rows, HV, DV)
    g = -torch.rand(batch, rows, HV, device=dev, generator=gen)
    beta = torch.rand(batch, rows, HV, device=dev, generator=gen)
    accepted = torch.randint(1, rows + 1, (batch,), device=dev, generator=gen)
    entry = HV * DK * DV * 4

    one = [torch.zeros(1 + batch, HV, DK, DV, device=dev) for _ in range(layers)]
    read = torch.arange(1, batch + 1, device=dev)

    def write_on_accept():
        for pool in one:
            delta_rule_in_pool(q, k, v, g, beta, pool, read)  # verify: reads only
            delta_rule_in_pool(q, k, v, g, beta, pool, read, final=read, lengths=accepted)

    per_row = [torch.zeros(1 + batch * rows, HV, DK, DV, device=dev) for _ in range(layers)]
    base = 1 + torch.arange(batch, device=dev) * rows
    row_entries = base[:, None] + torch.arange(rows, device=dev)[None, :]

    def per_row_slots():
        for pool in per_row:
            delta_rule_in_pool(q, k, v, g, beta, pool, base, rows=row_entries)

    def decode(block_v=None, num_warps=4):  # the plain decode step's state work, for scale
        for pool in one:
            delta_rule_in_pool(
                *(x[:, :1] for x in (q, k, v, g, beta)),
                pool,
                read,
                final=read,
                block_v=block_v,
                num_warps=num_warps,
            )

    result = {
        "batch": batch,
        "rows": rows,
        "write_on_accept_ms": _time(write_on_accept),
        "per_row_slots_ms": _time(per_row_slots),
        "decode_ms": _time(decode),
        "write_on_accept_state_bytes": layers * batch * entry,
        "per_row_slots_state_bytes": layers * batch * rows * entry,
        # the bytes a decode step must move: every state read and written once
        "decode_roofline_bytes": 2 * layers * batch * entry,
    }
    if sweep:
        result["decode_sweep_ms"] = {
            f"bv{bv}_w{w}": _time(lambda bv=bv, w=w: decode(bv, w))
            for bv in (16, 32, 64, 128)
            for w in (2, 4, 8)
        }
    return result


def measure_prefill(rows: int, layers: int) -> dict:
    """One sequence's prefill of `rows` rows through every GDN layer's delta rule: the torch WY
    reference, the chunked Triton kernel and the recurrent Triton kernel."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, device=dev, generator=gen, dtype=torch.bfloat16)

    q, k, v = rand(1, rows, HK, DK), rand(1, rows, HK, DK), rand(1, rows, HV, DV)
    g = -torch.rand(1, rows, HV, device=dev, generator=gen) * 0.1
    beta = torch.rand(1, rows, HV, device=dev, generator=gen)
    pool = torch.zeros(2, HV, DK, DV, device=dev)
    entry = torch.ones(1, dtype=torch.long, device=dev)
    runs = {
        "torch_wy_ms": lambda: chunk_gated_delta_rule(q, k, v, g, beta, pool[entry]),
        "triton_chunk_ms": lambda: chunk_delta_rule_in_pool(q, k, v, g, beta, pool, entry, entry),
        "triton_recurrent_ms": lambda: delta_rule_in_pool(
            q, k, v, g, beta, pool, entry, final=entry
        ),
    }
    ref = chunk_gated_delta_rule(q, k, v, g, beta, None)
    out = chunk_delta_rule_in_pool(q, k, v, g, beta, pool, None, entry)
    result = {"rows": rows, "max_abs_diff_chunk_vs_torch": (out - ref.out).abs().max().item()}
    for name, fn in runs.items():
        try:
            result[name] = _time(lambda fn=fn: [fn() for _ in range(layers)], reps=3)
        except RuntimeError as e:  # e.g. an op that cannot be graph-captured
            result[name] = f"{type(e).__name__}: {e}"[:200]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--rows", type=int, default=4, help="K + 1")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--sweep", action="store_true", help="time the decode launch shapes")
    parser.add_argument("--prefill-rows", type=int, default=1024, help="0: no prefill timing")
    args = parser.parse_args()
    runs = []
    for b in args.batch_sizes.split(","):
        runs.append(measure(int(b), args.rows, args.layers, args.sweep))
        torch.cuda.empty_cache()  # the last batch's pools are garbage now
    doc = {"layers": args.layers, "device": torch.cuda.get_device_name(), "runs": runs}
    if args.prefill_rows:
        doc["prefill"] = measure_prefill(args.prefill_rows, args.layers)
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
