"""Command words of the parallel worker protocol.

Rank 0 sends a 32-bit command word, then its operands, and every worker rank runs the same
forward so that the collectives inside it stay matched. The reference system's words are per
sequence (a verify of one sequence's K rows, an MTP propose); metrale's tensor-parallel workers
(`metrale/distributed/workers.py`) use the batched generalisation below: one word per forward of
a whole step, and the verify word carrying every sequence's accepted rows after it.
"""

from __future__ import annotations

# One K-row verify of the sequence in a given state slot: the K row tokens follow, then, after the
# forward, the accepted count.
EP_CMD_VERIFY_K4 = 0xFFFFFFF4
# One MTP propose on every rank: `last_token`, `position` and `num_drafts` follow, each a u32.
EP_CMD_MTP_PROPOSE = 0xFFFFFFF5

# The batched protocol. A forward of one step (ids, positions, attention metadata, the hybrid
# state's addressing follow); the logits of rows of the last forward (the rows follow); a reset of
# hybrid state entries (the entries follow); the seed's verify word, after a verify forward: each
# sequence's committed rows (the accepted counts plus one) follow; stop.
CMD_FORWARD = 0xFFFFFFF1
CMD_LOGITS = 0xFFFFFFF2
CMD_STATE_RESET = 0xFFFFFFF3
CMD_VERIFY_COMMIT = EP_CMD_VERIFY_K4
CMD_STOP = 0xFFFFFFFF
