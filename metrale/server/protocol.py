"""OpenAI request parsing and response shapes: bodies to SamplingParams, outputs to JSON.

Every malformed field raises `APIError` naming it, which the app turns into an HTTP 4xx with the
OpenAI error object `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

from metrale import __version__
from metrale.config import SamplingParams
from metrale.outputs import CompletionOutput, RequestOutput
from metrale.server.reasoning import split_whole

# Which build answered (OpenAI's field): the version, so clients can tell engines apart.
SYSTEM_FINGERPRINT = f"metrale-{__version__}"


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


# Fields that change what a request means, refused until supported (never silently ignored),
# with the values that mean "not used".
_UNSUPPORTED = {
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "suffix": ("",),
    "parallel_tool_calls": (True, False),
}


def check_request(body: dict, chat: bool) -> None:
    """Type-check the fields outside SamplingParams and refuse what is not supported."""
    for name, neutral in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value not in neutral:
            raise APIError(f"{name}: not supported by this server", name)
    echo = body.get("echo")
    if echo is not None:
        if not isinstance(echo, bool):
            raise APIError(f"echo: expected a boolean, got {echo!r}", "echo")
        if echo and chat:
            raise APIError("echo: not supported for chat completions", "echo")
        if echo and body.get("logprobs") is not None:  # 0 asks for the chosen token's too
            raise APIError("echo: the prompt's logprobs are not computed; drop logprobs", "echo")
    best_of = body.get("best_of")
    if best_of is not None and best_of not in (1, body.get("n", 1)):
        raise APIError("best_of: only best_of = n is supported", "best_of")
    for name in ("stream", "logprobs") if chat else ("stream",):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise APIError(f"{name}: expected a boolean, got {body[name]!r}", name)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise APIError("stream_options: expected an object", "stream_options")
        usage = options.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise APIError("stream_options.include_usage: expected a boolean", "stream_options")


def chat_messages(messages: Any) -> list[dict[str, str]]:
    """The chat history with every `content` as text: a string, or a list of text parts
    (joined by newlines, as vLLM does); null only for an assistant turn (tool calls)."""
    if not isinstance(messages, list) or not messages:
        raise APIError("messages: expected a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}]: expected an object with a string role", "messages")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise APIError(
                        f"messages[{i}].content[{j}]: only text parts are supported", "messages"
                    )
                if not isinstance(part.get("text"), str):
                    raise APIError(
                        f"messages[{i}].content[{j}].text: expected a string", "messages"
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None and m["role"] == "assistant":
            content = ""  # an assistant turn of tool calls only
        elif not isinstance(content, str):
            raise APIError(
                f"messages[{i}].content: expected a string or a list of text parts, "
                f"got {type(content).__name__}",
                "messages",
            )
        message = {**m, "content": content}
        if m.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(m["tool_calls"], i)
        out.append(message)
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _tool_calls(calls: Any, i: int) -> list[dict]:
    """An assistant message's `tool_calls`, checked, with each call's `arguments` (a JSON
    string in the OpenAI API) parsed to the object chat templates render (as vLLM does)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise APIError(f"{where}: expected a list of calls", "messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(f"{where}[{j}]: expected {{function: {{name, arguments}}}}", "messages")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = (
                    json.loads(arguments, parse_constant=_no_constant) if arguments.strip() else {}
                )
            except (ValueError, RecursionError) as e:  # JSONDecodeError, digit limits, depth
                raise APIError(
                    f"{where}[{j}].function.arguments: not valid JSON ({e})", "messages"
                ) from None
        if not isinstance(arguments, dict):
            raise APIError(f"{where}[{j}].function.arguments: expected an object", "messages")
        out.append({**call, "type": "function", "function": {**function, "arguments": arguments}})
    return out


# template variables a request may not set: the template's own inputs
_TEMPLATE_RESERVED = ("messages", "tools", "add_generation_prompt")


def template_kwargs(body: dict) -> dict[str, Any]:
    """`chat_template_kwargs`: extra variables for the chat template (Qwen3's
    `enable_thinking`), as vLLM takes them."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise APIError(
            "chat_template_kwargs: expected an object of template variables",
            "chat_template_kwargs",
        )
    reserved = [k for k in kwargs if k in _TEMPLATE_RESERVED]
    if reserved:
        raise APIError(
            f"chat_template_kwargs: {reserved[0]!r} is the template's own input",
            "chat_template_kwargs",
        )
    return kwargs


def sampling_params(body: dict, chat: bool, defaults: dict | None = None) -> SamplingParams:
    """`defaults`: the model's generation_config sampling, for fields the body leaves out."""
    check_request(body, chat)
    kw: dict[str, Any] = dict(defaults or {})
    for name, (field, types) in _FIELDS.items():
        if body.get(name) is not None:
            kw[field] = _typed(body, name, types)
    max_name = (
        "max_completion_tokens"
        if chat and body.get("max_completion_tokens") is not None
        else "max_tokens"
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
        if body.get("top_logprobs") is not None and not body.get("logprobs"):
            raise APIError("top_logprobs: needs logprobs: true", "top_logprobs")
        if body.get("logprobs"):
            top = _typed(body, "top_logprobs", (int,)) if body.get("top_logprobs") else 0
            if not 0 <= top <= SamplingParams.MAX_LOGPROBS:
                raise APIError(
                    f"top_logprobs: must be in [0, {SamplingParams.MAX_LOGPROBS}], got {top}",
                    "top_logprobs",
                )
            kw["logprobs"] = top
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
        if param == "max_tokens":
            param = max_name  # the field the client sent
        raise APIError(str(e), param if param in _known_params() else None) from None


def _known_params() -> set[str]:
    return {f for f, _ in _FIELDS.values()} | {
        "max_tokens",
        "max_completion_tokens",
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


def completion_logprobs(
    c: CompletionOutput, tokenizer, k: int, start: int = 0, offset: int = 0
) -> dict | None:
    """The legacy completions `logprobs` object for tokens[start:], whose text starts at
    character `offset` of the completion (a stream keeps it running: no re-decoding)."""
    if c.logprobs is None:
        return None
    entries = c.logprobs[start:]
    pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in c.token_ids[start:]]
    # each token's character offset in the completion, from its decoded piece (as vLLM's)
    offsets = list(itertools.accumulate((len(p) for p in pieces), initial=offset))
    return {
        "tokens": pieces,
        "token_logprobs": [next(iter(e.values())).logprob for e in entries],
        "top_logprobs": [{lp.decoded_token: lp.logprob for lp in _top(e, k)} for e in entries],
        "text_offset": offsets[:-1],
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


def prompt_text(out: RequestOutput, tokenizer) -> str:
    """The prompt as `echo` returns it: its text, or its ids decoded."""
    return out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)


def whole_response(
    out,
    request_id,
    params,
    chat: bool,
    tokenizer,
    model_name: str,
    reasoning: bool = False,
    echo: bool = False,
    opened: bool = False,
) -> dict:
    """The non-streamed response body of a finished request; `reasoning`: a chat answer's
    thinking goes to `reasoning_content` (`reasoning.py`; `opened`: the prompt opened the
    block); `echo`: each completion's text starts with the prompt."""
    echoed = prompt_text(out, tokenizer) if echo else ""
    k = params.logprobs or 0
    choices = []
    for c in out.outputs:
        if chat:
            message = {"role": "assistant", "content": c.text}
            if reasoning:
                thought, message["content"] = split_whole(c.text, opened)
                message["reasoning_content"] = thought
            choices.append(
                {
                    "index": c.index,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "message": message,
                    "logprobs": chat_logprobs(c, k),
                }
            )
        else:
            choices.append(
                {
                    "index": c.index,
                    "text": echoed + c.text,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "logprobs": completion_logprobs(c, tokenizer, k),
                }
            )
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": now(),
        "model": model_name,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": choices,
        "usage": usage(out),
        "metrale": {"speculative": spec_stats(out)},
    }
