"""Emitting tokens: record each one (with logprobs), detokenize it, check stop conditions, and
build the RequestOutputs a step returns.

Detokenizing is off the step's critical path where nothing this step decides needs the text: a
sequence with no stop strings and no logprobs ends on token ids alone (EOS, stop token ids,
`max_tokens`, the model length, a complete grammar), so its tokens are recorded at once and their
text is made later, by `drain`, which the engine runs while the next step's forward is on the
device (`ModelRunner.while_forward_runs`). Its output for step N is then returned by step N+1,
text and token ids together (as vLLM's asynchronous output processing does); a sequence that
ends is detokenized at once, so its last output is complete in the step it ends. Sequences with
stop strings (the text decides when they end) or logprobs are detokenized in the step itself.
"""

from __future__ import annotations

import logging

from metrale.engine.sequence import Sequence
from metrale.engine.step_output import SampledToken
from metrale.engine.stop import check_stop, find_stop_string, token_stop
from metrale.knobs import knobs
from metrale.outputs import CompletionOutput, Logprob, RequestOutput
from metrale.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# A delta: the text and the token ids a sequence emitted since its last output.
Delta = tuple[str, list[int]]


class Emitter:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self._pieces: dict[int, str] = {}  # token id -> its text alone (`_piece`)
        self.max_model_len = max_model_len
        # seq_id -> (sequence, token ids recorded but not yet detokenized)
        self._pending: dict[int, tuple[Sequence, list[int]]] = {}
        # deltas `drain` made, waiting for the step to return them; and the text a sequence
        # that failed or was aborted had held back (`settle`), the last of its output
        self._drained: list[tuple[Sequence, Delta]] = []
        self._tails: list[tuple[Sequence, str]] = []
        self.defers = not knobs().no_deferred_text

    def emit(self, seq: Sequence, tokens: list[SampledToken]) -> Delta | None:
        """Append `tokens` in order until a stop condition ends the sequence (later tokens of a
        verify are then dropped, as plain decoding would never have made them). Sets
        `seq.finish_reason` when it ends. Returns the (text, token ids) delta, or None when the
        text is deferred to `drain` (the tokens are recorded either way)."""
        if not self.defers or seq.params.stop or seq.params.logprobs is not None:
            whole = self._emit_whole(seq, tokens)
            if whole is not None:
                return whole
            text, ids = "", []
            for token in tokens:
                text += self._append(seq, token)
                ids.append(token.token_id)
                if seq.finish_reason is not None:
                    break
            return text, ids
        start = len(seq.output_token_ids)
        try:
            for token in tokens:
                self._record(seq, token)
                reason = token_stop(seq, self.max_model_len)
                if reason is not None:
                    seq.finish_reason, seq.stop_reason = reason
                    break
        finally:
            # every token recorded is pending, one whose grammar then raised included: its id
            # reaches the caller with the others (`settle`), never lost from the deltas
            ids = seq.output_token_ids[start:]
            entry = self._pending.get(seq.seq_id)
            if entry is None:
                self._pending[seq.seq_id] = (seq, ids)
            else:
                entry[1].extend(ids)
        if seq.finish_reason is None:
            return None
        # It ended: its text now, the last detokenizer tail included, so its final output
        # is whole; the delta covers every token its outputs have not shown yet.
        entry = self._pending.pop(seq.seq_id)
        try:
            delta = self._detokenize(*entry)
        except BaseException:
            self._pending[seq.seq_id] = entry  # (`settle` gives the caller its ids)
            raise
        try:
            tail = seq.detokenizer.flush()
        except Exception as e:  # noqa: BLE001 (it ends in error, with the text it has)
            log.exception("the detokenizer of %s failed at its end", seq.request_id)
            seq.finish_reason = "error"
            seq.error = f"its detokenizer failed at its end: {type(e).__name__}: {e}"
            tail = ""
        seq.text += tail
        return delta[0] + tail, delta[1]

    @staticmethod
    def _flush(seq: Sequence) -> str:
        """The detokenizer's tail of a sequence that failed or was aborted, or nothing if the
        detokenizer fails too (the text's end is lost, not the ids that come with it)."""
        try:
            return seq.detokenizer.flush()
        except Exception:  # noqa: BLE001
            log.exception("the detokenizer of %s failed at its end", seq.request_id)
            return ""

    def _emit_whole(self, seq: Sequence, tokens: list[SampledToken]) -> Delta | None:
        """`emit`'s in-step path for a verify's several tokens in one detokenizer push and one
        stop-string search (at batch 64 with stop strings, a push and a search a token were
        most of a verify step's commit), where that gives the token-by-token result: a
        byte-level decoder (the text of one push is the pushes' text), no grammar, and no
        token or stop string ending the sequence among them (logprob entries are made after).
        Otherwise it undoes what it did and returns None: the tokens go one at a time, which
        finds the exact token that ends it."""
        params = seq.params
        if len(tokens) < 2 or seq.grammar is not None or not self.tokenizer.byte_level:
            return None
        out = seq.output_token_ids
        start = len(out)
        for token in tokens:
            out.append(token.token_id)
            if token_stop(seq, self.max_model_len) is not None:
                del out[start:]
                return None
        ids = out[start:]
        mark = seq.detokenizer.mark()
        try:
            text = seq.pending_text + seq.detokenizer.push_each(ids)
        except BaseException:
            # its ids stay recorded (the commit ends it, showing them): with their logprob
            # entries, as token by token (found in review: the output had fewer entries)
            for token in tokens:
                self._logprobs(seq, token)
            raise
        stops = params.stop
        # (none found in the whole new text: none at any token; one found: which token
        # completed it, and whether after `min_tokens`, is the token-by-token path's to say)
        if stops and find_stop_string(seq, text, len(seq.pending_text)) is not None:
            seq.detokenizer.rewind(mark)
            del out[start:]
            return None
        for token in tokens:  # (in order: the cumulative logprob sums as token by token)
            self._logprobs(seq, token)
        hold = max(map(len, stops)) - 1 if stops else 0
        cut = max(0, len(text) - hold)
        seq.pending_text = text[cut:]
        seq.text += text[:cut]
        return text[:cut], ids

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def drain(self) -> None:
        """Detokenize every deferred token (the engine calls it while a forward runs); the
        deltas wait in `take_drained`. Each sequence leaves the pending set before its text is
        made, so a failure part-way never makes a text twice."""
        while self._pending:
            _, (seq, ids) = self._pending.popitem()
            try:
                self._drained.append((seq, self._detokenize(seq, ids)))
            except Exception as e:  # noqa: BLE001 (its sequence ends; the others go on)
                # Its detokenizer's state is unknown now: the sequence ends with an error at
                # its next token (`token_stop`), its tokens shown without their text.
                seq.error = f"detokenizer: {type(e).__name__}: {e}"
                self._drained.append((seq, ("", ids)))

    def take_drained(
        self, changed: dict[str, dict[int, Delta]], request_id: str | None = None
    ) -> list[tuple[Sequence, int]]:
        """Put the drained deltas (of one request, or all) into `changed` (request id -> seq id
        -> delta), before whatever delta the step itself gave the sequence: theirs are earlier
        tokens. Returns (sequence, tokens) of each delta: what its outputs now show."""
        if request_id is None:
            drained, self._drained = self._drained, []
            tails, self._tails = self._tails, []
        else:
            drained = [d for d in self._drained if d[0].request_id == request_id]
            self._drained = [d for d in self._drained if d[0].request_id != request_id]
            tails = [t for t in self._tails if t[0].request_id == request_id]
            self._tails = [t for t in self._tails if t[0].request_id != request_id]
        # one delta a sequence, its drained pieces in order (insertion order: the first seen)
        earlier: dict[int, tuple[Sequence, str, list[int]]] = {}
        for seq, (text, ids) in drained:
            _, text0, ids0 = earlier.get(seq.seq_id, (seq, "", []))
            earlier[seq.seq_id] = (seq, text0 + text, ids0 + ids)
        shown: list[tuple[Sequence, int]] = []
        for seq, text, ids in earlier.values():
            deltas = changed.setdefault(seq.request_id, {})
            later = deltas.get(seq.seq_id, ("", []))
            deltas[seq.seq_id] = (text + later[0], ids + later[1])
            shown.append((seq, len(ids)))
        # after the step's own delta: the tail is the text's end (found in review: a sequence
        # failing right after its step's commit streamed its tail before that commit's text)
        for seq, tail in tails:
            deltas = changed.setdefault(seq.request_id, {})
            text, ids = deltas.get(seq.seq_id, ("", []))
            deltas[seq.seq_id] = (text + tail, ids)
        return shown

    def settle(self, seq: Sequence) -> None:
        """Detokenize `seq`'s deferred tokens now (it ends, fails or is aborted): their delta
        joins the drained ones, so its output shows them. A sequence that fails or is aborted
        also gets the text held back for its stop strings and its detokenizer's tail, as one
        that runs out of tokens does (`stop.check_stop`): its text then covers its tokens."""
        entry = self._pending.pop(seq.seq_id, None)
        if entry is not None:
            try:
                delta = self._detokenize(*entry)
            except Exception:  # noqa: BLE001 (its ids still reach the caller, without text)
                log.exception("detokenizing the last tokens of %s failed", seq.request_id)
                delta = ("", list(entry[1]))
            self._drained.append((seq, delta))
        if seq.finish_reason in ("error", "abort"):
            tail = seq.pending_text + self._flush(seq)
            seq.pending_text = ""
            seq.text += tail
            if tail:
                self._tails.append((seq, tail))

    def pending_tokens(self, seq: Sequence) -> int:
        entry = self._pending.get(seq.seq_id)
        return 0 if entry is None else len(entry[1])

    @staticmethod
    def _detokenize(seq: Sequence, ids: list[int]) -> Delta:
        # The in-step path's text, which pushes token by token; in one push where that is the
        # same text (byte-level decoders): one push a token made the drain, with a speculative
        # batch's 2-3 tokens per sequence, outlast the forward it overlaps at batch 64 on the
        # H200.
        text = seq.detokenizer.push_each(ids)
        seq.text += text
        return text, ids

    def _record(self, seq: Sequence, token: SampledToken) -> None:
        seq.output_token_ids.append(token.token_id)
        if seq.grammar is not None and not seq.grammar.advance([token.token_id]):
            # the step's masks allow only what the grammar does: a token gets here only when
            # llguidance ran out of its limits following the grammar (its error says which)
            why = seq.grammar.matcher.get_error() or f"the grammar refused token {token.token_id}"
            seq.error = f"structured: {why.splitlines()[0]}"
            seq.error_by_request = True

    def _append(self, seq: Sequence, token: SampledToken) -> str:
        self._record(seq, token)
        self._logprobs(seq, token)
        reason, stop_reason, new_text = check_stop(
            seq, seq.detokenizer.push([token.token_id]), self.max_model_len
        )
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.text += new_text
        return new_text

    def _logprobs(self, seq: Sequence, token: SampledToken) -> None:
        """The token's logprob entry (the token first, then the top ones), if it carries one."""
        if token.logprob is None:
            return
        seq.cumulative_logprob += token.logprob
        entry = {token.token_id: Logprob(token.logprob, token.rank, self._piece(token.token_id))}
        for rank, (tok, lp) in enumerate(token.top or [], start=1):
            if lp == float("-inf"):  # a token a structured output's grammar forbids
                continue
            entry.setdefault(tok, Logprob(lp, rank, self._piece(tok)))
        seq.logprobs.append(entry)

    def _piece(self, token_id: int) -> str:
        """A logprob entry's token text, decoded once per id: a logprobs request decodes 1 + k
        ids per token it emits, the same few thousand over and over (at batch 64 with k = 5
        that was most of a step's commit)."""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
        return piece

    def output(self, request, deltas: dict[int, Delta]) -> RequestOutput:
        """The request's output: each sequence's text and the token ids that text covers (a
        sequence's deferred tokens show in the output after `drain`)."""
        outputs = []
        for i, seq in enumerate(request.seqs):
            delta_text, delta_ids = deltas.get(seq.seq_id, ("", []))
            wants_logprobs = seq.params.logprobs is not None
            # (not a held verify's tokens: they are emitted at its commit, `held_verify.py`)
            shown = seq.num_settled_tokens - seq.num_prompt_tokens - self.pending_tokens(seq)
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=seq.text,
                    token_ids=seq.output_token_ids[:shown],
                    cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
                    logprobs=list(seq.logprobs) if wants_logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    error=seq.error,
                    error_by_request=seq.error_by_request,
                    num_draft_tokens=seq.num_draft_tokens,
                    num_accepted_tokens=seq.num_accepted_tokens,
                    delta_text=delta_text,
                    delta_token_ids=delta_ids,
                )
            )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished,
            # n > 1: the prompt's first sequence (admitted first, or in the same step as the
            # others), as usage counts the prompt once
            num_cached_tokens=request.seqs[0].num_prompt_cached_tokens,
        )
