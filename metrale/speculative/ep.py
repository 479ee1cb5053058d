"""Command words of the expert-parallel worker protocol.

Under expert parallelism rank 0 broadcasts a 32-bit command word, then its operands, and every
worker rank runs the same forward so that the collectives inside it stay matched.
"""

from __future__ import annotations

# One K-row verify of the sequence in a given state slot: the K row tokens follow, then, after the
# forward, the accepted count.
EP_CMD_VERIFY_K4 = 0xFFFFFFF4
# One MTP propose on every rank: `last_token`, `position` and `num_drafts` follow, each a u32.
EP_CMD_MTP_PROPOSE = 0xFFFFFFF5
