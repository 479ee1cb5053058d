"""MTP drafter: the checkpoint's multi-token-prediction head(s) chained for K drafts.

After every target forward, `observe` catches the MTP layer up on the rows whose tokens are
now committed (prefill chunks, the last token and the accepted drafts of a verify): the row at
position p takes the target's hidden at p and the committed token at p+1, writes the MTP layer's
KV at p, and the last row's output gives the first draft. `propose` chains the rest: draft j+1
comes from the module fed with draft j and the previous step's own output hidden, one row per
sequence per depth (module `j % num_layers`), writing the MTP KV of positions p+1, p+2, ...

Rows of accepted drafts were already written by the chain, with the drafter's own hidden. By
default they are kept (one catch-up row per verify, as the reference system does); with
`METRALE_MTP_CATCHUP=1` and `METRALE_MTP_REFEED_ACCEPTED=1`, and only while the drafter serves
one sequence (`SpecConfig.mtp_max_seqs` = 1), they are re-fed with the target's hiddens,
`METRALE_MTP_REFEED_SHIFT` pairing each token with the hidden that many rows earlier (a probe of
the mapping; 0 is right) and `METRALE_MTP_REFEED_DEBUG=1` logging a fingerprint of each re-fed
hidden. Rows the chain never wrote (prefill, plain decodes, the bonus row) are always fed.

On CUDA with graphs, the chain steps replay captured programs (`mtp_graphs.py`); the catch-up,
whose rows vary per sequence, runs eagerly.

NOTE: rollback: chain rows of rejected drafts lie past the committed positions; the next
catch-up rewrites them before any row reads them. The MTP KV shares the target's block tables,
so pages follow the sequence. Drafts are greedy (one-hot q): lossless at any temperature.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from metrale.engine.sequence import Sequence
from metrale.knobs import (
    hidden_fingerprint,
    knobs,
    mtp_catchup_enabled,
    mtp_refeed_accepted_enabled,
)
from metrale.speculative.drafter import Draft, Verdict
from metrale.speculative.mtp_graphs import DraftChainGraphs

log = logging.getLogger(__name__)


@dataclass
class _State:
    """Per sequence: the MTP output of its newest committed row and the draft it predicts."""

    position: int  # the row's position p (it predicted the token at p + 2)
    hidden: torch.Tensor  # [H] next_hidden of that row
    first_draft: torch.Tensor  # [] int64 argmax of the head over that row
    # rows the last chain wrote: positions position + 1 .. position + chain_rows
    chain_rows: int = 0


class MTPDrafter:
    name = "mtp"
    needs_hidden = True

    def __init__(self, runner, max_seqs: int) -> None:
        """`max_seqs`: sequences drafted per step at most (the MTP dispatch cap)."""
        if runner.mtp is None:
            raise ValueError("the MTP drafter needs a model loaded with its MTP heads")
        self.runner = runner
        self.heads = runner.mtp
        self.max_seqs = max_seqs
        k = knobs()
        self.refeed = mtp_catchup_enabled(max_seqs, k) and mtp_refeed_accepted_enabled(max_seqs, k)
        self.refeed_shift = k.mtp_refeed_shift if self.refeed else 0
        self.refeed_debug = k.mtp_refeed_debug and self.refeed
        self._states: dict[int, _State] = {}
        graphs = runner.graphs
        self.chain_graphs = (
            DraftChainGraphs(runner, self.heads, max_seqs, graphs.max_model_len)
            if graphs is not None and graphs.paged_kernel and not k.no_mtp_chain_graphs
            else None
        )

    def _forward(self, step: int, spans, hidden: torch.Tensor):
        """One MTP module over spans (block table, first position, tokens at p + 1)."""
        input_ids, positions, meta = self.runner.span_metadata(spans)
        module = self.heads.for_step(step)
        logits_in, next_hidden = module(
            input_ids, positions, hidden, meta, self.runner.model.model.embed_tokens
        )
        return logits_in, next_hidden, meta

    @torch.inference_mode()
    def observe(self, verdicts: list[Verdict]) -> None:
        spans, hiddens, owners = [], [], []
        for v in verdicts:
            seq, rows = v.seq, 0 if v.hidden is None else v.hidden.shape[0]
            if rows == 0 or not seq.params.speculative or seq.params.num_drafts == 0:
                continue
            hidden, first = self._rows_to_feed(v)
            # the committed token after each row's position: prompt, accepted drafts, bonus
            spans.append((seq.block_table, first, seq.tokens(first + 1, first + 1 + len(hidden))))
            hiddens.append(hidden)
            owners.append(seq)
        if not spans:
            return
        logits_in, next_hidden, meta = self._forward(0, spans, torch.cat(hiddens))
        last = meta.query_start_loc[1:] - 1  # [S] each span's newest row
        firsts = self.runner.model.compute_logits(logits_in, last).argmax(dim=-1)  # [S]
        for i, (seq, (_, first, tokens)) in enumerate(zip(owners, spans, strict=True)):
            self._states[seq.seq_id] = _State(
                first + len(tokens) - 1, next_hidden[last[i]], firsts[i]
            )

    def _rows_to_feed(self, v: Verdict) -> tuple[torch.Tensor, int]:
        """The committed rows to run through the MTP layer: (target hiddens, first position)."""
        state = self._states.get(v.seq.seq_id)
        if not v.drafts or state is None or state.position + 1 != v.first_position:
            return v.hidden, v.first_position
        if self.refeed:
            hidden = v.hidden
            if self.refeed_shift:
                rows = torch.arange(hidden.shape[0], device=hidden.device)
                hidden = hidden[(rows - self.refeed_shift).clamp(0, hidden.shape[0] - 1)]
            if self.refeed_debug:
                for t, h in enumerate(hidden):
                    log.info(
                        "MTP_REFEED pos=%d fp=%016x", v.first_position + t, hidden_fingerprint(h)
                    )
            return hidden, v.first_position
        # The chain's rows for accepted drafts hold the right tokens; keep them.
        keep = min(v.num_accepted, state.chain_rows)
        return v.hidden[keep:], v.first_position + keep

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[Draft]:
        live = [
            (i, seq, k, self._states.get(seq.seq_id))
            for i, (seq, k) in enumerate(zip(seqs, max_drafts, strict=True))
        ]
        # A state is current only if it sits on the sequence's newest committed row.
        live = [
            (i, s, k, st)
            for i, s, k, st in live
            if st is not None and k > 0 and st.position == s.num_tokens - 2
        ][: self.max_seqs]
        drafts: list[Draft] = [Draft([]) for _ in seqs]
        if not live:
            return drafts
        columns = [torch.stack([st.first_draft for *_, st in live])]  # [S]
        hidden = torch.stack([st.hidden for *_, st in live])  # [S, H]
        for j in range(1, max(k for _, _, k, _ in live)):
            chain = [n for n, (_, _, k, _) in enumerate(live) if k > j]
            tokens = columns[-1][chain]  # [C] draft j, the input of draft j + 1
            spans = [(live[n][1].block_table, live[n][3].position + j, [0]) for n in chain]
            column = torch.full_like(columns[0], -1)
            graphed = None
            if self.chain_graphs is not None:
                index = j % self.heads.num_layers  # the module `for_step(j)` returns
                graphed = self.chain_graphs.step(index, tokens, hidden[chain], spans)
            if graphed is not None:
                column[chain], next_hidden = graphed
            else:
                _, positions, meta = self.runner.span_metadata(spans)
                module = self.heads.for_step(j)
                logits_in, next_hidden = module(
                    tokens, positions, hidden[chain], meta, self.runner.model.model.embed_tokens
                )
                column[chain] = self.runner.model.compute_logits(logits_in).argmax(dim=-1)
            columns.append(column)
            hidden = hidden.clone()
            hidden[chain] = next_hidden
        table = torch.stack(columns, dim=1).tolist()  # [S, Kmax]: the propose's one host sync
        for (i, _, k, state), row in zip(live, table, strict=True):
            drafts[i] = Draft(row[:k])
            state.chain_rows = k - 1
        return drafts

    def release(self, seq: Sequence) -> None:
        self._states.pop(seq.seq_id, None)
