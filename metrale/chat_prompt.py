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
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> tuple[list[int], str]:
    """(the prompt's token ids, its text) of `messages` (as chat templates take them) under
    `tokenizer`'s chat template, with the generation prompt unless `add_generation_prompt` is
    False. ValueError naming `messages` for a conversation that cannot fit `context_len` tokens
    (`slack` times that, for a route that only counts tokens) or whose text is not valid
    Unicode; a template that raises, raises. `continue_final_message` (vLLM's and transformers'
    option): the prompt ends inside the final message, after its text, so that the model goes
    on with it (a prefilled assistant turn) rather than starting a turn of its own."""
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message: cannot be true with add_generation_prompt (the final "
            "message would be closed and a new turn opened)"
        )
    bound = context_len * slack
    if len(messages) > bound:
        raise ValueError(
            f"messages: {len(messages)} messages cannot fit the context "
            f"(max_model_len={context_len})"
        )
    # (the rendered text, not the messages' content: a template may drop content, Qwen3's an
    # earlier turn's thinking; rendering holds the GIL no longer than any Python code does)
    limit = bound * tokenizer.max_token_chars
    if continue_final_message:
        messages = _tag_final_message(messages)
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tools=tools, **(variables or {})
    )
    if continue_final_message:
        text = _cut_at_tag(text)
    if len(text) > limit:  # the template's own text (many short messages, long tools)
        raise ValueError(
            f"messages: the rendered prompt's {len(text)} characters cannot fit the context "
            f"(max_model_len={context_len})"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"messages: not valid Unicode text ({e.reason})") from None
    return tokenizer.encode(text, add_special_tokens=False), text


# transformers' marker (5.x `apply_chat_template(continue_final_message=True)`): appended to
# the final message before rendering, the prompt is cut where it lands. (Finding the message's
# own text instead cut at its last occurrence, inside the closing tag for a message of "<" or
# "end": found in review.)
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str):
        raise ValueError("continue_final_message: the final message has no text to continue")
    return [*messages[:-1], {**messages[-1], "content": final + CONTINUE_TAG}]


def _cut_at_tag(text: str) -> str:
    """The rendered prompt up to the marker (where the template trimmed the message's trailing
    space, and the marker's, without what is left of it), as transformers cuts it."""
    at = text.rfind(CONTINUE_TAG.strip())
    if at < 0:
        raise ValueError(
            "continue_final_message: the chat template does not render the final message's text"
        )
    if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()


def chat_error(e: Exception) -> tuple[str, str]:
    """(message, field) of `chat_prompt_ids`'s failure: its own checks' as they are, a
    template's named by its type (`messages: TemplateError: ...`)."""
    text = str(e)
    if isinstance(e, ValueError):
        for field in ("messages", "continue_final_message"):
            if text.startswith(f"{field}: "):
                return text, field
    return f"messages: {type(e).__name__}: {e}", "messages"
