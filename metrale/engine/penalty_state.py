"""The penalties' state on the device: each live sequence with a repetition, presence or frequency
penalty keeps its output's token counts in a row of one [rows, V] tensor (and, with a repetition
penalty, its prompt's token mask in a row of a [rows, V] bool tensor), updated by each step's new
tokens only, as SGLang's penalizers keep theirs.

Built from each sequence's whole output every step (`SamplingBatch.build`'s history lists, still
the reference the tests compare with), a step's host work and copies grew with the length of
every output: at batch 64 and a few thousand tokens each, hundreds of thousands of ids a step.
Here a step gathers rows by index, and its tokens are added after it: the tokens a commit
emitted (host lists, one packed copy), or the token a step launched ahead left on the device
(`engine/ahead.py`: nothing is read back, so penalties no longer keep the engine synchronous).

A row counts the first `counted` tokens of its sequence's output (the placeholder of a token still
in flight included). Whatever moves an output otherwise (a step withdrawn, a failure part-way
through a commit) leaves `counted` unequal to the output's length, and the row is rebuilt from
the output before its next use: the counts are never wrong, only sometimes remade.
"""

from __future__ import annotations

import logging

import torch

from metrale.config import SamplingParams
from metrale.engine.device_tokens import DeviceRow
from metrale.engine.sequence import Sequence
from metrale.engine.staging import to_device_packed

_FIRST_ROWS = 8
log = logging.getLogger(__name__)


def uses_penalties(params: SamplingParams) -> bool:
    """Whether a request's logits depend on its tokens' counts (any of the three penalties)."""
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


class _Row:
    __slots__ = ("index", "counted", "prompt")

    def __init__(self, index: int) -> None:
        self.index = index
        self.counted = -1  # output tokens the row counts; -1: to be rebuilt
        self.prompt = False  # its prompt mask is filled


class PenaltyState:
    """Rows of token counts (and prompt masks) of the live sequences that use penalties. Row 0
    stays zero: the row of every sequence without penalties. Tensors are made at the first
    sequence with a penalty and grow by doubling, up to one row a scheduler slot and the zero
    row (only scheduled sequences take rows, and preempted ones give theirs back): at most
    (max_num_seqs + 1) x V x 5 bytes, 195 MB at 256 slots and Qwen3's vocabulary (past that,
    should a row never be released, they grow on with a warning). (Inference
    tensors: every method that touches them runs in inference mode, the step's and the
    commit's alike.)"""

    def __init__(self, device: torch.device, max_rows: int | None = None) -> None:
        """`max_rows`: the most sequences that hold rows at once (`max_num_seqs`); None: any."""
        self.device = device
        self.max_rows = None if max_rows is None else max_rows + 1  # (and the zero row)
        self.counts: torch.Tensor | None = None  # [rows, V] float32 occurrences in the output
        self.prompt: torch.Tensor | None = None  # [rows, V] bool, tokens of the prompt
        self._rows: dict[int, _Row] = {}  # seq_id -> its row
        self._free: list[int] = []
        self.rebuilds = 0  # rows made again from a sequence's output (tests, diagnostics)

    @property
    def holds_rows(self) -> bool:
        """Whether any sequence holds a row (else a step's tokens have nothing to update)."""
        return bool(self._rows)

    @torch.inference_mode()
    def rows_of(self, seqs: list[Sequence], vocab_size: int) -> list[int]:
        """Each sequence's row, current (rebuilt where it is not); 0 for one without penalties."""
        rows = []
        for seq in seqs:
            params = seq.params
            if not uses_penalties(params):
                rows.append(0)
                continue
            row = self._rows.get(seq.seq_id)
            if row is None:
                row = self._rows[seq.seq_id] = _Row(self._allocate(vocab_size))
            if row.counted != len(seq.output_token_ids):
                self._rebuild(seq, row)
            if params.repetition_penalty != 1.0 and not row.prompt:
                self._fill_prompt(seq, row, vocab_size)
            rows.append(row.index)
        return rows

    @torch.inference_mode()
    def committed(self, seqs: list[Sequence]) -> None:
        """Count the tokens a commit appended to these sequences' outputs (one packed copy)."""
        if not self.holds_rows:
            return
        where: list[int] = []
        tokens: list[int] = []
        added: list[tuple[_Row, int]] = []
        for seq in seqs:
            row = self._rows.get(seq.seq_id)
            if row is None:
                continue
            out = seq.output_token_ids
            counted, row.counted = row.counted, -1  # (until the add is queued: see below)
            if seq.inflight is not None or not 0 <= counted <= len(out):
                continue  # (nothing commits past a placeholder: rebuilt if used again)
            new = out[counted:]
            where += [row.index] * len(new)
            tokens += new
            added.append((row, len(out)))
        if tokens:
            where_t, tokens_t = to_device_packed([where, tokens], self.device)
            self._add(where_t, tokens_t)
        # only now: a copy or add that raised leaves these rows to be rebuilt (found in review:
        # moved first, the rows claimed tokens they never counted, and kept them wrong)
        for row, counted in added:
            row.counted = counted

    @torch.inference_mode()
    def launched(self, seqs: list[Sequence], at: list[int], tokens: torch.Tensor) -> None:
        """Count the tokens a step launched ahead left on the device (`tokens` [R, 1]; row
        at[i] is seqs[i]'s, whose output now ends with its placeholder): nothing is read."""
        if not self.holds_rows:
            return
        where: list[int] = []
        picked: list[int] = []
        added: list[tuple[_Row, int]] = []
        for seq, i in zip(seqs, at, strict=True):
            row = self._rows.get(seq.seq_id)
            if row is None:
                continue
            counted, row.counted = row.counted, -1  # (until the add is queued, as above)
            if counted != len(seq.output_token_ids) - 1:
                continue
            where.append(row.index)
            picked.append(i)
            added.append((row, counted + 1))
        if where:
            where_t, picked_t = to_device_packed([where, picked], self.device)
            self._add(where_t, tokens[:, 0].index_select(0, picked_t))
        for row, counted in added:
            row.counted = counted

    def release(self, seq: Sequence) -> None:
        """Its row goes back to the pool (it ended, or was preempted: rebuilt if it returns)."""
        row = self._rows.pop(seq.seq_id, None)
        if row is not None:
            self._free.append(row.index)

    def _allocate(self, vocab_size: int) -> int:
        if self.counts is None:
            first = _FIRST_ROWS if self.max_rows is None else min(_FIRST_ROWS, self.max_rows)
            self.counts = torch.zeros(max(first, 2), vocab_size, device=self.device)
            self._free = list(range(self.counts.shape[0] - 1, 0, -1))
        elif self.counts.shape[1] != vocab_size:
            raise ValueError(
                f"penalties: logits of width {vocab_size}, rows of width {self.counts.shape[1]}"
            )
        if not self._free:
            size = self.counts.shape[0]
            grown = 2 * size
            if self.max_rows is not None and size < self.max_rows:
                grown = min(grown, self.max_rows)
            elif self.max_rows is not None:  # (a row never released: grown, not failed)
                log.warning("penalties: more than %d sequences hold rows", self.max_rows - 1)
            self.counts = torch.cat(
                [self.counts, self.counts.new_zeros(grown - size, self.counts.shape[1])]
            )
            if self.prompt is not None:
                self.prompt = torch.cat(
                    [self.prompt, self.prompt.new_zeros(grown - size, self.prompt.shape[1])]
                )
            self._free = list(range(grown - 1, size - 1, -1))
        return self._free.pop()

    def _add(self, where: torch.Tensor, tokens: torch.Tensor) -> None:
        # Adding 1.0s is exact in any order: the atomics on a GPU stay deterministic.
        ones = torch.ones(where.shape[0], device=self.device)
        self.counts.index_put_((where, tokens.long()), ones, accumulate=True)

    def _rebuild(self, seq: Sequence, row: _Row) -> None:
        """The row from the sequence's output: its tokens on the host, and the one still on
        the device (a placeholder's) from there."""
        self.rebuilds += 1
        self.counts[row.index].zero_()
        out = seq.output_token_ids
        # (a held verify's placeholder holds its tokens' values: counted with the others)
        inflight = seq.inflight if type(seq.inflight) is DeviceRow else None
        known = out[: len(out) - len(inflight)] if inflight is not None else out
        if known:
            where_t, tokens_t = to_device_packed([[row.index] * len(known), known], self.device)
            self._add(where_t, tokens_t)
        if inflight is not None:
            tokens = inflight.source.tensor[inflight.at, : len(inflight)]
            where = torch.full((len(inflight),), row.index, device=self.device)
            self._add(where, tokens)
        row.counted = len(out)

    def _fill_prompt(self, seq: Sequence, row: _Row, vocab_size: int) -> None:
        ids = seq.prompt_token_ids
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids: token id {bad[0]} is outside the vocabulary ({vocab_size})"
            )
        if self.prompt is None:
            self.prompt = torch.zeros_like(self.counts, dtype=torch.bool)
        self.prompt[row.index].zero_()
        if ids:
            (ids_t,) = to_device_packed([ids], self.device)
            self.prompt[row.index].index_fill_(0, ids_t, True)
        row.prompt = True

    @torch.inference_mode()
    def gather(
        self, rows: list[int], pairs: tuple[list[int], list[int]], repetition: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(prompt masks or None, counts) [N, V] of N logits rows, rows[i] the state row of
        logits row i; `pairs` (logits row, token): a verify row's earlier drafts, counted on
        top of its sequence's output."""
        (index,) = to_device_packed([rows], self.device)
        counts = self.counts.index_select(0, index)
        if pairs[0]:
            where_t, tokens_t = to_device_packed(list(pairs), self.device)
            ones = torch.ones(where_t.shape[0], device=self.device)
            counts.index_put_((where_t, tokens_t), ones, accumulate=True)
        prompt = None
        if repetition:
            prompt = self.prompt.index_select(0, index)
        return prompt, counts
