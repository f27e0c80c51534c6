"""Structured output over HTTP: `response_format` and forced tool calls as one grammar.

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) and a
``tool_choice`` that forces a call (OpenAI ``"required"`` or a named function, Anthropic
``any`` or a named tool) become one `Grammar` the engine masks every token with, so the
answer parses by construction:

* a JSON answer is the schema's JSON and nothing else;
* a forced call is written in a tool-call syntax `parsing` reads back, with the arguments
  constrained by that tool's `parameters` schema (a Lark grammar with ``%json{...}``):
  the template's own syntax where it has one a grammar can write (`Features.call_syntax`:
  DeepSeek-V3.2's DSML block, one parameter element per argument, for a schema that is
  an object of named properties; gpt-oss's Harmony commentary message; DeepSeek-V3/V3.1's
  call tokens; the special tokens named as tokens), else
  ``<tool_call>{"name": "NAME", "arguments": {...}}</tool_call>``;
* with tools on ``auto`` and a JSON answer asked for, either one is allowed.

A model whose chat template cannot show tools is told about them in a system note when a
call is forced (the grammar does the rest); on ``auto`` it is still refused, since its
unforced output would not follow any call syntax. Every schema is checked here, so a bad
one is a 400 naming its field before any token is generated.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from colibrid.engine.constraint import Grammar, styled_schema
from colibrid.errors import RequestError
from colibrid.http.errors import bad_request
from colibrid.http.parsing import DSML, DSML_CLOSE, DSML_OPEN, TOOL_OPEN, Features

TOOL_CLOSE = "</tool_call>"
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolChoice:
    """`mode` none | auto | required; `name`: the one tool a required call must name."""

    mode: str = "auto"
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode == "required"


def response_schema(value: Any) -> dict[str, Any] | bool | None:
    """The JSON schema OpenAI's `response_format` asks the answer to follow (None: text).
    ``json_object`` is any object; ``json_schema`` without a `schema` is too."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                "response_format.json_schema must be an object with a `schema`",
                "response_format",
            )
        schema = spec.get("schema", ANY_OBJECT)
        if not isinstance(schema, (dict, bool)):
            raise bad_request(
                "response_format.json_schema.schema must be a JSON schema object",
                "response_format",
            )
        _check_schema(schema, "response_format.json_schema.schema", "response_format")
        return schema
    raise bad_request(
        '`response_format` must be {"type": "text" | "json_object"} or '
        '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
        "response_format",
    )


def _check_schema(schema: Any, where: str, param: str) -> None:
    try:
        Grammar.json_schema(schema)
    except RequestError as exc:
        raise bad_request(f"{where}: {exc}", param) from None


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """A template tool's function object (OpenAI's shape: what both APIs are turned into)."""
    return tool["function"]


def callable_tools(
    tools: Sequence[dict[str, Any]], choice: ToolChoice, param: str
) -> list[dict[str, Any]]:
    """The tools a call may name under `choice` (a named one must exist), each with a
    valid `parameters` schema (400 naming the tool otherwise)."""
    names = [_function(t)["name"] for t in tools]
    if choice.name is not None and choice.name not in names:
        raise bad_request(
            f"`tool_choice` names {choice.name!r}, which is not among `tools` ({', '.join(names)})",
            "tool_choice",
        )
    picked = [t for t in tools if choice.name is None or _function(t)["name"] == choice.name]
    for i, tool in enumerate(tools):
        if tool in picked:
            _check_schema(_parameters(tool), f"tools[{i}] parameters", param)
    return picked


def _parameters(tool: dict[str, Any]) -> Any:
    params = _function(tool).get("parameters")
    return ANY_OBJECT if params is None or params == {} else params


def _call_rule(index: int, tool: dict[str, Any]) -> str:
    """`call_<i>: "<tool_call>{"name": NAME, "arguments": " args_<i> "}</tool_call>"`."""
    head = f'{TOOL_OPEN}{{"name": {json.dumps(_function(tool)["name"], ensure_ascii=False)}, '
    head += '"arguments": '
    return (
        f"call_{index}: {json.dumps(head, ensure_ascii=False)} args_{index} "
        f"{json.dumps('}' + TOOL_CLOSE)}\n" + _args_rule(index, tool)
    )


PLAIN = Features()  # a template whose call syntax is not known: the JSON form

# What may annotate a parameter that is plain text (any string) without constraining it.
_ANNOTATIONS = {"type", "description", "title", "examples", "default"}
# What a parameters schema may hold for its arguments to be written as DSML parameters.
_DSML_OBJECT = _ANNOTATIONS | {"properties", "required", "additionalProperties", "$schema"}
_DSML_NAME = r"/[A-Za-z_][A-Za-z0-9_.\-]*/"
_DSML_SAFE = re.compile(r"[^\"<>]+")  # a name an attribute can hold as it is


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _dsml_properties(schema: Any) -> dict[str, Any] | None:
    """The named properties of a parameters schema DSML can express exactly (an object
    of properties, the required ones among them), {} for any object; None otherwise."""
    if schema == ANY_OBJECT:
        return {}
    if not isinstance(schema, dict) or schema.get("type") != "object" or set(schema) - _DSML_OBJECT:
        return None
    properties, required = schema.get("properties", {}), schema.get("required", [])
    if (
        not isinstance(properties, dict)
        or not properties
        or not isinstance(required, list)
        or not set(required) <= set(properties)
        or not all(isinstance(k, str) and _DSML_SAFE.fullmatch(k) for k in properties)
    ):
        return None
    return properties


def _dsml_parameter(rule: str, name: str | None, schema: Any) -> str:
    """Rules for one parameter element: a plain string's body is raw text
    (``string="true"``, no ``<`` in it), anything else JSON of its schema (``"false"``);
    `name` None: any name, any JSON value."""
    head = f'<{DSML}parameter name="'
    tail = _lit(f"</{DSML}parameter>\n")
    opened = f'{_lit(head)} {_DSML_NAME} "\\"" ' if name is None else _lit(f'{head}{name}"') + " "
    plain = isinstance(schema, dict) and schema.get("type") == "string"
    if plain and not set(schema) - _ANNOTATIONS:
        text = _lit(' string="true">')
        return f"{rule}: {opened}{text} /[^<]*/ {tail}\n"
    value = schema if name is not None else {}
    json_value = _lit(' string="false">')
    return (
        f"{rule}: {opened}{json_value} {rule}_value {tail}\n"
        f"{rule}_value: %json {json.dumps(styled_schema(value))}\n"
    )


def _dsml_call_rule(index: int, tool: dict[str, Any]) -> str | None:
    """`call_<i>` as DeepSeek-V3.2 writes a call: the DSML block with one invoke, the
    declared parameters in order (the optional ones optional), or any named parameters
    for a schema of any object; None where the schema needs the JSON form."""
    schema = _parameters(tool)
    properties = _dsml_properties(schema)
    name = _function(tool)["name"]
    if properties is None or not _DSML_SAFE.fullmatch(name):
        return None
    head = f'{DSML_OPEN}\n<{DSML}invoke name="{name}">\n'
    rules, parts = "", []
    if not properties:
        rules += _dsml_parameter(f"dsml_{index}_any", None, ANY_OBJECT)
        parts.append(f"dsml_{index}_any*")
    required = set(schema.get("required", [])) if isinstance(schema, dict) else set()
    for j, (key, sub) in enumerate(properties.items()):
        rules += _dsml_parameter(f"dsml_{index}_{j}", key, sub)
        parts.append(f"dsml_{index}_{j}" + ("" if key in required else "?"))
    tail = f"</{DSML}invoke>\n{DSML_CLOSE}"
    return f"call_{index}: {_lit(head)} {' '.join(parts)} {_lit(tail)}\n{rules}"


_TOKEN_SAFE = re.compile(r"[^\s\"<>]+")  # a name that reads back between special tokens


def _args_rule(index: int, tool: dict[str, Any]) -> str:
    return f"args_{index}: %json {json.dumps(styled_schema(_parameters(tool)))}\n"


def _harmony_call_rule(index: int, tool: dict[str, Any]) -> str | None:
    """`call_<i>` as gpt-oss writes a call (Harmony): a commentary message to the
    function, its JSON arguments constrained; the model's `<|call|>` (a stop token) ends it."""
    name = _function(tool)["name"]
    if not _TOKEN_SAFE.fullmatch(name):
        return None
    header = _lit(f"commentary to=functions.{name} ")
    return (
        f'call_{index}: <|channel|> {header} <|constrain|> "json" <|message|> args_{index}\n'
        + _args_rule(index, tool)
    )


def _deepseek_call_rule(index: int, tool: dict[str, Any], fenced: bool) -> str | None:
    """`call_<i>` between DeepSeek-V3's call tokens: `function<sep>NAME` and the JSON in a
    fence (V3), or `NAME<sep>` and the JSON (V3.1)."""
    name = _function(tool)["name"]
    if not _TOKEN_SAFE.fullmatch(name):
        return None
    if fenced:
        head = f'"function" <｜tool▁sep｜> {_lit(name + chr(10) + "```json" + chr(10))}'
        args = f"args_{index} {_lit(chr(10) + '```')}"
    else:
        head, args = f"{_lit(name)} <｜tool▁sep｜>", f"args_{index}"
    return (
        f"call_{index}: <｜tool▁calls▁begin｜> <｜tool▁call▁begin｜> {head} {args} "
        f"<｜tool▁call▁end｜> <｜tool▁calls▁end｜>\n" + _args_rule(index, tool)
    )


def _own_call_rule(index: int, tool: dict[str, Any], syntax: str) -> str | None:
    if syntax == "dsml":
        return _dsml_call_rule(index, tool)
    if syntax == "harmony":
        return _harmony_call_rule(index, tool)
    if syntax in ("deepseek_v3", "deepseek_v31"):
        return _deepseek_call_rule(index, tool, fenced=syntax == "deepseek_v3")
    return None


def _call_rules(tools: Sequence[dict[str, Any]], features: Features) -> str:
    """A `call_<i>` rule per tool, in the template's own syntax (`Features.call_syntax`)
    where it can state the tool's call, else in the JSON form."""
    rules = []
    for i, tool in enumerate(tools):
        own = _own_call_rule(i, tool, features.call_syntax)
        rules.append(own if own is not None else _call_rule(i, tool))
    return "".join(rules)


def output_grammar(
    answer: dict[str, Any] | bool | None,
    tools: Sequence[dict[str, Any]],
    choice: ToolChoice,
    features: Features = PLAIN,
) -> Grammar | None:
    """The grammar of the whole answer: a forced call (one of `tools`), else the JSON
    `answer` or, with tools on auto, a call instead; None when nothing is constrained.
    `tools` are the callable ones (`callable_tools`), already checked; `features` say
    which call syntax the template has."""
    if choice.forced:
        rules = _call_rules(tools, features)
        start = " | ".join(f"call_{i}" for i in range(len(tools)))
        return Grammar.lark(f"start: {start}\n{rules}", kind="tool_call")
    if answer is None:
        return None
    if not tools or choice.mode == "none":
        return Grammar.json_schema(answer)
    rules = _call_rules(tools, features)
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    answer_rule = f"answer: %json {json.dumps(styled_schema(answer))}\n"
    return Grammar.lark(f"start: answer | {calls}\n{answer_rule}{rules}", kind="json_schema")


def describe_tools(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]
) -> tuple[dict[str, Any], ...]:
    """`messages` with the tools described in the system message, for a chat template
    that cannot show them itself (the call's syntax is the grammar's business)."""
    listed = [
        {
            "name": _function(t)["name"],
            "description": _function(t).get("description", ""),
            "parameters": _parameters(t),
        }
        for t in tools
    ]
    note = (
        "You can call these tools:\n"
        + "\n".join(json.dumps(t, ensure_ascii=False) for t in listed)
        + f'\nCall one by answering {TOOL_OPEN}{{"name": ..., "arguments": {{...}}}}{TOOL_CLOSE}.'
    )
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{note}".lstrip()
    else:
        out.insert(0, {"role": "system", "content": note})
    return tuple(out)
