"""The model runner: owns the model and its KV pool; packs a Batch into tensors, runs the forward,
computes logits for the rows that sample, samples, and copies the picks back with one host sync.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from metrale.config import EngineConfig, ModelConfig
from metrale.engine.kv_cache import DUMMY_PAGE, allocate_kv_cache, kv_page_bytes
from metrale.engine.sampler import SamplingBatch, SamplingRow, sample
from metrale.engine.sequence import Batch, Sequence
from metrale.models.attention import AttentionMetadata, TorchPagedAttention
from metrale.models.loader import load_weights
from metrale.models.qwen3 import Qwen3ForCausalLM

log = logging.getLogger(__name__)


@dataclass
class SampledToken:
    """One emitted token of one sequence, with its logprob information when asked for."""

    seq: Sequence
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob), best first


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def num_pages_for(
    model_cfg: ModelConfig, cfg: EngineConfig, max_model_len: int, dtype: torch.dtype
) -> int:
    """Pool size: `num_kv_pages` if given, else room for `max_num_seqs` full-length sequences,
    capped by `kv_cache_memory_gb`; plus the dummy page."""
    if cfg.num_kv_pages is not None:
        return cfg.num_kv_pages
    pages_per_seq = -(-(max_model_len + cfg.num_lookahead_rows) // cfg.page_size)
    wanted = cfg.max_num_seqs * pages_per_seq
    affordable = int(cfg.kv_cache_memory_gb * 2**30) // kv_page_bytes(
        model_cfg, cfg.page_size, dtype
    )
    pages = min(wanted, affordable)
    if pages < pages_per_seq:
        raise ValueError(
            f"kv_cache_memory_gb={cfg.kv_cache_memory_gb} holds {pages} pages, fewer than one "
            f"sequence of max_model_len={max_model_len} needs ({pages_per_seq})"
        )
    return pages + 1


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        model_cfg: ModelConfig,
        cfg: EngineConfig,
        max_model_len: int,
    ) -> None:
        self.device = cfg.resolve_device()
        self.dtype = cfg.resolve_dtype(model_cfg, self.device)
        self.model_cfg = model_cfg
        self.page_size = cfg.page_size
        self.backend = TorchPagedAttention()
        with torch.device(self.device), default_dtype(self.dtype):
            self.model = Qwen3ForCausalLM(model_cfg, self.backend, max_model_len)
        load_weights(self.model, model_dir)
        self.model.eval()
        self.num_pages = num_pages_for(model_cfg, cfg, max_model_len, self.dtype)
        self.kv_cache = allocate_kv_cache(
            model_cfg, self.num_pages, cfg.page_size, self.dtype, self.device
        )
        for layer, cache in zip(self.model.attention_layers, self.kv_cache, strict=True):
            layer.kv_cache = cache
        log.info(
            "model on %s (%s): %d KV pages of %d rows",
            self.device,
            self.dtype,
            self.num_pages,
            self.page_size,
        )

    def _metadata(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        page = self.page_size
        for entry in batch.entries:
            seq, start = entry.seq, entry.seq.num_computed_tokens
            end = start + entry.num_rows
            input_ids += seq.tokens(start, end)
            positions += range(start, end)
            table = seq.block_table
            slots += (table[p // page] * page + p % page for p in range(start, end))
            starts.append(starts[-1] + entry.num_rows)
            seq_lens.append(end)
        width = max(len(e.seq.block_table) for e in batch.entries)
        tables = [
            e.seq.block_table + [DUMMY_PAGE] * (width - len(e.seq.block_table))
            for e in batch.entries
        ]

        def t(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=t(slots),
            positions=t(positions),
            query_start_loc=t(starts),
            seq_lens=t(seq_lens),
            block_tables=t(tables),
            max_query_len=max(e.num_rows for e in batch.entries),
            max_seq_len=max(seq_lens),
            page_size=page,
        )
        return t(input_ids), meta.positions, meta

    @torch.inference_mode()
    def all_logits(self, batch: Batch) -> torch.Tensor:
        """Run the batch and return float32 logits of every packed row [T, V] (prompt logprobs,
        acceptance studies, tests). Writes KV like `execute`; samples nothing."""
        input_ids, positions, meta = self._metadata(batch)
        return self.model.compute_logits(self.model(input_ids, positions, meta))

    @torch.inference_mode()
    def execute(self, batch: Batch) -> list[SampledToken]:
        """Run one step; returns a token for every sequence whose rows reached its last token."""
        if not batch.entries:
            return []
        input_ids, positions, meta = self._metadata(batch)
        hidden = self.model(input_ids, positions, meta)  # [T, H]
        sampling = [e for e in batch.entries if e.samples]
        if not sampling:
            return []
        # The last row of each sampling sequence.
        ends = meta.query_start_loc[1:] - 1
        rows = ends[[i for i, e in enumerate(batch.entries) if e.samples]]
        logits = self.model.compute_logits(hidden, rows)  # [S, V]
        seqs = [e.seq for e in sampling]
        sb = SamplingBatch.build(
            [
                SamplingRow(
                    params=s.params,
                    seed=s.seed,
                    prompt_token_ids=s.prompt_token_ids,
                    output_token_ids=s.output_token_ids,
                    eos_token_ids=s.eos_token_ids,
                )
                for s in seqs
            ],
            vocab_size=logits.shape[-1],
            device=self.device,
        )
        out = sample(logits, sb)
        return _to_host(seqs, out)


def _to_host(seqs: list[Sequence], out) -> list[SampledToken]:
    """The step's one host sync: picks (and logprobs when asked for) come back together."""
    if out.logprobs is None:
        return [SampledToken(s, t) for s, t in zip(seqs, out.token_ids.tolist(), strict=True)]
    k = out.top_token_ids.shape[1]
    packed = torch.cat(
        [
            out.token_ids[:, None].double(),
            out.ranks[:, None].double(),
            out.logprobs[:, None].double(),
            out.top_token_ids.double(),
            out.top_logprobs.double(),
        ],
        dim=1,
    ).tolist()
    result = []
    for s, row in zip(seqs, packed, strict=True):
        token = SampledToken(s, int(row[0]))
        if s.params.logprobs is not None:
            n = s.params.logprobs
            token.rank, token.logprob = int(row[1]), row[2]
            token.top = [(int(i), lp) for i, lp in zip(row[3 : 3 + n], row[3 + k : 3 + k + n])]
        result.append(token)
    return result
