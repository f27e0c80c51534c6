"""A request as the OpenAI body a remote model's endpoint is sent (pure).

Only standard OpenAI fields and the extensions llama-server, vLLM and SGLang share are
written, and only the ones that ask for something (an OpenAI default is left out, so an
endpoint applies its own), so any OpenAI-compatible server takes the body:

* chat messages go to ``/v1/chat/completions`` as messages (the endpoint applies its own
  chat template), a raw prompt to ``/v1/completions``;
* sampling: ``temperature``, ``top_p``, ``seed``, ``stop``, ``max_tokens``,
  ``frequency_penalty``, ``presence_penalty``, ``top_k``, ``min_p``; a repetition penalty
  under both names servers use (llama-server's ``repeat_penalty`` with its
  ``repeat_last_n``, vLLM's and SGLang's ``repetition_penalty``), each server honouring
  the one it knows;
* tools (``tools``, ``tool_choice``) and a JSON answer (``response_format``) as the
  client asked them (`Asked`), or a SERVE grammar that is a JSON schema as
  ``response_format``.

What has no OpenAI field is refused by name (`RequestError`, before anything is sent):
a Lark or regex grammar, logprobs, and colibri's own engine knobs (a usage profile,
speculative decoding). A conversation id (SERVE ``conv=``) and ``keep_alive`` ask nothing
of a remote model and are accepted: the whole conversation is sent each turn (the
endpoint's own prompt cache reuses its prefix), and nothing is loaded here to keep.
"""

from __future__ import annotations

import json
from typing import Any

from colibrid.errors import RequestError
from colibrid.remote.spec import RemoteSpec
from colibrid.serve.requests import Asked, GenerateRequest

# The context a request for a remote model is planned with: the endpoint's own is not
# known here, so a request that names no max_tokens is sent with none (the endpoint
# generates up to its context, as it would for any client).
OPEN_CONTEXT = 1 << 30
CHAT_ROUTE, COMPLETION_ROUTE = "chat/completions", "completions"
ANY_OBJECT = {"type": "object"}


def remote_call(request: GenerateRequest, spec: RemoteSpec) -> tuple[str, dict[str, Any]]:
    """(route, body) for `request` on `spec`'s endpoint; RequestError naming the field for
    what cannot be forwarded."""
    refuse_engine_knobs(request, spec)
    body: dict[str, Any] = {"model": spec.model, **sampling(request)}
    if request.messages is not None:
        body["messages"] = [wire_message(m, i) for i, m in enumerate(request.messages)]
        body.update(answer_fields(request))
        route = CHAT_ROUTE
    else:
        body["prompt"] = request.prompt or ""
        body.update(answer_fields(request, chat=False))
        route = COMPLETION_ROUTE
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    return route, body


def refuse_engine_knobs(request: GenerateRequest, spec: RemoteSpec) -> None:
    """What only colibri's own engine has: refused by name for a remote model."""
    who = f"the remote model {spec.name}"
    if request.params.logprobs is not None:
        raise RequestError(f"logprobs: not available from {who} (colibri forwards text only)")
    if request.profile is not None:
        raise RequestError(f"profile: usage profiles place colibri's own experts; {who} has none")
    if request.speculate is not None or request.draft_max is not None:
        raise RequestError(f"speculate/draft_max: {who} decodes on its own engine")


def sampling(request: GenerateRequest) -> dict[str, Any]:
    """The sampling fields that ask for something (see the module doc)."""
    p = request.params
    out: dict[str, Any] = {"temperature": p.temperature}
    if p.top_p < 1.0:
        out["top_p"] = p.top_p
    if p.top_k > 0:
        out["top_k"] = p.top_k
    if p.min_p > 0:
        out["min_p"] = p.min_p
    if p.seed is not None:
        out["seed"] = p.seed
    if p.stop:
        out["stop"] = list(p.stop)
    if p.max_tokens < OPEN_CONTEXT:
        out["max_tokens"] = p.max_tokens
    if p.frequency_penalty:
        out["frequency_penalty"] = p.frequency_penalty
    if p.presence_penalty:
        out["presence_penalty"] = p.presence_penalty
    if p.repeat_penalty != 1.0:
        out["repeat_penalty"] = out["repetition_penalty"] = p.repeat_penalty
        out["repeat_last_n"] = p.repeat_last_n
    return out


def answer_fields(request: GenerateRequest, *, chat: bool = True) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``response_format``: as the HTTP client asked them,
    or from a SERVE grammar (a JSON schema only)."""
    asked = request.asked
    if asked is None and request.grammar is not None:
        grammar = request.grammar
        if grammar.form != "json_schema":
            raise RequestError(
                f"grammar: a {grammar.form} grammar cannot be sent to a remote model (the "
                "OpenAI API it speaks takes a JSON schema only)"
            )
        asked = Asked(schema=json.loads(grammar.text))
    out: dict[str, Any] = {}
    if asked is None:
        return out
    if chat and request.tools:
        out["tools"] = list(request.tools)
        if asked.tool_choice != "auto":
            out["tool_choice"] = asked.tool_choice
    if asked.schema is not None:
        out["response_format"] = response_format(asked.schema)
    return out


def response_format(schema: dict[str, Any] | bool) -> dict[str, Any]:
    """OpenAI's ``response_format`` for a JSON answer following `schema`."""
    if schema == ANY_OBJECT or schema is True:
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def wire_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A chat-template message as OpenAI's wire form: a call's arguments are a JSON
    string there (an object here) and every call has an id."""
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    wire = []
    for k, call in enumerate(calls):
        fn = call.get("function") or {}
        arguments = fn.get("arguments", {})
        wire.append(
            {
                "id": call.get("id") or f"call_{index}_{k}",
                "type": "function",
                "function": {
                    "name": fn.get("name", ""),
                    "arguments": arguments
                    if isinstance(arguments, str)
                    else json.dumps(arguments, ensure_ascii=False),
                },
            }
        )
    return {**message, "tool_calls": wire}
