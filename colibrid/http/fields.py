"""Fields of the official request schemas that colibri cannot honour: refused by name, with
one line, instead of dropped (docs/api-fields.md lists every field of every dialect and
tests/http/test_api_fields.py walks that table against the daemon).

A field is refused only when it asks for something: absent, null, or its neutral value
(the one that asks for nothing, e.g. `logit_bias: {}`, `store: false`) is accepted.
"""

from __future__ import annotations

from typing import Any

from colibrid.http.errors import bad_request

# field -> (neutral values, why it is refused)
Refusals = dict[str, tuple[tuple[Any, ...], str]]

CHAT: Refusals = {
    "logit_bias": (({},), "token biases are not supported"),
    "audio": ((), "audio output is not supported (text models)"),
    "modalities": ((["text"],), 'only `["text"]` output is supported'),
    "prediction": ((), "predicted outputs are not supported (speculation is automatic)"),
    "functions": ((), "the deprecated `functions` is not supported: use `tools`"),
    "function_call": ((), "the deprecated `function_call` is not supported: use `tool_choice`"),
    "web_search_options": ((), "web search is not supported"),
    "store": ((False,), "stored chat completions are not supported"),
    "reasoning_effort": ((), "reasoning effort is not supported"),
    "verbosity": ((), "verbosity is not supported"),
    "service_tier": (("auto", "default"), 'only `service_tier` "auto" or "default"'),
}
COMPLETIONS: Refusals = {
    "logit_bias": (({},), "token biases are not supported"),
}
ANTHROPIC: Refusals = {
    "container": ((), "containers are not supported"),
    "context_management": ((), "context management is not supported"),
    "mcp_servers": (([],), "MCP servers are not supported"),
    "thinking": (({"type": "disabled"},), "extended thinking budgets are not supported"),
    "service_tier": (("auto", "standard_only"), 'only `service_tier` "auto" or "standard_only"'),
}


def refuse_unsupported(body: dict[str, Any], refusals: Refusals) -> None:
    """A 400 naming the first field of `refusals` the body sets to something it asks."""
    for name, (neutral, why) in refusals.items():
        value = body.get(name)
        if value is not None and not any(value == n and type(value) is type(n) for n in neutral):
            raise bad_request(f"`{name}`: {why}", name)
