"""The package layout's promises: the public names stay importable from where users import them,
the deprecated `metrale.spec.drafter` path still gives the same protocol (with a warning), nothing
inside the package uses that path, and every kernel names the torch reference it must equal."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

import metrale
import metrale.kernels


def test_public_names_import_from_the_package_root():
    from metrale import LLM, Drafter, EngineConfig, SamplingParams
    from metrale.speculative.drafter import Drafter as Protocol

    assert Drafter is Protocol
    assert {LLM, EngineConfig, SamplingParams} <= {getattr(metrale, n) for n in metrale.__all__}


def test_old_drafter_path_warns_and_is_the_same_protocol():
    sys.modules.pop("metrale.spec.drafter", None)
    with pytest.warns(DeprecationWarning, match="metrale.speculative.drafter"):
        old = importlib.import_module("metrale.spec.drafter")
    assert old.Drafter is metrale.Drafter


def test_no_package_module_imports_the_deprecated_path():
    root = Path(metrale.__file__).parent
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path.parent.name != "spec" and "metrale.spec." in path.read_text()
    ]
    assert offenders == []


def test_every_kernel_names_its_torch_reference():
    for info in pkgutil.iter_modules(metrale.kernels.__path__):
        module = importlib.import_module(f"metrale.kernels.{info.name}")
        doc = module.__doc__ or ""
        assert "reference" in doc, f"kernels/{info.name}.py names no torch reference"
