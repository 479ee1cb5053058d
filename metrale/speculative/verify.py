"""Acceptance: judge every sequence's drafts from one forward's logits, vectorised over the batch.

Each sequence contributes rows `[last_token, d_0 .. d_{k-1}]`; row j's logits predict the token
after d_{j-1}. Every row goes through the logits pipeline with the history it would have had
without speculation (the output so far plus the drafts before it), so penalties, bans and
`min_tokens` judge a draft exactly as plain decoding would. Then, per row:

- greedy rows: the draft matches iff it is the argmax of the processed logits;
- sampled rows (Leviathan/Chen): accept d with probability min(1, p(d)/q(d)), one uniform per
  position; one-hot q for deterministic drafters, so d is accepted with probability p(d).

A sequence accepts the longest matching prefix (`a` drafts), then emits one more token from row
a: for a rejected sampled draft, a sample of norm(max(0, p - q)); after a full accept (or with no
drafts, a plain decode), a sample of p. k = 0 is exactly non-speculative sampling, with the same
uniforms (stream `SAMPLE_STREAM` at the same output position), so one code path serves both.

NOTE: lossless: the emitted sequence is distributed as the target's own samples (exactly the
target's tokens under greedy), whatever the drafts. No host sync happens here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from metrale.engine.sampler import (
    SAMPLE_STREAM,
    SamplingBatch,
    apply_logits_pipeline,
    seeded_uniform,
)
from metrale.engine.staging import to_device_packed

# Independent uniform streams for the accept test and the residual sample (see seeded_uniform).
ACCEPT_STREAM = 1
RESIDUAL_STREAM = 2


class RowLayout(NamedTuple):
    """How verify rows are packed: sequence s owns rows starts[s] .. starts[s] + depths[s]."""

    seq_of_row: Tensor  # [R] int64
    draft_of_row: Tensor  # [R] int64 draft token verified by the row (-1 on the last row)
    pad_index: Tensor  # [S, Kmax + 1] int64 packed row of (seq, j), -1 past the sequence's rows
    depths: Tensor  # [S] int64 drafts per sequence


class Acceptance(NamedTuple):
    num_accepted: Tensor  # [S] int64
    matches: Tensor  # [R] bool: the row's draft matched (False on last rows)
    emitted: Tensor  # [R] int64: the token row j emits if it is reached (draft or pick)
    logprobs: Tensor | None  # [R] f32 raw logprob of `emitted`
    ranks: Tensor | None  # [R] int64
    top_token_ids: Tensor | None  # [R, k]
    top_logprobs: Tensor | None  # [R, k]


def build_layout(depths: list[int], drafts: list[list[int]], device: torch.device) -> RowLayout:
    """Host-side packing of per-sequence drafts into row tensors."""
    kmax = max(depths, default=0)
    seq_of_row, draft_of_row, pad = [], [], []
    row = 0
    for s, (k, d) in enumerate(zip(depths, drafts, strict=True)):
        seq_of_row += [s] * (k + 1)
        draft_of_row += list(d[:k]) + [-1]
        pad.append(list(range(row, row + k + 1)) + [-1] * (kmax - k))
        row += k + 1

    pad_flat = [r for rows in pad for r in rows]
    seq_t, draft_t, pad_t, depths_t = to_device_packed(
        [seq_of_row, draft_of_row, pad_flat, depths], device
    )
    return RowLayout(seq_t, draft_t, pad_t.view(len(depths), kmax + 1), depths_t)


def _race(probs: Tensor, batch: SamplingBatch, stream: int) -> Tensor:
    """Exponential race: argmax(p / E), E ~ Exp(1) seeded per (request, position, stream)."""
    u = seeded_uniform(batch.seed, batch.step, probs.shape[-1], stream)  # [R, V]
    return probs.div(u.log_().neg_()).argmax(dim=-1)


def accept(
    logits: Tensor,
    batch: SamplingBatch,
    layout: RowLayout,
    draft_probs: Tensor | None = None,
    raw_argmax: bool = False,
) -> Acceptance:
    """logits [R, V] raw float32, one row per verify row; draft_probs [R, V] (q on draft rows,
    ignored elsewhere) or None for one-hot drafts. See the module docstring for the rule.

    `raw_argmax` judges greedy draft rows on the argmax of the raw logits, skipping penalties,
    bias and bans (the reference system's block-drafter serve without masked verify); rows
    without a draft and sampled rows keep the pipeline. It is only lossless for requests whose
    pipeline leaves the argmax alone; the engine sets it only when asked
    (`SpecConfig.verify_raw_argmax`)."""
    processed = apply_logits_pipeline(logits, batch)  # [R, V]
    drafts = layout.draft_of_row
    has_draft = drafts >= 0  # [R]
    if raw_argmax:
        processed = torch.where((has_draft & batch.greedy)[:, None], logits, processed)
    safe_drafts = drafts.clamp(min=0)[:, None]  # [R, 1]
    greedy_pick = processed.argmax(dim=-1)  # [R]
    if batch.all_greedy:
        matches = has_draft & (greedy_pick == drafts)
        pick = greedy_pick
    else:
        p = torch.softmax(processed, dim=-1)  # [R, V]
        if draft_probs is None:
            q = torch.zeros_like(p).scatter_(1, safe_drafts, 1.0)  # one-hot drafts
        else:
            q = draft_probs.to(p.dtype)
        p_d = p.gather(1, safe_drafts).squeeze(1)
        q_d = q.gather(1, safe_drafts).squeeze(1).clamp(min=1e-30)
        u = seeded_uniform(batch.seed, batch.step, 1, ACCEPT_STREAM)[:, 0]  # [R]
        sampled_match = u < (p_d / q_d).clamp(max=1.0)
        residual = (p - q).clamp_(min=0.0)
        # p == q leaves no residual mass; a rejection is then impossible, but keep p finite.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
        sampled_pick = torch.where(
            has_draft, _race(residual, batch, RESIDUAL_STREAM), _race(p, batch, SAMPLE_STREAM)
        )
        matches = has_draft & torch.where(batch.greedy, greedy_pick == drafts, sampled_match)
        pick = torch.where(batch.greedy, greedy_pick, sampled_pick)

    # [S, Kmax + 1] -> accepted prefix length per sequence (padding counts as a miss)
    padded = torch.where(layout.pad_index >= 0, matches[layout.pad_index.clamp(min=0)], False)
    num_accepted = (
        padded[:, :-1].long().cumprod(dim=1).sum(dim=1)
        if padded.shape[1] > 1
        else (torch.zeros(padded.shape[0], dtype=torch.int64, device=logits.device))
    )
    emitted = torch.where(matches, drafts, pick)  # [R]
    if batch.max_logprobs is None:
        return Acceptance(num_accepted, matches, emitted, None, None, None, None)
    raw_logp = torch.log_softmax(logits, dim=-1)  # [R, V]
    token_logp = raw_logp.gather(1, emitted[:, None])  # [R, 1]
    ranks = (raw_logp > token_logp).sum(dim=-1) + 1
    top_logp, top_ids = raw_logp.topk(batch.max_logprobs, dim=-1)
    return Acceptance(
        num_accepted, matches, emitted, token_logp.squeeze(1), ranks, top_ids, top_logp
    )
