"""The model runner: owns the model and its KV pool; packs a Batch into tensors, runs the forward,
computes logits for the rows that sample, samples, and copies the picks back with one host sync.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from metrale.config import EngineConfig, ModelConfig
from metrale.distributed.shard import start_workers, whole_vocab
from metrale.engine.block_tables import DeviceBlockTables
from metrale.engine.graphs import GraphRunner
from metrale.engine.logits_pipeline import is_plain_greedy
from metrale.engine.model_setup import (
    TargetVocab,
    allocate_kv_pools,
    attach_dflash,
    build_target,
    num_pages_for,
    pages_wanted,
)
from metrale.engine.penalty_state import PenaltyState
from metrale.engine.program_shapes import RaggedShape
from metrale.engine.replay import (
    replay_decode,
    replay_gdn_mixed,
    replay_prefill,
    spans_of,
    split_mixed,
    table_rows,
)
from metrale.engine.sequence import Batch, Phase, ScheduledSeq
from metrale.engine.state_cache import StateSlots
from metrale.engine.step_metadata import pack_spans
from metrale.engine.step_output import (
    StepOutput,
    greedy_verdicts,
    pending_greedy,
    pending_sampled,
    sampled_verdicts,
    shown_tokens,
    to_host,
)
from metrale.kernels.batch_invariant import check_invariant_support, make_batch_invariant
from metrale.kernels.gemv import stream_projections
from metrale.kernels.paged_attention import TritonPagedAttention, triton_available
from metrale.models.attention import AttentionMetadata, TorchPagedAttention
from metrale.models.dflash import load_dflash
from metrale.models.mtp import load_mtp
from metrale.structured.masks import apply_grammar_masks

log = logging.getLogger(__name__)

# `graph_prefill_rows=None` on a hybrid target (its programs are keyed by width too: more each)
HYBRID_GRAPH_PREFILL_ROWS = 512


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        model_cfg: ModelConfig,
        cfg: EngineConfig,
        max_model_len: int,
        lookahead: int = 0,
        with_mtp: bool = False,
        num_drafts: int = 0,
        dflash_dir: str | Path | None = None,
    ) -> None:
        """`lookahead`: rows reserved past each sampling sequence's step (drafts and drafter
        KV). `with_mtp`: also load the checkpoint's MTP heads, with KV layers of their own.
        `num_drafts`: the most drafts a sequence verifies (0: no speculation). `dflash_dir`: load
        a DFlash drafter, give it context K/V pages and tap the target's hidden states for it."""
        self.device = cfg.resolve_device()
        self.dtype = cfg.resolve_dtype(model_cfg, self.device)
        self.model_cfg = model_cfg
        self.max_model_len = max_model_len  # the most tokens a sequence holds
        self.page_size = cfg.page_size
        self.verify_raw_argmax = cfg.spec.verify_raw_argmax
        use_kernel = self.device.type == "cuda" and triton_available(model_cfg.head_dim)
        if cfg.deterministic and self.device.type == "cuda":
            check_invariant_support(model_cfg, cfg, use_kernel)
        self.backend = (
            TritonPagedAttention(invariant=cfg.deterministic)
            if use_kernel
            else TorchPagedAttention(invariant=cfg.deterministic)
        )
        if cfg.deterministic and use_kernel:  # one decode/verify tile (`invariant_rows`)
            self.backend.invariant_rows = 1 << num_drafts.bit_length()
        self.hybrid = model_cfg.hybrid is not None
        # Rows of a step with prompt chunks that may replay a prefill program. The spare
        # sequence holding a program's padding rows sits at positions 0 .. rows - 1, so the
        # rotary table and the programs' block tables reach that far too, past a short model
        # length: a step of many sequences has more rows than any one sequence.
        graph_prefill = cfg.graph_prefill_rows
        if graph_prefill is None:
            graph_prefill = HYBRID_GRAPH_PREFILL_ROWS if self.hybrid else cfg.max_num_batched_tokens
        self.prefill_limit = min(graph_prefill, cfg.max_num_batched_tokens)
        positions = max(max_model_len, self.prefill_limit)
        self.tp_size = cfg.tensor_parallel_size
        # kv_cfg: the KV heads this process holds
        self.model, kv_cfg = build_target(
            model_dir, model_cfg, cfg, self.backend, positions, self.device, self.dtype
        )
        if cfg.deterministic:
            # the target alone: drafts only decide what is verified, never what is emitted
            make_batch_invariant(self.model)
        self.mtp = None
        if with_mtp:
            self.mtp = load_mtp(
                model_dir, model_cfg, self.model.model.rotary, self.backend, self.device, self.dtype
            )
            if self.mtp is None:
                raise ValueError(f"spec.method 'mtp': {model_dir} holds no MTP weights")
        # NOTE: the MTP layers' KV sits after the target's, addressed by the same block tables:
        # a drafter row at position p uses the page that holds the target's row p.
        layers = self.model.attention_layers + (
            [] if self.mtp is None else self.mtp.attention_layers
        )
        self.dflash = None
        if dflash_dir is not None:
            # its context rows are written by every target forward, a program's padding rows
            # included (as far as the target's table), and its blocks reach past the model
            # length by the lookahead
            reach = max(positions, max_model_len + lookahead)
            self.dflash = load_dflash(dflash_dir, model_cfg, reach, self.device, self.dtype)
        for part in (self.model, self.mtp, self.dflash):  # few-row projections as GEMVs on
            if part is not None:  # CUDA (`kernels/gemv.py`; not the invariant products)
                stream_projections(part)
        extra = (
            0 if self.dflash is None else self.dflash.config.page_bytes(self.page_size, self.dtype)
        )
        budget = None  # GiB for the KV pool: what the weights leave of the engine's share
        if cfg.gpu_memory_utilization is not None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = max(cfg.gpu_memory_utilization * total - (total - free), 0) / 2**30
        self.num_pages = num_pages_for(
            kv_cfg, cfg, max_model_len, self.dtype, lookahead, len(layers), extra, budget
        )
        # Under tensor parallelism the target's layers hold this rank's KV heads and the MTP
        # layers (on rank 0 alone) all of theirs: two pools of the same pages.
        split = len(self.model.attention_layers) if self.tp_size > 1 else len(layers)
        parts = [(kv_cfg, split), (model_cfg, len(layers) - split)]
        # and the DFlash drafter's context K/V, paged like the KV and budgeted with it
        beside = self.dflash and self.dflash.config.pool_shape(self.num_pages, self.page_size)
        wanted = pages_wanted(cfg, max_model_len, lookahead)
        pools = allocate_kv_pools(
            parts, self.num_pages, cfg, self.dtype, self.device, beside, wanted
        )
        self.kv_cache, drafter_kv, *dflash_kv = pools
        self.dflash_kv = dflash_kv[0] if dflash_kv else None
        for layer, cache in zip(layers, [*self.kv_cache, *drafter_kv], strict=True):
            layer.kv_cache = cache
        # what drafters embed tokens and project logits with: the target's own, or under tensor
        # parallelism a whole-vocabulary copy on rank 0, where drafters run alone
        self.vocab = TargetVocab(self.model)
        if self.tp_size > 1 and (self.mtp is not None or self.dflash is not None):
            self.vocab = whole_vocab(model_cfg, cfg, model_dir, self.device, self.dtype)
        if self.tp_size > 1:
            entries = 0
            if self.hybrid:
                entries = StateSlots.entries_for(
                    cfg.max_num_seqs, cfg.hybrid_verify_state, num_drafts + 1
                )
            self.model = start_workers(
                self.model,
                model_dir,
                cfg,
                model_cfg,
                positions,
                self.num_pages,
                entries,
                self.device,
            )
        self.states = None
        if self.hybrid:
            # a verify gives a sequence at most 1 + num_drafts rows (its last token, its drafts)
            self.states = StateSlots(
                self.model,
                cfg.max_num_seqs,
                cfg.hybrid_verify_state,
                num_drafts + 1,
                cfg.resolve_ssm_dtype(self.dtype),
            )
            if cfg.deterministic:
                self.states.pool.make_deterministic()
        # Every running sequence's block table, kept on the device by its slot; as many pages as
        # the programs' tables hold (a sequence's reach, the lookahead included)
        reach = max(max_model_len + lookahead, self.prefill_limit)
        self.block_tables = DeviceBlockTables(
            cfg.max_num_seqs, -(-reach // cfg.page_size) + 1, self.device
        )
        self.graphs = None
        # NOTE: tensor-parallel steps run eagerly for now (their collectives are not captured)
        if cfg.cuda_graphs and self.device.type == "cuda" and self.tp_size == 1:
            self.graphs = GraphRunner(
                self.model,
                cfg.graph_max_rows,
                # a sequence's block table may reach `lookahead` rows past the model length;
                # a prefill program's spare sequence, `prefill_limit` rows
                reach,
                cfg.page_size,
                self.device,
                paged_kernel=isinstance(self.backend, TritonPagedAttention),
                state_pool=None if self.states is None else self.states.pool,
                max_q=num_drafts + 1,
                max_seqs=cfg.max_num_seqs,
                prefill_rows=self.prefill_limit,
                verify_mode=None if self.states is None else self.states.verify_mode,
            )
        self.taps = None
        if self.dflash is not None:  # before any capture: the programs write the taps too
            self.taps = attach_dflash(self, cfg, num_drafts)
        # the target's programs captured before the first request: (programs, seconds, bytes
        # of device memory they took), `metrale bench` reports it; None where none are
        self.startup_capture: tuple[int, float, int] | None = None
        if self.graphs is not None and self.graphs.ragged:
            programs, seconds = self.graphs.capture_ragged()
            taken = self.graphs.pool_bytes()
            self.startup_capture = (programs, seconds, taken)
            log.info(
                "captured %d CUDA graphs in %.1f s (%.2f GiB)", programs, seconds, taken / 2**30
            )
        self.graph_refusals = 0
        # A bench-only override of the acceptance (`metrale.bench.forced`); never set by the
        # engine's configuration, the API or the server.
        self.forced_acceptance = None
        # running sequences under a grammar (the engine counts them): 0 skips the masks' work;
        # the matchers' vocabulary size (`GrammarCompiler.vocab_size`, set by the engine)
        self.structured_seqs = 0
        # Host work the engine hands the step to do while its forward runs on the device (the
        # last step's detokenizing): called once, before the step's first wait for the device.
        self.while_forward_runs: Callable[[], None] | None = None
        self.grammar_vocab = 0
        self.penalties = PenaltyState(self.device, cfg.max_num_seqs)  # their counts
        # A drafter's work that follows a target program on the device, queued before the host
        # waits for the verdicts: called with (entries, the program's shape, the target's token
        # at each sampling row, in row order) (the MTP catch-up, `MTPDrafter._catch_up_verified`;
        # DFlash's next drafts, `DFlashDrafter._draft_ahead`, which wants only steps with drafts:
        # `after_verify_drafts_only`). Never a step left on the device (`execute(defer=True)`).
        self.after_verify: Callable | None = None
        self.after_verify_drafts_only = False
        self.replayed_shape = None  # the program the step replayed, if any
        self.replayed_ids = None  # and its real rows' input ids on the device, in batch order
        log.info(
            "model on %s (%s): %d KV pages of %d rows",
            self.device,
            self.dtype,
            self.num_pages,
            self.page_size,
        )

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (once; later calls do nothing)."""
        if self.tp_size > 1:
            self.model.shutdown()

    def span_metadata(
        self, spans: list[tuple[list[int], int, list[int]]], rows: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """`step_metadata.pack_spans` on this runner's pages and device (the target's steps and
        drafters' own forwards over the same pages both use it)."""
        tables = self.block_tables if rows is not None else None
        return pack_spans(spans, self.page_size, self.device, tables, rows)

    def _metadata(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return self.span_metadata(spans_of(batch), table_rows(self, batch.entries))

    @torch.inference_mode()
    def all_logits(self, batch: Batch) -> torch.Tensor:
        """Run the batch and return float32 logits of every packed row [T, V] (prompt logprobs,
        acceptance studies, tests). Writes KV like `execute`; samples nothing."""
        input_ids, positions, meta = self._metadata(batch)
        return self.model.compute_logits(self._forward(batch, input_ids, positions, meta)[0])

    def _forward(
        self, batch: Batch, input_ids, positions, meta, verify: bool = False, head_seqs: int = 0
    ):
        """The target's eager forward -> (hidden [T, H], the hybrid state it ran on or None);
        a hybrid target also takes its sequences' state slots (`verify`: a forward with drafts,
        whose state `StateSlots.commit` settles once the acceptance is known; `head_seqs`: that
        many prompt chunks first, which advance theirs in place, `SplitState`)."""
        if self.states is None:
            return self.model(input_ids, positions, meta), None
        if head_seqs:
            state = self.states.bind_split(batch.entries, head_seqs)
        else:
            state = self.states.bind(batch.entries, verify)
        return self.model(input_ids, positions, meta, state), state

    @torch.inference_mode()
    def execute(self, batch: Batch, defer: bool = False) -> StepOutput:
        """Run one step: the forward over every row, then acceptance of every sampling sequence's
        drafts (k = 0 is a plain decode). One host sync copies the verdicts back; with `defer`
        (a step without drafts or grammars: `engine/ahead.py`) none: the copies are
        queued behind the step and its output's `settle` reads them."""
        head_seqs, mixed = 0, None  # a hybrid's prompt chunks first, beside a verify
        if self.hybrid:
            batch, head_seqs, mixed, apart = split_mixed(self, batch)
            if apart is not None:
                return StepOutput.merge([self.execute(part) for part in apart])
        verify_state = self.hybrid and any(e.drafts for e in batch.entries)
        graphed = self.graphs is not None and batch.phase in (Phase.DECODE, Phase.VERIFY)
        if graphed:
            # One order for any permutation of the same depths: deepest first, then by slot.
            batch = Batch(sorted(batch.entries, key=lambda e: (-e.num_rows, e.seq.slot)))
        ends = list(itertools.accumulate(e.num_rows for e in batch.entries))
        sampling = [(e, end) for e, end in zip(batch.entries, ends, strict=True) if e.samples]
        # The last 1 + k rows of each sampling sequence: its last token, then its k drafts.
        rows = [r for e, end in sampling for r in range(end - 1 - len(e.drafts), end)]
        replayed = self.replayed_shape = None
        if graphed:
            replayed = replay_decode(self, batch)
        elif mixed is not None:  # a hybrid's verify beside prompt chunks
            replayed = replay_gdn_mixed(self, batch, head_seqs, mixed, rows)
        elif self.graphs is not None:  # a step with prompt chunks
            replayed = replay_prefill(self, batch, rows)
        if replayed is None:
            input_ids, positions, meta = self._metadata(batch)
            hidden, state = self._forward(
                batch, input_ids, positions, meta, verify_state, head_seqs
            )
            logits, state_entries = None, list(batch.entries)
        else:
            # logits: the sampling rows', in order; state_entries: the sequences of the
            # program's state, graph padding included (None)
            hidden, logits, state, state_entries = replayed
        self._overlap()
        # the drafter's work on the step's rows, queued before the verdicts' host sync
        follow = self._follow(batch, entries := [e for e, _ in sampling], defer)
        if not sampling:
            if verify_state:  # unreachable: drafts only come with sampling entries
                raise RuntimeError("a verify step without sampling entries")
            if follow is not None:
                follow(torch.empty(0, dtype=torch.long, device=self.device))
            return StepOutput(batch.entries, [], hidden, ends)
        if logits is None:  # eager: the sampling rows' logits alone
            logits = self.model.compute_logits(hidden, torch.tensor(rows, device=self.device))
        if self.structured_seqs:
            # Filled on the host while the forward runs (nothing above waited for it).
            apply_grammar_masks(entries, logits, self.grammar_vocab)
        greedy = all(is_plain_greedy(e.seq.params, len(e.seq.output_token_ids)) for e in entries)
        if defer:
            if verify_state or any(e.drafts for e in entries):
                raise RuntimeError("only a step without drafts can leave its verdicts pending")
            if greedy:
                values, picks = logits.max(dim=-1)
                pending = pending_greedy(entries, picks, shown_tokens(values, picks))
            else:
                pending = pending_sampled(entries, logits, self.penalties)
            return StepOutput(batch.entries, [], hidden, ends, pending)
        if greedy:
            # The common case needs only each row's argmax: no sampling tensors, no kernels
            # beyond the max (and its finiteness), the same one host sync.
            values, picks = logits.max(dim=-1)
            table = to_host(shown_tokens(values, picks), follow, picks)
            verdicts = greedy_verdicts(entries, table, self.forced_acceptance)
        else:
            forced, raw = self.forced_acceptance, self.verify_raw_argmax
            verdicts = sampled_verdicts(entries, logits, raw, forced, follow, self.penalties)
        if verify_state:
            # Each sequence's committed state: the one after its last token + accepted drafts.
            accepted = {id(v.entry): v.num_accepted for v in verdicts}
            last_rows = [
                -1 if e is None else e.num_rows - 1 - len(e.drafts) + accepted.get(id(e), 0)
                for e in state_entries
            ]
            graph_commit = None if replayed is None else self.graphs.commit
            self.states.commit(state, state_entries, last_rows, graph_commit)
        return StepOutput(batch.entries, verdicts, hidden, ends)

    def _overlap(self) -> None:
        work, self.while_forward_runs = self.while_forward_runs, None
        if work is None:
            return
        try:
            work()
        except Exception:  # noqa: BLE001 (not the forward's failure: never isolate for it)
            # What it left undone the engine does in the step's commit, where a failure is
            # the step's own, as it was before this work moved here.
            log.exception("host work overlapped with the forward failed")

    def _follow(self, batch: Batch, entries: list[ScheduledSeq], defer: bool = False):
        """`after_verify` bound to this step, given the target's token at each sampling row,
        when it applies: a program ran the step (a ragged one, where every entry samples, or a
        prefill one), and what the verdicts accept follows from those tokens alone (not the
        bench's forced acceptance, not raw-argmax judging). Not a step left on the device
        (`defer`): it has no drafts, and no sequence a drafter learns from every step of
        (`ahead.runs_ahead` keeps those synchronous: MTP's), so no hook has work in it."""
        shape = self.replayed_shape
        if (
            defer
            or self.after_verify is None
            or shape is None
            or (isinstance(shape, RaggedShape) and len(entries) != len(batch.entries))
            or self.forced_acceptance is not None
            or self.verify_raw_argmax
            or (self.after_verify_drafts_only and not any(e.drafts for e in entries))
        ):
            return None
        hook = self.after_verify
        return lambda tokens: hook(batch.entries, shape, tokens)
