"""The Python heap against the cyclic garbage collector.

A full collection walks every tracked object alive: about 185k once torch and metrale are
imported, against some 1.5k that an engine adds. That walk (60-100 ms on the H200's host, measured)
lands inside whichever step triggers it, a stall worth dozens of decode steps. A process whose
engine lives as long as it does (the server, the benches, `metrale generate` and `chat`) freezes
what is alive once its engine is up, out of the collector's reach (vLLM's engine process does the
same). The library itself never freezes: a program embedding `LLM` may hold objects in reference
cycles that must stay collectable; it can call `freeze_startup_heap()` itself.
"""

from __future__ import annotations

import atexit
import gc

_frozen = False


def freeze_startup_heap() -> None:
    """Once per process: collect, then freeze every object alive now (objects made later stay
    collectable)."""
    global _frozen
    if _frozen:
        return
    _frozen = True
    gc.collect()
    gc.freeze()
    # Back in reach at exit: interpreter shutdown then frees them as usual (native extensions
    # such as Triton's otherwise report their objects as leaked).
    atexit.register(gc.unfreeze)
