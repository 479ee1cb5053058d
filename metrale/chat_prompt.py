"""A conversation rendered into prompt token ids through the chat template, with the checks that
keep a hostile conversation from stalling the process: the Python API's `LLM.chat`, the
server's `/v1/chat/completions` and `/tokenize` all render through here.

A tokenizer's `encode` holds the GIL for as long as it runs (about 1.3 s per million
characters), so a worker thread does not keep it from stalling every other request on the
server: a conversation whose text cannot fit the context is refused before it is tokenised.
A text of n characters is at least n / `max_token_chars` tokens, and every message renders to
at least one token (its role's markers), so both bounds refuse only conversations that could
never run."""

from __future__ import annotations

from typing import Any


def chat_prompt_ids(
    tokenizer,
    messages: list[dict[str, Any]],
    context_len: int,
    tools: list | None = None,
    variables: dict[str, Any] | None = None,
    slack: int = 1,
) -> tuple[list[int], str]:
    """(the prompt's token ids, its text) of `messages` (as chat templates take them) under
    `tokenizer`'s chat template, with the generation prompt. ValueError naming `messages` for a
    conversation that cannot fit `context_len` tokens (`slack` times that, for a route that
    only counts tokens) or whose text is not valid Unicode; a template that raises, raises."""
    bound = context_len * slack
    if len(messages) > bound:
        raise ValueError(f"messages: {len(messages)} messages cannot fit the context")
    # (the rendered text, not the messages' content: a template may drop content, Qwen3's an
    # earlier turn's thinking; rendering holds the GIL no longer than any Python code does)
    limit = bound * tokenizer.max_token_chars
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tools=tools, **(variables or {})
    )
    if len(text) > limit:  # the template's own text (many short messages, long tools)
        raise ValueError(f"messages: the rendered prompt's {len(text)} characters cannot fit")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"messages: not valid Unicode text ({e.reason})") from None
    return tokenizer.encode(text, add_special_tokens=False), text


def chat_error(e: Exception) -> str:
    """The message of `chat_prompt_ids`'s failure: its own checks' as they are, a template's
    named by its type (`messages: TemplateError: ...`)."""
    if isinstance(e, ValueError) and str(e).startswith("messages: "):
        return str(e)
    return f"messages: {type(e).__name__}: {e}"
