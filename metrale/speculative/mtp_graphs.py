"""CUDA graphs for the MTP drafter's chained steps.

A chained draft step runs one MTP depth module over one row per sequence, then the target's head
and an argmax: a few dozen small kernels whose launch costs (tens of microseconds each, eagerly)
exceed their run time. Run eagerly, the K - 1 chain steps of a verify cost more than the target's
whole decode step on a small model. Each (depth module, padded sequence count) is captured once
and replayed; padding rows are one-row sequences on the dummy page, like decode padding.

Inputs are copied into one static workspace that all programs read: draft tokens, positions,
slots, the block tables and the chain's hidden states. The outputs (draft ids, next hiddens)
live in the graph pool and are consumed before the next replay.
"""

from __future__ import annotations

import torch

from metrale.engine.graphs import capture
from metrale.engine.kv_cache import DUMMY_PAGE
from metrale.engine.program_shapes import decode_bucket
from metrale.models.attention import AttentionMetadata


class DraftChainGraphs:
    """Programs keyed by (depth module index, padded sequence count)."""

    def __init__(self, runner, heads, max_seqs: int, max_model_len: int) -> None:
        self.runner, self.heads = runner, heads
        self.page_size = runner.page_size
        self.max_model_len = max_model_len
        self.max_seqs = decode_bucket(max_seqs)
        device, n = runner.device, self.max_seqs
        pages = -(-max_model_len // self.page_size) + 1

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.tokens, self.positions, self.slots = zeros(n), zeros(n), zeros(n)
        self.starts = torch.arange(n + 1, device=device)  # one row per sequence, always
        self.seq_lens = zeros(n)
        self.block_tables = zeros(n, pages)
        self.hidden = zeros(n, runner.model.config.hidden_size, dtype=runner.dtype)
        self.pool = runner.graphs.pool
        self._programs: dict[tuple[int, int], tuple] = {}

    def _step_fn(self, module_index: int, n: int):
        module = self.heads.depths[module_index]
        model = self.runner.model

        def run():
            meta = AttentionMetadata(
                slot_mapping=self.slots[:n],
                positions=self.positions[:n],
                query_start_loc=self.starts[: n + 1],
                seq_lens=self.seq_lens[:n],
                block_tables=self.block_tables[:n],
                max_query_len=1,
                max_seq_len=self.max_model_len,
                page_size=self.page_size,
            )
            logits_in, next_hidden = module(
                self.tokens[:n], self.positions[:n], self.hidden[:n], meta, model.model.embed_tokens
            )
            return model.compute_logits(logits_in).argmax(dim=-1), next_hidden

        return run

    def _program(self, module_index: int, n: int):
        key = (module_index, n)
        if key not in self._programs:
            # Capture-time inputs: every row a one-row sequence on the dummy page.
            self.tokens.zero_()
            self.positions.zero_()
            self.slots.fill_(DUMMY_PAGE * self.page_size)
            self.seq_lens.fill_(1)
            self.block_tables.fill_(DUMMY_PAGE)
            self._programs[key] = capture(
                self._step_fn(module_index, n), self.pool, self.runner.device
            )
        return self._programs[key]

    def step(
        self,
        module_index: int,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        spans: list[tuple[list[int], int, list[int]]],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(draft ids [C], next hidden [C, H]) of one chained step over C sequences (`spans`:
        block table, position, one placeholder token each), or None when C is past the
        workspace (the caller then runs eagerly)."""
        count = len(spans)
        n = decode_bucket(count)
        if n > self.max_seqs:
            return None
        graph, (drafts, next_hidden) = self._program(module_index, n)
        _, positions, meta = self.runner.span_metadata(spans)
        self.tokens[:count].copy_(tokens, non_blocking=True)
        self.hidden[:count].copy_(hidden, non_blocking=True)
        self.positions[:count].copy_(positions, non_blocking=True)
        self.slots[:count].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:count].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n].fill_(DUMMY_PAGE)
        width = meta.block_tables.shape[1]
        self.block_tables[:count, :width].copy_(meta.block_tables, non_blocking=True)
        # NOTE: padding rows write their K/V to the dummy page and see only it.
        self.tokens[count:n].zero_()
        self.positions[count:n].zero_()
        self.slots[count:n].fill_(DUMMY_PAGE * self.page_size)
        self.seq_lens[count:n].fill_(1)
        graph.replay()
        return drafts[:count].clone(), next_hidden[:count].clone()
