"""OpenAI request parsing and response shapes: bodies to SamplingParams, outputs to JSON.

Every malformed field raises `APIError` naming it, which the app turns into an HTTP 4xx with the
OpenAI error object `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import time
from typing import Any

from metrale.config import SamplingParams
from metrale.outputs import CompletionOutput, RequestOutput


class APIError(Exception):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = (
            message,
            param,
            status,
            type_,
            code,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# body field -> (SamplingParams field, accepted JSON types)
_NUMBER = (int, float)
_FIELDS = {
    "temperature": ("temperature", _NUMBER),
    "top_p": ("top_p", _NUMBER),
    "top_k": ("top_k", (int,)),
    "min_p": ("min_p", _NUMBER),
    "presence_penalty": ("presence_penalty", _NUMBER),
    "frequency_penalty": ("frequency_penalty", _NUMBER),
    "repetition_penalty": ("repetition_penalty", _NUMBER),
    "seed": ("seed", (int,)),
    "n": ("n", (int,)),
    "min_tokens": ("min_tokens", (int,)),
    "ignore_eos": ("ignore_eos", (bool,)),
    "stop_token_ids": ("stop_token_ids", (list,)),
}


def _typed(body: dict, name: str, types: tuple) -> Any:
    value = body[name]
    if isinstance(value, bool) and bool not in types:
        raise APIError(f"{name}: expected {types[0].__name__}, got a boolean", name)
    if not isinstance(value, types):
        raise APIError(f"{name}: expected {types[0].__name__}, got {type(value).__name__}", name)
    return value


def sampling_params(body: dict, chat: bool) -> SamplingParams:
    kw: dict[str, Any] = {}
    for name, (field, types) in _FIELDS.items():
        if body.get(name) is not None:
            kw[field] = _typed(body, name, types)
    max_name = (
        "max_completion_tokens" if chat and body.get("max_completion_tokens") else "max_tokens"
    )
    if body.get(max_name) is not None:
        kw["max_tokens"] = _typed(body, max_name, (int,))
    elif chat:
        kw["max_tokens"] = None  # until the context ends, as OpenAI's chat does
    if body.get("stop") is not None:
        stop = body["stop"]
        if not isinstance(stop, (str, list)):
            raise APIError("stop: expected a string or a list of strings", "stop")
        kw["stop"] = stop
    if body.get("logit_bias") is not None:
        kw["logit_bias"] = _typed(body, "logit_bias", (dict,))
    if chat:
        if body.get("logprobs"):
            top = body.get("top_logprobs") or 0
            kw["logprobs"] = int(_typed(body, "top_logprobs", (int,)) if top else 0)
    elif body.get("logprobs") is not None:
        kw["logprobs"] = _typed(body, "logprobs", (int,))
    spec = body.get("speculative")
    if spec is not None:
        if not isinstance(spec, dict):
            raise APIError("speculative: expected an object {enabled, num_drafts}", "speculative")
        if "enabled" in spec:
            kw["speculative"] = spec["enabled"]
        if spec.get("num_drafts") is not None:
            kw["num_drafts"] = spec["num_drafts"]
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        param = str(e).split(" ", 1)[0].split(":", 1)[0].split("[", 1)[0]
        raise APIError(str(e), param if param in _known_params() else None) from None


def _known_params() -> set[str]:
    return {f for f, _ in _FIELDS.values()} | {
        "max_tokens",
        "stop",
        "logit_bias",
        "logprobs",
        "speculative",
        "num_drafts",
        "n",
    }


def usage(out: RequestOutput) -> dict:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def spec_stats(out: RequestOutput) -> dict:
    """Per-request speculative figures (the `metrale` extension field of responses)."""
    drafted = sum(c.num_draft_tokens for c in out.outputs)
    accepted = sum(c.num_accepted_tokens for c in out.outputs)
    return {
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
    }


def completion_logprobs(c: CompletionOutput, tokenizer, k: int, start: int = 0) -> dict | None:
    """The legacy completions `logprobs` object for tokens[start:]."""
    if c.logprobs is None:
        return None
    entries = c.logprobs[start:]
    tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in c.token_ids[start:]]
    return {
        "tokens": tokens,
        "token_logprobs": [next(iter(e.values())).logprob for e in entries],
        "top_logprobs": [{lp.decoded_token: lp.logprob for lp in _top(e, k)} for e in entries],
        "text_offset": [],
    }


def _top(entry: dict, k: int) -> list:
    """The top-k of one position's logprobs, best first (the emitted token too, if in them)."""
    ranked = [lp for lp in entry.values() if lp.rank is not None and lp.rank <= k]
    return sorted(ranked, key=lambda lp: lp.rank)


def chat_logprobs(c: CompletionOutput, k: int, start: int = 0) -> dict | None:
    if c.logprobs is None:
        return None

    def item(lp) -> dict:
        token = lp.decoded_token or ""
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}

    content = []
    for entry in c.logprobs[start:]:
        first = next(iter(entry.values()))  # the emitted token
        content.append({**item(first), "top_logprobs": [item(lp) for lp in _top(entry, k)]})
    return {"content": content}


def now() -> int:
    return int(time.time())
