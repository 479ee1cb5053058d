"""Acceptance: judge every sequence's drafts from one forward's logits, vectorised over the batch.

Each sequence contributes rows `[last_token, d_0 .. d_{k-1}]`; row j's logits predict the token
after d_{j-1}. Every row goes through the logits pipeline with the history it would have had
without speculation (the output so far plus the drafts before it), so penalties, bans and
`min_tokens` judge a draft exactly as plain decoding would. Then, per row:

- greedy rows: the draft matches iff it is the argmax of the processed logits;
- sampled rows with a one-hot draft (every drafter metrale ships): the draft matches iff it is
  the target's own seeded sample at that row, the very token plain seeded decoding draws there
  (stream `SAMPLE_STREAM` keyed by the seed and the output position). P(match) = p(d), and a
  mismatch emits that sample, distributed as p without d: the law of rejection sampling with a
  one-hot q, and the emitted tokens are plain seeded decoding's, whatever the drafts, the batch
  or the depths D-Cut picked;
- sampled rows whose drafter gave a distribution q (Leviathan/Chen): accept d with probability
  min(1, p(d)/q(d)); on rejection emit a sample of norm(max(0, p - q)). That is lossless only
  for d drawn from q, which the engine cannot check of a drafter's token, so the engine draws
  d from q itself before the forward (`draft_shapes.drawn_from_q`, its own noise stream): a
  drafter that claims a q it did not draw from cannot steer the output. Once a sequence has had
  such drafts, every row of it is keyed by its sampling-step count as well (`SamplingRow.
  fresh_noise`), so a position decided in a later step never meets noise a drafter saw through
  `Verdict.picks`: neither re-proposing revealed picks nor choosing which positions get judged
  can bias the output. (A drafter that recomputes the noise from the seed itself is outside any
  such guarantee.)

A sequence accepts the longest matching prefix (`a` drafts), then emits one more token from row
a: the correction above, or after a full accept (or with no drafts, a plain decode) the seeded
sample of p. k = 0 is exactly non-speculative sampling, so one code path serves both.

NOTE: lossless: the emitted sequence is distributed as the target's own samples (exactly the
target's tokens under greedy and, for one-hot drafts, under seeded sampling), whatever the
drafts. No host sync happens here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from metrale.engine.sampler import (
    SAMPLE_STREAM,
    SamplingBatch,
    apply_logits_pipeline,
    exponential_race,
    seeded_uniform,
)
from metrale.engine.staging import to_device_packed

# Independent uniform streams for the accept test and the residual sample (see seeded_uniform),
# and for the engine's own draw of a draft from the drafter's q (`draft_shapes.drawn_from_q`).
ACCEPT_STREAM = 1
RESIDUAL_STREAM = 2
DRAFT_STREAM = 3


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


def accepted_prefix(matches: Tensor, layout: RowLayout) -> Tensor:
    """[R] bool row matches -> [S] int64 each sequence's longest matching prefix of drafts
    (padding past a sequence's rows counts as a miss)."""
    padded = torch.where(layout.pad_index >= 0, matches[layout.pad_index.clamp(min=0)], False)
    return padded[:, :-1].long().cumprod(dim=1).sum(dim=1)


def accepted_from_tokens(starts: Tensor, tokens: Tensor, inputs: Tensor, max_q: int) -> Tensor:
    """[S] accepted drafts of each sequence of a packed verify step, computed on the device
    from the target's token at every row (`tokens` [R], `Acceptance.emitted`) and the step's
    input ids (`inputs`, at least R + 1 long where row r + 1's input is the draft row r
    verified): the rows before a sequence's first token that differs from the next row's
    input. Sequence s owns rows starts[s] .. starts[s + 1] - 1 (at most `max_q`; none for a
    padding sequence). For one-hot drafts a draft is accepted exactly when it equals the token
    its row emits, so this is `accept`'s `num_accepted`, with no host layout (capturable)."""
    rows = tokens.shape[0]
    first = starts[:-1]
    offsets = torch.arange(max_q, device=tokens.device)
    grid = (first[:, None] + offsets).clamp_(max=rows - 1)  # [S, q]
    verifies = offsets < (starts[1:] - first - 1)[:, None]  # a row that another row follows
    following = inputs[(grid + 1).clamp_(max=inputs.shape[0] - 1)]
    matches = (tokens[grid] == following) & verifies
    return matches[:, : max_q - 1].long().cumprod(dim=1).sum(dim=1)


def _race(probs: Tensor, batch: SamplingBatch, stream: int) -> Tensor:
    """Exponential race: argmax(p / E), E ~ Exp(1) seeded per (request, position, stream)."""
    return exponential_race(probs, batch.seed, batch.step, stream)


def accept(
    logits: Tensor,
    batch: SamplingBatch,
    layout: RowLayout,
    draft_probs: Tensor | None = None,
    raw_argmax: bool = False,
    q_rows: Tensor | None = None,
) -> Acceptance:
    """logits [R, V] raw float32, one row per verify row; draft_probs [R, V] (q on draft rows,
    ignored elsewhere) or None for one-hot drafts; q_rows [R] bool, the rows whose q came from
    the drafter (None: every row, when draft_probs is given). See the module docstring.

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
        own = _race(p, batch, SAMPLE_STREAM)  # [R] the target's seeded sample at each row
        sampled_match, sampled_pick = own == drafts, own
        if draft_probs is not None:
            q = draft_probs.to(p.dtype)
            judged = has_draft if q_rows is None else has_draft & q_rows
            p_d = p.gather(1, safe_drafts).squeeze(1)
            q_d = q.gather(1, safe_drafts).squeeze(1).clamp(min=1e-30)
            u = seeded_uniform(batch.seed, batch.step, 1, ACCEPT_STREAM)[:, 0]  # [R]
            residual = (p - q).clamp_(min=0.0)
            # p == q leaves no residual mass; a rejection is then impossible, but keep p finite.
            residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
            corrected = _race(residual, batch, RESIDUAL_STREAM)
            sampled_match = torch.where(judged, u < (p_d / q_d).clamp(max=1.0), sampled_match)
            sampled_pick = torch.where(judged, corrected, sampled_pick)
        matches = has_draft & torch.where(batch.greedy, greedy_pick == drafts, sampled_match)
        pick = torch.where(batch.greedy, greedy_pick, sampled_pick)

    num_accepted = accepted_prefix(matches, layout)
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
