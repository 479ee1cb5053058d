"""`LLM.chat`'s arguments checked as the server checks a chat request's fields (the same
pydantic models): conversations, template variables and tools, each fault a ValueError naming
its field (`messages[0].content: ...`, `tools[1].function.name: ...`)."""

from __future__ import annotations


def is_batch(messages) -> bool:
    """A list of conversations (each a list of messages), not one conversation."""
    return (
        isinstance(messages, (list, tuple))
        and bool(messages)
        and all(isinstance(m, (list, tuple)) for m in messages)
    )


def checked_variables(value) -> dict | None:
    """`chat_template_kwargs`, checked as the server checks it (a ValueError naming it)."""
    from metrale.server.chat_messages import template_variables

    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"chat_template_kwargs must be a dict of names, got {value!r:.80}")
    try:
        return template_variables(value)
    except ValueError as e:
        raise ValueError(f"chat_template_kwargs: {e}") from None


def checked_tools(tools):
    """`LLM.chat`'s tools, checked as the server checks a request's (a ValueError naming the
    field at fault: `tools[0].function.name: ...`), or None."""
    if tools is None:
        return None
    from pydantic import ValidationError

    from metrale.server.tools import ToolFields

    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of OpenAI function tools, got {tools!r:.80}")
    try:
        return ToolFields.model_validate({"tools": list(tools)}).tools
    except ValidationError as e:
        raise _first_error(e, []) from None


def checked_messages(messages, where: str = "messages") -> list[dict]:
    """`messages` as chat templates take them, through the server's own model of a message (a
    ValueError naming the first field at fault: `messages[0].content: ...`, under `where`)."""
    from pydantic import TypeAdapter, ValidationError

    from metrale.server.chat_messages import ChatMessage

    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(
            f"{where} must be a non-empty list of {{role, content}} dicts, got {messages!r:.80}"
        )
    try:
        checked = TypeAdapter(list[ChatMessage]).validate_python(list(messages))
    except ValidationError as e:
        raise _first_error(e, [where]) from None
    return [m.for_template() for m in checked]


def _first_error(e, under: list) -> ValueError:
    """A pydantic error's first fault as a ValueError naming its field under `under`
    (`messages[0].content: ...`)."""
    from metrale.server.chat_messages import error_path

    error = e.errors()[0]
    message = error["msg"].removeprefix("Value error, ")
    path = error_path([*under, *error["loc"]])
    # (a check of a whole list names its item itself: "tools[1].function.name: ...")
    return ValueError(f"{path}{message}" if message.startswith("[") else f"{path}: {message}")
