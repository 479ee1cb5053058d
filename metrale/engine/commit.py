"""A step's commit: each sequence moves past its committed rows (its last token and the drafts
its verdict accepted), emits its tokens, and the drafter and D-Cut observe the verdicts.

Split out of `engine/llm.py`: `LLMEngine._commit` wraps it (the sequences it ends are ended in a
`finally`), and both the synchronous engine and `engine/ahead.py` commit through it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from metrale.engine.held_verify import StepState, rows_moved
from metrale.engine.sequence import Sequence, SequenceStatus
from metrale.engine.step_output import StepOutput
from metrale.speculative.drafter import Verdict

if TYPE_CHECKING:
    from metrale.engine.llm import LLMEngine

log = logging.getLogger(__name__)

NONFINITE = "the target's logits for this sequence were not finite (NaN or inf)"


def commit_rows(
    engine: LLMEngine,
    out: StepOutput,
    changed: dict,
    advanced: bool,
    finished: list,
    state: StepState | None = None,
    observe_later: bool = False,
) -> int:
    """`LLMEngine._commit`'s work but ending the sequences it ends (`finished` gets them, and
    `_commit` ends them whatever happens here). `state`: the step's controller state where
    a later step was prepared since (`held_verify.StepState`), which says whether it is
    observed; `observe_later`: its verdicts wait in it for the rest of the step's."""
    verdict_of = {id(v.entry): v for v in out.verdicts}
    now, requests = time.perf_counter(), engine.telemetry.request
    # A step that drafted nothing, with a drafter that keeps no per-step state, has nothing
    # to tell the speculative side: it is a plain decode step.
    # (a plain step launched ahead drafted nothing, for a `stateless` drafter)
    spec = engine.spec
    if state is not None:
        observing = state.observing
    else:
        observing = not advanced and spec is not None and spec.observing
    needs_hidden = observing and spec.drafter.needs_hidden
    drafter_verdicts: list[Verdict] = []
    cache = engine.allocator.cache
    page = 0 if cache is None else cache.page_size
    filled: list[Sequence] = []  # sequences whose committed rows filled a page
    emitted = 0
    for entry, end in zip(out.entries, out.row_ends, strict=True):
        seq, first = entry.seq, entry.seq.num_computed_tokens
        if advanced:  # its counters moved at the launch
            first -= rows_moved(seq, entry)
        v = verdict_of.get(id(entry))
        # A row whose logits were not finite shows -1 and ends the verdict
        # (`step_output.shown_tokens`): the tokens before it are emitted, then the sequence ends
        # with an error (no arbitrary token, and none of its pages offered to the prefix cache)
        broken = v is not None and v.tokens[-1].token_id < 0
        if broken and cache is not None:
            # its pages offered so far (at a launch ahead, `AheadStepper._advance`, before
            # anyone knew; a prompt chunk's, whose row may be the one gone wrong) lose their
            # names, from the first it computed: those its first admission found cached are
            # others' rows (a later admission's hits may be its own, from before a preemption)
            cache.withdraw(seq, seq.num_prompt_cached_tokens // page)
        accepted = 0 if v is None else v.num_accepted
        committed = entry.num_rows - len(entry.drafts) + accepted
        if advanced:
            if seq.is_finished:
                continue
            if v is not None:  # its token replaces the placeholder
                seq.drop_inflight()
        else:
            seq.num_computed_tokens += committed
        if page and not broken and seq.num_computed_tokens >= (seq.num_registered_pages + 1) * page:
            filled.append(seq)
        tokens: list[int] = []
        if v is not None:
            seq.num_draft_tokens += len(entry.drafts)
            seq.num_accepted_tokens += accepted
            if not advanced:  # else counted at launch (the next step's noise keys on it)
                seq.noise_epoch += 1
            before = len(seq.output_token_ids)
            try:
                delta = engine.emitter.emit(seq, v.tokens[:-1] if broken else v.tokens)
            except Exception as e:  # noqa: BLE001 (its detokenizer, grammar: its failure alone)
                # out of `step`, it failed every request of the call, and one that raised
                # each step stopped the engine (found in review)
                log.exception("emitting the tokens of %s failed", seq.request_id)
                broken = True
                # the ids it recorded reach the caller: later from the emitter's pending ones
                # (`Emitter.settle`), else now, without text
                pending = engine.emitter.pending_tokens(seq)
                delta = None if pending else ("", seq.output_token_ids[before:])
                seq.finish_reason = None
                seq.error = f"emitting its tokens failed: {type(e).__name__}: {e}"
            tokens = seq.output_token_ids[before:]
            emitted += len(tokens)
            if tokens and seq.first_commit_time is None:
                seq.first_commit_time = now
            if delta is not None:  # else its tokens and text come with the next step's
                if tokens:
                    requests.emitted(seq, len(tokens), now)
                deltas = changed.setdefault(seq.request_id, {})
                earlier = deltas.get(seq.seq_id, ("", []))
                deltas[seq.seq_id] = (earlier[0] + delta[0], earlier[1] + delta[1])
            if broken and seq.finish_reason is None:  # (not if a stop came first)
                seq.finish_reason, seq.error = "error", seq.error or NONFINITE
                deltas = changed.setdefault(seq.request_id, {})
                deltas.setdefault(seq.seq_id, ("", []))
            if seq.finish_reason is not None:
                finished.append(seq)
        if observing and not broken:
            row = end - entry.num_rows
            drafter_verdicts.append(
                Verdict(
                    seq=seq,
                    drafts=entry.drafts,
                    num_accepted=accepted,
                    emitted=tokens,
                    matches=[] if v is None else v.matches,
                    hidden=out.hidden[row : row + committed] if needs_hidden else None,
                    first_position=first,
                    picks=[] if v is None else v.picks,
                )
            )
    # the penalties' device counts take the tokens emitted (a step launched ahead counted its
    # token at launch: its placeholder's)
    penalties = engine.runner.penalties
    if penalties.holds_rows:
        penalties.committed([v.seq for v in out.verdicts])
    if observing and observe_later:
        state.early.extend(drafter_verdicts)
    elif observing:
        if state is not None and state.early:
            drafter_verdicts, state.early = state.early + drafter_verdicts, []
        for seq, message in spec.observe(drafter_verdicts, state):
            engine._fail(seq, message)
            changed.setdefault(seq.request_id, {}).setdefault(seq.seq_id, ("", []))
    # After the drafters wrote their KV rows of these positions: the pages are complete.
    for seq in filled:
        if seq.status is SequenceStatus.RUNNING:
            offer_pages(cache, seq)
    if filled and engine.runner.states is not None:  # a hybrid's snapshots, all at once
        engine.runner.states.flush_snapshots()
    return emitted


def offer_pages(cache, seq: Sequence) -> None:
    """`cache.commit(seq)`, whose failure costs the cache those pages and nothing else: out of
    the step, it failed every request of the call, and one raising each step stopped the
    engine (found in review); the sequence's own output never depended on it."""
    try:
        cache.commit(seq)
    except Exception:  # noqa: BLE001
        log.exception("offering the pages of %s to the prefix cache failed", seq.request_id)
        # (not offered again: once a page, not once a step)
        done = min(seq.num_computed_tokens, seq.num_tokens)
        seq.num_registered_pages = max(seq.num_registered_pages, done // cache.page_size)
