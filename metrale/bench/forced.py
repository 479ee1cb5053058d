"""Forced acceptance, for `metrale bench --forced-acceptance` only: the cost of a speculative
step at a chosen acceptance rate, on any shape, random weights included.

On random bf16 weights replayed drafts stop matching after a few tokens (a verify row and a
decode row round differently, and near-tied argmaxes flip), so a replayed acceptance collapses
at wide batches. Here every draft row "matches" with probability alpha, independently, drawn on
the device; the accepted count is the longest matching prefix as usual, and every emitted token is
the target's own pick at its row. The output is then no longer the target's continuation, which is
why this lives in the bench: nothing in the engine's configuration, the Python API or the server
can turn it on; the bench sets it on the runner (`ModelRunner.forced_acceptance`) and labels its
results as forced.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from metrale.speculative.verify import Acceptance, RowLayout, accepted_prefix


class ForcedAcceptance:
    def __init__(self, alpha: float, seed: int = 0) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.alpha, self.seed = alpha, seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._host = random.Random(seed)

    def draw(self, k: int) -> list[bool]:
        """Matches of k draft rows, each at rate alpha: the runner's greedy fast path, which
        judges on the host (`step_output.greedy_verdicts`), draws them here."""
        return [self._host.random() < self.alpha for _ in range(k)]

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return gen

    def __call__(self, acc: Acceptance, layout: RowLayout) -> Acceptance:
        drafts = layout.draft_of_row
        u = torch.rand(drafts.shape, generator=self._generator(drafts.device), device=drafts.device)
        matches = (drafts >= 0) & (u < self.alpha)
        # `emitted` already holds the target's pick on every row: where a real draft matched
        # greedily, the draft is the pick.
        return acc._replace(num_accepted=accepted_prefix(matches, layout), matches=matches)


@contextmanager
def forcing(runner, alpha: float, seed: int, on: bool = True) -> Iterator[None]:
    """Forced acceptance at `alpha` on `runner` for the block (`on`: else the replayed one), off
    after it whatever happens."""
    runner.forced_acceptance = ForcedAcceptance(alpha, seed=seed) if on else None
    try:
        yield
    finally:
        runner.forced_acceptance = None
