"""Device sweep for the batch-invariant GEMM (issue 13): tile configurations against cuBLAS on
the qwen3-8b weights, M = 1 .. 2048, and a bitwise check that a row's output does not depend on
M or on where the row sits. Writes JSON to the path given as the first argument."""

import json
import sys

import torch
import triton

from metrale.kernels.batch_invariant import invariant_linear

SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (24576, 4096),
    "down": (4096, 12288),
    "lm_head": (151936, 4096),
}
MS = [1, 4, 16, 64, 128, 256, 512, 2048]
CONFIGS = [
    dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=5),
    dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, num_warps=2, num_stages=4),
]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def main():
    out_path = sys.argv[1]
    torch.manual_seed(0)
    dev = torch.device("cuda")
    results = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        x_all = torch.randn(2048, k, device=dev, dtype=torch.bfloat16)
        for ci, cfg in enumerate(CONFIGS):
            ref_full = invariant_linear(x_all[:256], w, config=cfg)
            invariant = True
            for m, at in ((1, 0), (1, 77), (3, 5), (17, 100), (64, 192), (256, 0)):
                part = invariant_linear(x_all[at : at + m], w, config=cfg)
                invariant &= torch.equal(part, ref_full[at : at + m])
            # a row placed at another position of another batch
            shuffled = x_all[:256].flip(0).contiguous()
            invariant &= torch.equal(invariant_linear(shuffled, w, config=cfg).flip(0), ref_full)
            err = (
                (ref_full.float() - torch.nn.functional.linear(x_all[:256], w).float()).norm()
                / torch.nn.functional.linear(x_all[:256], w).float().norm()
            ).item()
            for m in MS:
                x = x_all[:m]
                t = bench(lambda x=x, w=w, cfg=cfg: invariant_linear(x, w, config=cfg))
                t_ref = bench(lambda x=x, w=w: torch.nn.functional.linear(x, w))
                results.append(
                    dict(
                        shape=name,
                        n=n,
                        k=k,
                        config=ci,
                        m=m,
                        ms=t,
                        cublas_ms=t_ref,
                        ratio=t / t_ref,
                        invariant=invariant,
                        rel_err=err,
                    )
                )
            print(
                name,
                ci,
                "invariant" if invariant else "VARIES",
                f"err {err:.1e}",
                " ".join(f"{r['m']}:{r['ratio']:.2f}" for r in results[-len(MS) :]),
                flush=True,
            )
    with open(out_path, "w") as f:
        json.dump(dict(configs=CONFIGS, results=results), f, indent=1)
    # summary: per config, decode-weight ratio (sum over shapes of the M = 1, 64, 256 times)
    for ci in range(len(CONFIGS)):
        for m in MS:
            rows = [r for r in results if r["config"] == ci and r["m"] == m]
            t = sum(r["ms"] for r in rows)
            tr = sum(r["cublas_ms"] for r in rows)
            print(f"config {ci} M={m}: {t:.3f} ms vs cuBLAS {tr:.3f} ms ({t / tr:.2f}x)")


main()
