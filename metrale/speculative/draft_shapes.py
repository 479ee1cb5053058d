"""How many drafts a sequence may verify, and a draft reshaped to what the step verifies: padded to
a dealt depth, cut where a grammar forbids it, or drawn by the engine from the drafter's q (the
speculative controller's helpers)."""

from __future__ import annotations

import operator

import torch

from metrale.config import SpecConfig
from metrale.engine.device_tokens import DeviceRow
from metrale.engine.logits_pipeline import GREEDY_TEMPERATURE_EPS, to_int64
from metrale.engine.sampler import exponential_race
from metrale.engine.sequence import Sequence
from metrale.speculative.drafter import Draft
from metrale.speculative.verify import DRAFT_STREAM


def draft_caps(seq: Sequence, cfg: SpecConfig, context_len: int) -> int:
    """How many drafts `seq` may verify now: every accepted draft plus the bonus token must fit
    under `max_tokens` and the context (`context_len`), so speculation never emits past either."""
    params = seq.params
    if not params.speculative or seq.is_prefilling:
        return 0
    k = cfg.num_drafts if params.num_drafts is None else min(cfg.num_drafts, params.num_drafts)
    k = min(k, context_len - seq.num_tokens - 1)
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
    # (one-hot drafts only, `checked_draft`: cutting a draft at a token of its own is lossless
    # only where each row emits the target's own sample, whatever the draft)
    return draft.truncate(valid)


def checked_draft(draft: Draft, cap: int, seq: Sequence, vocab_size: int, own: bool) -> Draft:
    """A drafter's proposal for `seq` cut to `cap`, or TypeError/ValueError (its sequence alone
    fails): a Draft of a list of in-vocabulary ids (a tensor of them failed the whole step
    outside this isolation: found in review); with a q, its tokens drawn from q
    (`drawn_from_q`). `own`: the drafter proposes the sequence's own tokens (no range check)."""
    if isinstance(draft, Draft) and draft.probs is not None:
        if seq.params.temperature >= GREEDY_TEMPERATURE_EPS and seq.grammar is None:
            return drawn_from_q(draft.truncate(cap), seq, vocab_size)
        # Judged one-hot (q checked all the same, then dropped): lossless for any token, so the
        # drafter's own are kept. Greedy rows judge the argmax (drawn from a soft q, an oracle's
        # 92 of 92 accepted fell to 56 of 216). Under a grammar a draft is cut where the
        # grammar stops validating it (`grammar_drafts`), a cut that depends on the drawn
        # token, which rejection sampling with q does not survive: cut before a forbidden
        # token, its row sampled p, not the residual, and the output was off; kept, an end
        # token the grammar allows mid-output (validation stops at one) let the unmasked row
        # after it emit what the grammar forbids (both found in review).
        normalised_q(draft.probs, min(len(draft.tokens), cap), vocab_size)
        draft = Draft(draft.tokens)
    if not isinstance(draft, Draft):
        raise TypeError(f"propose returned a {type(draft).__name__}, not a Draft")
    if isinstance(draft.tokens, tuple):
        draft = Draft(list(draft.tokens), draft.probs)
    elif not isinstance(draft.tokens, (list, DeviceRow)):
        raise TypeError(f"a Draft's tokens must be a list of ints, got {type(draft.tokens)}")
    if own or isinstance(draft.tokens, DeviceRow):
        # the sequence's own tokens, or a device drafter's picks from the target's head: in the
        # vocabulary by construction (and reading the latter here would wait for its forward)
        return draft.truncate(cap)
    # one pass over the tokens: each an integer id (a bool or a float such as 3.0 passed as one;
    # review) in the vocabulary
    return Draft([_token_id(t, vocab_size) for t in draft.tokens], draft.probs).truncate(cap)


def _token_id(token, vocab_size: int) -> int:
    """A draft token as an int id: Python's, numpy's and 0-d torch integers are ids; a bool or a
    float (3.0) is a TypeError, an id outside the vocabulary a ValueError (its sequence alone
    fails)."""
    if type(token) is int and 0 <= token < vocab_size:  # (the usual case, first: every token)
        return token
    if isinstance(token, (bool, float)) or (
        isinstance(token, torch.Tensor) and (token.dtype == torch.bool or token.is_floating_point())
    ):
        raise TypeError(f"draft token {token!r:.40} is not an int")
    try:
        token = operator.index(token)
    except TypeError:
        raise TypeError(f"draft token {token!r:.40} is not an int") from None
    if not 0 <= token < vocab_size:
        raise ValueError(f"draft token {token} is outside the vocabulary ({vocab_size})")
    return token


def normalised_q(probs, k: int, vocab_size: int) -> torch.Tensor:
    """A drafter's q for `k` drafts as [k, vocab] float32 rows that sum to 1, or a ValueError
    (its sequence alone fails): not [>= k, vocab] of finite non-negative values with mass in
    every row."""
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2:
        raise ValueError(f"a Draft's probs must be a 2-D tensor [drafts, vocab], got {probs!r:.60}")
    if probs.shape[0] < k or probs.shape[1] != vocab_size:
        raise ValueError(
            f"a Draft's probs must be [{k}, {vocab_size}] (a row per draft over the target's "
            f"vocabulary), got {list(probs.shape)}"
        )
    # (detached: a table a drafter built with autograd on failed the draws' in-place sampling
    # and its request; found in review)
    q = probs[:k].detach().to(torch.float64)
    if k == 0:
        return q.float()
    peak = q.amax(dim=-1, keepdim=True)
    if not bool((torch.isfinite(q).all() & (q >= 0).all() & (peak > 0).all()).item()):
        raise ValueError("a Draft's probs must be finite, non-negative, with mass in every row")
    # scaled by each row's peak before it is summed: finite values whose sum passed float32's
    # range normalised to zeros, and the draw then always took token 0 (found in review)
    q = q / peak
    return (q / q.sum(dim=-1, keepdim=True)).to(torch.float32)


def drawn_from_q(draft: Draft, seq: Sequence, vocab_size: int) -> Draft:
    """A draft with a distribution q (`Draft.probs`), its tokens drawn by the engine from q.

    Rejection sampling (accept d with probability min(1, p(d)/q(d)), else a sample of
    norm(max(0, p - q))) emits the target's distribution only when d was drawn from q; a
    drafter that claimed a uniform q and always proposed one token made it about 6 times
    likelier, and one that claimed a q one-hot elsewhere forced it outright (found in review).
    So the drafter's tokens only say how deep it drafted: each row's token is drawn from its q
    (normalised) by an exponential race on the engine's own noise, keyed like the row's other
    noise (seed, output position, sampling-step count: the sequence has `fresh_noise`) on a
    stream of its own, so it is independent of the accept test and the residual and is never
    met again in a later step. A q that `normalised_q` refuses is a ValueError (its sequence
    alone fails). Greedy requests and those under a grammar never come here: their drafts are
    judged one-hot (`checked_draft` checks their q, then drops it)."""
    k = len(draft.tokens)
    q = normalised_q(draft.probs, k, vocab_size)
    if k == 0:
        return Draft([], q)
    first = len(seq.output_token_ids) + (seq.noise_epoch << 32)
    seed = torch.full((k,), to_int64(seq.seed), dtype=torch.int64, device=q.device)
    keys = torch.arange(first, first + k, dtype=torch.int64, device=q.device)
    return Draft(exponential_race(q, seed, keys, DRAFT_STREAM).tolist(), q)
