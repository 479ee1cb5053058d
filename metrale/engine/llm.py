"""The engine loop: admit requests, then `step()`: schedule -> run -> emit tokens -> stop checks.

`LLMEngine` is synchronous and single-threaded; the Python API (`metrale.LLM`) and the server
drive it. Every request is validated in `add_request`, before it touches any engine state, so a bad
request raises a ValueError and leaves the others untouched. A failure while running a batch is
isolated to the sequence that caused it (`finish_reason="error"`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

from metrale.config import EngineConfig, ModelConfig
from metrale.distributed.parallel import check_tp
from metrale.engine.ahead import AheadStepper
from metrale.engine.calibrate import measured_cost_model
from metrale.engine.commit import commit_rows
from metrale.engine.emitter import Emitter
from metrale.engine.isolation import recompute_later, run_batch
from metrale.engine.kv_cache import PageAllocator
from metrale.engine.prefix_cache import build_prefix_cache
from metrale.engine.requests import Request, RequestAdmission
from metrale.engine.runner import ModelRunner
from metrale.engine.scheduler import Scheduler
from metrale.engine.sequence import Batch, Phase, Sequence
from metrale.engine.step_output import StepOutput
from metrale.hub import resolve_model
from metrale.knobs import knobs
from metrale.outputs import RequestOutput
from metrale.speculative.drafter import Drafter
from metrale.speculative.setup import dflash_dir, resolve_num_drafts, speculative_decoder
from metrale.structured.grammar import GrammarCompiler
from metrale.telemetry import Telemetry
from metrale.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class LLMEngine(RequestAdmission):
    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        """`drafter` plugs in a drafter of the caller's (a replay drafter for benchmarks, an
        oracle in tests); otherwise `config.spec.method` picks one (or none)."""
        self.config = config or EngineConfig()
        # a directory, or a Hub id resolved through huggingface_hub (the local cache offline)
        self.model_dir = resolve_model(model_dir, self.config.revision)
        self.config = resolve_num_drafts(self.config, self.model_dir, drafter)
        self.model_config = ModelConfig.from_hf(self.model_dir)
        if self.config.tensor_parallel_size > 1:
            check_tp(
                self.model_config, self.config.tensor_parallel_size, self.config.expert_parallel
            )
        if self.config.expert_parallel and (
            self.config.tensor_parallel_size == 1 or self.model_config.hybrid is None
        ):
            # (said, not refused: a launch script may pass it for every model; vLLM's flag
            # is ignored where there are no experts to split)
            log.warning(
                "expert_parallel: ignored (it splits a MoE target's experts across "
                "tensor-parallel ranks; this %s)",
                "target has no experts"
                if self.model_config.hybrid is None
                else "engine has one rank",
            )
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.max_model_len = self._resolve_max_model_len()
        spec_on = drafter is not None or self.config.spec.enabled
        # Speculating sequences keep K rows reserved past their step: the next verify's drafts
        # and a drafter's own KV rows land there.
        self.lookahead = max(
            self.config.num_lookahead_rows, self.config.spec.num_drafts if spec_on else 0
        )
        self.runner = ModelRunner(
            self.model_dir,
            self.model_config,
            self.config,
            self.max_model_len,
            self.lookahead,
            with_mtp=drafter is None and self.config.spec.method == "mtp",
            num_drafts=self.config.spec.num_drafts if spec_on else 0,
            dflash_dir=dflash_dir(self.config.spec, self.model_dir) if drafter is None else None,
        )
        try:
            self._setup(drafter)
        except BaseException:
            self.runner.shutdown()  # the tensor-parallel workers, if any
            raise
        log.info("%s", knobs().describe())
        if knobs().unrecognised:  # almost always a typo: said without -v (found in review)
            log.warning("unrecognised METRALE_* settings, ignored: %s", knobs().unrecognised)

    def _setup(self, drafter: Drafter | None) -> None:
        """What sits on the runner: telemetry, the page allocator (and its prefix cache), the
        scheduler, the EOS ids, the speculative side (and D-Cut's calibration)."""
        self.telemetry = Telemetry()
        self.retried_batches = 0  # batches whose forward failed, run again one at a time
        self._ahead: AheadStepper | None = None
        cache = build_prefix_cache(self.config, self.runner, self.telemetry.prefix_cache)
        self.allocator = PageAllocator(self.runner.num_pages, self.config.page_size, cache)
        self.scheduler = Scheduler(
            self.allocator,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            lookahead=self.lookahead,
        )
        eos = dict.fromkeys(self.model_config.eos_token_ids + self.tokenizer.eos_token_ids)
        outside = [t for t in eos if not 0 <= t < self.vocab_size]
        if outside:
            # a tokenizer may know ids the model's vocabulary lacks; they can never be sampled
            log.warning(
                "EOS ids %s are outside the vocabulary (%d): ignored", outside, self.vocab_size
            )
        self.eos_token_ids = tuple(t for t in eos if 0 <= t < self.vocab_size)
        self.requests: dict[str, Request] = {}
        # Unfinished sequences whose steps must wait for the one before (`ahead.runs_ahead`)
        self._sync_seq_ids: set[int] = set()
        # the outputs of a step an exception cut short (request id -> seq id -> delta), which
        # the next step returns (a request it ended has no step after it but that one)
        self._carried: dict[str, dict[int, tuple[str, list[int]]]] = {}
        # outputs a step made and could not return (it raised after `_outputs`): the next
        # step returns them first; and this step's, once made (`_outputs`), until it returns
        self._carried_outputs: list[RequestOutput] = []
        self._made: list[RequestOutput] | None = None
        self._rng = random.Random(self.config.seed)
        self._next_seq_id = 0
        # The tokens a sequence can reach: max_model_len, or what the KV pool holds when that is
        # less (a sequence's last token needs no K/V row, hence + 1). A sequence stops there
        # with finish_reason "length", as at max_model_len; before, it outgrew the pool and
        # ended as an error. The server refuses prompt + max_tokens past it.
        pool_tokens = self.allocator.num_usable * self.allocator.page_size + 1
        self.context_len = min(self.max_model_len, pool_tokens)
        self.scheduler.context_len = self.context_len
        if self.context_len < self.max_model_len:
            log.warning(
                "the KV pool holds %d tokens, fewer than max_model_len=%d: sequences stop at %d "
                "tokens (a larger --kv-cache-memory-gb or --num-kv-pages lifts it)",
                pool_tokens - 1,
                self.max_model_len,
                self.context_len,
            )
        self.emitter = Emitter(self.tokenizer, self.context_len)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.runner.grammar_vocab = self.grammars.vocab_size
        # (drafts capped by the context a sequence reaches: past a small pool's end, dropped)
        self.spec = speculative_decoder(
            self.config, self.runner, drafter, self.telemetry.spec, self.context_len
        )
        if cache is not None and self.spec is not None:
            # a drafter whose K/V rows live in the pages reads them on a prefix hit too
            cache.draft_kv = getattr(self.spec.drafter, "page_kv", None)
        if self.spec is not None:
            # every unfinished sequence that may draft with a drafter that is not `stateless`
            # is one of these (`ahead.runs_ahead`; with grammars beside them)
            self.spec.drafting_pending = lambda: self.sync_seqs > 0
        if self.spec is not None and self.spec.cfg.dcut and self.runner.graphs is not None:
            self._calibrate_dcut()
        # NOTE: a hybrid target's prefix-cache snapshots are saved when a step is launched,
        # with its pages (`AheadStepper._advance`); where a drafter keeps K/V rows in the pages
        # (MTP) they wait for the commit, and a snapshot saved then would hold the state the
        # next step already advanced (found in review): that engine stays synchronous
        snapshots_at_commit = (
            self.runner.hybrid and cache is not None and cache.draft_kv is not None
        )
        ahead = self.config.async_scheduling and not snapshots_at_commit
        self._ahead = AheadStepper(self) if ahead else None

    def _calibrate_dcut(self) -> None:
        """D-Cut's verify cost curve, measured on this device now (CUDA, about a second)."""
        k = self.spec.cfg.num_drafts
        context = min(256, self.max_model_len - k - 2)
        # as many sequences as the KV pool holds at that context, up to max_num_seqs
        fits = self.allocator.num_usable // self.allocator.pages_for(context + k + 1)
        seqs = min(self.config.max_num_seqs, fits)
        if context < 2 or seqs < 1:
            return
        start = time.perf_counter()
        self.spec.cost = measured_cost_model(self, k, seqs, context)
        log.info("D-Cut verify cost measured in %.1f s", time.perf_counter() - start)

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(
                f"max_model_len={wanted} exceeds the model's max_position_embeddings={limit}"
            )
        return wanted

    @property
    def sync_seqs(self) -> int:
        """Unfinished sequences that keep the asynchronous engine's steps synchronous."""
        return len(self._sync_seq_ids)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._carried or self._carried_outputs)

    def shutdown(self) -> None:
        self.runner.shutdown()

    def _carrying(self) -> dict[str, dict[int, tuple[str, list[int]]]]:
        """A step's `changed` map (request id -> seq id -> (text, tokens)), starting from what
        a step that raised had committed (`_carry`)."""
        changed, self._carried = self._carried, {}
        self._made = None
        return changed

    def _carry(self, changed: dict) -> None:
        """A step raised: what it committed reaches the caller with the next step (its requests
        may have ended: `has_unfinished_requests` counts them until then). If it had made its
        outputs already (`_outputs`), those go out as made, first in the next step's: made
        again from `changed`, a finished request had left the engine and its final output
        never came, and text drained since went in front of the text they held (found in
        review: an async step raising at the launched step's prefix-cache commit, a
        synchronous one at D-Cut's timing, both after their outputs)."""
        if self._made is None:
            self._carried = changed
        else:
            self._carried_outputs, self._made = self._made, None

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling step; returns an output for every request that changed (with
        `async_scheduling`, those of the step launched by the call before: `engine/ahead.py`)."""
        if self._ahead is not None:
            return self._ahead.step()
        changed = self._carrying()
        try:
            return self._step(changed)
        except BaseException:
            self._carry(changed)
            raise

    def _step(self, changed: dict) -> list[RequestOutput]:
        start, retried = time.perf_counter(), self.retried_batches
        batch = ran = None
        emitted = prompt_rows = 0
        try:
            if self.spec is not None:
                for seq, message in self.spec.prepare(self.scheduler.running):
                    self._fail(seq, message)
                    changed.setdefault(seq.request_id, {}).setdefault(seq.seq_id, ("", []))
            batch = self.scheduler.schedule()
            self._scheduled(batch, changed)
            prompt_rows = batch.num_prompt_rows
            # The last step's deferred text is made while this step's forward runs.
            self.runner.while_forward_runs = self.while_forward(batch)
            ran = batch
            out = self._run(batch)
            self.runner.while_forward_runs = None
            emitted = self._commit(out, changed)
            self._mark_errors(batch, changed)
        except BaseException:
            if ran is not None:  # (its forward may have advanced a hybrid target's state)
                recompute_later(self, [ran])
            raise
        finally:
            # NOTE: recorded on every exit path, a failing step included.
            if batch is not None:
                self._record_step(batch, prompt_rows, emitted, start)
        outputs = self._outputs(changed)
        spec = self.spec
        if spec is not None and batch is not None:
            seconds = time.perf_counter() - start
            if self.retried_batches != retried:
                seconds = None  # its batch failed and ran again one sequence at a time
            elif batch.phase is Phase.DECODE and not spec.asked:
                # what drafting's host work is priced against: a whole plain step, not its
                # forward (one whose drafter was asked, even for nothing, paid that work)
                spec.host.plain(len(batch.entries), seconds)
            spec.timed_step(batch, seconds)
        return outputs

    def while_forward(self, batch: Batch) -> Callable[[], None] | None:
        """The host work a step does while its forward runs on the device
        (`ModelRunner.while_forward_runs`): the text the steps before deferred, then the
        speculative side's (`SpeculativeDecoder.while_forward`: the drafter's catch-up, D-Cut's
        next choice). Each part that raises is logged and left to the commit and the next step,
        where it runs again."""
        drain = self.emitter.drain if self.emitter.has_pending else None
        speculative = None
        if self.spec is not None:
            speculative = self.spec.while_forward(batch.entries, self.scheduler.running)
        if drain is None or speculative is None:
            return drain or speculative

        def both() -> None:
            try:
                drain()
            finally:
                speculative()

        return both

    def _scheduled(self, batch: Batch, changed: dict) -> None:
        """What the scheduler decided beside the batch: preemptions and failures."""
        self.telemetry.preemptions += len(batch.preempted)
        for seq in batch.preempted:
            self.runner.penalties.release(seq)
            if self.spec is not None:
                self.spec.release(seq)
        for seq in batch.failed:
            self._fail(seq, seq.error or "cannot be scheduled")
            changed.setdefault(seq.request_id, {}).setdefault(seq.seq_id, ("", []))

    @staticmethod
    def _mark_errors(batch: Batch, changed: dict) -> None:
        for entry in batch.entries:
            if entry.seq.finish_reason == "error":
                changed.setdefault(entry.seq.request_id, {}).setdefault(entry.seq.seq_id, ("", []))

    def _record_step(self, batch: Batch, prompt_rows: int, emitted: int, start: float) -> None:
        if batch.entries:
            self.telemetry.record_step(
                batch.phase.value, prompt_rows, emitted, time.perf_counter() - start
            )

    def _outputs(self, changed: dict) -> list[RequestOutput]:
        """The outputs of the requests that changed, the deferred text drained meanwhile
        included; a finished request leaves the engine."""
        now = time.perf_counter()
        for seq, count in self.emitter.take_drained(changed):
            # their tokens reach the caller now: time to first token and between tokens as
            # the client sees them
            self.telemetry.request.emitted(seq, count, now)
        outputs = []
        for request_id, deltas in changed.items():
            request = self.requests.get(request_id)
            if request is None:
                continue
            finished = request.finished
            if request.final_only:
                if not finished:
                    continue
                deltas = request.whole()
            outputs.append(self.emitter.output(request, deltas))
            if finished:
                del self.requests[request_id]
        # (those a step that raised had made first: they are earlier)
        outputs, self._carried_outputs = self._carried_outputs + outputs, []
        self._made = outputs
        return outputs

    def _run(self, batch: Batch) -> StepOutput:
        """Run the batch, isolating a failing sequence (`isolation.run_batch`)."""
        return run_batch(self, batch)

    def _commit(
        self, out: StepOutput, changed: dict, advanced=False, state=None, observe_later=False
    ) -> int:
        """Advance every sequence past its committed rows, emit its tokens, feed the drafter.
        `advanced`: a step launched ahead (`engine/ahead.py`), whose counters moved at launch
        and whose sequences ended since are passed over; `state`, `observe_later`: a held
        verify's (`engine/held_verify.py`, `commit.commit_rows`).

        NOTE: rollback: a sequence that verified k drafts and accepted a of them keeps the KV of
        its rows up to its last token plus the a accepted drafts; the rows of rejected drafts lie
        past `num_computed_tokens` and are overwritten by later steps, never read."""
        if self.emitter.has_pending:  # not drained during the forward: before this step's tokens
            self.emitter.drain()
        finished: list[Sequence] = []
        try:
            return commit_rows(self, out, changed, advanced, finished, state, observe_later)
        finally:
            # (an exception after a sequence ended, out of the drafter's side or the cache,
            # left it running past its last token: it decoded once more; found in review)
            self._finish(finished)

    def _finish(self, seqs: list[Sequence]) -> None:
        self.scheduler.finish(seqs)
        now = time.perf_counter()
        for seq in seqs:
            seq.drop_inflight()  # a token still in flight never reaches its output
            self.runner.penalties.release(seq)
            self._sync_seq_ids.discard(seq.seq_id)
            if seq.grammar is not None:
                seq.grammar = None
                self.runner.structured_seqs -= 1
            try:
                self.emitter.settle(seq)
            except Exception:  # noqa: BLE001 (its text alone is lost, not the engine's counts)
                # (found in review: a detokenizer raising here left the engine counting the
                # sequence as synchronous and under a grammar for good)
                log.exception("the text of %s could not be finished", seq.request_id)
            self.telemetry.requests_finished[seq.finish_reason] += 1
            self.telemetry.request.finished(seq, now)
            if self.spec is not None:
                self.spec.release(seq)

    def _fail(self, seq: Sequence, message: str) -> None:
        seq.finish_reason, seq.error = "error", message
        self._finish([seq])
