"""Reasoning parsers: a model's thinking, split from its answer (`reasoning_content` beside
`content`, as vLLM's `--reasoning-parser` does).

`qwen3`: Qwen3 writes `<think> ... </think>` before its answer when thinking is on. Text inside
the block is reasoning, the rest content; an output that does not open with `<think>` is all
content, and one whose block never closes (cut by `max_tokens`) is all reasoning. When the chat
template itself opened the block at the end of the prompt (Qwen3's thinking-only models), the
output starts as reasoning and only closes it. The same state
machine runs over a stream's deltas and over a whole text, so a streamed response and a whole one
split alike; a delta that ends inside a tag holds that part back until the next delta tells.
"""

from __future__ import annotations

REASONING_PARSERS = ("qwen3",)


class ThinkSplitter:
    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, opened: bool = False) -> None:
        """`opened`: the prompt ends inside a block its template opened (Qwen3's thinking-only
        models): the output starts as reasoning and only closes the block."""
        # start -> reasoning -> after (newlines after the block dropped) -> content,
        # or start -> content
        self.state = "reasoning" if opened else "start"
        self.held = ""
        self.opened = opened  # whether a block was opened (by the output or the prompt)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of the next piece of output; `final`: nothing follows."""
        buf, self.held = self.held + text, ""
        reasoning = ""
        if self.state == "start":
            stripped = buf.lstrip()
            if stripped.startswith(self.OPEN):
                self.state, buf = "reasoning", stripped[len(self.OPEN) :]
                self.opened = True
            elif self.OPEN.startswith(stripped) and not final:
                self.held = buf  # may still open a block
                return "", ""
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = buf.find(self.CLOSE)
            if end >= 0:
                reasoning, buf = buf[:end], buf[end + len(self.CLOSE) :]
                self.state = "after"
            else:
                keep = 0 if final else _partial_suffix(buf, self.CLOSE)
                reasoning, self.held = buf[: len(buf) - keep], buf[len(buf) - keep :]
                return reasoning, ""
        if self.state == "after":
            buf = buf.lstrip("\n")
            if buf:
                self.state = "content"
        return reasoning, buf


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def opens_block(prompt: str) -> bool:
    """Whether a rendered chat prompt leaves a thinking block open for the output."""
    return prompt.rstrip().endswith(ThinkSplitter.OPEN)


def split_whole(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, or None when no block was opened; content) of a whole output."""
    splitter = ThinkSplitter(opened)
    reasoning, content = splitter.feed(text, final=True)
    return (reasoning if splitter.opened else None), content
