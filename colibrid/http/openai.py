"""Pure translators between OpenAI JSON and the scheduler's types.

`chat_plan` / `completion_plan` turn a request body into a `Plan` (a `GenerateRequest`
plus what the response needs); `ChatStream` / `CompletionStream` turn the scheduler's
events into response objects (chunks when streaming, one object otherwise). No I/O.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from colibrid.engine.grammar import Grammar
from colibrid.engine.sampling import SamplingParams
from colibrid.errors import ColibriError, RequestError
from colibrid.http.errors import ApiError, bad_request
from colibrid.http.parsing import Features, ToolCall
from colibrid.http.splitter import make_splitter
from colibrid.http.structured import (
    SchemaCheck,
    ToolChoice,
    callable_tools,
    describe_tools,
    output_grammar,
    response_schema,
    schema_checks,
)
from colibrid.serve.events import Done
from colibrid.serve.requests import GenerateRequest

ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass(frozen=True)
class Plan:
    request: GenerateRequest
    model: str
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None  # as the client asked (None: up to the context)
    features: Features = field(default_factory=Features)
    # the client's schemas, compiled one by one before the request's grammar (a 400 names one)
    checks: tuple[SchemaCheck, ...] = ()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _obj(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def known_model(model: str, installed: list[str]) -> str:
    """`model` when it is installed, else a 404 naming what is."""
    if model not in installed:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; installed: {', '.join(installed) or 'none'} "
            "(`colibri list`, `colibri pull`)",
            code="model_not_found",
            param="model",
        )
    return model


def check_model(body: Any, installed: str | list[str]) -> str:
    """The body's `model`: required, and one of `installed` (or the one given)."""
    body = _obj(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required (a string)", "model")
    return known_model(model, [installed] if isinstance(installed, str) else installed)


def keep_alive(body: dict[str, Any]) -> float | None:
    """Ollama's `keep_alive`: seconds, or a duration ("5m"); negative keeps the model."""
    value = body.get("keep_alive")
    if value is None:
        return None
    from colibrid.serve.models import parse_keep_alive

    try:
        return parse_keep_alive(value)
    except ColibriError as exc:
        raise bad_request(str(exc), "keep_alive") from None


def _int(body: dict[str, Any], name: str, *, low: int = 1) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise bad_request(f"`{name}` must be an integer >= {low}", name)
    return value


def _num(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise bad_request(f"`{name}` must be a number in [{low:g}, {high:g}]", name)
    return float(value)


def _stop(value: Any, name: str = "stop") -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if (
        not isinstance(items, list)
        or not all(isinstance(s, str) and s for s in items)
        or len(items) > 16
    ):
        raise bad_request(f"`{name}` must be a non-empty string or a list of up to 16", name)
    return tuple(items)


def sampling(
    body: dict[str, Any], *, max_tokens: int | None, max_context: int, stop: tuple[str, ...]
) -> SamplingParams:
    """OpenAI defaults: temperature 1, top_p 1; no max_tokens means up to the context.

    `seed` is passed as given: `SamplingParams` is the one check of its range ([0, 2**64),
    an int, not a bool) for HTTP and SERVE alike, so the two cannot drift apart."""
    try:
        return SamplingParams(
            max_tokens=max_tokens or max_context,
            temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_num(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,
            top_k=_int(body, "top_k", low=0) or 0,
            seed=body.get("seed"),
            stop=stop,
        )
    except RequestError as exc:
        name = str(exc).split(" ", 1)[0]  # SamplingParams' messages start with the field
        raise bad_request(str(exc), name if name in body else None) from None


def _common(body: dict[str, Any]) -> tuple[bool, bool]:
    n = body.get("n", 1)
    if type(n) is not int or n != 1:  # `true == 1` in Python; not in JSON
        raise bad_request("only `n` = 1 is supported (one choice per request)", "n")
    if body.get("logprobs") not in (None, False, 0):
        raise bad_request("`logprobs` is not supported", "logprobs")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise bad_request(
            "`stream_options` needs `stream: true` and must be an object", "stream_options"
        )
    return stream, bool((options or {}).get("include_usage"))


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad_request(f"{where}: only text content parts are supported", where)
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where}: content must be a string or a list of text parts", where)


def _template_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{where}: a tool call needs function.name", where)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise bad_request(f"{where}: function.arguments is not valid JSON", where) from None
    return {
        "type": "function",
        "id": call.get("id"),
        "function": {"name": fn["name"], "arguments": args},
    }


def chat_messages(messages: Any) -> tuple[dict[str, Any], ...]:
    """OpenAI messages as the chat template expects them (text only)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad_request(f"{where}: role must be one of {sorted(ROLES)}", where)
        role = "system" if message["role"] == "developer" else message["role"]
        calls = (message.get("tool_calls") or []) if role == "assistant" else []
        if message.get("content") is None and not calls:
            raise bad_request(
                f"{where}: `content` is required (a string or a list of text parts; only "
                "an assistant message with tool_calls may leave it null)",
                where,
            )
        msg: dict[str, Any] = {"role": role, "content": _text(message.get("content"), where)}
        if role == "assistant":
            if not isinstance(calls, list):
                raise bad_request(f"{where}: tool_calls must be a list", where)
            if calls:
                msg["tool_calls"] = [_template_call(c, where) for c in calls]
            reasoning = message.get("reasoning_content")
            if isinstance(reasoning, str):
                msg["reasoning_content"] = reasoning
        if role == "tool" and isinstance(message.get("tool_call_id"), str):
            msg["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            msg["name"] = message["name"]
        out.append(msg)
    return tuple(out)


def tool_choice(value: Any) -> ToolChoice:
    """OpenAI's `tool_choice` checked for shape: "none" | "auto" | "required" or
    ``{"type": "function", "function": {"name": str}}`` (a call of that one, required)."""
    if value is None:
        return ToolChoice()
    if isinstance(value, str) and value in ("none", "auto", "required"):
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return ToolChoice("required", fn["name"])
    raise bad_request(
        '`tool_choice` must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def chat_tools(
    body: dict[str, Any], features: Features
) -> tuple[tuple[dict[str, Any], ...] | None, ToolChoice]:
    """The request's tools (None when there are none or they are off) and its choice. A
    forced call works on any chat template (structured.describe_tools); "auto" needs a
    template that shows tools, so that the model knows their syntax."""
    tools, choice = body.get("tools"), tool_choice(body.get("tool_choice"))
    if tools is None or tools == [] or choice.mode == "none":
        if choice.forced:
            raise bad_request("`tool_choice` names tools but `tools` is empty", "tool_choice")
        return None, choice
    if not isinstance(tools, list) or not all(
        isinstance(t, dict)
        and t.get("type") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise bad_request(
            "`tools` must be a list of {type: function, function: {name, ...}}", "tools"
        )
    if not features.tools and not choice.forced:
        raise bad_request(
            "this model's chat template does not support tools (a forced call, "
            '`tool_choice` "required" or a named function, works without)',
            "tools",
        )
    return tuple(tools), choice


def shaped(
    messages: tuple[dict[str, Any], ...],
    tools: tuple[dict[str, Any], ...] | None,
    choice: ToolChoice,
    answer: dict[str, Any] | bool | None,
    features: Features,
    *,
    param: str = "tools",
) -> tuple[
    tuple[dict[str, Any], ...],
    tuple[dict[str, Any], ...] | None,
    Grammar | None,
    tuple[SchemaCheck, ...],
]:
    """The messages, the tools for the chat template, the grammar of a request with
    tools and/or a JSON answer (structured.py) and the client's schemas in it: a
    template that cannot show tools gets them in a system note when a call is forced."""
    if tools is None:
        checks = schema_checks(answer, (), (), param)  # first: a 400 naming the field
        return messages, None, output_grammar(answer, (), choice), checks
    if not choice.forced and answer is None:  # the model decides, unconstrained
        return messages, tools, None, ()
    callable_ = callable_tools(tools, choice, param)
    checks = schema_checks(answer, tools, callable_, param)  # first: a 400 naming the field
    grammar = output_grammar(answer, callable_, choice, features)
    if features.tools:
        return messages, tools, grammar, checks
    return describe_tools(messages, callable_), None, grammar, checks


def chat_plan(body: Any, *, served: str, client: int, max_context: int, features: Features) -> Plan:
    body = _obj(body)
    model = check_model(body, served)
    stream, include_usage = _common(body)
    messages = chat_messages(body.get("messages"))
    tools, choice = chat_tools(body, features)
    answer = response_schema(body.get("response_format"))
    messages, template_tools, grammar, checks = shaped(messages, tools, choice, answer, features)
    max_tokens = _int(body, "max_completion_tokens")
    max_tokens = max_tokens if max_tokens is not None else _int(body, "max_tokens")
    params = sampling(
        body, max_tokens=max_tokens, max_context=max_context, stop=_stop(body.get("stop"))
    )
    request = GenerateRequest(
        id=new_id("chatcmpl"),
        client=client,
        params=params,
        messages=messages,
        tools=template_tools,
        keep_alive=keep_alive(body),
        grammar=grammar,
    )
    return Plan(
        request,
        model,
        stream,
        include_usage,
        max_tokens,
        replace(features, tools=tools is not None),
        checks,
    )


def completion_plan(body: Any, *, served: str, client: int, max_context: int) -> Plan:
    body = _obj(body)
    model = check_model(body, served)
    stream, include_usage = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request("`prompt` must be a string (or a list of one string)", "prompt")
    for name in ("echo", "suffix"):
        if body.get(name):
            raise bad_request(f"`{name}` is not supported", name)
    best_of = body.get("best_of", 1)
    if type(best_of) is not int or best_of != 1:
        raise bad_request("only `best_of` = 1 is supported", "best_of")
    max_tokens = _int(body, "max_tokens")
    params = sampling(
        body,
        max_tokens=max_tokens if max_tokens is not None else 16,
        max_context=max_context,
        stop=_stop(body.get("stop")),
    )
    answer = response_schema(body.get("response_format"))
    checks = schema_checks(answer, (), (), "response_format")  # first: a 400 naming the field
    request = GenerateRequest(
        id=new_id("cmpl"),
        client=client,
        params=params,
        prompt=prompt,
        keep_alive=keep_alive(body),
        grammar=None if answer is None else Grammar.json_schema(answer),
    )
    return Plan(request, model, stream, include_usage, max_tokens, checks=checks)


def finish_reason(done: Done, calls: list[ToolCall]) -> str:
    if calls:
        return "tool_calls"
    return "length" if done.finish == "length" else "stop"


def whole(plan: Plan, done: Done) -> bool:
    """Whether the answer may be read as finished: a constrained one cut by the length
    limit is not (its grammar never completed), so no tool call is made of it."""
    return plan.request.grammar is None or done.finish != "length"


def usage(done: Done) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.generated_tokens,
        "total_tokens": done.prompt_tokens + done.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def tool_calls_json(calls: list[ToolCall], *, stream: bool = False) -> list[dict[str, Any]]:
    out = []
    for i, call in enumerate(calls):
        item = {
            "id": new_id("call"),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json},
        }
        out.append({"index": i, **item} if stream else item)
    return out


class ChatStream:
    """The events of one chat request as OpenAI objects; `chunks` when streaming,
    `response` (after every piece was fed) otherwise."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.id = plan.request.id
        self.created = int(time.time())
        self.splitter = make_splitter(plan.features)
        self.reasoning: list[str] = []
        self.content: list[str] = []

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.plan.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self.plan.include_usage:
            chunk["usage"] = None
        return chunk

    def start(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def _pieces(self, pieces: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out = []
        for kind, text in pieces:
            (self.reasoning if kind == "reasoning" else self.content).append(text)
            key = "reasoning_content" if kind == "reasoning" else "content"
            out.append(self._chunk({key: text}))
        return out

    def token(self, text: str) -> list[dict[str, Any]]:
        return self._pieces(self.splitter.feed(text))

    def finish(self, done: Done) -> list[dict[str, Any]]:
        pieces, self.calls = self.splitter.finish(whole=whole(self.plan, done))
        out = self._pieces(pieces)
        if self.calls:
            out.append(self._chunk({"tool_calls": tool_calls_json(self.calls, stream=True)}))
        out.append(self._chunk({}, finish_reason(done, self.calls)))
        if self.plan.include_usage:
            out.append({**self._chunk({}), "choices": [], "usage": usage(done)})
        return out

    def response(self, done: Done) -> dict[str, Any]:
        self.finish(done)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self.content) or (None if self.calls else ""),
        }
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = tool_calls_json(self.calls)
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.plan.model,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": finish_reason(done, self.calls),
                }
            ],
            "usage": usage(done),
        }


class CompletionStream:
    """The same for /v1/completions (raw text, no parsing)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.id = plan.request.id
        self.created = int(time.time())
        self.text: list[str] = []

    def _chunk(self, text: str, finish: str | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.plan.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        }

    def start(self) -> list[dict[str, Any]]:
        return []

    def token(self, text: str) -> list[dict[str, Any]]:
        self.text.append(text)
        return [self._chunk(text)]

    def finish(self, done: Done) -> list[dict[str, Any]]:
        out = [self._chunk("", finish_reason(done, []))]
        if self.plan.include_usage:
            out.append({**self._chunk(""), "choices": [], "usage": usage(done)})
        return out

    def response(self, done: Done) -> dict[str, Any]:
        body = self._chunk("".join(self.text), finish_reason(done, []))
        return {**body, "usage": usage(done)}


def models_list(names: list[str], created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(name, created) for name in names]}


def model_card(served: str, created: int) -> dict[str, Any]:
    return {"id": served, "object": "model", "created": created, "owned_by": "colibri"}
