"""The tool-call syntaxes a forced call's grammar writes: one Lark rule `call_<i>` per tool.

A model answers best in the call syntax its chat template taught it, so a forced call is
written in the template's own where a grammar can state it (`Features.call_syntax`):
DeepSeek-V3.2's DSML block (plain text: one parameter element per argument, for a
schema that is an object of named properties), gpt-oss's Harmony commentary message and
DeepSeek-V3/V3.1's call tokens (special tokens, named as tokens in the grammar, so only
where the tokenizer has them); every other template, and a schema DSML cannot state,
gets ``<tool_call>{"name": "NAME", "arguments": {...}}</tool_call>``. The arguments are
held to the tool's `parameters` schema (``%json{...}``) in every syntax, and
`http.parsing` reads each back into the same call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from colibrid.engine.grammar import styled_schema
from colibrid.http.parsing import DSML, DSML_CLOSE, DSML_OPEN, TOOL_OPEN, Features

TOOL_CLOSE = "</tool_call>"
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    """A template tool's function object (OpenAI's shape: what both APIs are turned into)."""
    return tool["function"]


def parameters_of(tool: dict[str, Any]) -> Any:
    """A tool's `parameters` schema; none (or {}) is any object."""
    params = function_of(tool).get("parameters")
    return ANY_OBJECT if params is None or params == {} else params


def _call_rule(index: int, tool: dict[str, Any], opened: bool = False) -> str:
    """`call_<i>: "<tool_call>{"name": NAME, "arguments": " args_<i> "}</tool_call>"`;
    `opened`: `body_<i>`, the same after its opener (the newlines Hermes-style templates
    put around the JSON allowed)."""
    name = json.dumps(function_of(tool)["name"], ensure_ascii=False)
    head = f'{{"name": {name}, "arguments": '
    if opened:
        return (
            f'body_{index}: "\\n"? {json.dumps(head, ensure_ascii=False)} args_{index} "}}" '
            f'"\\n"? {json.dumps(TOOL_CLOSE)}\n' + _args_rule(index, tool)
        )
    return (
        f"call_{index}: {json.dumps(TOOL_OPEN + head, ensure_ascii=False)} args_{index} "
        f"{json.dumps('}' + TOOL_CLOSE)}\n" + _args_rule(index, tool)
    )


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


def _dsml_call_rule(index: int, tool: dict[str, Any], opened: bool = False) -> str | None:
    """`call_<i>` as DeepSeek-V3.2 writes a call: the DSML block with one invoke, the
    declared parameters in order (the optional ones optional), or any named parameters
    for a schema of any object; None where the schema needs the JSON form."""
    schema = parameters_of(tool)
    properties = _dsml_properties(schema)
    name = function_of(tool)["name"]
    if properties is None or not _DSML_SAFE.fullmatch(name):
        return None
    head = f'{"" if opened else DSML_OPEN}\n<{DSML}invoke name="{name}">\n'
    rules, parts = "", []
    if not properties:
        rules += _dsml_parameter(f"dsml_{index}_any", None, ANY_OBJECT)
        parts.append(f"dsml_{index}_any*")
    required = set(schema.get("required", [])) if isinstance(schema, dict) else set()
    for j, (key, sub) in enumerate(properties.items()):
        rules += _dsml_parameter(f"dsml_{index}_{j}", key, sub)
        parts.append(f"dsml_{index}_{j}" + ("" if key in required else "?"))
    tail = f"</{DSML}invoke>\n{DSML_CLOSE}"
    rule = f"body_{index}" if opened else f"call_{index}"
    return f"{rule}: {_lit(head)} {' '.join(parts)} {_lit(tail)}\n{rules}"


_TOKEN_SAFE = re.compile(r"[^\s\"<>]+")  # a name that reads back between special tokens


def _args_rule(index: int, tool: dict[str, Any]) -> str:
    return f"args_{index}: %json {json.dumps(styled_schema(parameters_of(tool)))}\n"


def _harmony_call_rule(index: int, tool: dict[str, Any]) -> str | None:
    """`call_<i>` as gpt-oss writes a call (Harmony): a commentary message to the
    function, its JSON arguments constrained; the model's `<|call|>` (a stop token) ends it."""
    name = function_of(tool)["name"]
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
    name = function_of(tool)["name"]
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


def call_rules(tools: Sequence[dict[str, Any]], features: Features) -> str:
    """A `call_<i>` rule per tool, in the template's own syntax (`Features.call_syntax`)
    where it can state the tool's call, else in the JSON form."""
    rules = []
    for i, tool in enumerate(tools):
        own = _own_call_rule(i, tool, features.call_syntax)
        rules.append(own if own is not None else _call_rule(i, tool))
    return "".join(rules)


def opened_call_rules(
    tools: Sequence[dict[str, Any]], features: Features
) -> tuple[str, list[str | None]]:
    """For tools on ``auto`` (http.tools): per tool, `call_<i>` as `call_rules` writes it
    and the text that opens it (None where a special token does), and for a text opener
    also `body_<i>`, the call after its opener. A free answer ends at its first opener,
    so the grammar needs the rest of a call as its own rule."""
    rules, openers = [], []
    for i, tool in enumerate(tools):
        own = _own_call_rule(i, tool, features.call_syntax)
        if own is not None and features.call_syntax != "dsml":  # opened by a special token
            rules.append(own)
            openers.append(None)
            continue
        opener = DSML_OPEN if own is not None else TOOL_OPEN
        body = _dsml_call_rule(i, tool, opened=True) if own is not None else None
        rules.append(body or _call_rule(i, tool, opened=True))
        rules.append(f"call_{i}: {_lit(opener)} body_{i}\n")
        openers.append(opener)
    return "".join(rules), openers
