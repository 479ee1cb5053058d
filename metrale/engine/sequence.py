"""Sequence (one generation: tokens, progress, pages, status) and Batch (what one step runs).

A step computes rows `[num_computed_tokens, num_computed_tokens + num_rows)` of each scheduled
sequence. Prefill, chunked prefill, recompute after preemption and decode are all that one rule;
the step samples a token for a sequence exactly when its rows reach its last token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from metrale.config import SamplingParams
from metrale.engine.device_tokens import DeviceRow, PendingIds


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Phase(enum.Enum):
    """What a batch's rows are: decode batches are the graph-capturable ones."""

    PREFILL = "prefill"  # every sequence runs prompt (or recompute) rows and none samples yet
    DECODE = "decode"  # every sequence runs exactly its one last row
    MIXED = "mixed"  # prefill chunks and decodes in one forward
    VERIFY = "verify"  # last token + drafts per sequence (speculative decoding)


# eq=False: a sequence is itself alone (identity, hashable). A field-by-field __eq__ made every
# `seq in scheduler.running` and `running.remove(seq)` build and compare tuples of all fields of
# every sequence before it: quadratic Python at each finish of a wide batch.
@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...]
    arrival: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # the request itself caused `error` (its grammar failed on a token, it can never fit the KV
    # pool), as a check at admission would have found: the server answers 400, not 500
    error_by_request: bool = False
    num_preemptions: int = 0
    # per emitted token: {token_id: Logprob} (the emitted token first, then the top-k)
    logprobs: list[dict[int, Any]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # set by the engine: output text state (an IncrementalDetokenizer) and the emitted text
    detokenizer: Any = None
    text: str = ""
    pending_text: str = ""  # decoded but held back (a stop string may be completing)
    # state slot while running (verify keys and, for hybrid models, the recurrent state); -1 when
    # not running
    slot: int = -1
    # speculative decoding of this sequence: drafts verified and accepted so far
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # steps that sampled for it, and whether its noise is keyed by them (it had drafts with a
    # distribution q: see `SamplingRow.fresh_noise`)
    noise_epoch: int = 0
    fresh_noise: bool = False
    # drafts proposed for the next verify (a `speculative.drafter.Draft`), cut to the planned depth
    draft: Any = None
    # its `structured.grammar.SequenceGrammar` when its output is constrained
    grammar: Any = None
    # request timing (time.perf_counter()): arrival, first scheduled, first and last token as
    # the caller gets them (with deferred text a step after they are made), and the step that
    # committed its first token (the engine's clock: where its prefill ends and decode begins)
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float = 0.0
    first_commit_time: float | None = None
    # Prefix caching (`engine/prefix_cache.py`). Chain hashes of its full pages, computed once
    # (its tokens never change, so they outlive a preemption); the pages of its block table
    # already offered to the cache; the tokens its last admission took from the cache; the
    # tokens its first admission took (what its request reports as `num_cached_tokens`).
    page_hashes: list[bytes] = field(default_factory=list)
    num_registered_pages: int = 0
    num_cached_tokens: int = 0
    num_prompt_cached_tokens: int = 0
    # Hybrid targets: the snapshot entry its recurrent state is loaded from before its next
    # forward (-1: none; set on a hit, cleared once loaded), the snapshot it resumed from, held
    # until it ends (a failed step rebuilds its state from there), and the page boundaries
    # (token counts, ascending) at which its state is saved as a snapshot.
    state_restore: int = -1
    state_pin: int = -1
    snapshot_at: list[int] = field(default_factory=list)
    # Asynchronous scheduling (`engine/ahead.py`): the token its last launched step samples,
    # still on the device (a `DeviceRow`), or the tokens of a held verify, known but not
    # emitted yet (`held_verify.HeldTokens`); `output_token_ids` ends with a placeholder for
    # them until that step is settled.
    inflight: Any = None

    def drop_inflight(self) -> None:
        """Drop the placeholder of the tokens still in flight (`inflight`), if any: one token on
        the device (a `DeviceRow`), or a held verify's tokens (`held_verify.HeldTokens`)."""
        if self.inflight is not None:
            del self.output_token_ids[-len(self.inflight) :]
            self.inflight = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_settled_tokens(self) -> int:
        """Its tokens but those a placeholder stands for (`inflight`)."""
        held = self.inflight
        return self.num_tokens - (0 if held is None else len(held))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def tokens(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """True while rows other than the last token are still to be computed."""
        return self.num_computed_tokens < self.num_tokens - 1


@dataclass
class ScheduledSeq:
    """One sequence's rows in a step: `num_rows` rows from `seq.num_computed_tokens` on; when they
    reach past the sequence's last token, the rows past it verify `drafts`."""

    seq: Sequence
    num_rows: int
    # the drafts' tokens: a host list, or a `DeviceRow` still on the device until the verdicts
    drafts: list[int] | DeviceRow = field(default_factory=list)
    # [len(drafts), V] the drafter's q for these drafts, or None (one-hot drafts)
    draft_probs: Any = None
    # The rows reach the sequence's last token, so this step emits tokens for it. Fixed when
    # scheduled: the sequence's counters move on once the step has run.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        end = self.seq.num_computed_tokens + self.num_rows
        self.samples = end == self.seq.num_tokens + len(self.drafts)
        if end > self.seq.num_tokens and not self.samples:
            raise ValueError("draft rows must follow every token of the sequence")

    def token_ids(self) -> list[int]:
        """The rows' token ids (drafts, or a last token, still on the device as `PendingIds`
        placeholders, which `ModelRunner.span_metadata` fills there)."""
        seq = self.seq
        start = seq.num_computed_tokens
        end = min(start + self.num_rows, seq.num_tokens)
        if type(seq.inflight) is DeviceRow and end == seq.num_tokens:
            # its last token is still being sampled by the step before (no drafts then)
            return PendingIds.of(seq.tokens(start, end - 1), seq.inflight)
        if isinstance(self.drafts, DeviceRow):
            return PendingIds.of(seq.tokens(start, end), self.drafts)
        return seq.tokens(start, end) + self.drafts


@dataclass
class Batch:
    entries: list[ScheduledSeq]
    preempted: list[Sequence] = field(default_factory=list)
    # sequences the scheduler ended (e.g. one that can never fit the page pool)
    failed: list[Sequence] = field(default_factory=list)
    # (the entry list's identity and length, its phase): `phase` is read several times a step
    # (runner, engine, D-Cut's timing), a pass over every entry each time
    _phase: tuple[tuple[int, int], Phase] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def phase(self) -> Phase:
        # worked out again only when the list changed (the scheduler appends to it while it
        # builds the batch; nothing changes an entry once made)
        key = (id(self.entries), len(self.entries))
        if self._phase is None or self._phase[0] != key:
            self._phase = (key, self._phase_of_entries())
        return self._phase[1]

    def _phase_of_entries(self) -> Phase:
        if all(e.samples and e.num_rows == 1 + len(e.drafts) for e in self.entries):
            return Phase.VERIFY if any(e.drafts for e in self.entries) else Phase.DECODE
        if not any(e.samples for e in self.entries):
            return Phase.PREFILL
        return Phase.MIXED

    @property
    def num_rows(self) -> int:
        return sum(e.num_rows for e in self.entries)

    @property
    def num_prompt_rows(self) -> int:
        """Rows at prompt positions (prefill, or its recompute after a preemption)."""
        return sum(
            max(
                0,
                min(e.seq.num_computed_tokens + e.num_rows, e.seq.num_prompt_tokens)
                - e.seq.num_computed_tokens,
            )
            for e in self.entries
        )

    def __len__(self) -> int:
        return len(self.entries)
