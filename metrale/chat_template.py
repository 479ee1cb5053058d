"""Chat templates as transformers renders them: which of a checkpoint's named templates serves a
request, and the sandboxed Jinja environment (its `tojson`, `raise_exception`, `strftime_now` and
the `{% generation %}` tag) that `Tokenizer.apply_chat_template` compiles them in."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox


def pick_template(template: Any, has_tools: bool) -> str | None:
    """HF allows a list of named templates; like transformers, prefer `tool_use` when tools are
    given and `default` otherwise."""
    if template is None or isinstance(template, str):
        return template
    named = {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
    if has_tools and "tool_use" in named:
        return named["tool_use"]
    if "default" in named:
        return named["default"]
    return next(iter(named.values()), None)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in HF
    templates; for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)  # the `generation` name itself
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own `tojson` HTML-escapes and sorts keys; chat templates expect plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def jinja_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    # Templates come with downloaded checkpoints, so they run sandboxed and cannot mutate inputs.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
