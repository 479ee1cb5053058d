"""Helpers of the n-gram drafter's tests: a stand-in for the fields of a sequence it reads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Seq:
    """The fields of `engine.sequence.Sequence` the drafter reads."""

    seq_id: int
    slot: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    inflight: object = None  # a token in flight: `output_token_ids` ends with its placeholder
    is_finished: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self, start: int, stop: int) -> list[int]:
        return (self.prompt_token_ids + self.output_token_ids)[start:stop]
