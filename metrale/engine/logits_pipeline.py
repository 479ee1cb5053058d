"""Per-row logits processing: the host-built `SamplingBatch` and the on-device logits pipeline.

A "row" is one logits row to pick a token from: one per running sequence in plain decoding,
several per sequence in speculative verification (each with its own token history, drafts
appended). `SamplingBatch.build` turns the rows into tensors once per step on the host;
`apply_logits_pipeline` then uses tensor ops only (no host sync, no loop over rows) and skips every
stage that no row uses, through flags computed at build time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from metrale.config import SamplingParams
from metrale.engine.penalty_state import uses_penalties

if TYPE_CHECKING:
    from metrale.engine.penalty_state import PenaltyState

# Temperatures below this count as greedy: dividing logits by them can overflow float32, and the
# limit of sampling as the temperature goes to 0 is the argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5

_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs about one sequence's logits rows: 1 + len(drafts) of them, row j
    picking after `output_token_ids + drafts[:j]` (a verify's rows share everything else, so
    they are described once and expanded in `SamplingBatch.build`)."""

    params: SamplingParams
    seed: int  # resolved per-request seed (the engine draws one when params.seed is None)
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens emitted before the first row's pick
    eos_token_ids: tuple[int, ...] = ()  # model EOS ids
    drafts: Sequence[int] = ()
    # Noise keys: by default a row's noise is keyed by (seed, output position), so speculation
    # reproduces plain seeded decoding. A sequence that has had drafts with a distribution q
    # (`fresh_noise`) keys it by its sampling-step count (`epoch`) too: a position decided again
    # in a later step never meets the noise a drafter may have seen there (Verdict.picks).
    epoch: int = 0
    fresh_noise: bool = False
    # its row of the engine's `PenaltyState` (0: none), when `SamplingBatch.build` is given it
    penalty_row: int = 0


def is_plain_greedy(params: SamplingParams, num_output_tokens: int) -> bool:
    """True when the pipeline leaves this sequence's logits rows untouched and picks their
    argmax: greedy, no penalty, bias or min_tokens ban now, no logprobs. Such rows need no
    `SamplingBatch` at all (the runner's greedy fast path). Keep in step with `build` and
    `apply_logits_pipeline`: any stage added there that can touch a greedy row belongs here."""
    return (
        params.temperature < GREEDY_TEMPERATURE_EPS
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and not params.logit_bias
        and num_output_tokens >= params.min_tokens
        and params.logprobs is None
    )


def to_int64(value: int) -> int:
    """Wrap any Python int into int64 range (two's complement), so huge or negative seeds work."""
    value &= _U64
    return value - (1 << 64) if value >= 1 << 63 else value


def _check_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what}: token id {bad[0]} is outside the vocabulary ({vocab_size})")


def _check_id_tensor(ids: Tensor, vocab_size: int, what: str) -> None:
    """Range-check a host tensor of token ids (an out-of-range index would fault on GPU)."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)][0]
        raise ValueError(f"{what}: token id {int(bad)} is outside the vocabulary ({vocab_size})")


def _history_index(ids: list[int], lens: list[int]) -> Tensor:
    """Flat token ids plus per-row counts -> [2, M] int64 host tensor of (row, token).

    One numpy conversion of the flat list is several times faster than a tensor per row."""
    toks = torch.from_numpy(np.asarray(ids, dtype=np.int64).reshape(-1))  # [M]
    rows = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))  # [M]
    return torch.stack([rows, toks])


@dataclass
class SamplingBatch:
    """Device tensors describing N logits rows (see `build`). Optional tensors are None when no
    row needs them, so the pipeline skips their stage."""

    num_rows: int
    vocab_size: int
    device: torch.device
    temperature: Tensor  # [N] f32, 1.0 on greedy rows (so dividing by it is a no-op there)
    greedy: Tensor  # [N] bool
    top_k: Tensor  # [N] i64, vocab_size when disabled (and on greedy rows)
    top_p: Tensor  # [N] f32, 1.0 when disabled
    min_p: Tensor  # [N] f32, 0.0 when disabled
    repetition_penalty: Tensor  # [N] f32
    presence_penalty: Tensor  # [N] f32
    frequency_penalty: Tensor  # [N] f32
    seed: Tensor  # [N] i64
    # [N] i64 the noise key's position word: len(output_token_ids), the output position of the
    # pick, plus epoch << 32 on fresh-noise rows (`SamplingRow.fresh_noise`)
    step: Tensor
    bias_index: Tensor | None  # [2, M] i64: (row, token) of each logit-bias entry
    bias_value: Tensor | None  # [M] f32
    ban_index: Tensor | None  # [2, B] i64: (row, token) banned by min_tokens
    prompt_mask: Tensor | None  # [N, V] bool: token occurs in the prompt (repetition penalty)
    output_counts: Tensor | None  # [N, V] f32: occurrences in the output (any penalty)
    max_logprobs: int | None  # max requested top-logprobs k; None when no row wants logprobs
    all_greedy: bool
    any_greedy: bool
    any_repetition: bool
    any_frequency_presence: bool
    any_temperature: bool
    any_top_k: bool
    max_top_k: int  # largest enabled top_k (0 when none): lets top-k alone use torch.topk
    any_top_p: bool
    any_min_p: bool

    @property
    def any_penalty(self) -> bool:
        return self.any_repetition or self.any_frequency_presence

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        device: torch.device,
        penalties: PenaltyState | None = None,
    ) -> SamplingBatch:
        """Gather per-row settings on the host, then move them to `device` in a few copies.
        `penalties`: the engine's device state of the penalties' counts, each row's at its
        `penalty_row`; without it they are built from each row's whole history (the reference
        the state is tested against)."""
        v = vocab_size
        n = sum(1 + len(row.drafts) for row in rows)
        if n == 0:
            raise ValueError("SamplingBatch.build: no rows")
        # Per sequence (its rows share them; expanded below, with one numpy repeat each):
        floats: list[tuple[float, ...]] = []  # temperature, top_p, min_p, rep, pres, freq
        ints: list[tuple[int, ...]] = []  # top_k, seed, its first row's noise step, greedy
        reps: list[int] = []  # its rows
        bias_rows, bias_toks, bias_vals = [], [], []
        ban_rows, ban_toks = [], []
        # Histories for the penalties, flattened; per-row lengths are 0 where a row needs none.
        prompt_ids: list[int] = []
        prompt_lens: list[int] = []
        out_ids: list[int] = []
        out_lens: list[int] = []
        state_rows: list[int] = []  # with `penalties`: each logits row's state row
        draft_pairs: tuple[list[int], list[int]] = ([], [])  # (logits row, an earlier draft)
        logprobs_k: list[int] = []
        any_rep = any_out = False
        i = 0  # the logits row
        for row in rows:
            p = row.params
            greedy = p.temperature < GREEDY_TEMPERATURE_EPS
            first_step = len(row.output_token_ids)
            r = 1 + len(row.drafts)
            # Sampling-only knobs are neutralised on greedy rows: they never change the argmax.
            top_k = v if greedy or p.top_k <= 0 or p.top_k >= v else p.top_k
            top_p = 1.0 if greedy else p.top_p
            min_p = 0.0 if greedy else p.min_p
            temperature = 1.0 if greedy else p.temperature
            settings = (
                temperature,
                top_p,
                min_p,
                p.repetition_penalty,
                p.presence_penalty,
                p.frequency_penalty,
            )
            floats.append(settings)
            key = first_step + (row.epoch << 32 if row.fresh_noise else 0)
            ints.append((top_k, to_int64(row.seed), key, int(greedy)))
            reps.append(r)
            if p.logit_bias:
                toks = list(p.logit_bias)
                _check_ids(toks, v, "logit_bias")
                for j in range(r):
                    bias_rows += [i + j] * len(toks)
                    bias_toks += toks
                    bias_vals += [p.logit_bias[t] for t in toks]
            if first_step < p.min_tokens:
                banned = set(p.stop_token_ids)
                if not p.ignore_eos:
                    banned.update(row.eos_token_ids)
                banned_ids = sorted(banned)
                _check_ids(banned_ids, v, "stop_token_ids/eos_token_ids")
                for j in range(min(r, p.min_tokens - first_step)):
                    ban_rows += [i + j] * len(banned_ids)
                    ban_toks += banned_ids
            uses_rep = p.repetition_penalty != 1.0
            any_rep = any_rep or uses_rep
            uses_out = uses_penalties(p)
            any_out = any_out or uses_out
            if penalties is not None:
                # each row's counts are its sequence's state row plus the drafts before it
                state_rows.extend([row.penalty_row if uses_out else 0] * r)
                for j in range(1, r if uses_out else 0):
                    draft_pairs[0].extend([i + j] * j)
                    draft_pairs[1].extend(row.drafts[:j])
            else:
                for j in range(r):
                    prompt_lens.append(len(row.prompt_token_ids) if uses_rep else 0)
                    out_lens.append(first_step + j if uses_out else 0)
                    if uses_rep:
                        prompt_ids.extend(row.prompt_token_ids)
                    if uses_out:
                        out_ids.extend(row.output_token_ids)
                        out_ids.extend(row.drafts[:j])
            if p.logprobs is not None:
                logprobs_k.append(p.logprobs)
            i += r

        def to_dev(t: Tensor) -> Tensor:
            # Pinned + non_blocking lets the copy overlap; the caching host allocator keeps the
            # pinned block alive until the copy has run.
            if device.type == "cuda":
                return t.pin_memory().to(device, non_blocking=True)
            return t.to(device)

        counts = np.asarray(reps)
        f_rows = np.repeat(np.asarray(floats, dtype=np.float32), counts, axis=0)  # [N, 6]
        i_rows = np.repeat(np.asarray(ints, dtype=np.int64), counts, axis=0)  # [N, 4]
        # a row's noise step: its sequence's first row's, plus its place among them
        i_rows[:, 2] += np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
        f = to_dev(torch.from_numpy(f_rows))
        it = to_dev(torch.from_numpy(i_rows))

        bias_index = bias_value = ban_index = None
        if bias_rows:
            bias_index = to_dev(torch.tensor([bias_rows, bias_toks], dtype=torch.int64))
            bias_value = to_dev(torch.tensor(bias_vals, dtype=torch.float32))
        if ban_rows:
            ban_index = to_dev(torch.tensor([ban_rows, ban_toks], dtype=torch.int64))

        # The [N, V] history tensors are built on the device from (row, token) index lists, which
        # are much smaller to copy than the dense tensors.
        prompt_mask = output_counts = None
        if penalties is not None and any_out:
            _check_ids(draft_pairs[1], v, "drafts")
            prompt_mask, output_counts = penalties.gather(state_rows, draft_pairs, any_rep)
        elif any_rep:
            idx = _history_index(prompt_ids, prompt_lens)  # [2, P]
            _check_id_tensor(idx[1], v, "prompt_token_ids")
            idx = to_dev(idx)
            prompt_mask = torch.zeros(n, v, dtype=torch.bool, device=device)
            prompt_mask[idx[0], idx[1]] = True
        if any_out and penalties is None:
            idx = _history_index(out_ids, out_lens)  # [2, O]
            _check_id_tensor(idx[1], v, "output_token_ids")
            idx = to_dev(idx)
            output_counts = torch.zeros(n, v, dtype=torch.float32, device=device)
            # Adding 1.0s is exact in any order, so the atomics on GPU stay deterministic.
            ones = torch.ones(idx.shape[1], dtype=torch.float32, device=device)
            output_counts.index_put_((idx[0], idx[1]), ones, accumulate=True)

        # (over sequences: every row of one has its settings)
        greedy_flags = [g for *_, g in ints]
        enabled_k = [k for k, *_ in ints if k < v]
        sampled = [row for row, (*_, g) in zip(floats, ints, strict=True) if not g]
        return cls(
            num_rows=n,
            vocab_size=v,
            device=device,
            temperature=f[:, 0],
            greedy=it[:, 3].bool(),
            top_k=it[:, 0],
            top_p=f[:, 1],
            min_p=f[:, 2],
            repetition_penalty=f[:, 3],
            presence_penalty=f[:, 4],
            frequency_penalty=f[:, 5],
            seed=it[:, 1],
            step=it[:, 2],
            bias_index=bias_index,
            bias_value=bias_value,
            ban_index=ban_index,
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            max_logprobs=max(logprobs_k) if logprobs_k else None,
            all_greedy=all(greedy_flags),
            any_greedy=any(greedy_flags),
            any_repetition=prompt_mask is not None,
            any_frequency_presence=any(r[4] != 0.0 or r[5] != 0.0 for r in floats),
            any_temperature=any(r[0] != 1.0 for r in sampled),
            any_top_k=bool(enabled_k),
            max_top_k=max(enabled_k, default=0),
            any_top_p=any(r[1] < 1.0 for r in sampled),
            any_min_p=any(r[2] > 0.0 for r in sampled),
        )


def _top_k_only(x: Tensor, batch: SamplingBatch) -> Tensor:
    """Top-k without top-p: a partial torch.topk up to the largest k beats a full sort."""
    top_vals = x.topk(batch.max_top_k, dim=-1).values  # [N, kmax], descending
    k = batch.top_k.clamp(max=batch.max_top_k)  # disabled rows (k = V) read column kmax - 1
    kth = top_vals.gather(1, (k - 1)[:, None])  # [N, 1]
    kth = kth.masked_fill((batch.top_k >= batch.vocab_size)[:, None], float("-inf"))
    # Ties with the k-th value are all kept, so the result does not depend on sort order.
    return x.masked_fill(x < kth, float("-inf"))


def _top_k_top_p(x: Tensor, batch: SamplingBatch) -> Tensor:
    """Top-k then top-p, both in sorted space from one descending sort."""
    # stable=True: tokens of equal logit keep id order, so the boundary is device-independent.
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)  # [N, V] each
    if batch.any_top_k:
        kth = sorted_x.gather(1, (batch.top_k - 1)[:, None])  # [N, 1]; k = V keeps all
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)  # [N, V], renormalised after top-k
    cum = probs.cumsum(dim=-1)
    # Mass strictly before each token: keeping tokens whose preceding mass is < top_p gives the
    # smallest prefix with mass >= top_p; the top token (preceding mass 0) always stays.
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # [N, V]
    # Rows with top_p = 1 are exempt: rounding in the cumsum could otherwise cut their tail.
    drop = (before >= batch.top_p[:, None]) & (batch.top_p < 1.0)[:, None]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def apply_logits_pipeline(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """[N, V] logits -> processed [N, V] float32 (a new tensor; the input is left untouched).

    Order: repetition penalty, frequency/presence penalties, logit bias, min_tokens bans; then on
    sampled rows temperature, top-k, top-p and min-p (masked tokens become -inf).
    """
    if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
        raise ValueError(f"logits shape {tuple(logits.shape)} != [{batch.num_rows}, V]")
    if logits.shape[1] != batch.vocab_size:
        raise ValueError(f"logits width {logits.shape[1]} != vocab_size {batch.vocab_size}")
    x = logits.to(torch.float32, copy=True)  # [N, V]; the caller keeps the raw logits
    if batch.any_repetition:
        assert batch.prompt_mask is not None and batch.output_counts is not None
        present = batch.prompt_mask | (batch.output_counts > 0)  # [N, V]
        r = batch.repetition_penalty[:, None]  # [N, 1]
        x = torch.where(present, torch.where(x > 0, x / r, x * r), x)
    if batch.any_frequency_presence:
        counts = batch.output_counts  # [N, V]
        assert counts is not None
        x -= batch.frequency_penalty[:, None] * counts + batch.presence_penalty[:, None] * (
            counts > 0
        )
    if batch.bias_index is not None:
        # Each (row, token) appears once (logit_bias is a dict), so accumulate is a plain add.
        x.index_put_((batch.bias_index[0], batch.bias_index[1]), batch.bias_value, accumulate=True)
    if batch.ban_index is not None:
        x[batch.ban_index[0], batch.ban_index[1]] = float("-inf")
    if batch.all_greedy:
        return x
    if batch.any_temperature:
        x /= batch.temperature[:, None]  # greedy rows divide by 1.0: exact no-op
    if batch.any_top_p:
        x = _top_k_top_p(x, batch)
    elif batch.any_top_k:
        x = _top_k_only(x, batch)
    if batch.any_min_p:
        # p_i < min_p * p_max  <=>  x_i - x_max < log(min_p); log(0) = -inf disables the row.
        x_max = x.max(dim=-1, keepdim=True).values  # [N, 1]
        x = x.masked_fill(x < x_max + torch.log(batch.min_p)[:, None], float("-inf"))
    return x
