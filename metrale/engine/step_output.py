"""What one model step returns: every entry's packed rows and hidden states, and for each sampling
sequence its verdict (accepted drafts, emitted tokens with logprobs), copied back in one sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale.engine.device_tokens import DeviceDrafts, HostCopy, record_now
from metrale.engine.penalty_state import PenaltyState
from metrale.engine.sampler import SamplingBatch, SamplingRow
from metrale.engine.sequence import ScheduledSeq, Sequence
from metrale.speculative.verify import accept, build_layout


@dataclass
class SampledToken:
    """One emitted token of one sequence, with its logprob information when asked for."""

    seq: Sequence
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob), best first


@dataclass
class SeqVerdict:
    """A sampling sequence's result: its verified drafts, how many were accepted, and the tokens
    it emits (accepted drafts, then the target's own token), with logprobs when asked for."""

    entry: ScheduledSeq
    num_accepted: int
    matches: list[bool]  # per draft, every position
    # its tokens with their logprob information, or None: plain ids, made when first asked for
    # (`tokens`: a greedy verify's are read at its commit, in the next forward's window)
    built: list[SampledToken] | None
    picks: list[int]  # the target's token at every row, past the first miss too

    @property
    def seq(self) -> Sequence:
        return self.entry.seq

    @property
    def tokens(self) -> list[SampledToken]:
        """The tokens it emits: `picks` up to the first rejected draft's row (the bonus)."""
        if self.built is None:
            seq = self.entry.seq
            self.built = [SampledToken(seq, t) for t in self.picks[: self.num_accepted + 1]]
        return self.built

    @property
    def token_ids(self) -> list[int]:
        """The ids of `tokens`, without making them."""
        return self.picks[: self.num_accepted + 1]


class PendingVerdicts:
    """A step's verdicts still on the device (`ModelRunner.execute(defer=True)`, a step without
    drafts): each sampling entry's token, which the next step's input ids take from the device
    (`tokens`, one row each), and the host copies of the step's results, queued behind it."""

    def __init__(
        self, entries: list[ScheduledSeq], tokens: DeviceDrafts, table: HostCopy | None, k: int
    ) -> None:
        """`table`: a `verdict_table` (sampled rows, logprobs), or None when each row's token is
        all there is (plain greedy rows)."""
        self.entries, self.tokens, self.table, self.k = entries, tokens, table, k

    def verdicts(self) -> list[SeqVerdict]:
        """Waits for the step's copies (its forward and sampling alone)."""
        if self.table is None:
            return greedy_verdicts(self.entries, [row[0] for row in self.tokens.rows()])
        return parse_verdicts(self.entries, self.table.rows(), self.k)


@dataclass
class StepOutput:
    entries: list[ScheduledSeq]  # the entries that ran, in packed order
    verdicts: list[SeqVerdict]  # one per sampling entry, in packed order
    hidden: torch.Tensor  # [T, H] final hidden states of every packed row
    row_ends: list[int]  # per entry, the end of its packed rows
    # a deferred step's verdicts (`verdicts` is empty until `settle`)
    pending: PendingVerdicts | None = None

    def settle(self) -> None:
        """A deferred step's verdicts, read back now."""
        if self.pending is not None:
            self.verdicts, self.pending = self.pending.verdicts(), None

    @staticmethod
    def merge(parts: list[StepOutput]) -> StepOutput:
        """Concatenate the outputs of entries run separately (failure isolation)."""
        ends, offset = [], 0
        # NOTE: a failed part's hidden is an empty CPU tensor: never cat it with CUDA ones.
        hidden = [p.hidden for p in parts if p.entries]
        for part in parts:
            ends += [offset + end for end in part.row_ends]
            offset += part.row_ends[-1] if part.row_ends else 0
        return StepOutput(
            [e for p in parts for e in p.entries],
            [v for p in parts for v in p.verdicts],
            torch.cat(hidden) if hidden else torch.empty(0),
            ends,
        )


def to_host(tensor: torch.Tensor, follow=None, tokens: torch.Tensor | None = None) -> list:
    """`tensor.tolist()`, with `follow(tokens)` queued on the device after the copy (a
    drafter's work on the step's tokens, see `ModelRunner.after_verify`). On CUDA the copy goes
    to pinned memory and the host waits on an event for it alone, not for `follow`'s work."""
    if follow is None:
        return tensor.tolist()
    if tensor.device.type != "cuda":
        follow(tokens)
        return tensor.tolist()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    record_now(copied)
    follow(tokens)
    copied.synchronize()
    return host.tolist()


def shown_tokens(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`tokens` [R] as the host is shown them: -1 at each row whose logits are not finite (a NaN,
    an inf, or every entry -inf: a forward gone wrong), which fails that sequence alone at its
    commit (`commit.commit_rows`) rather than emit an arbitrary token. `values` [R]: each row's
    max logit (a max lands on a NaN or +inf wherever there is one; the greedy path has it from
    the reduction that picks its tokens). Two small kernels and a select: v - v is 0 exactly
    when v is finite (`torch.isfinite` is four). The device keeps `tokens` themselves: valid
    ids for the next step's input, whose row for that sequence is thrown away."""
    return torch.where((values - values) == 0, tokens, -1)


def verdict_table(acc) -> tuple[torch.Tensor, int]:
    """([R, 2 (+ 2 + 2k)] every row's match, emitted token and logprob data together, k): what
    the step's one host copy carries."""
    cols = [acc.matches[:, None].double(), acc.emitted[:, None].double()]
    k = 0
    if acc.logprobs is not None:
        k = acc.top_token_ids.shape[1]
        cols += [
            acc.ranks[:, None].double(),
            acc.logprobs[:, None].double(),
            acc.top_token_ids.double(),
            acc.top_logprobs.double(),
        ]
    return torch.cat(cols, dim=1), k


def verdicts_of(entries: list[ScheduledSeq], acc, read=None) -> list[SeqVerdict]:
    """The step's one host sync: every row's match, emitted token and logprob data together
    (`read` turns the table into host lists: `to_host` with the step's drafter work)."""
    table, k = verdict_table(acc)
    return parse_verdicts(entries, table.tolist() if read is None else read(table), k)


def parse_verdicts(entries: list[ScheduledSeq], table: list, k: int) -> list[SeqVerdict]:
    """The verdicts from a `verdict_table` read back to the host."""
    result, row = [], 0
    for e in entries:
        rows = table[row : row + len(e.drafts) + 1]
        row += len(rows)
        matches = [bool(r[0]) for r in rows[:-1]]
        accepted = next((i for i, m in enumerate(matches) if not m), len(matches))
        tokens = []
        for r in rows[: accepted + 1]:
            token = SampledToken(e.seq, int(r[1]))
            n = e.seq.params.logprobs
            if n is not None:
                token.rank, token.logprob = int(r[2]), r[3]
                token.top = [(int(i), lp) for i, lp in zip(r[4 : 4 + n], r[4 + k : 4 + k + n])]
            tokens.append(token)
        result.append(SeqVerdict(e, accepted, matches, tokens, [int(r[1]) for r in rows]))
    return result


def greedy_verdicts(
    entries: list[ScheduledSeq], picks: torch.Tensor | list[int], forced=None
) -> list[SeqVerdict]:
    """`verdicts_of(entries, accept(...))` for plain greedy rows (`is_plain_greedy`), from the
    argmax of every row alone: a draft matches iff it is its row's argmax, and every row emits
    its argmax. One host sync, no sampling tensors, no acceptance kernels (`picks` [R], or
    already on the host). `forced` (the bench's `ForcedAcceptance`) draws the matches instead."""
    table = picks.tolist() if isinstance(picks, torch.Tensor) else picks  # [R]
    result, row = [], 0
    for e in entries:
        k = len(e.drafts)
        rows = table[row : row + k + 1]
        row += k + 1
        if forced is None:
            matches = [d == t for d, t in zip(e.drafts, rows, strict=False)]
        else:  # (never past a row whose logits were not finite: `shown_tokens`)
            matches = [m and t >= 0 for m, t in zip(forced.draw(k), rows, strict=False)]
        accepted = next((i for i, m in enumerate(matches) if not m), k)
        result.append(SeqVerdict(e, accepted, matches, None, rows))
    return result


def sampled_verdicts(
    entries: list[ScheduledSeq],
    logits: torch.Tensor,
    raw_argmax: bool,
    forced=None,
    follow=None,
    penalties: PenaltyState | None = None,
) -> list[SeqVerdict]:
    """Verdicts through the logits pipeline and `accept` (sampling, penalties, logprobs).
    `forced`: the bench's `ForcedAcceptance`; `follow` (`ModelRunner.after_verify` bound to the
    step) is given the emitted token of every row, queued before the host sync, when the drafts
    are one-hot (a match is then an equal token); `penalties`: the engine's penalty state."""
    acc, one_hot = _acceptance(entries, logits, raw_argmax, forced, penalties)
    follow = follow if one_hot else None  # the drafts' own q: matches are not equal tokens
    shown = _shown(acc, logits)
    return verdicts_of(entries, shown, lambda table: to_host(table, follow, acc.emitted))


def pending_sampled(
    entries: list[ScheduledSeq], logits: torch.Tensor, penalties: PenaltyState | None = None
) -> PendingVerdicts:
    """`sampled_verdicts` of a step without drafts, left on the device (`PendingVerdicts`)."""
    acc, _ = _acceptance(entries, logits, False, penalties=penalties)
    table, k = verdict_table(_shown(acc, logits))
    tokens = DeviceDrafts(acc.emitted.long().contiguous().view(-1, 1))
    return PendingVerdicts(entries, tokens, HostCopy(table), k)


def pending_greedy(
    entries: list[ScheduledSeq], picks: torch.Tensor, shown: torch.Tensor
) -> PendingVerdicts:
    """`greedy_verdicts` of a step without drafts, left on the device (`PendingVerdicts`):
    the next step's input ids take `picks`, the host reads `shown` (`shown_tokens`)."""
    tokens = DeviceDrafts(picks.view(-1, 1), shown=shown.view(-1, 1))
    return PendingVerdicts(entries, tokens, None, 0)


def _shown(acc, logits: torch.Tensor):
    """`acc` as the host is shown it (`shown_tokens`): a row whose logits are not finite emits
    -1 and matches no draft, so the sequence's verdict ends there, with it."""
    shown = shown_tokens(logits.amax(dim=-1), acc.emitted)
    return acc._replace(emitted=shown, matches=acc.matches & (shown >= 0))


def _acceptance(
    entries: list[ScheduledSeq],
    logits: torch.Tensor,
    raw_argmax: bool,
    forced=None,
    penalties: PenaltyState | None = None,
):
    """(`accept`'s result, whether every draft is one-hot) on the device."""
    device = logits.device
    vocab = logits.shape[-1]
    state_rows = [0] * len(entries)
    if penalties is not None:
        state_rows = penalties.rows_of([e.seq for e in entries], vocab)
    sb = SamplingBatch.build(
        [
            SamplingRow(
                params=e.seq.params,
                seed=e.seq.seed,
                prompt_token_ids=e.seq.prompt_token_ids,
                output_token_ids=e.seq.output_token_ids,
                eos_token_ids=e.seq.eos_token_ids,
                drafts=e.drafts,  # its rows: the last token's, then one per draft
                epoch=e.seq.noise_epoch,
                fresh_noise=e.seq.fresh_noise,
                penalty_row=row,
            )
            for e, row in zip(entries, state_rows, strict=True)
        ],
        vocab_size=vocab,
        device=device,
        penalties=penalties,
    )
    layout = build_layout([len(e.drafts) for e in entries], [e.drafts for e in entries], device)
    q, q_rows = _draft_probs(entries, logits)
    acc = accept(logits, sb, layout, q, raw_argmax=raw_argmax, q_rows=q_rows)
    if forced is not None:  # `metrale bench --forced-acceptance` only
        acc = forced(acc, layout)
    return acc, q is None


def _draft_probs(entries: list[ScheduledSeq], logits: torch.Tensor):
    """([R, V] draft distributions, zeros elsewhere; [R] bool, the rows that have one), or
    (None, None) when every draft is one-hot (judged against the target's own sample)."""
    if not any(e.draft_probs is not None for e in entries):
        return None, None
    device, parts, flags = logits.device, [], []
    for e in entries:
        k = len(e.drafts)
        q = torch.zeros(k + 1, logits.shape[-1], device=device)
        given = k > 0 and e.draft_probs is not None
        if given:
            q[:k] = e.draft_probs.to(device, torch.float32)
        parts.append(q)
        flags += [given] * k + [False]
    return torch.cat(parts), torch.tensor(flags, device=device)
