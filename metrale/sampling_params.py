"""Per-request sampling controls (vLLM/OpenAI-shaped), validated once at construction."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from metrale.structured.params import StructuredOutput


def _float32(value: float) -> float:
    """`value` as the sampler holds it."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _check_number(name: str, value: Any, lo: float, hi: float, lo_open=False, hi_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    too_low = value <= lo if lo_open else value < lo
    too_high = value >= hi if hi_open else value > hi
    # An open bound holds in float32 too, where the sampler uses the value: top_p = 1e-320 is 0
    # there, which kept no token (token 0 came out, in review).
    if lo_open and not too_low and _float32(value) <= lo:
        raise ValueError(f"{name} must be > {lo}, got {value!r}: {_float32(value)} in float32")
    if too_low or too_high:
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        raise ValueError(f"{name} must be in {lb}{lo}, {hi}{rb}, got {value!r}")


def _unused_field() -> Any:
    """A vLLM field metrale does not implement: keyword-only, left out of repr and ==, as only
    its "not used" value is accepted."""
    return field(default=None, kw_only=True, repr=False, compare=False)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _empty(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and not value


# vLLM's SamplingParams fields that metrale does not implement: (whether the value is one that
# changes nothing, what is accepted). A vLLM user's code that passes them gets a ValueError
# naming the field rather than a TypeError, or the field silently ignored.
_VLLM_UNSUPPORTED: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "best_of": (lambda v, p: v is None or (_int(v) and v == p.n), "only best_of = n"),
    "use_beam_search": (lambda v, p: v is None or v is False, "only False"),
    "length_penalty": (lambda v, p: v is None or (_number(v) and v == 1), "only 1"),
    "early_stopping": (lambda v, p: v is None or v is False, "only False"),
    "prompt_logprobs": (lambda v, p: v is None, "only None"),
    "bad_words": (lambda v, p: v is None or _empty(v), "only None"),
    "allowed_token_ids": (lambda v, p: v is None, "only None"),
    "logits_processors": (lambda v, p: v is None or _empty(v), "only None"),
    "truncate_prompt_tokens": (lambda v, p: v is None, "only None"),
    "guided_decoding": (lambda v, p: v is None, "use structured= for constrained output"),
    "detokenize": (lambda v, p: v is None or v is True, "only True"),
    # (vLLM's fast detokenizer follows neither value: nor does a `tokenizers` decode)
    "spaces_between_special_tokens": (lambda v, p: v is None or isinstance(v, bool), "a bool"),
    # (vLLM's default, RequestOutputKind.CUMULATIVE, is what LLM.generate returns)
    "output_kind": (
        lambda v, p: v is None or getattr(v, "name", None) == "CUMULATIVE",
        "only CUMULATIVE (LLM.stream gives deltas)",
    ),
    "extra_args": (lambda v, p: v is None or v == {}, "only None"),
    "structured_outputs": (lambda v, p: v is None, "use structured= for constrained output"),
}


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding controls, vLLM/OpenAI-shaped.

    temperature 0 means greedy. `top_k` <= 0 (or -1) disables top-k; `top_p` = 1 and `min_p` = 0
    disable theirs. `repetition_penalty` (HF semantics) applies to prompt and output tokens;
    `presence_penalty` and `frequency_penalty` (OpenAI semantics) to output tokens only.
    `logprobs=None` returns none; `logprobs=k` returns the emitted token's logprob and the top-k,
    computed from the model's raw logits (before penalties and temperature; after a `structured`
    constraint's mask).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Speculative decoding for this request: off, or a cap on its draft depth (None = engine's).
    speculative: bool = True
    num_drafts: int | None = None
    # The output must match a JSON schema, regex, choice or grammar (a dict of its fields works).
    structured: StructuredOutput | dict | None = None
    # vLLM's fields metrale does not implement (`_VLLM_UNSUPPORTED`): only their "not used"
    # value is accepted, so vLLM code that passes it as such runs unchanged
    best_of: int | None = _unused_field()
    use_beam_search: bool | None = _unused_field()
    length_penalty: float | None = _unused_field()
    early_stopping: bool | None = _unused_field()
    prompt_logprobs: int | None = _unused_field()
    bad_words: list[str] | None = _unused_field()
    allowed_token_ids: list[int] | None = _unused_field()
    logits_processors: list | None = _unused_field()
    truncate_prompt_tokens: int | None = _unused_field()
    guided_decoding: Any = _unused_field()
    detokenize: bool | None = _unused_field()
    spaces_between_special_tokens: bool | None = _unused_field()
    output_kind: Any = _unused_field()
    extra_args: dict | None = _unused_field()
    structured_outputs: Any = _unused_field()

    MAX_LOGPROBS = 20
    MAX_N = 128  # OpenAI's bound: one request cannot flood the engine with sequences
    MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 256, 16384, 1024

    def __post_init__(self) -> None:
        def set_(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= self.MAX_N:
            raise ValueError(f"n must be an integer in [1, {self.MAX_N}], got {self.n!r}")
        _check_number("temperature", self.temperature, 0.0, 1e4)
        _check_number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        _check_number("min_p", self.min_p, 0.0, 1.0)
        # HF's penalty divides positive logits by it, in float32: at most by 1 / 1e4, as it
        # multiplies the negative ones by at most 1e4 (1e-39 overflowed them to inf, the
        # softmax gave NaN, and token 0 came out, in review)
        _check_number("repetition_penalty", self.repetition_penalty, 1e-4, 1e4)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not -(2**63) <= self.seed < 2**63
        ):
            # (vLLM's range: seeds past it wrapped here, 2**63 and 0 giving the same output)
            raise ValueError(f"seed must be an integer in [-2**63, 2**63), got {self.seed!r:.40}")
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int):
            raise ValueError(f"min_tokens must be an integer, got {self.min_tokens!r}")
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        stop = tuple(stop)
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        # every stop string is checked against every new token: bound the work one request asks
        if len(stop) > self.MAX_STOP or sum(map(len, stop)) > self.MAX_STOP_CHARS:
            raise ValueError(
                f"stop: at most {self.MAX_STOP} strings of {self.MAX_STOP_CHARS} characters in "
                f"all, got {len(stop)} of {sum(map(len, stop))}"
            )
        set_("stop", stop)
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(
                f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
            )
        ids = tuple(self.stop_token_ids or ())
        if len(ids) > self.MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids: at most {self.MAX_STOP_TOKEN_IDS} ids, got {len(ids)}"
            )
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(
                f"stop_token_ids must hold token ids >= 0, got {self.stop_token_ids!r}"
            )
        set_("stop_token_ids", ids)
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        if self.logit_bias is not None:
            bias = {}
            for tok, value in self.logit_bias.items():
                if isinstance(tok, str) and len(tok) > 20:
                    # more digits than any id has (int() refuses over 4300, in its own words)
                    raise ValueError(
                        f"logit_bias: a key of {len(tok)} characters is not a token id"
                    )
                plain_digits = isinstance(tok, str) and tok.isascii() and tok.isdigit()
                if isinstance(tok, bool) or not (isinstance(tok, int) or plain_digits):
                    raise ValueError(f"logit_bias: key {tok!r} is not a token id")
                tok_id = int(tok)
                if tok_id < 0:
                    raise ValueError(f"logit_bias: token id {tok_id} is negative")
                _check_number(f"logit_bias[{tok_id}]", value, -100.0, 100.0)
                bias[tok_id] = float(value)
            set_("logit_bias", bias)
        for name in (
            "speculative",
            "ignore_eos",
            "skip_special_tokens",
            "include_stop_str_in_output",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.num_drafts is not None and (
            isinstance(self.num_drafts, bool)
            or not isinstance(self.num_drafts, int)
            or self.num_drafts < 0
        ):
            raise ValueError(f"num_drafts must be an integer >= 0, got {self.num_drafts!r}")
        set_("structured", StructuredOutput.coerce(self.structured))
        if self.structured is not None and self.min_tokens:
            # the mask may leave only the ends the ban removes: nothing could be sampled
            raise ValueError(
                "min_tokens: not supported with structured output (its grammar decides where "
                "the text ends)"
            )
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= self.MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an integer in [0, {self.MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        for name, (unused, accepted) in _VLLM_UNSUPPORTED.items():
            value = getattr(self, name)
            if not unused(value, self):
                raise ValueError(
                    f"{name}: not supported by metrale ({accepted}), got {value!r:.80}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model's vocabulary."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", tuple(self.logit_bias or ())),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(
                    f"{name}: token id {bad[0]} is outside the vocabulary ({vocab_size})"
                )
