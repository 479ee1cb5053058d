"""The Python heap against the cyclic garbage collector.

A full collection walks every tracked object alive: about 185k once torch and metrale are
imported, against some 1.5k that an engine adds. That walk (60-100 ms on the H200's host, measured)
lands inside whichever step triggers it, a stall worth dozens of decode steps. Objects alive when
the first engine starts (imports, module state) live as long as the process, so they are frozen
out of the collector's reach once; the engines' own objects stay collectable, so dropping an
engine still frees it. The server and the benches also freeze their one engine after start-up
(vLLM's engine process does the same).
"""

from __future__ import annotations

import atexit
import gc

_frozen = False


def freeze_startup_heap() -> None:
    """Once per process: collect, then freeze every object alive now."""
    global _frozen
    if _frozen:
        return
    _frozen = True
    gc.collect()
    gc.freeze()
    # Back in reach at exit: interpreter shutdown then frees them as usual (native extensions
    # such as Triton's otherwise report their objects as leaked).
    atexit.register(gc.unfreeze)
