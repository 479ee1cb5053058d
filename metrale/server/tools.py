"""Tool calling on /v1/chat/completions: the request fields (`tools`, `tool_choice`,
`parallel_tool_calls`, OpenAI's), how the tools reach the prompt, and the grammar that makes the
model call one when it must.

- Rendering: the tools go to the model's chat template when its source reads `tools`; a template
  that does not (the shipped model's) gets Qwen3's own tool preamble in the system message
  instead, and the assistant turns' earlier calls as `<tool_call>` blocks in their text. With
  `tool_choice: "none"` no tools are rendered and no calls are parsed.
- Parsing (`tool_parser.py`): the answer's `<tool_call>` blocks naming a given tool become
  `tool_calls`.
- `"required"` and a named function constrain the output with an llguidance Lark grammar: one
  call (one or more, separated by newlines, with `parallel_tool_calls`) of `<tool_call>\\n`, a
  JSON object `{"name": <the tool's name>, "arguments": <its parameters schema>}` and
  `\\n</tool_call>`, written as Qwen3 writes JSON (`", "` and `": "` separators), over every tool
  for `"required"`. Where the tokenizer has the tags as tokens of their own (real Qwen3 ones do)
  the grammar names those tokens, since llguidance never lets an added token stand for text.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal

import llguidance
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    field_validator,
)

from metrale.server.protocol import APIError
from metrale.server.tool_parser import CLOSE, OPEN, ToolParsing
from metrale.structured import StructuredOutput
from metrale.structured.grammar import error_summary


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDefinition(_Body):
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="a JSON schema of the arguments object"
    )
    strict: StrictBool | None = Field(
        None, description='accepted; the schema is enforced under a "required" or named choice'
    )

    @field_validator("parameters")
    @classmethod
    def _object(cls, value):
        if value is not None and value.get("type", "object") != "object":
            raise ValueError('the arguments are a JSON object: expected "type": "object"')
        return value


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class FunctionName(_Body):
    name: StrictStr


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


def _choice_shape(value, handler):
    """One error that says what `tool_choice` takes (pydantic would give one per member)."""
    try:
        return handler(value)
    except ValidationError:
        raise ValueError(
            'expected "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        ) from None


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice, WrapValidator(_choice_shape)
]


class ToolFields(BaseModel):
    """The request fields (mixed into the chat completions body)."""

    tools: list[Tool] | None = Field(None, description="functions the model may call")
    tool_choice: ToolChoice | None = Field(
        None, description='"auto" when tools are given, else "none"'
    )
    parallel_tool_calls: StrictBool | None = Field(
        None, description="several calls in one answer (true when left out)"
    )

    @field_validator("tools")
    @classmethod
    def _distinct(cls, value):
        seen = set()
        for i, tool in enumerate(value or ()):
            if tool.function.name in seen:
                raise ValueError(f"[{i}].function.name: {tool.function.name!r} is given twice")
            seen.add(tool.function.name)
        return value

    @field_validator("tool_choice")
    @classmethod
    def _given_tool(cls, value, info: ValidationInfo):
        if "tools" not in info.data or value in (None, "none", "auto"):
            return value  # (tools that failed their own check are reported as such)
        names = [tool.function.name for tool in info.data["tools"] or ()]
        if not names:
            raise ValueError(f"{_choice_text(value)} needs tools")
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(f"function {value.function.name!r} is not one of the tools")
        return value

    @property
    def tool_mode(self) -> str:
        """The request's use of tools: "none" (none rendered, no calls parsed), "auto",
        "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"


def _choice_text(value) -> str:
    if isinstance(value, NamedToolChoice):
        return f"function {value.function.name!r}"
    return repr(value)


# -- rendering -----------------------------------------------------------------------------

# Qwen3's chat template's words, for templates that cannot render tools themselves
_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_CALL_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tools_preamble(tools: list[dict[str, Any]]) -> str:
    """The system text Qwen3's template writes for `tools`."""
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return _PREAMBLE + lines + _CALL_FORMAT


def _call_text(call: dict[str, Any]) -> str:
    function = call["function"]
    body = {"name": function["name"], "arguments": function.get("arguments", {})}
    return f"{OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CLOSE}"


def render_tools(
    messages: list[dict[str, Any]], tools: list[Tool] | None, tokenizer
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools for the template) to render: the tools go to a template that reads
    them; for one that does not, into the system message (Qwen3's words) and, where the template
    ignores `tool_calls`, the assistant turns' calls into their text."""
    if not tools:
        return messages, None
    listed = [tool.for_template() for tool in tools]
    if tokenizer.template_reads("tools"):
        return messages, listed
    messages = [dict(m) for m in messages]
    if not tokenizer.template_reads("tool_calls"):
        for m in messages:
            calls = m.pop("tool_calls", None) if m.get("role") == "assistant" else None
            if calls:
                texts = [m["content"]] if m["content"] else []
                m["content"] = "\n".join(texts + [_call_text(c) for c in calls])
    preamble = tools_preamble(listed)
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{preamble}"
    else:
        messages.insert(0, {"role": "system", "content": preamble})
    return messages, None


# -- the grammar of a constrained choice -----------------------------------------------------

# JSON as Qwen3 writes it (json.dumps' separators), with no other whitespace
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_DATA_KEYWORDS = ("const", "enum", "default", "examples")  # values, not schemas
# keywords whose value maps names (a property's, a definition's) to schemas: a name there is
# never a keyword (a property called "enum" or "$ref" holds a schema like any other)
_NAMED_SCHEMAS = (
    "properties",
    "patternProperties",
    "$defs",
    "definitions",
    "dependentSchemas",
    "dependencies",
)


def _rebased(schema, base: str):
    """`schema` with its local `$ref`s ("#/...") pointing under `base`, where it now lives."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: _rebased(sub, base) for name, sub in value.items()}
        else:
            out[key] = _rebased(value, base)
    return out


def arguments_schema(function: FunctionDefinition) -> dict[str, Any]:
    """The schema a call's arguments must match: the function's parameters (an object)."""
    return {"type": "object", **(function.parameters or {})}


def _call_schema(function: FunctionDefinition, at: str) -> dict[str, Any]:
    arguments = _rebased(arguments_schema(function), f"{at}/properties/arguments")
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_grammar(
    functions: list[FunctionDefinition],
    parallel: bool,
    open_tag: str = json.dumps(OPEN),
    close_tag: str = json.dumps(CLOSE),
) -> str:
    """The Lark grammar of an answer that is one call (one or more if `parallel`) of one of
    `functions`; `open_tag`/`close_tag`: the tags as Lark terms (a string, or a token)."""
    if len(functions) == 1:
        schema = _call_schema(functions[0], "#")
    else:
        schema = {"anyOf": [_call_schema(f, f"#/anyOf/{i}") for i, f in enumerate(functions)]}
    schema["x-guidance"] = _JSON_STYLE
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    body = json.dumps(schema, ensure_ascii=False)
    return f'{start}\ncall: {open_tag} "\\n" %json {body} "\\n" {close_tag}\n'


def _tag_term(tag: str, tokenizer, grammars) -> str:
    """A tag as a Lark term: its token where it is one added token, else its text."""
    token = tokenizer.backend.token_to_id(tag)
    if token is not None and grammars.tokenizer.is_special_token(token):
        return f"<[{token}]>"
    return json.dumps(tag)


# -- a request's plan ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools do: the tools rendered (`render`), the calls parsed out of
    its answers, and the output constraint and decoding a constrained choice needs."""

    tools: list[Tool] | None = None
    parsing: ToolParsing | None = None
    structured: StructuredOutput | None = None
    decode_special: bool = False  # special tokens kept in the text: the tags are special

    def render(self, messages: list[dict[str, Any]], tokenizer):
        return render_tools(messages, self.tools, tokenizer)

    def apply(self, params):
        """The request's SamplingParams with the constraint and decoding this plan needs."""
        changes = {}
        if self.structured is not None:
            changes["structured"] = self.structured
        if self.decode_special:
            changes["skip_special_tokens"] = False
        return dataclasses.replace(params, **changes) if changes else params


def _check_schema(i: int, function: FunctionDefinition, grammars) -> None:
    try:
        text = StructuredOutput(json=arguments_schema(function)).grammar_text()
        error = llguidance.LLMatcher.validate_grammar(text, grammars.tokenizer)
    except ValueError as e:
        error = str(e)
    if error:
        raise APIError(f"tools[{i}].function.parameters: {error_summary(error)}", "tools")


def plan_tools(body, tokenizer, grammars) -> ToolPlan:
    """The plan of a validated chat request (`ToolFields`), or an APIError (a 400) naming the
    field at fault: a constrained choice beside another output constraint, a tool whose
    parameters schema does not compile."""
    mode = body.tool_mode
    if mode == "none":
        return ToolPlan()
    tools = body.tools
    names = frozenset(tool.function.name for tool in tools)
    skipped = [
        tag
        for tag in (OPEN, CLOSE)
        if (token := tokenizer.backend.token_to_id(tag)) is not None
        and not tokenizer.decode([token])
    ]
    # decoding special tokens (so the tags survive) adds the end-of-text token's text too
    parsing = ToolParsing(
        names, _eos_texts(tokenizer) if skipped else (), body.parallel_tool_calls is False
    )
    if mode == "auto":
        return ToolPlan(tools, parsing, decode_special=bool(skipped))
    other = body.structured_field()
    if other is not None:
        raise APIError(
            f"tool_choice: {_choice_text(body.tool_choice)} constrains the output; it cannot "
            f"be combined with {other}",
            "tool_choice",
        )
    chosen = [
        (i, tool.function)
        for i, tool in enumerate(tools)
        if mode == "required" or tool.function.name == body.tool_choice.function.name
    ]
    for i, function in chosen:
        _check_schema(i, function, grammars)
    open_tag, close_tag = (_tag_term(tag, tokenizer, grammars) for tag in (OPEN, CLOSE))
    # a named function is called once (vLLM's named choice is that function's arguments, once;
    # here the grammar let the small model repeat the call until max_tokens cut it)
    parallel = mode == "required" and body.parallel_tool_calls is not False
    lark = tool_call_grammar([f for _, f in chosen], parallel, open_tag, close_tag)
    structured = StructuredOutput(grammar=lark)
    try:
        grammars.check(structured)
    except ValueError as e:
        raise APIError(f"tools: {str(e).split(':', 1)[1].strip()}", "tools") from None
    # the grammar allows calls alone: a call cut off (max_tokens, a stop string) and the
    # newlines between calls are no answer text (OpenAI's content is null under a forced choice)
    parsing = dataclasses.replace(parsing, calls_only=True)
    return ToolPlan(tools, parsing, structured, decode_special=bool(skipped))


def _eos_texts(tokenizer) -> tuple[str, ...]:
    texts = (tokenizer.decode([t], skip_special_tokens=False) for t in tokenizer.eos_token_ids)
    return tuple(t for t in texts if t)
