"""Structured output over HTTP: `response_format` and forced tool calls as one grammar.

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) and a
``tool_choice`` that forces a call (OpenAI ``"required"`` or a named function, Anthropic
``any`` or a named tool) become one `Grammar` the engine masks every token with, so the
answer parses by construction:

* a JSON answer is the schema's JSON and nothing else;
* a forced call is written in a tool-call syntax `parsing` reads back, the template's own
  where a grammar can write it, with the arguments constrained by that tool's
  `parameters` schema (`call_grammar`);
* with tools on ``auto`` and a JSON answer asked for, either one is allowed.

A model whose chat template cannot show tools is told about them in a system note
(`http.tools`, which also holds tools on ``auto`` to a grammar of free text or a
well-formed call). Every schema is checked for shape and
size here, and `schema_checks` lists each one the client gave with the field it came in,
so that the grammar service compiles it by itself first and a bad one is a 400 naming its
field before any token is generated.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from colibrid.engine.grammar import Grammar, styled_schema
from colibrid.errors import RequestError
from colibrid.http.call_grammar import (
    ANY_OBJECT,
    call_rules,
    function_of,
    parameters_of,
)
from colibrid.http.errors import bad_request
from colibrid.http.parsing import Features

PLAIN = Features()  # a template whose call syntax is not known: the JSON form


@dataclass(frozen=True)
class SchemaCheck:
    """A schema the client gave, to compile by itself (`where` and `param` name it in a
    400) before the grammar that holds it."""

    grammar: Grammar
    where: str
    param: str


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
        return schema
    raise bad_request(
        '`response_format` must be {"type": "text" | "json_object"} or '
        '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
        "response_format",
    )


def _schema_check(schema: Any, where: str, param: str) -> SchemaCheck:
    try:
        return SchemaCheck(Grammar.json_schema(schema), where, param)
    except RequestError as exc:
        raise bad_request(f"{where}: {exc}", param) from None


def schema_checks(
    answer: dict[str, Any] | bool | None,
    tools: Sequence[dict[str, Any]],
    picked: Sequence[dict[str, Any]],
    param: str,
) -> tuple[SchemaCheck, ...]:
    """The response schema and each picked tool's parameters schema, with their fields
    (a schema past the size caps is a 400 naming its field now)."""
    checks = []
    if answer is not None and answer != ANY_OBJECT:
        checks.append(
            _schema_check(answer, "response_format.json_schema.schema", "response_format")
        )
    for i, tool in enumerate(tools):
        if tool in picked and parameters_of(tool) != ANY_OBJECT:
            checks.append(_schema_check(parameters_of(tool), f"tools[{i}] parameters", param))
    return tuple(checks)


def callable_tools(
    tools: Sequence[dict[str, Any]], choice: ToolChoice, param: str
) -> list[dict[str, Any]]:
    """The tools a call may name under `choice` (a named one must exist)."""
    names = [function_of(t)["name"] for t in tools]
    if choice.name is not None and choice.name not in names:
        raise bad_request(
            f"`tool_choice` names {choice.name!r}, which is not among `tools` ({', '.join(names)})",
            "tool_choice",
        )
    return [t for t in tools if choice.name is None or function_of(t)["name"] == choice.name]


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
        rules = call_rules(tools, features)
        start = " | ".join(f"call_{i}" for i in range(len(tools)))
        return Grammar.lark(f"start: {start}\n{rules}", kind="tool_call")
    if answer is None:
        return None
    if not tools or choice.mode == "none":
        return Grammar.json_schema(answer)
    rules = call_rules(tools, features)
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    answer_rule = f"answer: %json {json.dumps(styled_schema(answer))}\n"
    return Grammar.lark(f"start: answer | {calls}\n{answer_rule}{rules}", kind="json_schema")
