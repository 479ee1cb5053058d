"""Emitting tokens: record each one (with logprobs), detokenize it, check stop conditions, and
build the RequestOutputs a step returns."""

from __future__ import annotations

from metrale.engine.sequence import Sequence
from metrale.engine.step_output import SampledToken
from metrale.engine.stop import check_stop
from metrale.outputs import CompletionOutput, Logprob, RequestOutput
from metrale.tokenizer import Tokenizer


class Emitter:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def emit(self, seq: Sequence, tokens: list[SampledToken]) -> tuple[str, list[int]]:
        """Append `tokens` in order until a stop condition ends the sequence (later tokens of a
        verify are then dropped, as plain decoding would never have made them). Sets
        `seq.finish_reason` when it ends. Returns the (text, token ids) delta."""
        text, ids = "", []
        for token in tokens:
            text += self._append(seq, token)
            ids.append(token.token_id)
            if seq.finish_reason is not None:
                break
        return text, ids

    def _append(self, seq: Sequence, token: SampledToken) -> str:
        seq.output_token_ids.append(token.token_id)
        if seq.grammar is not None and not seq.grammar.advance([token.token_id]):
            # the step's masks allow only what the grammar does: nothing should get here
            seq.error = f"structured: the grammar refused token {token.token_id}"
        if token.logprob is not None:
            seq.cumulative_logprob += token.logprob
            entry = {
                token.token_id: Logprob(token.logprob, token.rank, self._piece(token.token_id))
            }
            for rank, (tok, lp) in enumerate(token.top or [], start=1):
                if lp == float("-inf"):  # a token a structured output's grammar forbids
                    continue
                entry.setdefault(tok, Logprob(lp, rank, self._piece(tok)))
            seq.logprobs.append(entry)
        reason, stop_reason, new_text = check_stop(
            seq, seq.detokenizer.push([token.token_id]), self.max_model_len
        )
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.text += new_text
        return new_text

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @staticmethod
    def output(request, deltas: dict[int, tuple[str, list[int]]]) -> RequestOutput:
        outputs = []
        for i, seq in enumerate(request.seqs):
            delta_text, delta_ids = deltas.get(seq.seq_id, ("", []))
            wants_logprobs = seq.params.logprobs is not None
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=seq.text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
                    logprobs=list(seq.logprobs) if wants_logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    error=seq.error,
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
