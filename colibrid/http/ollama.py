"""Pure translators for Ollama's native generation API (``/api/chat``, ``/api/generate``).

Requests become the same `Plan` as the OpenAI and Anthropic layers (messages through the
chat template, tools and `format` through `http.tools` and `http.structured`, sampling
through `SamplingParams`); events become Ollama's objects, one a line when streaming
(`ndjson`), or one object. Ollama streams by default: a request that leaves out
`stream` gets lines.

Ollama's own defaults apply where a request leaves an option out (its documented
Modelfile defaults: temperature 0.8, top_k 40, top_p 0.9, repeat_penalty 1.1 over the last
64 tokens), since a client written for Ollama expects them. Every field and option is
either honoured or refused with one line (an Ollama-shaped 400, ``{"error": …}``); an
option at the value that means "off" (``mirostat`` 0, ``typical_p`` 1, ``tfs_z`` 1) is
accepted, since off is what is done. What is not done, and why:

* ``context`` (the token ids of a previous /api/generate): colibri returns none, so none
  comes back; the whole conversation is sent instead and its prefix is reused from the
  prompt cache all the same;
* ``suffix`` (fill-in-the-middle), ``template`` (a per-request template), ``images``;
* ``think: false`` on a model that reasons (the template is rendered as it is) and
  ``think`` levels; ``think: true`` on a model that does not is Ollama's own 400.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

from colibri_protocol.messages import Alternative, Logprobs

from colibrid.engine.sampling import SamplingParams
from colibrid.errors import RequestError
from colibrid.http.errors import ApiError, bad_request, context_exceeded
from colibrid.http.openai import Plan, keep_alive, known_model, new_id, whole
from colibrid.http.parsing import Features, ToolCall
from colibrid.http.splitter import make_splitter
from colibrid.http.structured import ANY_OBJECT, SchemaCheck, ToolChoice
from colibrid.http.tools import (
    call_message,
    checked_tools,
    plan_tools,
    template_call,
    tool_message,
)
from colibrid.serve.events import Done, Token
from colibrid.serve.requests import GenerateRequest

CHAT, GENERATE = "/api/chat", "/api/generate"
# Ollama's documented defaults for what a request leaves out (docs/ollama.md)
DEFAULTS: dict[str, Any] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.0,
    "repeat_penalty": 1.1,
    "repeat_last_n": 64,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
OPTIONS = frozenset({*DEFAULTS, "num_ctx", "num_predict", "seed", "stop"})
OFF_OPTIONS = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}  # accepted at "off" only
COMMON_FIELDS = frozenset(
    {"model", "format", "options", "stream", "keep_alive", "think", "logprobs", "top_logprobs"}
)
FIELDS = {
    CHAT: COMMON_FIELDS | {"messages", "tools"},
    GENERATE: COMMON_FIELDS
    | {"prompt", "system", "raw", "suffix", "template", "context", "images"},
}
# fields of /api/generate refused unless empty (the official client sends some empty)
UNSUPPORTED = {
    "suffix": "`suffix` (fill-in-the-middle) is not supported",
    "template": "`template` is not supported: the model's own chat template is used "
    "(`raw: true` sends a prompt as it is)",
    "context": "`context` is not supported: colibri returns no context ids; send the whole "
    "conversation (or use /api/chat), its prefix is reused from the prompt cache",
    "images": "`images` are not supported (colibri serves no vision model)",
}
MESSAGE_FIELDS = frozenset({"role", "content", "thinking", "images", "tool_calls", "tool_name"})
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Exchange:
    """One generation request: its `plan`, and what the answer needs beyond it."""

    plan: Plan
    chat: bool  # /api/chat (a message) or /api/generate (a response)
    num_ctx: int | None  # the client's context window, within the daemon's
    logprobs: bool


def model_name(body: Any, installed: list[str]) -> str:
    """The body's `model` (Ollama's `name` is its older spelling), one installed; an
    Ollama name's ``:latest`` tag is the untagged name (colibri names carry no tags)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    name = body.get("model", body.get("name"))
    if not isinstance(name, str) or not name:
        raise bad_request("`model` is required (a string)", "model")
    return known_model(name.removesuffix(":latest"), installed)


def now() -> str:
    """Ollama's `created_at`: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


# ---- options --------------------------------------------------------------------------------
def _number(options: dict[str, Any], name: str) -> Any:
    value = options.get(name)
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        raise bad_request(f"`options.{name}` must be a number", f"options.{name}")
    return value


def _check_options(options: Any) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise bad_request("`options` must be an object", "options")
    for name, value in options.items():
        if value is None or name in OPTIONS:
            continue
        if name in OFF_OPTIONS:
            if _number(options, name) != OFF_OPTIONS[name]:
                raise bad_request(
                    f"`options.{name}` is not supported (only {OFF_OPTIONS[name]!r}, off)",
                    f"options.{name}",
                )
            continue
        raise bad_request(
            f"`options.{name}` is not supported; colibri takes {', '.join(sorted(OPTIONS))}",
            f"options.{name}",
        )
    return options


def _max_tokens(options: dict[str, Any], max_context: int) -> int:
    """`num_predict`: a count, or -1 / -2 (Ollama's "no limit" and "fill the context":
    up to the context, which is what colibri does without a limit)."""
    value = options.get("num_predict")
    if value is None or value in (-1, -2):
        return max_context
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise bad_request(
            "`options.num_predict` must be an integer >= 1, or -1 (no limit)",
            "options.num_predict",
        )
    return value


def num_ctx(options: dict[str, Any], max_context: int) -> int | None:
    """The client's context window: at most the daemon's (fixed when the model loads)."""
    value = options.get("num_ctx")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 2:
        raise bad_request("`options.num_ctx` must be an integer >= 2", "options.num_ctx")
    if value > max_context:
        raise bad_request(
            f"`options.num_ctx` {value} is past the loaded model's context of {max_context} "
            "tokens (set max_context in config.toml and restart the daemon for more)",
            "options.num_ctx",
        )
    return value


def sampling(options: dict[str, Any], *, max_context: int, logprobs: int | None) -> SamplingParams:
    """`options` as `SamplingParams`, Ollama's defaults for what is left out; `seed` -1
    (Ollama's "random") is a seed drawn by the daemon."""
    values = {name: _number(options, name) for name in DEFAULTS}
    values = {k: (DEFAULTS[k] if v is None else v) for k, v in values.items()}
    if values["top_p"] == 0:  # Ollama's top_p 0 keeps the top token only
        values["top_p"] = 1e-9
    seed = options.get("seed")
    stop = options.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    try:
        return SamplingParams(
            max_tokens=_max_tokens(options, max_context),
            seed=None if seed == -1 else seed,
            stop=() if stop is None else stop,
            logprobs=logprobs,
            **values,
        )
    except RequestError as exc:
        name = str(exc).split(" ", 1)[0]  # SamplingParams' messages start with the field
        raise bad_request(f"`options.{name}`: {exc}", f"options.{name}") from None


def _logprobs(body: dict[str, Any]) -> int | None:
    """Ollama's `logprobs` (bool) and `top_logprobs` (k alternatives) as the engine's k."""
    on, top = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise bad_request("`logprobs` must be a boolean", "logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool)):
        raise bad_request("`top_logprobs` must be an integer", "top_logprobs")
    if not on:
        if top:
            raise bad_request("`top_logprobs` needs `logprobs: true`", "top_logprobs")
        return None
    return top or 0


# ---- the request's shape ----------------------------------------------------------------------
def _check_fields(path: str, body: dict[str, Any]) -> None:
    for name in body:
        if name not in FIELDS[path] and name != "name":
            raise bad_request(f"`{name}` is not a field of {path}", name)
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, "", [], False):
            raise bad_request(why, name)
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean", "stream")


def answer_schema(value: Any) -> dict[str, Any] | bool | None:
    """`format`: "json" (any JSON object) or a JSON schema the answer must follow."""
    if value is None or value == "":
        return None
    if value == "json":
        return ANY_OBJECT
    if isinstance(value, dict):
        return value
    raise bad_request('`format` must be "json" or a JSON schema (an object)', "format")


def thinking(body: dict[str, Any], model: str, features: Features) -> Features:
    """`think`: the reasoning a model writes comes back in `thinking` (unset or true);
    a model without any is Ollama's 400, and colibri cannot switch a model's off."""
    think = body.get("think")
    if think is None:
        return features
    if not isinstance(think, bool):
        raise bad_request("`think` levels are not supported (true or false)", "think")
    if think and not features.think:
        raise bad_request(f'"{model}" does not support thinking', "think")
    if not think and features.think:
        raise bad_request(
            "`think: false` is not supported: this model's chat template is rendered as it "
            "is, reasoning included (leave `think` out or true)",
            "think",
        )
    return features


def _arguments(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise bad_request(f"{where}: function.arguments is not valid JSON", where) from None
    if not isinstance(value, dict):
        raise bad_request(f"{where}: function.arguments must be an object", where)
    return value


def _message(message: Any, where: str) -> dict[str, Any]:
    """One Ollama message as the chat template reads it."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise bad_request(f"{where}: role must be one of {', '.join(ROLES)}", where)
    extra = sorted(set(message) - MESSAGE_FIELDS)
    if extra:
        raise bad_request(f"{where}: `{extra[0]}` is not a field of a message", where)
    if message.get("images"):
        raise bad_request(f"{where}: {UNSUPPORTED['images']}", where)
    content = message.get("content") or ""
    if not isinstance(content, str):
        raise bad_request(f"{where}: content must be a string", where)
    role = message["role"]
    if role == "tool":
        name = message.get("tool_name")
        return tool_message(content, None, name if isinstance(name, str) else None)
    if role != "assistant":
        return {"role": role, "content": content}
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise bad_request(f"{where}: tool_calls must be a list", where)
    made = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}: a tool call needs function.name", where)
        made.append(template_call(fn["name"], _arguments(fn.get("arguments", {}), where), None))
    msg = call_message(content, made)
    if isinstance(message.get("thinking"), str) and message["thinking"]:
        msg["reasoning_content"] = message["thinking"]
    return msg


def _relabel(checks: tuple[SchemaCheck, ...]) -> tuple[SchemaCheck, ...]:
    """The answer's schema comes in `format` here (http.tools names OpenAI's field)."""
    return tuple(
        replace(c, where="format", param="format") if c.param == "response_format" else c
        for c in checks
    )


def plan(
    path: str,
    body: dict[str, Any],
    *,
    served: str,
    client: int,
    max_context: int,
    features: Features,
) -> Exchange:
    """A /api/chat or /api/generate body as an `Exchange` (a 400 for what is refused)."""
    _check_fields(path, body)
    options = _check_options(body.get("options"))
    top = _logprobs(body)
    params = sampling(options, max_context=max_context, logprobs=top)
    window = num_ctx(options, max_context)
    answer = answer_schema(body.get("format"))
    features = thinking(body, served, features)
    chat = path == CHAT
    prompt: str | None = None
    if chat:
        raw = body.get("messages")
        if not isinstance(raw, list):
            raise bad_request("`messages` must be a list", "messages")
        messages = tuple(_message(m, f"messages[{i}]") for i, m in enumerate(raw))
        tools = checked_tools(body.get("tools"))
    else:
        text = body.get("prompt")
        system = body.get("system") or ""
        if not isinstance(text, str) or not isinstance(system, str):
            raise bad_request("`prompt` and `system` must be strings", "prompt")
        raw_mode = body.get("raw") or False
        if not isinstance(raw_mode, bool):
            raise bad_request("`raw` must be a boolean", "raw")
        if raw_mode and system:
            raise bad_request("`system` needs the template; `raw: true` skips it", "system")
        messages = ({"role": "system", "content": system},) if system else ()
        messages += ({"role": "user", "content": text},)
        tools = None
        if raw_mode:
            prompt, features = text, Features()  # no template: the text as it is
    shaped = plan_tools(messages, tools, ToolChoice(), features, answer=answer, param="tools")
    request = GenerateRequest(
        id=new_id("ollama"),
        client=client,
        params=params,
        prompt=prompt,
        messages=None if prompt is not None else shaped.messages,
        tools=shaped.tools,
        keep_alive=keep_alive(body),
        grammar=shaped.grammar,
        asked=shaped.asked,
    )
    return Exchange(
        Plan(
            request,
            served,
            stream=body.get("stream", True),
            max_tokens=None if params.max_tokens == max_context else params.max_tokens,
            features=shaped.features if prompt is None else features,
            checks=_relabel(shaped.checks),
        ),
        chat,
        window,
        top is not None,
    )


def within(plan: Plan, window: int | None) -> Plan:
    """The prepared `plan` held to the client's `num_ctx`: prompt and answer together
    fit in it (the prompt is never truncated: one that does not fit is a 400)."""
    if window is None:
        return plan
    request = plan.request
    used = len(request.prompt_ids or ())
    if used >= window:
        raise context_exceeded(
            f"the prompt is {used} tokens, which leaves no room in `options.num_ctx` "
            f"{window} (it is never truncated); shorten it or raise num_ctx"
        )
    params = replace(request.params, max_tokens=min(request.params.max_tokens, window - used))
    return replace(plan, request=replace(request, params=params))


def only_loads(path: str, body: dict[str, Any]) -> bool:
    """A request with nothing to answer (no messages, an empty prompt): Ollama's way to
    load a model, or to unload it with ``keep_alive: 0``."""
    if path == CHAT:
        return body.get("messages") in (None, [])
    return body.get("prompt") in (None, "")


def loaded(path: str, model: str, reason: str, load_ns: int, started_ns: int) -> dict[str, Any]:
    """The answer to `only_loads`: done at once, `done_reason` "load" or "unload"."""
    out: dict[str, Any] = {"model": model, "created_at": now()}
    if path == CHAT:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    return {
        **out,
        "done": True,
        "done_reason": reason,
        "total_duration": time.perf_counter_ns() - started_ns,
        "load_duration": load_ns,
    }


# ---- the answer -------------------------------------------------------------------------------
def _alternative(alt: Alternative) -> dict[str, Any]:
    return {
        "token": alt.bytes.decode("utf-8", errors="replace"),
        "logprob": alt.logprob,
        "bytes": list(alt.bytes),
    }


def logprob_json(lp: Logprobs) -> dict[str, Any]:
    return {**_alternative(lp.chosen), "top_logprobs": [_alternative(a) for a in lp.top]}


def tool_calls_json(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Ollama's calls: arguments an object, not a JSON string."""
    return [
        {"id": new_id("call"), "function": {"index": i, "name": c.name, "arguments": c.arguments}}
        for i, c in enumerate(calls)
    ]


class Stream:
    """The events of one request as Ollama objects: `token` / `finish` lines when
    streaming, `response` (after every token was fed) otherwise."""

    def __init__(self, exchange: Exchange, *, started_ns: int, load_ns: int) -> None:
        self.exchange = exchange
        self.plan = exchange.plan
        self.started_ns = started_ns
        self.load_ns = load_ns
        self.splitter = make_splitter(self.plan.features)
        self.content: list[str] = []
        self.thinking: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self._pending: list[dict[str, Any]] = []  # logprobs of tokens whose text is held

    def _object(
        self, content: str = "", thinking: str = "", calls: list[ToolCall] | None = None
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.plan.model, "created_at": now()}
        if self.exchange.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = tool_calls_json(calls)
            out["message"] = message
        else:
            out["response"] = content
            if thinking:
                out["thinking"] = thinking
        return out

    def _pieces(self, pieces: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out = []
        for kind, text in pieces:
            (self.thinking if kind == "reasoning" else self.content).append(text)
            item = self._object(**{"thinking" if kind == "reasoning" else "content": text})
            if self._pending:
                item["logprobs"], self._pending = self._pending, []
            out.append({**item, "done": False})
        return out

    def token(self, event: Token) -> list[dict[str, Any]]:
        if event.logprobs is not None and self.exchange.logprobs:
            item = logprob_json(event.logprobs)
            self.logprobs.append(item)
            self._pending.append(item)
        return self._pieces(self.splitter.feed(event.text) if event.text else [])

    def _stats(self, done: Done) -> dict[str, Any]:
        return {
            "done": True,
            "done_reason": "length" if done.finish == "length" else "stop",
            "total_duration": time.perf_counter_ns() - self.started_ns,
            "load_duration": self.load_ns,
            "prompt_eval_count": done.prompt_tokens,
            "prompt_eval_duration": round(done.prefill_s * 1e9),
            "eval_count": done.generated_tokens,
            "eval_duration": round(done.decode_s * 1e9),
        }

    def finish(self, done: Done) -> list[dict[str, Any]]:
        pieces, self.calls = self.splitter.finish(whole=whole(self.plan, done))
        out = self._pieces(pieces)
        if self.calls:
            out.append({**self._object(calls=self.calls), "done": False})
        last = self._object()
        if self._pending:
            last["logprobs"], self._pending = self._pending, []
        out.append({**last, **self._stats(done)})
        return out

    def response(self, done: Done) -> dict[str, Any]:
        self.finish(done)
        out = self._object("".join(self.content), "".join(self.thinking), self.calls)
        if self.exchange.logprobs:
            out["logprobs"] = self.logprobs
        return {**out, **self._stats(done)}


def error_line(error: ApiError) -> dict[str, Any]:
    """An error once the stream's status is out: the line Ollama's clients raise."""
    return {"error": error.message}
