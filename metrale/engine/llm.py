"""The engine loop: admit requests, then `step()`: schedule -> run -> emit tokens -> stop checks.

`LLMEngine` is synchronous and single-threaded; the Python API (`metrale.LLM`) and the server
drive it. Every request is validated in `add_request`, before it touches any engine state, so a bad
request raises a ValueError and leaves the others untouched. A failure while running a batch is
isolated to the sequence that caused it (`finish_reason="error"`).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

from metrale.config import EngineConfig, ModelConfig, SamplingParams
from metrale.engine.kv_cache import PageAllocator
from metrale.engine.runner import ModelRunner, SampledToken
from metrale.engine.scheduler import Scheduler
from metrale.engine.sequence import Batch, Sequence
from metrale.engine.stop import check_stop
from metrale.knobs import knobs
from metrale.outputs import CompletionOutput, Logprob, RequestOutput
from metrale.telemetry import StepTimer, Telemetry
from metrale.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

SEED_MASK = (1 << 63) - 1


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise FileNotFoundError(f"model directory {self.model_dir} does not exist")
        self.model_config = ModelConfig.from_hf(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.max_model_len = self._resolve_max_model_len()
        self.runner = ModelRunner(
            self.model_dir, self.model_config, self.config, self.max_model_len
        )
        self.allocator = PageAllocator(self.runner.num_pages, self.config.page_size)
        self.scheduler = Scheduler(
            self.allocator,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            lookahead=self.config.num_lookahead_rows,
        )
        self.telemetry = Telemetry()
        self.eos_token_ids = tuple(
            dict.fromkeys(self.model_config.eos_token_ids + self.tokenizer.eos_token_ids)
        )
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(self.config.seed)
        self._next_seq_id = 0
        log.info("knobs: %s", knobs().describe())

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(
                f"max_model_len={wanted} exceeds the model's max_position_embeddings={limit}"
            )
        return wanted

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        params.check_vocab(self.vocab_size)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens leave no room to generate under "
                f"max_model_len={self.max_model_len}"
            )
        pages = self.allocator.pages_for(len(token_ids) + 1 + self.config.num_lookahead_rows)
        if pages > self.allocator.num_usable:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens need {pages} KV pages; the pool has "
                f"{self.allocator.num_usable}"
            )
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
            )
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens
            )
            self._next_seq_id += 1
            seqs.append(seq)
        self.requests[request_id] = Request(request_id, text, list(token_ids), seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return prompt, self.tokenizer.encode(prompt)
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
        self.scheduler.finish(live)
        self.telemetry.requests_finished["abort"] += len(live)
        return self._output(request, {s.seq_id: ("", []) for s in request.seqs})

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling step; returns an output for every request that changed."""
        with StepTimer() as timer:
            batch = self.scheduler.schedule()
            self.telemetry.preemptions += len(batch.preempted)
            for seq in batch.failed:
                self._fail(seq, seq.error or "cannot be scheduled")
            prompt_rows = batch.num_prompt_rows
            sampled = self._run(batch)
            changed: dict[str, dict[int, tuple[str, list[int]]]] = {}
            for seq in batch.failed:
                changed.setdefault(seq.request_id, {})[seq.seq_id] = ("", [])
            for token in sampled:
                delta = self._append(token)
                changed.setdefault(token.seq.request_id, {})[token.seq.seq_id] = delta
            for entry in batch.entries:
                if entry.seq.error and entry.seq.finish_reason == "error":
                    changed.setdefault(entry.seq.request_id, {})[entry.seq.seq_id] = ("", [])
        if batch.entries:
            self.telemetry.record_step(batch.phase.value, prompt_rows, len(sampled), timer.seconds)
        outputs = []
        for request_id, deltas in changed.items():
            request = self.requests.get(request_id)
            if request is None:
                continue
            outputs.append(self._output(request, deltas))
            if request.finished:
                del self.requests[request_id]
        return outputs

    def _run(self, batch: Batch) -> list[SampledToken]:
        """Run the batch; if the forward fails, isolate the failing sequence(s) by running each
        alone, so one bad sequence never takes the others down."""
        try:
            sampled = self.runner.execute(batch)
        except Exception as e:  # noqa: BLE001 (isolation: any error ends only its sequence)
            if len(batch.entries) == 1:
                log.exception("sequence %s failed", batch.entries[0].seq.request_id)
                self._fail(batch.entries[0].seq, f"{type(e).__name__}: {e}")
                return []
            sampled = []
            for entry in list(batch.entries):
                sampled += self._run(Batch(entries=[entry]))
            return sampled
        for entry in batch.entries:
            entry.seq.num_computed_tokens += entry.num_rows
        return sampled

    def _fail(self, seq: Sequence, message: str) -> None:
        seq.finish_reason, seq.error = "error", message
        self.scheduler.finish([seq])
        self.telemetry.requests_finished["error"] += 1

    def _append(self, token: SampledToken) -> tuple[str, list[int]]:
        """Emit one token: record it, detokenize, check stop conditions. Returns the delta."""
        seq = token.seq
        seq.output_token_ids.append(token.token_id)
        if token.logprob is not None:
            seq.cumulative_logprob += token.logprob
            entry = {
                token.token_id: Logprob(token.logprob, token.rank, self._piece(token.token_id))
            }
            for rank, (tok, lp) in enumerate(token.top or [], start=1):
                entry.setdefault(tok, Logprob(lp, rank, self._piece(tok)))
            seq.logprobs.append(entry)
        reason, stop_reason, new_text = check_stop(
            seq, seq.detokenizer.push([token.token_id]), self.max_model_len
        )
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self.scheduler.finish([seq])
            self.telemetry.requests_finished[reason] += 1
        seq.text += new_text
        return new_text, [token.token_id]

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _output(self, request: Request, deltas: dict[int, tuple[str, list[int]]]) -> RequestOutput:
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
        )
