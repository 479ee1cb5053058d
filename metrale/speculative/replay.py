"""Replay drafter: proposes a recorded continuation of each prompt, every position corrupted
with probability 1 - alpha, so the engine runs at a known acceptance.

`metrale bench` records the continuation from a run without speculation and replays it; tests use
it as an oracle (alpha = 1: every draft right, a = K at every step; alpha = 0: every draft wrong,
a = 0). Corruption is a deterministic function of (seed, prompt, position), so a
run repeats. Each sequence's corrupted continuation is computed once, on its first propose, so a
step's proposing is a slice per sequence.
"""

from __future__ import annotations

import random
import zlib
from array import array
from collections.abc import Mapping, Sequence

from metrale.engine.sequence import Sequence as Seq
from metrale.speculative.drafter import Draft, Verdict


class ReplayDrafter:
    name = "replay"
    needs_hidden = False
    stateless = True  # learns nothing from verdicts: steps that draft nothing skip `observe`

    def __init__(
        self,
        continuations: Mapping[tuple[int, ...], Sequence[int]],
        alpha: float,
        vocab_size: int,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2 to corrupt a draft, got {vocab_size}")
        self.alpha, self.vocab_size, self.seed = alpha, vocab_size, seed
        self._by_seq: dict[int, list[int]] = {}  # seq_id -> its prompt's replay
        self.record(continuations)

    def record(
        self, continuations: Mapping[tuple[int, ...], Sequence[int]], alpha: float | None = None
    ) -> None:
        """Replay these continuations from now on (at `alpha`, if given). The corrupted
        replays are computed here, once per prompt, not while the engine steps."""
        if alpha is not None and not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.alpha = self.alpha if alpha is None else alpha
        self.continuations = {tuple(k): list(v) for k, v in continuations.items()}
        self._replays = {
            prompt: [self._corrupt(prompt, pos, t) for pos, t in enumerate(ref)]
            for prompt, ref in self.continuations.items()
        }
        self._by_seq = {}

    def _replay(self, seq: Seq) -> list[int]:
        replay = self._by_seq.get(seq.seq_id)
        if replay is None:
            replay = self._replays.get(tuple(seq.prompt_token_ids), [])
            self._by_seq[seq.seq_id] = replay
        return replay

    def _corrupt(self, prompt: tuple[int, ...], pos: int, token: int) -> int:
        # Keyed by the prompt, not the request id: a second generate of the same prompts gets
        # the same corruptions, so a warm-up run meets every verify shape the timed run will.
        key = zlib.crc32(array("q", prompt).tobytes())
        rng = random.Random(f"{self.seed}:{key}:{pos}")
        if rng.random() < self.alpha:
            return token
        return (token + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size  # never token

    def propose(self, seqs: list[Seq], max_drafts: list[int]) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, max_drafts, strict=True):
            start = len(seq.output_token_ids)
            # Off the recorded path (an earlier corruption was "accepted" by sampling), the
            # recording no longer predicts anything; keep proposing it anyway.
            drafts.append(Draft(self._replay(seq)[start : start + k]))
        return drafts

    def observe(self, verdicts: list[Verdict]) -> None:
        pass

    def release(self, seq: Seq) -> None:
        self._by_seq.pop(seq.seq_id, None)
