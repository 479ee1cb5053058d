"""What generation returns: RequestOutput holding one CompletionOutput per sample (vLLM-shaped)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # one dict per emitted token: {token id: Logprob}, the emitted token first, then the top-k
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    error_by_request: bool = False  # the request caused `error` (a 4xx), not the engine
    # speculative decoding of this output: drafts verified and accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # what this output gained since the previous RequestOutput of the same request (streaming)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # prompt tokens whose KV came from the prefix cache (vLLM's name): its first admission's hit,
    # kept after a preemption; 0 before it is admitted, without a hit, or with caching off
    num_cached_tokens: int = 0
