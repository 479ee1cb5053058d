"""The drafter protocol: propose up to K tokens per sequence for a batch; observe each verdict.

A drafter never changes what is emitted: the target verifies every draft, so a wrong or even
malicious proposal only costs acceptance. The engine calls, per step:

1. `propose(seqs, max_drafts)` for the running sequences that will decode next, before the
   step is scheduled (so pages are reserved for the draft rows);
2. `observe(verdicts)` after the verify forward, with the accepted count, the emitted tokens and
   the target's hidden states of the committed rows (drafters that condition on the target, such
   as MTP, catch up from them);
3. `release(seq)` when a sequence ends or is preempted (its drafter state must go).

A hook that raises fails only the sequences it fails for: the engine retries `propose` and
`observe` one sequence at a time to find them (so a sequence the batch call already handled is
shown to the hook again: make them safe to repeat), and ignores a failing `release` (logged).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from metrale.engine.device_tokens import DeviceRow
from metrale.engine.sequence import Sequence


@dataclass
class Draft:
    # host ints, or a `DeviceRow` of drafts still on the device (`DeviceDrafts.row`; read at
    # the verdicts). Device drafts are not checked against the vocabulary (that would read
    # them): a drafter returns them only for ids it took from the target's head.
    tokens: list[int] | DeviceRow
    # [len(tokens), V] float32 draft distribution q (after the request's logits pipeline), or
    # None when the drafter is deterministic (one-hot q: accepted with probability p(token)).
    # With q, the engine draws the verified tokens from it (`draft_shapes.drawn_from_q`):
    # `tokens` then only says how deep the drafter drafted; `Verdict.drafts` has the drawn ones.
    probs: torch.Tensor | None = None

    def truncate(self, depth: int) -> Draft:
        probs = None if self.probs is None else self.probs[:depth]
        return Draft(self.tokens[:depth], probs)


@dataclass
class Verdict:
    """What the target decided about one sequence's drafts in one step."""

    seq: Sequence
    drafts: list[int] | DeviceRow  # the drafts verified (after the depth cut)
    num_accepted: int
    emitted: list[int]  # accepted drafts then the bonus/correction token (stop may cut it)
    matches: list[bool]  # per draft position, every position (even past the first miss)
    # [num_committed_rows, H] target hidden states of the rows whose tokens are now committed, or
    # None when the drafter did not ask for them.
    hidden: torch.Tensor | None = None
    # positions of those rows (the first is the row of the sequence's previous last token)
    first_position: int = 0
    # the target's token at every verify row (the draft where it matched), past the first miss too
    picks: list[int] = field(default_factory=list)


def may_draft(seq: Sequence) -> bool:
    """Whether `seq`'s request lets it draft at all (speculation on, a depth above 0)."""
    params = seq.params
    return params.speculative and params.num_drafts != 0


def learns_from_every_step(drafter, seq: Sequence) -> bool:
    """Whether `drafter` is shown every step of `seq`: not a `stateless` one; one that
    `observes_drafting_only` where `seq` may draft."""
    if getattr(drafter, "stateless", False):
        return False
    return not getattr(drafter, "observes_drafting_only", False) or may_draft(seq)


class Drafter(Protocol):
    name: str
    # True when the drafter needs the target's hidden states in `observe`.
    needs_hidden: bool
    # Optional (default False): a drafter that learns nothing from `observe` may say so with
    # `stateless = True`; the engine then skips `observe` on steps where nothing was drafted, so
    # those steps are plain decode steps. Any other drafter sees every step's verdicts, or with
    # `observes_drafting_only = True` (optional, default False) only while a sequence that may
    # draft (`may_draft`) is unfinished: it learns from those sequences alone, so the steps of
    # the others (`speculative=False`, `num_drafts=0`) may run ahead (`engine/ahead.py`).
    # Optional (default False): `own_tokens = True` says every draft is made of the sequence's
    # own tokens (prompt lookup), so in the vocabulary: the controller skips checking each one.
    # Optional (default None): a drafter that keeps K/V rows in the target's pages says which
    # sequences it writes them for with `page_kv` (`prefix_cache.DraftKV`), so a prefix-cache
    # hit maps only pages whose drafter rows it can read.

    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[Draft]:
        """One Draft per sequence, each with at most `max_drafts[i]` tokens (0 is allowed)."""
        ...

    def observe(self, verdicts: list[Verdict]) -> None: ...

    def release(self, seq: Sequence) -> None: ...
