"""Each step's allowed-token masks for the rows of sequences under a grammar.

A sequence verifying k drafts has k + 1 rows: row j is judged in the grammar state after its
committed tokens and drafts 1..j, so a draft the grammar forbids cannot be the target's pick at
the row before it, and is rejected like any mismatch; the emitted text always parses. The masks
are filled on the host (llguidance, several matchers in parallel, off the GIL) after the step's
forward was launched, so they overlap it; one pinned copy takes them to the device, where the
logits of forbidden tokens become -inf before the logits pipeline and the acceptance.

Rows past a forbidden draft are left unconstrained: acceptance stops before them.
"""

from __future__ import annotations

import llguidance
import llguidance.torch as llgt
import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}
_EXECUTOR: llguidance.LLExecutor | None = None
# The host bitmask, kept and grown: a new pinned buffer every step cost more than the fill.
# NOTE: reused by the next step, by when this step's copy has landed (each step reads its
# verdicts back before the next one starts).
_HOST: dict[tuple[int, bool], torch.Tensor] = {}


def _host_bitmask(rows: int, vocab: int, pin: bool) -> torch.Tensor:
    buf = _HOST.get((vocab, pin))
    if buf is None or buf.shape[0] < rows:
        with torch.inference_mode(False):  # a normal tensor: written in and out of the mode
            buf = llgt.allocate_token_bitmask(max(rows, 64), vocab)
            _HOST[vocab, pin] = buf = buf.pin_memory() if pin else buf
    return buf[:rows]


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


def grammar_rows(entries) -> tuple[list, list[int]]:
    """(llguidance work items, the logits rows they cover) for `entries`, the step's sampling
    entries in logits-row order; ([], []) when none is under a grammar."""
    items, rows, first = [], [], 0
    for e in entries:
        grammar = e.seq.grammar
        n = 1 + len(e.drafts)
        if grammar is not None:
            # (the controller cut the drafts to the grammar's, but D-Cut may pad them after)
            valid = e.drafts[: grammar.valid_prefix(e.drafts)]
            items.append((grammar.matcher, len(rows), valid))
            rows.extend(range(first, first + n))
        first += n
    return items, rows


def apply_grammar_masks(entries, logits: torch.Tensor, grammar_vocab: int) -> None:
    """Set the logits of tokens the grammar forbids to -inf, in place, for every row of every
    entry under a grammar (`logits` [R, V]: the entries' rows, in order; `grammar_vocab`: the
    matchers' vocabulary size, at least V)."""
    items, rows = grammar_rows(entries)
    if not items:
        return
    vocab = logits.shape[-1]
    pin = logits.device.type == "cuda"
    bitmask = _host_bitmask(len(rows), grammar_vocab, pin)
    bitmask.fill_(-1)  # all allowed: rows past a forbidden draft stay so
    # llguidance takes the rows without drafts and those with apart
    plain = [(m, row) for m, row, drafts in items if not drafts]
    drafted = [item for item in items if item[2]]
    if plain:
        llgt.fill_next_token_bitmask_par(_executor(), plain, bitmask)
    if drafted:
        llgt.fill_next_token_bitmask_par_with_draft_tokens(_executor(), drafted, bitmask)
    device = logits.device
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    bits = bitmask.to(device, non_blocking=pin)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        index = torch.tensor(rows, pin_memory=pin).to(device, non_blocking=pin)
        logits.index_copy_(
            0, index, logits.index_select(0, index).masked_fill(~allowed, -torch.inf)
        )
