"""metrale: an LLM inference engine built around lossless speculative decoding.

The public API is vLLM-shaped: `LLM(model, **engine_options).generate(prompts, SamplingParams)`.

Its names are imported on first use (PEP 562): `import metrale` alone does not load torch, so the
`metrale` command (`metrale/__main__.py`) starts inside its own Ctrl-C handling, and a Ctrl-C
during the seconds torch takes to import ends it quietly rather than with a traceback.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from metrale.api import LLM
    from metrale.config import EngineConfig, SamplingParams
    from metrale.outputs import CompletionOutput, Logprob, RequestOutput
    from metrale.speculative.drafter import Drafter
    from metrale.structured import StructuredOutput

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "metrale.api",
    "CompletionOutput": "metrale.outputs",
    "Drafter": "metrale.speculative.drafter",
    "EngineConfig": "metrale.config",
    "Logprob": "metrale.outputs",
    "RequestOutput": "metrale.outputs",
    "SamplingParams": "metrale.config",
    "StructuredOutput": "metrale.structured",
}
__all__ = [
    "LLM",
    "CompletionOutput",
    "Drafter",
    "EngineConfig",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'metrale' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except AttributeError as e:
        # (`from metrale import X` turns an AttributeError from here into a bare "cannot import
        # name": a dependency's moved API would lose its traceback; found in review)
        raise ImportError(f"metrale.{name}: importing {module} failed: {e}") from e
    globals()[name] = value  # (imported once: later lookups find it here)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
