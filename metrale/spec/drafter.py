"""Deprecated: the drafter protocol is `metrale.speculative.drafter` (and `metrale.Drafter`)."""

import warnings

from metrale.speculative.drafter import Draft, Drafter, Verdict

warnings.warn(
    "metrale.spec.drafter moved to metrale.speculative.drafter (or import metrale.Drafter)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["Draft", "Drafter", "Verdict"]
