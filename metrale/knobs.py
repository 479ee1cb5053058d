"""The one place where metrale reads its `METRALE_*` environment variables.

Everything else asks `knobs()` for a typed, frozen `Knobs`. Keeping the reads here means a value is
parsed and validated once, a bad value fails with an error that names the variable, and the start-up
log can show every resolved setting with `knobs().describe()`.

`knobs()` is cached for the life of the process; tests that change the environment call
`knobs.cache_clear()` afterwards.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

_PREFIX = "METRALE_"


def _parse_path(value: str) -> Path:
    # Made absolute at read time so a later chdir cannot move the cache under our feet.
    return Path(value).expanduser().absolute()


def _default_home() -> Path:
    return _parse_path("~/.cache/metrale")


def _knob(env: str, parse: Callable[[str], Any], default: Callable[[], Any], doc: str) -> Any:
    """A dataclass field bound to one environment variable."""
    return field(default_factory=default, metadata={"env": env, "parse": parse, "doc": doc})


@dataclass(frozen=True)
class Knobs:
    """Resolved values of every `METRALE_*` environment variable.

    Adding a knob is one `_knob(...)` field: its variable name, a parser from the raw string (which
    raises ValueError on bad input), a default factory and a one-line description.
    """

    home: Path = _knob(
        "METRALE_HOME",
        _parse_path,
        _default_home,
        "where generated artefacts (such as the default model) live",
    )
    # `METRALE_*` names that no knob reads: almost always a typo worth a line in the log.
    unrecognised: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Knobs:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        known = set()
        for f in _knob_fields():
            name = f.metadata["env"]
            known.add(name)
            raw = env.get(name)
            # An empty value counts as unset, as with most Unix tools: `METRALE_HOME= cmd`.
            if raw is None or raw == "":
                continue
            try:
                values[f.name] = f.metadata["parse"](raw)
            except ValueError as e:
                raise ValueError(f"environment variable {name}={raw!r}: {e}") from None
        unrecognised = tuple(sorted(k for k in env if k.startswith(_PREFIX) and k not in known))
        return cls(**values, unrecognised=unrecognised)

    def describe(self) -> str:
        """One line listing every knob's resolved value, for the start-up log."""
        parts = [f"{f.metadata['env']}={getattr(self, f.name)}" for f in _knob_fields()]
        line = "knobs: " + ", ".join(parts)
        if self.unrecognised:
            line += f" (unrecognised, ignored: {', '.join(self.unrecognised)})"
        return line


def _knob_fields() -> list[Any]:
    return [f for f in fields(Knobs) if "env" in f.metadata]


@functools.cache
def knobs() -> Knobs:
    """The process-wide knobs, read from `os.environ` on first use."""
    return Knobs.from_env()
