"""Requests entering and leaving the engine: validation (before any engine state is touched, so a
bad request raises a ValueError naming its field and leaves the others untouched), admission as
sequences (seeds, detokenizers, grammars) and aborts. `LLMEngine` takes these as a mixin.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from metrale.config import SamplingParams
from metrale.engine.ahead import runs_ahead
from metrale.engine.sequence import Sequence
from metrale.outputs import RequestOutput
from metrale.tokenizer import IncrementalDetokenizer

# Seeds are kept to 64 bits, as the sampler reads them (`to_int64`): masked to 63, -1 and 2**63 - 1
# drew the same tokens (found in review).
SEED_MASK = (1 << 64) - 1


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    # its output only once it finishes (vLLM's FINAL_ONLY, as offline `generate` wants), with
    # the whole text as the delta: no per-step output to build
    final_only: bool = False

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def whole(self) -> dict[int, tuple[str, list[int]]]:
        """Deltas of every sequence's whole output: a final-only request's one output."""
        return {s.seq_id: (s.text, list(s.output_token_ids)) for s in self.seqs}


class RequestAdmission:
    """`LLMEngine`'s request side (it holds the state these methods read and write)."""

    def validate(
        self, prompt: str | list[int], params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """Check a request against this engine without touching its state (so another thread,
        such as the HTTP server's, may call it): (prompt text or None, prompt token ids)."""
        text, token_ids = self._tokenize(prompt)
        params.check_vocab(self.vocab_size)
        if params.structured is not None:
            self.grammars.check(params.structured)
        # (the context: max_model_len, or less where the KV pool holds less, `context_len`;
        # speculation's lookahead is cut to what the pool holds, `Scheduler._reach`, so it
        # never refuses a request)
        if len(token_ids) >= self.context_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens leave no room to generate under "
                f"{self._context_words()}"
            )
        return text, token_ids

    def _context_words(self) -> str:
        """The context a sequence has, as an error names it."""
        if self.context_len == self.max_model_len:
            return f"max_model_len={self.max_model_len}"
        # (the pool's rows plus the last token, which needs none: the start-up warning's count)
        return (
            f"the {self.context_len}-token context the KV pool allows "
            f"(max_model_len={self.max_model_len})"
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        final_only: bool = False,
    ) -> None:
        """Queue a request; `final_only`: `step` returns its output once, when it finishes
        (building each step's output copies every sequence's tokens so far)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params: expected a SamplingParams, got {type(params).__name__}"
            )
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self.validate(prompt, params)
        seqs = []
        for i in range(params.n):
            if params.seed is None:
                seed = self._rng.getrandbits(63)
            else:  # children of one seeded request get distinct, reproducible seeds
                seed = (params.seed + i * 0x9E3779B97F4A7C15) & SEED_MASK
            seq = Sequence(
                seq_id=self._next_seq_id,
                request_id=request_id,
                prompt_token_ids=list(token_ids),
                params=params,
                seed=seed,
                eos_token_ids=self.eos_token_ids,
                arrival=self._next_seq_id,
                arrival_time=time.perf_counter(),
            )
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop_token_ids=self._text_stops(params),
            )
            if params.structured is not None:
                seq.grammar = self.grammars.matcher(params.structured)
            self._next_seq_id += 1
            seqs.append(seq)
        # the engine's counts change once every sequence is made: a matcher that raised for the
        # second of n left them counting a sequence that never ran (review), which kept the
        # engine synchronous for good
        for seq in seqs:
            if seq.grammar is not None:
                self.runner.structured_seqs += 1
            if not runs_ahead(seq, self.spec):
                self._sync_seq_ids.add(seq.seq_id)
        self.requests[request_id] = Request(request_id, text, list(token_ids), seqs, final_only)
        for seq in seqs:
            self.scheduler.add(seq)

    def _text_stops(self, params: SamplingParams) -> tuple[int, ...]:
        """The ids whose text a sequence's output leaves out: a token that stops it (EOS unless
        `ignore_eos`, `stop_token_ids`; the sampler bans both until `min_tokens`, so an emitted
        one always stops), unless `include_stop_str_in_output`, as vLLM does. With
        skip_special_tokens (the default) an EOS's text is empty anyway."""
        if params.include_stop_str_in_output:
            return ()
        return (*params.stop_token_ids, *(() if params.ignore_eos else self.eos_token_ids))

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            # refused from its length alone, before any tokenising work
            if len(prompt) > self.context_len * self.tokenizer.max_token_chars:
                raise ValueError(
                    f"prompt: {len(prompt)} characters cannot fit {self._context_words()}"
                )
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"prompt: not valid Unicode text ({e.reason})") from None
            ids = self.tokenizer.encode(prompt)
            # A tokenizer larger than the model's vocabulary (a special token the embedding
            # lacks): refused here, as a token-id prompt is, not failed mid-step (or, under
            # tensor parallelism, read as a zero row by the vocabulary-split embedding)
            if ids and max(ids) >= self.vocab_size:
                raise ValueError(
                    f"prompt: its text encodes to token id {max(ids)}, outside the model's "
                    f"vocabulary [0, {self.vocab_size})"
                )
            return prompt, ids
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError(
                f"prompt: expected a non-empty string or list of token ids, got {prompt!r}"
            )
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"prompt_token_ids: {t!r} is not a token id in [0, {self.vocab_size})"
                )
        return None, list(prompt)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request wherever it is (waiting, mid-prefill, decoding); its pages are freed."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        live = [s for s in request.seqs if not s.is_finished]
        for seq in live:
            seq.finish_reason = "abort"
        self._finish(live)
        if self._ahead is not None:  # a launched step left with no live sequence: settled now
            self._ahead.settle_ended()
        changed = {request_id: {s.seq_id: ("", []) for s in request.seqs}}
        now = time.perf_counter()
        # its deferred text: those tokens reach the caller now, as a step's would (`_outputs`)
        for seq, count in self.emitter.take_drained(changed, request_id):
            self.telemetry.request.emitted(seq, count, now)
        return self.emitter.output(
            request, request.whole() if request.final_only else changed[request_id]
        )
