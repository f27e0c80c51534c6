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

from colibri_protocol.messages import Logprobs

from colibrid.engine.grammar import Grammar
from colibrid.engine.logprobs import MAX_TOP_LOGPROBS
from colibrid.engine.sampling import SamplingParams
from colibrid.errors import ColibriError, RequestError
from colibrid.http import fields
from colibrid.http.errors import ApiError, bad_request
from colibrid.http.fields import refuse_unsupported
from colibrid.http.logprobs import ChatLogprobs, CompletionLogprobs
from colibrid.http.parsing import Features, ToolCall
from colibrid.http.splitter import make_splitter
from colibrid.http.structured import (
    SchemaCheck,
    ToolChoice,
    response_schema,
    schema_checks,
)
from colibrid.http.tools import checked_tools, plan_tools
from colibrid.serve.events import Done
from colibrid.serve.requests import Asked, GenerateRequest

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
    n: int = 1  # choices: n requests sharing the prompt (http.choices)
    # `parallel_tool_calls: false` (Anthropic: `disable_parallel_tool_use`): the first call only
    one_call: bool = False


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


# llama-server's extensions of the OpenAI body (and Ollama's option names): honoured, not
# dropped; `top_k` was accepted before them. Anthropic's Messages API has none of them.
PENALTY_FIELDS = ("frequency_penalty", "presence_penalty", "repeat_penalty", "repeat_last_n")
EXTENSION_FIELDS = (*PENALTY_FIELDS, "min_p")
MAX_CHOICES = 8  # `n`: choices decode together; more would crowd out other clients


def _given(body: dict[str, Any], name: str, default: Any) -> Any:
    """The body's value (checked by `SamplingParams`, the one check of its range for HTTP
    and SERVE alike), or the default when absent or null."""
    value = body.get(name)
    return default if value is None else value


def sampling(
    body: dict[str, Any],
    *,
    max_tokens: int | None,
    max_context: int,
    stop: tuple[str, ...],
    logprobs: int | None = None,
    extensions: bool = True,
) -> SamplingParams:
    """OpenAI defaults: temperature 1, top_p 1, penalties 0; no max_tokens means up to
    the context. `extensions`: the body may carry llama-server's `repeat_penalty`,
    `repeat_last_n` and `min_p` beside OpenAI's penalties (False for Anthropic, which
    refuses every one of them by name).

    `seed` and the penalties are passed as given: `SamplingParams` is the one check of
    their range for HTTP and SERVE alike, so the two cannot drift apart."""
    if not extensions:
        extra = next((f for f in EXTENSION_FIELDS if body.get(f) is not None), None)
        if extra is not None:
            raise bad_request(f"`{extra}` is not a field of this API", extra)
    try:
        return SamplingParams(
            max_tokens=max_tokens or max_context,
            temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_num(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,
            top_k=_int(body, "top_k", low=0) or 0,
            seed=body.get("seed"),
            stop=stop,
            frequency_penalty=_given(body, "frequency_penalty", 0.0),
            presence_penalty=_given(body, "presence_penalty", 0.0),
            repeat_penalty=_given(body, "repeat_penalty", 1.0),
            repeat_last_n=_given(body, "repeat_last_n", 64),
            min_p=_given(body, "min_p", 0.0),
            logprobs=logprobs,
        )
    except RequestError as exc:
        name = str(exc).split(" ", 1)[0]  # SamplingParams' messages start with the field
        raise bad_request(str(exc), name if name in body else None) from None


def _common(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise bad_request(
            "`stream_options` needs `stream: true` and must be an object", "stream_options"
        )
    return stream, bool((options or {}).get("include_usage"))


def choices(body: dict[str, Any]) -> int:
    """`n`: how many choices (1 to MAX_CHOICES), each a request of its own sharing the
    prompt and decoded in the same passes."""
    n = body.get("n")
    if n is None:
        return 1
    if type(n) is not int or not 1 <= n <= MAX_CHOICES:  # `true == 1` in Python; not in JSON
        raise bad_request(f"`n` must be an integer in [1, {MAX_CHOICES}]", "n")
    return n


def chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's `logprobs` (a boolean) and `top_logprobs` (0-20, needs `logprobs: true`) as
    the alternatives reported per token (None: no logprobs)."""
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise bad_request("`logprobs` must be a boolean", "logprobs")
    top = body.get("top_logprobs")
    if top is None:
        return 0 if on else None
    if type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request(
            f"`top_logprobs` must be an integer in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs"
        )
    if not on:
        raise bad_request("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    return top


def completion_logprobs(body: dict[str, Any]) -> int | None:
    """Completions' `logprobs`: the alternatives per token, 0-20 (OpenAI stops at 5)."""
    k = body.get("logprobs")
    if k is None:
        return None
    if type(k) is not int or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise bad_request(f"`logprobs` must be an integer in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
    return k


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


def flag(body: dict[str, Any], name: str, default: bool) -> bool:
    """A boolean field (absent or null: `default`); a 400 naming it otherwise."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"`{name}` must be a boolean", name)
    return value


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
    """The request's tools (None when there are none or they are off) and its choice;
    every choice works on every chat template (http.tools)."""
    tools, choice = checked_tools(body.get("tools")), tool_choice(body.get("tool_choice"))
    if tools is None or choice.mode == "none":
        if choice.forced:
            raise bad_request("`tool_choice` names tools but `tools` is empty", "tool_choice")
        return None, choice
    return tools, choice


def chat_plan(body: Any, *, served: str, client: int, max_context: int, features: Features) -> Plan:
    body = _obj(body)
    model = check_model(body, served)
    refuse_unsupported(body, fields.CHAT)
    stream, include_usage = _common(body)
    messages = chat_messages(body.get("messages"))
    tools, choice = chat_tools(body, features)
    answer = response_schema(body.get("response_format"))
    shaped = plan_tools(messages, tools, choice, features, answer=answer)
    max_tokens = _int(body, "max_completion_tokens")
    max_tokens = max_tokens if max_tokens is not None else _int(body, "max_tokens")
    params = sampling(
        body,
        max_tokens=max_tokens,
        max_context=max_context,
        stop=_stop(body.get("stop")),
        logprobs=chat_logprobs(body),
    )
    request = GenerateRequest(
        id=new_id("chatcmpl"),
        client=client,
        params=params,
        messages=shaped.messages,
        tools=shaped.tools,
        keep_alive=keep_alive(body),
        grammar=shaped.grammar,
        asked=shaped.asked,
    )
    return Plan(
        request,
        model,
        stream,
        include_usage,
        max_tokens,
        replace(features, tools=tools is not None),
        shaped.checks,
        choices(body),
        one_call=not flag(body, "parallel_tool_calls", True),
    )


def completion_plan(body: Any, *, served: str, client: int, max_context: int) -> Plan:
    body = _obj(body)
    model = check_model(body, served)
    refuse_unsupported(body, fields.COMPLETIONS)
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
        logprobs=completion_logprobs(body),
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
        asked=None if answer is None else Asked(schema=answer),
    )
    return Plan(request, model, stream, include_usage, max_tokens, checks=checks, n=choices(body))


def finish_reason(done: Done, calls: list[ToolCall]) -> str:
    if calls:
        return "tool_calls"
    return "length" if done.finish == "length" else "stop"


def ended(done: Done, calls: list[ToolCall]) -> dict[str, Any]:
    """A last choice's ending: `finish_reason`, and vLLM's `stop_reason` (the stop string
    that ended the answer, null when none did), which OpenAI has no field for; another
    colibrid reads it when this one is its remote model (remote.chunks)."""
    return {"finish_reason": finish_reason(done, calls), "stop_reason": done.stop_string}


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
        self.index = 0  # the choice's (http.choices sets it for `n` > 1)
        on = plan.request.params.logprobs is not None
        self.logprobs = ChatLogprobs() if on else None

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        lp = None if self.logprobs is None else self.logprobs.pending()
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.plan.model,
            "system_fingerprint": None,
            "choices": [
                {"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            ],
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

    def token(self, text: str, logprobs: Logprobs | None = None) -> list[dict[str, Any]]:
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.add(logprobs)
        return self._pieces(self.splitter.feed(text)) if text else []

    def _call_deltas(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """One call as OpenAI streams it: index, id, type and name with empty arguments
        first, then the arguments (what the SDKs' accumulators expect)."""
        fn = call["function"]
        head = {**call, "function": {"name": fn["name"], "arguments": ""}}
        rest = {"index": call["index"], "function": {"arguments": fn["arguments"]}}
        return [self._chunk({"tool_calls": [head]}), self._chunk({"tool_calls": [rest]})]

    def finish(self, done: Done) -> list[dict[str, Any]]:
        pieces, self.calls = self.splitter.finish(whole=whole(self.plan, done))
        self.calls = self.calls[:1] if self.plan.one_call else self.calls
        out = self._pieces(pieces)
        for call in tool_calls_json(self.calls, stream=True):
            out += self._call_deltas(call)
        end = self._chunk({})
        end["choices"][0].update(ended(done, self.calls))
        out.append(end)
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
                    "index": self.index,
                    "message": message,
                    "logprobs": None if self.logprobs is None else self.logprobs.whole(),
                    **ended(done, self.calls),
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
        self.index = 0  # the choice's (http.choices sets it for `n` > 1)
        on = plan.request.params.logprobs is not None
        self.logprobs = CompletionLogprobs() if on else None

    def _chunk(
        self, text: str, finish: str | None = None, lp: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        choice = {"index": self.index, "text": text, "logprobs": lp, "finish_reason": finish}
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.plan.model,
            "system_fingerprint": None,
            "choices": [choice],
        }

    def start(self) -> list[dict[str, Any]]:
        return []

    def token(self, text: str, logprobs: Logprobs | None = None) -> list[dict[str, Any]]:
        self.text.append(text)
        if logprobs is None or self.logprobs is None:
            return [self._chunk(text)]
        self.logprobs.add(logprobs)
        return [self._chunk(text, lp=self.logprobs.pending())]

    def finish(self, done: Done) -> list[dict[str, Any]]:
        end = self._chunk("")
        end["choices"][0].update(ended(done, []))
        out = [end]
        if self.plan.include_usage:
            out.append({**self._chunk(""), "choices": [], "usage": usage(done)})
        return out

    def response(self, done: Done) -> dict[str, Any]:
        lp = None if self.logprobs is None else self.logprobs.whole()
        body = self._chunk("".join(self.text), lp=lp)
        body["choices"][0].update(ended(done, []))
        return {**body, "usage": usage(done)}


def models_list(names: list[str], created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(name, created) for name in names]}


def model_card(served: str, created: int) -> dict[str, Any]:
    return {"id": served, "object": "model", "created": created, "owned_by": "colibri"}
