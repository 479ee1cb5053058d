"""Text <-> token ids for an HF model directory, using only `tokenizers` and `jinja2`.

`Tokenizer` reads the files HF checkpoints ship (`tokenizer.json`, `tokenizer_config.json`,
`chat_template.jinja`, `generation_config.json`) and renders chat templates the way transformers
does, so the engine never needs transformers at run time. `IncrementalDetokenizer` turns a stream
of generated ids into text deltas for streaming responses.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jinja2
import tokenizers

from metrale.chat_template import jinja_env, pick_template
from metrale.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
logger = logging.getLogger(__name__)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: each of the 256 characters a byte-level token is
    spelt with -> the byte it stands for (printable Latin-1 bytes stand for themselves, the
    others for 256 + their order)."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + i): b for i, b in enumerate(shifted)}


_BYTE_OF = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    return data if isinstance(data, dict) else {}


def _valid_sampling_defaults(gen: dict[str, Any]) -> dict[str, float | int]:
    """generation_config.json's sampling fields that a request could carry itself. An invalid
    one is dropped with a warning (as vLLM ignores it): applied to every request that leaves the
    field out, it would make each of them fail with a 400 about a field the client never sent."""
    defaults: dict[str, float | int] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = gen.get(name)
        if value is None:
            continue
        try:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"expected a number, got {value!r}")
            SamplingParams(**{name: value})
        except ValueError as e:
            logger.warning("generation_config.json: ignoring %s=%r (%s)", name, value, e)
            continue
        defaults[name] = value
    return defaults


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or a serialised AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token and chat-template facts from an HF dir."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        tokenizer_config: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        chat_template: str | list[dict[str, str]] | None = None,
    ) -> None:
        self._tok = tokenizer
        # A tokenizer.json may carry padding/truncation settings meant for training; an engine
        # must see every token of the prompt.
        self._tok.no_padding()
        self._tok.no_truncation()
        cfg = tokenizer_config or {}
        gen = generation_config or {}
        # the checkpoint's recommended sampling (generation_config.json), which the server
        # applies to requests that leave those fields out, as vLLM does
        self.sampling_defaults = _valid_sampling_defaults(gen)
        if gen.get("do_sample") is False:  # greedy by the checkpoint's own choice
            self.sampling_defaults["temperature"] = 0.0
        self.chat_template = (
            chat_template if chat_template is not None else cfg.get("chat_template")
        )

        self.special_tokens: dict[str, str] = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            content = _token_content(cfg.get(name))
            if content is not None:
                self.special_tokens[name] = content
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        # `add_bos_token` unset means "whatever tokenizer.json's post-processor does" (Llama 3
        # adds BOS there); set, it decides alone.
        self._add_bos: bool | None = cfg.get("add_bos_token")

        eos: list[int] = _as_ids(gen.get("eos_token_id"))
        cfg_eos = self._id_of(self.special_tokens.get("eos_token"))
        if cfg_eos is not None:
            eos.append(cfg_eos)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))

        # A byte-level decoder renders the bytes of an unfinished character as one U+FFFD,
        # whatever ids come before it in a decode; ByteFallback (SentencePiece) renders each
        # byte of an invalid run as its own, so its detokenizer takes one id a push.
        self.byte_level = isinstance(self._tok.decoder, tokenizers.decoders.ByteLevel)
        added = self._tok.get_added_tokens_decoder()
        self._added_ids = frozenset(added)
        # Exactly the ids that `decode(..., skip_special_tokens=True)` drops.
        self._skip_ids = frozenset(i for i, t in added.items() if t.special)
        named = (self._id_of(c) for c in self.special_tokens.values())
        self.all_special_ids: tuple[int, ...] = tuple(
            sorted(self._skip_ids | {i for i in named if i is not None})
        )
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file}: no tokenizer.json in the model directory")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # noqa: BLE001 - the Rust binding raises a bare Exception
            raise ValueError(f"{tok_file}: not a readable tokenizer ({e})") from None
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        # transformers 5 saves the template beside the config instead of inside it; the separate
        # file wins, as it does in transformers.
        jinja_file = path / "chat_template.jinja"
        template = jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else None
        return cls(tok, cfg, gen, template)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of tokens including added ones (the model's embedding may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def id_limit(self) -> int:
        """One past the largest id the tokenizer knows: ids from there on (a model's embedding
        padded past the vocabulary) decode to nothing."""
        return 1 + max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token's text in characters, at least 1: a text of n characters is at
        least n / max_token_chars tokens, so an over-long prompt is refused before tokenising."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1) or 1

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def template_reads(self, variable: str) -> bool:
        """Whether the chat template picked when tools are given mentions `variable` (`tools`:
        it renders the tools itself; `tool_calls`: it renders assistant turns' calls)."""
        source = pick_template(self.chat_template, True)
        return bool(source) and re.search(rf"\b{re.escape(variable)}\b", source) is not None

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (OpenAI's logprobs `bytes`): a byte-level token's own
        bytes, a byte-fallback token's (`<0xE6>`) byte, though neither decodes alone to more
        than U+FFFD; a SentencePiece piece's text, its spaces included; an added token's text;
        else its decoded text's UTF-8."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id not in self._added_ids:
            if self.byte_level:
                return bytes(_BYTE_OF.get(ch, ord(ch) & 0xFF) for ch in piece)
            if _BYTE_FALLBACK.fullmatch(piece):
                return bytes([int(piece[3:5], 16)])
            if "\u2581" in piece:  # SentencePiece's space (decoded alone, a leading one goes)
                return piece.replace("\u2581", " ").encode()
            return self.decode([token_id], skip_special_tokens=False).encode()
        return piece.encode()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._add_bos is None:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self._add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's chat template, as transformers would (tokenize=False).

        Extra keyword arguments become template variables (e.g. `enable_thinking=False`). Errors
        the template raises itself (`raise_exception`) surface as ValueError: they describe a bad
        request, not a broken engine.
        """
        source = pick_template(self.chat_template, bool(tools))
        if not source:
            raise ValueError(
                "this model has no chat template; send a plain prompt (completions) instead"
            )
        template = self._compiled.get(source)
        if template is None:
            try:
                template = jinja_env().from_string(source)
            except jinja2.exceptions.TemplateError as e:  # (a syntax error: review)
                raise ValueError(f"chat template: {e}") from e
            self._compiled[source] = template
        variables = {**self.special_tokens, **kwargs}
        try:
            return template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template: {e}") from e


class IncrementalDetokenizer:
    """Streams the text of generated ids without re-decoding the whole output per token.

    Only a window of recent ids is decoded: `window[:read]` is left context whose text is already
    out (kept because some decoders, SentencePiece's, render a token differently at the start of
    a string), `window[read:]` the pending ids. The delta is the window's text beyond what was
    already emitted. A trailing U+FFFD means the bytes end inside a UTF-8 character, so it is
    held back until more ids arrive (or `flush()`): one U+FFFD where the decoder is byte-level
    (it renders an unfinished character as one), every trailing one otherwise (a byte-fallback
    decoder renders each byte of an unfinished run as one, and context bytes that the next
    character's first byte joins as well, as vLLM holds back all of them); the window slides
    (pending ids become the context) once they produced new text that ends on a whole character.

    For a byte-level tokenizer the deltas plus `flush()` concatenate to exactly
    `tokenizer.decode(ids)`, valid UTF-8 or not. With `prompt_token_ids`, the last prompt ids
    seed the context, so the first output token is rendered as a continuation (a SentencePiece
    leading space is kept, as a plain `decode(output_ids)` would not).
    """

    # Prompt tokens kept as left context; a few suffice for every decoder we know of.
    PROMPT_CONTEXT = 5
    # Pending tokens that still end in U+FFFD after this many can only be invalid UTF-8 (an
    # unfinished character spans at most 3 bytes); the window then slides anyway, so a model
    # that emits garbage bytes cannot make each step slower.
    MAX_PENDING = 16

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
        stop_token_ids: Iterable[int] = (),
    ) -> None:
        """`stop_token_ids`: generated ids that end the text and add none of it (vLLM leaves a
        stop token's text out unless `include_stop_str_in_output`)."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stops = frozenset(stop_token_ids)
        self._limit = tokenizer.id_limit
        self.token_ids: list[int] = []
        self.text = ""
        context = [t for t in (prompt_token_ids or ()) if not self._skipped(t)]
        self._window: list[int] = context[max(len(context) - self.PROMPT_CONTEXT, 0) :]
        # window[:read] is left context whose text is already out; `_slide` sets the rest.
        self._read = 0
        self._slide()

    def _skipped(self, token_id: int) -> bool:
        # Skipped special tokens and ids past the vocabulary decode to nothing, so leaving them
        # out of the window changes no text and stops a run of them from growing it, or from
        # forcing a slide while a character is open (where speculation, pushing several ids
        # at once, and plain decoding cut at other ids: an extra U+FFFD, found in review).
        return (
            self._skip_special and token_id in self._tokenizer._skip_ids
        ) or token_id >= self._limit

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Add generated ids; return the text they complete (possibly empty)."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        self.token_ids.extend(ids)
        self._window.extend(t for t in ids if not self._skipped(t) and t not in self._stops)
        text = self._decode(self._window)
        stable = self._stable(text)
        forced = len(self._window) - self._read > self.MAX_PENDING
        # A byte-fallback run this long is garbage, not a character: its U+FFFD go out now
        # (held, a second forced slide dropped them with the context; review).
        whole = forced and not self._tokenizer.byte_level
        if whole:
            stable = text
        unfinished = len(stable) < len(text)
        delta = stable[self._emitted :]
        self._emitted = max(self._emitted, len(stable))
        # Slide once the pending tokens produced text of their own, so the next left context is
        # never text-less (which would drop a SentencePiece leading space).
        if (not unfinished and len(text) > self._context_len) or forced:
            self._slide(whole)
        self.text += delta
        return delta

    def _stable(self, text: str) -> str:
        """`text` without what may still change: its trailing U+FFFD (see the class)."""
        if self._tokenizer.byte_level:  # (one U+FFFD for an unfinished character)
            return text.removesuffix(_REPLACEMENT)
        return text.rstrip(_REPLACEMENT)

    def push_each(self, token_ids: list[int]) -> str:
        """The text of `token_ids`, exactly as pushing them one at a time makes it: in one push
        where the decoder is byte-level (a push decodes the window once or twice however many
        ids it adds), one push an id otherwise (a byte-fallback decoder renders a newline
        byte and the lead byte of a character pushed together as two U+FFFD, and only the
        last is held back)."""
        if self._tokenizer.byte_level:
            return self.push(token_ids)
        return "".join(self.push(t) for t in token_ids)

    def mark(self) -> tuple:
        """The state `rewind` returns to (pushes since are undone)."""
        window = list(self._window)
        return len(self.token_ids), window, self._read, self._emitted, self._context_len, self.text

    def rewind(self, mark: tuple) -> None:
        n, window, self._read, self._emitted, self._context_len, self.text = mark
        del self.token_ids[n:]
        self._window = list(window)

    def _slide(self, emitted_all: bool = False) -> None:
        """Make the pending ids the new left context and drop the older ones.

        After a forced slide the cut can fall inside a character; that is harmless. The ids
        after the cut become context only at the next slide, and by then they have closed that
        character (a normal slide needs new text after it, a forced one more than 3 bytes), so
        the decoder is back in step before any pending id; only already-emitted context text
        decodes differently. (Ids that make no text never count towards it: `_skipped`.)
        `emitted_all`: the whole text went out, a held tail included.
        """
        del self._window[: self._read]
        self._read = len(self._window)
        context = self._decode(self._window)
        self._context_len = len(context)
        self._emitted = len(context if emitted_all else self._stable(context))

    def flush(self) -> str:
        """Return any held-back text (an unfinished character renders as U+FFFD)."""
        text = self._decode(self._window)
        delta = text[self._emitted :]
        self._emitted = len(text)
        self.text += delta
        return delta
