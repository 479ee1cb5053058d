"""Device check for the batch-invariant GEMM (issue 13): do tile configurations of different
shapes give bitwise the same rows (same BLOCK_K order, float32 accumulation)? If they do, the
kernel may choose its tiles by M and stay invariant. Also times large-M configurations."""

import sys

import torch
import triton

from metrale.kernels.batch_invariant import invariant_linear


def cfg(bm, bn, bk, w, s):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)


CONFIGS = [
    cfg(16, 16, 256, 2, 4),
    cfg(16, 32, 256, 4, 4),
    cfg(16, 64, 128, 4, 5),
    cfg(32, 32, 128, 4, 4),
    cfg(64, 32, 128, 4, 4),
    cfg(64, 64, 128, 4, 4),
    cfg(64, 128, 64, 4, 4),
    cfg(128, 128, 64, 8, 3),
    cfg(128, 128, 64, 4, 4),
    cfg(128, 256, 64, 8, 3),
    cfg(64, 256, 64, 4, 3),
    cfg(128, 64, 64, 4, 4),
    cfg(16, 16, 64, 2, 4),
    cfg(16, 32, 32, 2, 4),
]
SHAPES = {"o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        x = torch.randn(2048, k, device=dev, dtype=torch.bfloat16)
        outs = [invariant_linear(x[:256], w, config=c) for c in CONFIGS]
        base = outs[0]
        same = [torch.equal(o, base) for o in outs]
        diff = [(o.float() - base.float()).abs().max().item() for o in outs]
        print(name, "equal to config 0:", same, "max diff", [f"{d:.1e}" for d in diff])
        for m in (128, 256, 512, 2048):
            ts = [
                triton.testing.do_bench(
                    lambda c=c, m=m, x=x, w=w: invariant_linear(x[:m], w, config=c),
                    warmup=5,
                    rep=25,
                    return_mode="median",
                )
                for c in CONFIGS[4:12]
            ]
            tr = triton.testing.do_bench(
                lambda m=m, x=x, w=w: torch.nn.functional.linear(x[:m], w),
                warmup=5,
                rep=25,
                return_mode="median",
            )
            print(
                f"  M={m} cuBLAS {tr:.3f} ms;",
                " ".join(f"c{i + 4}:{t / tr:.2f}" for i, t in enumerate(ts)),
                flush=True,
            )
    sys.stdout.flush()


main()
