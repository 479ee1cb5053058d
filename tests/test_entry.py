"""The `metrale` command's entry (`metrale/__main__.py`) and the lazy package: `import metrale`
loads no torch, the public names still import, and a Ctrl-C while the CLI's modules load (the
seconds torch takes) exits with 130 and no traceback, as one during a run does."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import metrale

ROOT = Path(metrale.__file__).parent.parent


def test_importing_the_package_loads_no_torch_until_a_name_is_used():
    code = (
        "import sys, metrale\n"
        "assert 'torch' not in sys.modules, 'import metrale loaded torch'\n"
        "from metrale import LLM, SamplingParams\n"
        "assert LLM.__module__ == 'metrale.api' and 'torch' in sys.modules\n"
        "assert set(metrale.__all__) <= set(dir(metrale))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        metrale.nope  # noqa: B018


def test_the_console_script_is_the_entry_that_handles_an_interrupt():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["metrale"] == "metrale.__main__:main"


def test_ctrl_c_while_the_cli_loads_exits_130_without_a_traceback(monkeypatch, capsys):
    import builtins

    from metrale import __main__ as entry

    real_import = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == "metrale.cli":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "metrale.cli", raising=False)
    monkeypatch.setattr(builtins, "__import__", interrupted)
    assert entry.main() == 130
    assert "Traceback" not in capsys.readouterr().err


def test_python_m_metrale_runs_the_cli():
    done = subprocess.run(
        [sys.executable, "-m", "metrale", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0 and "generate" in done.stdout


def test_every_public_name_has_its_module():
    assert sorted(metrale.__all__) == sorted(metrale._EXPORTS)


def test_a_failing_import_behind_a_public_name_keeps_its_cause():
    """`from metrale import LLM` whose import hits an AttributeError inside (a dependency's API
    moved) raises an ImportError naming it, with the cause chained; and `dir` lists each name
    once (found in review)."""
    code = (
        "import torch\n"
        "del torch.no_grad\n"
        "try:\n"
        "    from metrale import LLM\n"
        "except ImportError as e:\n"
        "    assert 'no_grad' in str(e) and isinstance(e.__cause__, AttributeError), e\n"
        "else:\n"
        "    raise SystemExit('imported')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr + done.stdout
    metrale.LLM  # noqa: B018
    names = dir(metrale)
    assert len(names) == len(set(names)) and "LLM" in names
