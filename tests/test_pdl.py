"""Programmatic dependent launch (`kernels/pdl.py`): off where it cannot apply; every kernel that
may be launched with it waits for the kernel before it first (the rule that keeps it correct,
checked over the source); and on a GPU, a captured chain of the step's kernels gives the same bits
with it as without it.

    python -m pytest -q tests/test_pdl.py   (the GPU test is skipped without CUDA)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from metrale.kernels import pdl

KERNELS = Path(pdl.__file__).parent


def test_pdl_is_off_on_the_cpu_and_under_the_knob(knob_env):
    x = torch.zeros(2)
    assert pdl.launch(x) == {"PDL": False}
    knob_env(METRALE_NO_PDL="1")
    assert pdl.launch(x) == {"PDL": False}


class _FakeCuda:
    """A tensor stand-in on an sm90 CUDA device (`launch` reads `is_cuda` and `device`)."""

    is_cuda = True
    device = torch.device("cuda", 0)


@pytest.mark.parametrize("why", ["no gdc", "rocm", "interpreter", "knob", "sm80"])
def test_pdl_is_off_wherever_it_cannot_launch(why, monkeypatch, knob_env):
    """On an sm90 device it is on, and off without the instructions in Triton (a stand-in that
    took their name once made them look present: found in review), on ROCm (its Triton takes
    no `launch_pdl`), under Triton's interpreter with CUDA tensors, under the knob, and before
    sm90."""
    monkeypatch.setattr(pdl, "HAS_GDC", True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_majors", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    assert pdl.launch(_FakeCuda()) == {"PDL": True, "launch_pdl": True}
    pdl._majors.clear()
    if why == "no gdc":
        monkeypatch.setattr(pdl, "HAS_GDC", False)
    elif why == "rocm":
        monkeypatch.setattr(torch.version, "hip", "6.2")
    elif why == "interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    elif why == "knob":
        knob_env(METRALE_NO_PDL="1")
    else:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    assert pdl.launch(_FakeCuda()) == {"PDL": False}


def _jit_kernels(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
            "jit" in ast.unparse(d) for d in node.decorator_list
        ):
            found[node.name] = node
    return found


def _launched_with_pdl(tree: ast.Module) -> set[str]:
    """Names of the kernels called as `name[grid](..., **pdl.launch(...))` (or through a
    variable bound to one of several kernels: every name it may hold)."""
    names = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
            continue
        if any(
            k.arg is None and ast.unparse(k.value).startswith("pdl.launch") for k in node.keywords
        ):
            names.add(ast.unparse(node.func.value))
    return names


def test_every_kernel_launched_with_pdl_waits_first():
    """A kernel launched with PDL may start before the kernel before it has finished: its first
    statement (after a docstring) must be `pdl_prologue(PDL)`, before any load or store. And a
    launch that passes `pdl.launch` must be of a kernel that takes `PDL`."""
    checked = 0
    for path in sorted(KERNELS.glob("*.py")):
        if path.name == "pdl.py":  # the prologue itself
            continue
        tree = ast.parse(path.read_text())
        kernels = _jit_kernels(tree)
        for name, fn in kernels.items():
            params = [a.arg for a in fn.args.args]
            if "PDL" not in params:
                continue
            body = fn.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            assert ast.unparse(body[0]) == "pdl_prologue(PDL)", f"{path.name}: {name}"
            checked += 1
        launched = set()
        for called in _launched_with_pdl(tree):
            if called == "kernel" and path.name == "gdn_recurrent.py":  # one of two, by mode
                targets = [k for k in kernels if k.endswith("delta_rule_kernel")]
            else:
                targets = [called]
            for target in targets:
                assert target in kernels, f"{path.name}: {target} is not a kernel of the file"
                args = [a.arg for a in kernels[target].args.args]
                assert "PDL" in args, f"{path.name}: {target} launched with PDL takes no PDL"
                launched.add(target)
        # and the other way: a kernel that takes PDL is launched with `pdl.launch`
        takes = {name for name, fn in kernels.items() if "PDL" in [a.arg for a in fn.args.args]}
        assert takes <= launched, f"{path.name}: {sorted(takes - launched)} never get pdl.launch"
    assert checked == 19  # the step's kernels (norms, attention, GDN, MoE, few-row GEMV)


@pytest.mark.gpu
def test_a_captured_moe_block_gives_the_same_bits_with_and_without_pdl(monkeypatch):
    """The MoE block (router product and plan, grouped gate/up and down, combine with the next
    norm) replayed from CUDA graphs, its kernels launched with PDL, then without: equal bits."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs a Hopper GPU or later")
    from metrale.models import qwen3_next_moe
    from tests.test_hybrid_kernels_gpu import _block  # (qwen3-next-a3b-64e's MoE block)

    monkeypatch.setattr(qwen3_next_moe, "hybrid_kernels_enabled", lambda x: True)
    block = _block()
    outs = {}
    for mode in ("on", "off"):
        if mode == "off":
            monkeypatch.setattr(pdl, "launch", lambda x: {"PDL": False})
        else:  # (not a silent fallback: the comparison would then prove nothing)
            assert pdl.launch(torch.zeros(1, device="cuda"))["PDL"]
        got = []
        for n in (1, 16):
            x = torch.randn(n, 2048, generator=torch.Generator().manual_seed(n)).cuda().bfloat16()
            with torch.no_grad():
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    block(x)  # compiles
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    y = block(block(x))  # two blocks back to back: kernel after kernel
                for _ in range(3):
                    graph.replay()
            torch.cuda.synchronize()
            got.append(y.clone())
        outs[mode] = got
    for a, b in zip(outs["on"], outs["off"], strict=True):
        assert torch.equal(a, b)
