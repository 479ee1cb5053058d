"""How many drafts a sequence may verify, and a draft reshaped to what the step verifies: padded to
a dealt depth, or cut where a grammar forbids it (the speculative controller's helpers)."""

from __future__ import annotations

import torch

from metrale.config import SpecConfig
from metrale.engine.sequence import Sequence
from metrale.speculative.drafter import Draft


def draft_caps(seq: Sequence, cfg: SpecConfig, max_model_len: int) -> int:
    """How many drafts `seq` may verify now: every accepted draft plus the bonus token must fit
    under `max_tokens` and `max_model_len`, so speculation never emits past either."""
    params = seq.params
    if not params.speculative or seq.is_prefilling:
        return 0
    k = cfg.num_drafts if params.num_drafts is None else min(cfg.num_drafts, params.num_drafts)
    k = min(k, max_model_len - seq.num_tokens - 1)
    if params.max_tokens is not None:
        k = min(k, params.max_tokens - len(seq.output_token_ids) - 1)
    return max(k, 0)


def pad_draft(draft: Draft, depth: int, vocab_size: int, avoid: tuple[int, ...] = ()) -> Draft:
    """Extend a draft to `depth` rows by repeating its last token (or cut it). The canonical arm
    may deal a sequence more rows than it drafted; a padded row is verified like any other, so
    it costs a row and never breaks losslessness. `avoid`: tokens an empty draft is not padded
    with (under a grammar, its end-of-text tokens: the verify's masks stop before one, so a row
    past an accepted one would go unmasked)."""
    if depth <= len(draft.tokens):
        return draft.truncate(depth)
    extra = depth - len(draft.tokens)
    filler = (
        draft.tokens[-1] if draft.tokens else next(t for t in range(vocab_size) if t not in avoid)
    )
    probs = draft.probs
    if probs is not None:
        pad = torch.zeros(extra, probs.shape[-1], dtype=probs.dtype, device=probs.device)
        pad[:, filler] = 1.0
        probs = torch.cat([probs, pad])
    return Draft(draft.tokens + [filler] * extra, probs)


def grammar_drafts(seq: Sequence, draft: Draft, cap: int) -> Draft:
    """Under a grammar: the draft up to its first token the grammar forbids (a row past it
    could only be rejected; the verify masks it too), or the tokens the grammar forces next
    when they reach further (JSON keys and punctuation the drafter cannot know about: the
    target, masked, can emit nothing else)."""
    valid = seq.grammar.valid_prefix(draft.tokens)
    forced = seq.grammar.forced(cap)
    if len(forced) > valid:
        return Draft(forced)
    return draft.truncate(valid)
