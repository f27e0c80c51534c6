"""Tools in the prompt and calls out of the text, for every HTTP dialect.

One idea: a request that declares tools (OpenAI chat, Anthropic Messages, Ollama chat,
OpenAI Responses) becomes the chat template's messages, the tools the template shows,
and the grammar the answer is held to; the answer is read back into calls by the output
splitter (`http.splitter.make_splitter(plan.features)`, whose `finish()` returns
`parsing.ToolCall`s). The translators only convert their dialect's shapes into the
ones here and back.

API (stable; every translator uses it, none keeps a copy):

* `checked_tools(value, param)` — OpenAI-shaped tools checked, None when there are none;
  `function_tool(name, description, parameters)` builds one (Anthropic's `input_schema`,
  Ollama's and Responses' tools convert through it).
* `call_message(content, calls)` and `tool_message(content, call_id, name)` — an assistant
  turn carrying calls (`template_call(name, arguments, call_id)` each) and a tool
  result, in the shapes Hugging Face chat templates read.
* `plan_tools(messages, tools, choice, features, answer=..., param=...)` -> `ToolPlan`:
  the prompt side and the grammar; `ToolPlan.features` is what the splitter needs.

Prompt side. A template that renders `tools` (Features.tools) gets them as they are and
the conversation's calls and results in its own way. A template that cannot show tools
(the demo's) gets them described in a system note that teaches the
``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` form, and the history rendered
readably in that same form: an assistant call as that text, a tool result as a user turn
``<tool_response>…</tool_response>`` (Qwen2.5's convention; a user turn, because many
plain templates refuse a `tool` role).

Output side. A forced call is a grammar that allows only a call (`structured`). On
``auto`` the answer is held to a grammar too, wherever the call syntax is one a grammar
writes: free text that never contains a call's opener, or free text up to the first
opener and then a whole, well-formed call (arguments valid for the tool's schema) and
possibly more calls. So a small model that starts a call always finishes a parseable one,
and one that does not is untouched (plain text is every text without an opener). Where
the template's own syntax is not one `call_grammar` writes (gpt-oss's Harmony channels,
GLM's ``<arg_key>`` calls, templates in unknown syntaxes) the answer is left free and the
splitter reads what the model writes, rather than pushing it into a syntax it was not
trained on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from colibrid.engine.grammar import Grammar
from colibrid.http.call_grammar import (
    TOOL_CLOSE,
    function_of,
    opened_call_rules,
    parameters_of,
)
from colibrid.http.errors import bad_request
from colibrid.http.parsing import TOOL_OPEN, Features
from colibrid.http.structured import (
    SchemaCheck,
    ToolChoice,
    callable_tools,
    output_grammar,
    schema_checks,
)
from colibrid.serve.requests import Asked

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
# Syntaxes `call_grammar` writes exactly as the template taught them (Features.call_syntax).
_GRAMMAR_SYNTAXES = frozenset({"dsml", "deepseek_v3", "deepseek_v31"})


@dataclass(frozen=True)
class ToolPlan:
    """What a request with tools becomes: the template's `messages` and the `tools` it
    shows (None: not shown by it), the answer's `grammar` (None: free), the client's
    schemas to compile first (`checks`, a 400 naming their field) and the `features`
    the output splitter reads the answer with (tools on: calls are parsed)."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    grammar: Grammar | None
    checks: tuple[SchemaCheck, ...]
    features: Features
    # the same in OpenAI's terms, for a remote model (serve.requests.Asked)
    asked: Asked = Asked()


# ---- the shapes every dialect converts into ------------------------------------------------
def function_tool(name: str, description: str = "", parameters: Any = None) -> dict[str, Any]:
    """One tool as chat templates and `plan_tools` read it (OpenAI's function shape)."""
    fn: dict[str, Any] = {"name": name, "description": description}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def checked_tools(value: Any, param: str = "tools") -> tuple[dict[str, Any], ...] | None:
    """OpenAI-shaped `tools` checked for shape (a 400 naming `param` otherwise); None for
    none or an empty list."""
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(
        isinstance(t, dict)
        and t.get("type") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        and t["function"]["name"]
        and isinstance(t["function"].get("parameters", {}), (dict, bool))
        for t in value
    ):
        raise bad_request(
            "`tools` must be a list of {type: function, function: {name, description, parameters}}",
            param,
        )
    return tuple(value)


def template_call(name: str, arguments: dict[str, Any], call_id: str | None) -> dict[str, Any]:
    """One call of an assistant turn as chat templates read it (arguments an object)."""
    return {"type": "function", "id": call_id, "function": {"name": name, "arguments": arguments}}


def call_message(content: str, calls: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """An assistant turn with its calls (`template_call` each)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = list(calls)
    return msg


def tool_message(content: str, call_id: str | None, name: str | None = None) -> dict[str, Any]:
    """A tool's result, answering the call `call_id` (of the tool `name`, where known)."""
    msg: dict[str, Any] = {"role": "tool", "content": content}
    if call_id is not None:
        msg["tool_call_id"] = call_id
    if name is not None:
        msg["name"] = name
    return msg


# ---- the prompt side -------------------------------------------------------------------------
def call_text(name: str, arguments: Any) -> str:
    """A call in the form the system note teaches (and the parser reads back)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_OPEN}{body}{TOOL_CLOSE}"


def readable_history(messages: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """The conversation for a template that cannot show tools: an assistant's calls as
    call text after its content, tool results as one user turn per run of results."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.get("role") == "tool":
            result = f"{RESPONSE_OPEN}\n{message.get('content') or ''}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("role") == "user" and out[-1].get("_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_results": True})
            continue
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        msg = {k: v for k, v in message.items() if k != "tool_calls"}
        if calls:
            text = "".join(
                call_text(c["function"]["name"], c["function"].get("arguments", {})) for c in calls
            )
            msg["content"] = "\n".join(t for t in (message.get("content") or "", text) if t)
        out.append(msg)
    return tuple({k: v for k, v in m.items() if k != "_results"} for m in out)


def describe_tools(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], choice: ToolChoice
) -> tuple[dict[str, Any], ...]:
    """`messages` with the tools described in the system message, for a chat template
    that cannot show them itself: what each takes and the exact form of a call (on
    ``auto`` also that a plain answer is fine; the grammar keeps either well-formed)."""
    listed = [
        {
            "name": function_of(t)["name"],
            "description": function_of(t).get("description", ""),
            "parameters": parameters_of(t),
        }
        for t in tools
    ]
    form = f'{TOOL_OPEN}{{"name": ..., "arguments": {{...}}}}{TOOL_CLOSE}'
    how = (
        f"Call one by answering {form}."
        if choice.forced
        else f"To call one, answer with only {form}; results come back in "
        f"{RESPONSE_OPEN}…{RESPONSE_CLOSE}. Otherwise answer in plain text."
    )
    note = (
        "You can call these tools:\n"
        + "\n".join(json.dumps(t, ensure_ascii=False) for t in listed)
        + "\n"
        + how
    )
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{note}".lstrip()
    else:
        out.insert(0, {"role": "system", "content": note})
    return tuple(out)


# ---- the output side -------------------------------------------------------------------------
def _either(texts: Sequence[str]) -> str:
    return "(" + "|".join(re.escape(t) for t in texts) + ")"


def auto_grammar(tools: Sequence[dict[str, Any]], features: Features) -> Grammar | None:
    """Free text without a call opener, or free text up to the first opener and then
    well-formed calls (`tools` are the callable ones, `features` the syntax to write);
    None where the template's own syntax is not one a grammar writes."""
    if features.tools and not (
        features.call_syntax in _GRAMMAR_SYNTAXES
        or (features.call_syntax == "json" and features.json_calls)
    ):
        return None
    rules, openers = opened_call_rules(tools, features)
    texts = sorted({o for o in openers if o is not None})
    any_char = r"(.|\n)"
    plain = f"/{any_char}*/"
    if texts:
        plain += f" & ~/{any_char}*{_either(texts)}{any_char}*/"
    lines = [f"PLAIN: {plain}"]
    starts = ["PLAIN"]
    for k, opener in enumerate(texts):
        mine = [i for i, o in enumerate(openers) if o == opener]
        lines.append(
            f"LEAD_{k}: /{any_char}*{re.escape(opener)}/ & ~/{any_char}*{_either(texts)}"
            f"{any_char}+/"
        )
        lines.append(f"first_{k}: " + " | ".join(f"body_{i}" for i in mine))
        lines.append(f'more_{k}: ("\\n"? (' + " | ".join(f"call_{i}" for i in mine) + "))*")
        starts.append(f"LEAD_{k} first_{k} more_{k}")
    token_opened = [i for i, o in enumerate(openers) if o is None]
    if token_opened:
        starts.append("PLAIN? (" + " | ".join(f"call_{i}" for i in token_opened) + ")")
    head = "start: " + " | ".join(starts) + "\n" + "\n".join(lines) + "\n"
    return Grammar.lark(head + rules, kind="tool_call_auto")


def plan_tools(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
    choice: ToolChoice,
    features: Features,
    *,
    answer: dict[str, Any] | bool | None = None,
    param: str = "tools",
) -> ToolPlan:
    """The prompt and grammar of a request with `tools` (checked: `checked_tools`) under
    `choice`, and/or a JSON `answer` (structured.response_schema); `param` names the
    field a bad schema is a 400 about."""
    if not features.tools:
        messages = readable_history(messages)
    messages = tuple(messages)
    plain = replace(features, tools=False)
    asked = Asked(wire_choice(choice), answer)
    if not tools or choice.mode == "none":
        if choice.forced:
            raise bad_request("`tool_choice` names tools but `tools` is empty", "tool_choice")
        checks = schema_checks(answer, (), (), param)  # first: a 400 naming the field
        grammar = output_grammar(answer, (), choice)
        return ToolPlan(messages, None, grammar, checks, plain, asked)
    callable_ = callable_tools(tools, choice, param)
    checks = schema_checks(answer, tools, callable_, param)  # first: a 400 naming the field
    # a template that cannot show tools is taught the JSON form, whatever else it holds
    syntax = features if features.tools else replace(features, call_syntax="json")
    if choice.forced or answer is not None:
        grammar = output_grammar(answer, callable_, choice, syntax)
    else:
        grammar = auto_grammar(callable_, syntax)
    parsed = replace(features, tools=True)
    if features.tools:
        return ToolPlan(messages, tuple(tools), grammar, checks, parsed, asked)
    described = describe_tools(messages, callable_, choice)
    return ToolPlan(described, None, grammar, checks, parsed, asked)


def wire_choice(choice: ToolChoice) -> str | dict[str, Any]:
    """`choice` as OpenAI's `tool_choice` (what a remote model is sent)."""
    if choice.name is not None:
        return {"type": "function", "function": {"name": choice.name}}
    return choice.mode
