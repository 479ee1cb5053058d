"""Tool calls out of a chat answer's text, in Qwen3's (Hermes') format: each call is a
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` block, and becomes an OpenAI
tool call `{"id": "call_<hex>", "type": "function", "function": {"name", "arguments": <JSON
text>}}`. Text outside the blocks is the answer's content (null when it is only whitespace). A
block whose JSON does not parse, is not an object with a string `name` and object `arguments`,
or names a tool the request did not give stays in the content as it was written, as does a block
that never closes.

`ToolCallSplitter` is one state machine for a stream's deltas and for a whole text (as
`reasoning.ThinkSplitter` is for thinking), so a streamed answer and a whole one split alike:
text from where `<tool_call>` may be starting (a prefix of it at the end of a delta) is held back
until the next delta tells, a call is released whole when its `</tool_call>` arrives, and the
content's leading whitespace is held until something else follows it (content that is only
whitespace is never sent).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from metrale.server.reasoning import _partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    """One tool call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str

    def as_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def parse_call(body: str, names: frozenset[str]) -> ParsedCall | None:
    """The call a block's text (between the tags) holds, or None when it holds none."""

    def no_constant(name: str):
        raise ValueError(f"{name} is not JSON")

    try:
        call = json.loads(body, parse_constant=no_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None  # (a name that is not a string is in no set of names either)
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    try:  # what JSON and UTF-8 cannot carry (1e999, a lone surrogate escape) is no call
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except (ValueError, UnicodeEncodeError):
        return None
    return ParsedCall(call["name"], text, f"call_{uuid.uuid4().hex}")


_DECODER = json.JSONDecoder()


def _block_end(buf: str) -> int:
    """Where the closing tag of the block `buf` holds (after its `<tool_call>`) starts: after
    the JSON value at its start, so a string in the arguments may hold the tag; -1 while no
    JSON value followed by the tag is there (yet)."""
    body = buf.lstrip()
    try:
        _, n = _DECODER.raw_decode(body)
    except ValueError:
        return -1
    rest = body[n:]
    tail = rest.lstrip()
    if not tail.startswith(CLOSE):
        return -1
    return len(buf) - len(body) + n + len(rest) - len(tail)


class ToolCallSplitter:
    """Content and tool calls of an answer fed in pieces. `names`: the tools a call may name;
    `strip`: texts dropped from the end of the answer (end-of-text tokens, when special tokens
    are decoded so that tool tags survive); `calls_only`: a grammar made the answer calls and
    the newlines between them (a "required" or named choice), so the text between blocks and a
    call that max_tokens or a stop string cut off are dropped, not released as content."""

    def __init__(
        self,
        names: frozenset[str],
        strip: tuple[str, ...] = (),
        single: bool = False,
        calls_only: bool = False,
    ) -> None:
        self.names, self.strip = names, strip
        self.single = single  # parallel_tool_calls false: a block after the first call is text
        self.calls_only = calls_only
        self.state = "text"  # or "call": inside a block, after its `<tool_call>`
        self.held = ""  # text not released yet (a partial tag, or an open block)
        self.space = ""  # leading whitespace of the content, until something else follows it
        self.spoke = False  # content other than whitespace was released
        self.count = 0  # calls released

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ParsedCall]]:
        """(content, calls) of the next piece of the answer; `final`: nothing follows."""
        buf, self.held = self.held + text, ""
        if final:
            for suffix in self.strip:
                buf = buf.removesuffix(suffix)
        content, calls = "", []
        while True:
            if self.state == "text":
                start = buf.find(OPEN)
                if start < 0:
                    # (held too: what may be the start of a text stripped from the end, so
                    # that a stream's content drops it as the whole answer's does)
                    keep = 0 if final else max(_partial_suffix(buf, OPEN), self._stripped(buf))
                    content += self._text(buf[: len(buf) - keep])
                    self.held = buf[len(buf) - keep :]
                    break
                content += self._text(buf[:start])
                buf, self.state = buf[start + len(OPEN) :], "call"
            end = _block_end(buf)
            if end < 0:
                if not final:  # the JSON may still be coming
                    self.held = buf
                    break
                # It never parsed: text, up to the first closing tag (or all of it).
                end = buf.find(CLOSE)
                if end < 0:
                    content += self._text(OPEN + buf)  # (a call cut off)
                    break
            call = parse_call(buf[:end], self.names)
            if self.single and self.count + len(calls) > 0:
                call = None
            if call is None:
                content += OPEN + buf[: end + len(CLOSE)]
            else:
                calls.append(call)
            buf, self.state = buf[end + len(CLOSE) :], "text"
        self.count += len(calls)
        return self._content(content, final), calls

    def _text(self, text: str) -> str:
        """Text outside the finished blocks (between them, or a block cut off): content, but
        under `calls_only`, whose grammar allowed nothing there but newlines. A finished block
        that does not parse (a number JSON cannot carry back) does not come here: it stays
        content under `calls_only` too, or the answer would look empty."""
        return "" if self.calls_only else text

    def _stripped(self, buf: str) -> int:
        """Length of the end of `buf` the final piece may strip: the longest end that begins
        (or is) a text of `strip`, and whole texts of `strip` before it (the whole answer
        strips each in turn)."""
        best = 0
        for suffix in self.strip:
            for n in range(min(len(suffix), len(buf)), best, -1):
                if suffix.startswith(buf[-n:]):
                    best = n
                    break
        rest = buf[: len(buf) - best]
        while whole := next((s for s in self.strip if s and rest.endswith(s)), None):
            best += len(whole)
            rest = rest[: -len(whole)]
        return best

    def _content(self, content: str, final: bool) -> str:
        """`content` to release, its leading whitespace held until other text follows."""
        if self.spoke:
            return content
        self.space += content
        if not self.space.strip():
            if final:
                self.space = ""
            return ""
        content, self.space, self.spoke = self.space, "", True
        return content


def split_tool_calls(
    text: str,
    names: frozenset[str],
    strip: tuple[str, ...] = (),
    single: bool = False,
    calls_only: bool = False,
) -> tuple[str | None, list[ParsedCall]]:
    """(content, or None when it is only whitespace; calls) of a whole answer."""
    content, calls = ToolCallSplitter(names, strip, single, calls_only).feed(text, final=True)
    return content or None, calls


@dataclass(frozen=True)
class ToolParsing:
    """How a request's answers are parsed: the tools a call may name, the texts dropped from the
    end of an answer (`ToolCallSplitter`)."""

    names: frozenset[str]
    strip: tuple[str, ...] = ()
    single: bool = False  # parallel_tool_calls false: one call at most
    calls_only: bool = False  # a constrained choice: no text outside the finished blocks

    def splitter(self) -> ToolCallSplitter:
        return ToolCallSplitter(self.names, self.strip, self.single, self.calls_only)

    def split(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        return split_tool_calls(text, self.names, self.strip, self.single, self.calls_only)
