"""The deterministic mode's Triton kernels compile once per tile shape, never once per step.

Triton specialises a kernel on each integer argument (== 1, a multiple of 16 or not) and on each
pointer's 16-byte alignment, and compiles a new binary, inside the running step, the first time a
new combination comes. An eager step (a prompt chunk wider than the captured prefill programs)
passes the step's row count to the invariant GEMM, the block table's width to the attention
kernels, and metadata that are views into one packed buffer (`staging.to_device_packed`), aligned
or not with the step's row and sequence counts. Specialised on those, a serving load kept meeting
new combinations (seconds of compiling each, every request in the engine waiting): in the H200
multi-turn bench with prefix caching, whose many sequences with short uncached suffixes make
eager steps of every shape, the first server run paid them all (p50 TTFT 5.6 s in turn 1 against
0.1 s in turns 3-4) while the server run after it found them in Triton's disk cache.

The hybrid's delta rule must also run one binary for a decode and a verify step: two binaries
of the same arithmetic rounded a state differently on the H100 (session 67), so speculation
changed a quarter of the deterministic hybrid's requests there.

CPU: the real wrappers (`invariant_linear`, `invariant_attention`, `delta_rule_in_pool`) over
steps of different row counts, sequence counts and block-table widths, packed as the runner
packs an eager step, with the launch replaced by Triton's own specialisation of the arguments
(its binder, against a stand-in driver for an sm_90 target: nothing is compiled or run); in a
subprocess, as the test session runs kernels under the interpreter. GPU-marked: the same steps
really run, and each kernel's compiled binaries do not grow after the first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]

# Steps that share every compile-time constant (each has a prompt chunk of 17+ rows, and at least
# 16 rows per sequence, so the attention's row block and partial layout are the same), but not
# their row count's parity or divisibility, their sequence count's parity, their metadata's
# alignment or their block table's width (17, 126, 127, 128 pages).
# (rows, first position) per sequence.
STEPS = [
    [(40, 2000)],
    [(41, 1984), (1, 99)],
    [(25, 2016), (25, 300), (1, 5)],
    [(33, 230)],
    [(48, 1990), (17, 2000)],
]
PAGE, HEADS, KV_HEADS, DIM = 16, 4, 2, 16
# M for the GEMM, all of one tile configuration: 1, odd, a multiple of 16, large and odd.
GEMM_ROWS = [1, 3, 16, 17, 600, 601, 2048]


def step_inputs(step, device):
    """(q, k cache, v cache, metadata) of a step, its metadata packed as the runner packs an
    eager step's (`step_metadata.pack_spans`, views into one buffer)."""
    from metrale.engine.step_metadata import pack_spans

    spans, page = [], 1
    for rows, start in step:
        pages = -(-(start + rows) // PAGE)
        spans.append((list(range(page, page + pages)), start, [1] * rows))
        page += pages
    _, _, meta = pack_spans(spans, PAGE, torch.device(device))
    rows = sum(r for r, _ in step)
    q = torch.randn(rows, HEADS, DIM, device=device, dtype=torch.bfloat16)
    cache = torch.randn(2, page, PAGE, KV_HEADS, DIM, device=device, dtype=torch.bfloat16)
    return q, cache[0], cache[1], meta


# Run in a fresh interpreter without TRITON_INTERPRET: prints, per kernel, how many argument
# specialisations each set of compile-time constants met. Exit 3: this Triton's internals differ.
SCRIPT = r"""
import json, sys
import torch
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
except ImportError as e:
    print(f"this Triton has no {e.name}"); sys.exit(3)


class Sm90:
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)


driver.set_active(Sm90())
seen = {}


def specialise(self, *args, grid, warmup, **kwargs):
    if warmup:  # the attention's one-time fit of its tile to the device (no launch): not a step's
        return None
    caches = getattr(self, "device_caches", None)
    if caches is None:
        print("this Triton keeps no device_caches"); sys.exit(3)
    try:
        binder = caches[0][-1]
    except Exception as e:  # a Triton that needs more of its driver than this stand-in has
        print(f"this Triton's binder needs more than the stand-in driver: {e!r}"); sys.exit(3)
    bound = binder(*args, **kwargs)
    if not isinstance(bound, tuple) or len(bound) != 3:
        print("this Triton's binder returns another shape"); sys.exit(3)
    spec = bound[1]
    consts = tuple(repr(s) for s in spec if s[0] == "constexpr")
    args_spec = tuple(repr(s) for s in spec if s[0] != "constexpr")
    per = seen.setdefault(self.fn.__name__, {})
    per.setdefault(consts, set()).add(args_spec)


JITFunction.run = specialise

sys.path.insert(0, sys.argv[1])
from metrale.kernels import batch_invariant as bi
from metrale.kernels.invariant_attention import invariant_attention
from tests.test_deterministic_compiles import GEMM_ROWS, STEPS, step_inputs

bi.INTERPRETED = True  # the wrapper's CPU gate; the configuration below is the GPU's
w = torch.randn(4096, 64, dtype=torch.bfloat16)
config = bi.config_for(600, 4096, 64)
for m in GEMM_ROWS:
    bi.invariant_linear(torch.randn(m, 64, dtype=torch.bfloat16), w, config=config)
for step in STEPS:
    q, kc, vc, meta = step_inputs(step, "cpu")
    invariant_attention(q, kc, vc, meta, 0.25, max_rows=16, prompt_tile_rows=64, interpreted=False)
# the hybrid's delta rule: a decode step, a write-on-accept verify, its commit and a verify
# into per-row slots, of one and of three sequences (two binaries on the H100 rounded a state
# differently: found in session 67)
from metrale.kernels.gdn_recurrent import GateInputs, delta_rule_in_pool

hk, hv, dk, dv = 2, 4, 16, 32
pool = torch.zeros(16, hv, dk, dv)
steps = ((1, 1, "decode"), (3, 1, "decode"), (1, 4, "verify"), (3, 4, "verify"),
         (3, 4, "commit"), (1, 4, "rows"), (3, 2, "rows"))
for i, (b, t, mode) in enumerate(steps):
    # bf16 activations over a float32 pool, int64 slots and int32 lengths and row slots, as
    # the engine passes them; q, k and v row-strided views into one buffer (the conv's output)
    # whose start and row width vary with the step (aligned or not, a multiple of 16 or not)
    at, width = i % 3, 2 * hk * dk + hv * dv + i % 2
    mixed = torch.randn(at + b * t * width, dtype=torch.bfloat16)[at:].view(b, t, width)
    q = mixed[..., : hk * dk].view(b, t, hk, dk)
    k = mixed[..., hk * dk : 2 * hk * dk].view(b, t, hk, dk)
    v = mixed[..., 2 * hk * dk : 2 * hk * dk + hv * dv].view(b, t, hv, dv)
    # the gates' inputs likewise (columns of the in-projection's output), the slots and
    # lengths views into packed metadata
    ab = torch.randn(at + b * t * (2 * hv + i % 2), dtype=torch.bfloat16)[at:]
    ab = ab.view(b, t, 2 * hv + i % 2)
    gates = GateInputs(ab[..., :hv], ab[..., hv : 2 * hv], torch.randn(hv), torch.randn(hv))
    read = torch.arange(at + b)[at:]
    packed = torch.arange(at + b + b * t, dtype=torch.int32)[at:]
    kw = {"decode": {"final": read}, "verify": {},
          "commit": {"final": read, "lengths": packed[:b]},
          "rows": {"rows": packed[b:].view(b, t)}}[mode]
    delta_rule_in_pool(q, k, v, None, None, pool, read, gates=gates, block_v=32,
                       invariant=True, **kw)
print(json.dumps({
    name: {"constants": len(per), "most_variants": max(len(s) for s in per.values())}
    for name, per in seen.items()
}))
"""


def test_invariant_kernels_are_not_specialised_on_what_changes_per_step():
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    expected = {"_invariant_matmul_kernel", "_tile_kernel", "_decode_group_kernel",
                "_combine_kernel", "_invariant_delta_rule_kernel"}  # fmt: skip
    assert set(seen) == expected, seen
    for name, got in seen.items():
        # one set of constants per kernel (the steps were chosen so), and one binary for it
        assert got == {"constants": 1, "most_variants": 1}, (name, got)


@pytest.mark.gpu
def test_cuda_invariant_kernels_compile_once_across_steps():
    """The same steps on the GPU: after the first, no kernel compiles another binary."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from metrale.kernels import batch_invariant as bi
    from metrale.kernels import invariant_attention as ia

    kernels = [bi._invariant_matmul_kernel, ia._tile_kernel, ia._decode_group_kernel,
               ia._combine_kernel]  # fmt: skip
    dev = torch.cuda.current_device()

    def compiled():
        caches = [getattr(k, "device_caches", None) for k in kernels]
        if any(c is None for c in caches):
            pytest.skip("this Triton keeps no device_caches")
        return [len(c[dev][0]) for c in caches]

    w = torch.randn(4096, 64, device="cuda", dtype=torch.bfloat16)
    config = bi.config_for(600, 4096, 64)
    counts = []
    for m, step in zip(GEMM_ROWS, STEPS + STEPS[:2], strict=True):
        x = torch.randn(m, 64, device="cuda", dtype=torch.bfloat16)
        bi.invariant_linear(x, w, config=config)
        q, kc, vc, meta = step_inputs(step, "cuda")
        ia.invariant_attention(
            q, kc, vc, meta, 0.25, max_rows=16, prompt_tile_rows=64, interpreted=False
        )
        counts.append(compiled())
    torch.cuda.synchronize()
    assert all(c == counts[0] for c in counts), counts
