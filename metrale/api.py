"""The offline Python API: `LLM(model, **engine_options).generate(prompts, SamplingParams)`.

Shaped like vLLM's `LLM`: prompts are strings or token-id lists, or vLLM's prompt dicts
(`{"prompt": text}`, `{"prompt_token_ids": ids}`); the result is one RequestOutput per prompt in
input order. `stream()` yields a growing RequestOutput for a single request, and
`chat()` applies the model's chat template first.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypedDict

from tqdm.auto import tqdm

from metrale.chat_inputs import checked_messages, checked_tools, checked_variables, is_batch
from metrale.chat_prompt import chat_prompt_ids
from metrale.config import EngineConfig, SamplingParams
from metrale.engine.llm import LLMEngine
from metrale.outputs import RequestOutput
from metrale.speculative.drafter import Drafter


class TextPrompt(TypedDict):
    """vLLM's text prompt dict."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's token-id prompt dict."""

    prompt_token_ids: list[int]


class _PromptError(ValueError):
    """A dict prompt's error, naming its field already (`prompts[0].prompt: ...`)."""


Prompt = str | list[int] | TextPrompt | TokensPrompt
# the dict prompts' keys: vLLM's others (multi_modal_data, cache_salt, ...) mean something
# metrale does not do, so they are refused rather than dropped
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def engine_config_from(options: dict) -> EngineConfig:
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown engine option {unknown[0]!r}; known: {sorted(known)}")
    return EngineConfig(**options)


class LLM:
    """An engine over one model directory (the embedded default model when `model` is None)."""

    def __init__(
        self, model: str | Path | None = None, drafter: Drafter | None = None, **engine_options
    ) -> None:
        """`engine_options` are EngineConfig fields (`spec=dict(method="ngram", num_drafts=4)`
        turns speculation on); `drafter` plugs in a drafter object of your own."""
        if model is None:
            from metrale.default_model import default_model_dir

            model = default_model_dir()
        self.engine = LLMEngine(model, engine_config_from(engine_options), drafter)
        self._ids = itertools.count()
        # Each live request's outputs that another caller's step made (`_take`): an open
        # `stream` and a `generate` beside it (or two streams) share the engine's steps.
        self._outbox: dict[str, list[RequestOutput]] = {}
        self._set_aside = 0  # outputs in it: none (the usual case), no per-request look-ups

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The engine's tokenizer (`metrale.tokenizer.Tokenizer`), as vLLM's `LLM` names it."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request given no SamplingParams samples with (vLLM's method of that name):
        the checkpoint's recommended sampling in generation_config.json (temperature, top_p,
        top_k, min_p, repetition_penalty), as the server applies it, else the defaults."""
        return SamplingParams(**self.tokenizer.sampling_defaults)

    def _params(self, params: SamplingParams | dict | None) -> SamplingParams:
        return _params(params, self.tokenizer.sampling_defaults)

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); a no-op on one device."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _add(
        self,
        prompt: Prompt,
        params: SamplingParams | dict,
        final_only: bool = False,
        where: str = "prompt",
    ) -> str:
        """Queue one request. A dict prompt's errors name its key under `where`
        (`prompts[1].prompt_token_ids: ...`); a plain prompt's are the engine's own."""
        request_id = f"req-{next(self._ids)}"
        if not isinstance(prompt, dict):
            self.engine.add_request(request_id, prompt, self._params(params), final_only)
            self._outbox[request_id] = []
            return request_id
        key, plain = _from_dict(prompt, where)
        try:
            self.engine.add_request(request_id, plain, self._params(params), final_only)
        except ValueError as e:
            # the engine names a prompt `prompt` or `prompt_token_ids`: name the dict's key
            message = str(e)
            for name in _PROMPT_KEYS:
                if message.startswith(f"{name}: "):
                    raise _PromptError(f"{where}.{key}: {message[len(name) + 2 :]}") from None
            raise
        self._outbox[request_id] = []
        return request_id

    def _take(self, ids: set[str]) -> list[RequestOutput]:
        """The next outputs of requests `ids`, in order: those other callers' steps set aside,
        else one engine step's, whose outputs of other live requests are set aside for their
        callers. Before this, a `generate` beside an open `stream` (or two streams) dropped
        the other's outputs: its deltas no longer added up to its text, and a stream whose
        last output was dropped stepped an idle engine forever (found in review)."""
        taken = []
        if self._set_aside:
            for request_id in ids:
                box = self._outbox.get(request_id)
                if box:
                    taken += box
                    self._set_aside -= len(box)
                    box.clear()
            if taken:
                return taken
        idle = not self.engine.has_unfinished_requests()
        for out in self.engine.step():
            if out.request_id in ids:
                taken.append(out)
            elif out.request_id in self._outbox:
                self._outbox[out.request_id].append(out)
                self._set_aside += 1
        if idle and not taken:  # never finishing: say so rather than step an idle engine
            raise RuntimeError(f"requests {sorted(ids)} are no longer in the engine")
        return taken

    def _forget(self, request_id: str) -> None:
        self._set_aside -= len(self._outbox.pop(request_id, ()))

    def _abort(self, request_id: str) -> None:
        self._forget(request_id)
        self.engine.abort_request(request_id)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched continuously; outputs come back in input order."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(
                "prompts must be a string, a list of token ids, a prompt dict, or a list of "
                f"them, got {type(prompts).__name__}"
            )
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, (SamplingParams, dict)):
            params_list = [self._params(sampling_params)] * len(prompts)
        elif not isinstance(sampling_params, (list, tuple)):
            raise ValueError(
                "sampling_params must be a SamplingParams, a dict of its fields, or a list of "
                f"them (one per prompt), got {type(sampling_params).__name__}"
            )
        else:
            params_list = []
            for i, params in enumerate(sampling_params):
                try:
                    params_list.append(self._params(params))
                except ValueError as e:  # which of them (review)
                    message = str(e).removeprefix("sampling_params: ")
                    raise ValueError(f"sampling_params[{i}]: {message}") from None
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params: {len(params_list)} given for {len(prompts)} prompts"
                )
        ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                ids.append(self._add(prompt, params, final_only=True, where=f"prompts[{i}]"))
        except (ValueError, TypeError) as e:
            # Nothing half-queued: drop what this call added, then name the bad prompt.
            for request_id in ids:
                self._abort(request_id)
            if isinstance(e, _PromptError):  # a dict prompt's field, named already
                raise ValueError(str(e)) from None
            raise ValueError(f"prompts[{len(ids)}]: {e}") from None
        finals = self._run(set(ids), use_tqdm and len(ids) > 1)
        return [finals[i] for i in ids]

    def _run(self, ids: set[str], show_progress: bool) -> dict[str, RequestOutput]:
        finals: dict[str, RequestOutput] = {}
        pending = set(ids)  # (updated as requests finish: no per-step work over the batch)
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not show_progress)
        try:
            while pending:
                for out in self._take(pending):
                    if out.finished:
                        finals[out.request_id] = out
                        pending.discard(out.request_id)
                        self._forget(out.request_id)
                        bar.update(1)
        except BaseException:
            for request_id in pending:
                self._abort(request_id)
            raise
        finally:
            bar.close()
        return finals

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the request's output each time it grows; `delta_text` holds the new text.
        `prompt` is one prompt, of any form `generate` takes.

        Closing the iterator early aborts the request and frees its pages."""
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (str, dict)):
            # (read as token ids, a list of texts was refused as "'a' is not a token id")
            raise ValueError(
                f"prompt: stream takes one prompt, got a list of {len(prompt)} (generate runs "
                "several)"
            )
        request_id = self._add(prompt, sampling_params)
        finished = False
        try:
            while not finished:
                for out in self._take({request_id}):
                    finished = out.finished
                    yield out
        finally:
            if finished:
                self._forget(request_id)
            else:
                self._abort(request_id)

    def _chat_ids(self, messages, where: str, variables, render: dict, tools=None) -> list[int]:
        """One conversation's prompt ids (a ValueError naming `where` for its faults); `tools`
        (checked) rendered as the server renders a request's."""
        messages = checked_messages(messages, where)
        if tools:
            from metrale.server.tools import render_tools

            messages, tools = render_tools(messages, tools, self.tokenizer)
        ids = chat_prompt_ids(
            self.tokenizer,
            messages,
            self.engine.context_len,
            tools=tools,
            variables=variables,
            **render,
        )[0]
        try:
            self.engine.validate(ids, SamplingParams())  # the prompt's own checks (its length)
        except ValueError as e:  # a conversation's fault is its messages'
            raise ValueError(f"{where}: {str(e).removeprefix('prompt: ')}") from None
        return ids

    def chat(
        self,
        messages: list[dict],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        *,
        stream: bool = False,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> RequestOutput | list[RequestOutput] | Iterator[RequestOutput]:
        """Apply the chat template and generate the assistant's reply. `messages` are checked
        as the server checks a body's: a message's content is a string or a list of OpenAI's
        text parts (joined by newlines), null only on an assistant turn. A list of
        conversations (vLLM's batch form) gives a list of outputs, run together;
        `sampling_params` is then one for all or a list, one each.
        `continue_final_message` (with `add_generation_prompt=False`), as vLLM's `LLM.chat`:
        the reply goes on with the final message's text (a prefilled assistant turn).
        `chat_template_kwargs`: extra template variables, as vLLM's and the server's (Qwen3's
        `{"enable_thinking": False}`); the template's own inputs (`messages`, ...) are refused.
        `tools`: OpenAI function tools, rendered into the prompt as the server renders them
        (vLLM's `LLM.chat(tools=...)`); the reply is text, its calls unparsed. The arguments
        follow vLLM's order (`use_tqdm` third); `stream=True` yields the reply as it grows."""
        for name, value in (
            ("stream", stream),
            ("add_generation_prompt", add_generation_prompt),
            ("continue_final_message", continue_final_message),
        ):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {type(value).__name__}")
        variables = checked_variables(chat_template_kwargs)
        tools = checked_tools(tools)
        render = dict(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        if is_batch(messages):
            if stream:
                raise ValueError("stream: one conversation at a time (messages is a batch)")
            prompts = [
                self._chat_ids(m, f"messages[{i}]", variables, render, tools)
                for i, m in enumerate(messages)
            ]
            try:
                return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
            except ValueError as e:  # a conversation's index, as its messages are named
                raise ValueError(str(e).replace("prompts[", "messages[", 1)) from None
        ids = self._chat_ids(messages, "messages", variables, render, tools)
        if stream:
            return self.stream(ids, sampling_params)
        try:
            return self.generate([ids], sampling_params, use_tqdm=use_tqdm)[0]
        except ValueError as e:  # (one conversation: no prompt index to name)
            raise ValueError(str(e).removeprefix("prompts[0]: ")) from None


def _params(params: SamplingParams | dict | None, defaults: dict) -> SamplingParams:
    """A request's SamplingParams; a dict of its fields is accepted too (ValueError naming an
    unknown field); None: `defaults` (the checkpoint's, `LLM.get_default_sampling_params`)."""
    if params is None:
        return SamplingParams(**defaults)
    if isinstance(params, dict):
        try:
            return SamplingParams(**params)
        except TypeError as e:
            raise ValueError(f"sampling_params: {e}") from None
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params: expected a SamplingParams, got {type(params).__name__}")
    return params


def _from_dict(prompt: dict, where: str) -> tuple[str, str | list[int]]:
    """A vLLM prompt dict as (its key, the plain prompt it holds); ValueError naming the field
    at fault (`prompts[0].prompt_token_ids: ...`). Checks the engine makes of a plain prompt
    (empty text, ids outside the vocabulary) are left to it."""
    unknown = [k for k in prompt if k not in _PROMPT_KEYS]
    if unknown:
        raise _PromptError(
            f"{where}.{unknown[0]}: not supported (a prompt dict holds one of "
            f"{', '.join(_PROMPT_KEYS)})"
        )
    if len(prompt) != 1:
        raise _PromptError(
            f"{where}: a prompt dict holds exactly one of {', '.join(_PROMPT_KEYS)}, got "
            f"{sorted(prompt) or 'neither'}"
        )
    key, value = next(iter(prompt.items()))
    if key == "prompt":
        if not isinstance(value, str):
            raise _PromptError(f"{where}.prompt: expected a string, got {type(value).__name__}")
        return key, value
    if not isinstance(value, (list, tuple)) or not value:
        raise _PromptError(
            f"{where}.prompt_token_ids: expected a non-empty list of token ids, got {value!r:.80}"
        )
    bad = [t for t in value if isinstance(t, bool) or not isinstance(t, int)]
    if bad:  # (the engine checks the ids' range)
        raise _PromptError(f"{where}.prompt_token_ids: {bad[0]!r:.80} is not a token id")
    return key, list(value)
