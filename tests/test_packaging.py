"""The base install holds what the package imports: every third-party module that a module of
`metrale` imports at its top (not inside a function or a `try`, where a missing one is handled)
is a distribution that `pyproject.toml` lists in `dependencies`, or the one named beside it that
installs it. Found when `metrale generate` failed on a fresh machine: `metrale bench serve`'s
client (httpx), which the CLI imports with its other commands, came only with the test extras
and with older huggingface_hub releases."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import metrale

ROOT = Path(metrale.__file__).parent
# modules another listed distribution always installs (their parent's own API)
CARRIED = {"starlette": "fastapi"}


def normal(name: str) -> str:
    """A distribution's name as pip compares it (a module's name is its distribution's here)."""
    return name.lower().replace("_", "-")


def top_level_imports() -> dict[str, str]:
    found: dict[str, str] = {}
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def test_every_module_imported_at_the_top_is_a_base_dependency():
    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]
    listed = {normal(re.split(r"[<>=!~; \[]", d, maxsplit=1)[0]) for d in project["dependencies"]}
    missing = []
    for module, where in top_level_imports().items():
        if module in sys.stdlib_module_names or module in ("metrale", "__future__"):
            continue
        if normal(module) not in listed and CARRIED.get(module) not in listed:
            missing.append(f"{module} (imported by {where})")
    assert not missing, missing
