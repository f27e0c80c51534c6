"""Pure translator for OpenAI's Responses API (``POST /v1/responses``): a request body
becomes the same `Plan` as a chat completion, plus the `ResponseSpec` its answer echoes.

The Responses API is chat completions with other names, so everything that decides what
is generated is openai.py's and structured.py's, reached through chat-shaped values:
`instructions` and the `input` items become chat messages (a ``function_call`` item an
assistant tool call, a ``function_call_output`` item a tool message), the flat function
tools become chat tools, ``text.format`` a response format, and `shaped` makes the
grammar of a forced call or a JSON answer exactly as for /v1/chat/completions. Answers
are turned into Responses objects and events by response_events.py.

Fields: the API has many that do not apply to a local model. Each one is honoured,
accepted at the value that means what colibri does anyway (`truncation: "disabled"`,
`background: false`, ...), or refused with one line naming it; a field this module does
not know is refused too, so nothing a client sends is silently dropped
(docs/api-fields.md lists them all).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace
from typing import Any

from colibrid.engine.logprobs import MAX_TOP_LOGPROBS
from colibrid.http.errors import bad_request
from colibrid.http.openai import (
    EXTENSION_FIELDS,
    Plan,
    _int,
    _obj,
    check_model,
    flag,
    keep_alive,
    sampling,
)
from colibrid.http.openai import tool_choice as chat_tool_choice
from colibrid.http.parsing import Features
from colibrid.http.response_store import Conversation, ResponseStore
from colibrid.http.structured import ToolChoice, response_schema
from colibrid.http.tools import (
    checked_tools,
    function_tool,
    plan_tools,
    template_call,
    tool_message,
)
from colibrid.serve.requests import GenerateRequest

# honoured as the API defines them
HONOURED = (
    "model",
    "input",
    "instructions",
    "stream",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "max_output_tokens",
    "temperature",
    "top_p",
    "metadata",
    "store",
    "previous_response_id",
)
# colibri's own sampling fields, as on /v1/chat/completions (openai.sampling reads them)
EXTENSIONS = ("seed", "top_k", "keep_alive", *EXTENSION_FIELDS)
LOGPROBS = "message.output_text.logprobs"  # the one `include` served
# identifiers for the provider's abuse monitoring and cache routing: echoed, else unused
# (a local daemon has neither; the prompt cache finds shared prefixes by itself)
IGNORED = ("user", "safety_identifier", "prompt_cache_key")
# field -> (the values that mean what colibri does anyway, why others are refused)
DEFAULT_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((False,), "responses run in the foreground (stream to see one grow)"),
    "truncation": (("disabled",), "the input is never truncated; it must fit the context"),
    "include": (([], [LOGPROBS]), f"only {LOGPROBS!r} is served"),
    "service_tier": (("auto", "default"), "there is one tier"),
    "max_tool_calls": ((), "there are no built-in tools"),
    "prompt": ((), "stored prompt templates are not served"),
    "conversation": ((), "the Conversations API is not served (use previous_response_id)"),
    "prompt_cache_retention": (("in_memory",), "the prompt cache lives in memory only"),
    "prompt_cache_options": ((), "the prompt cache is automatic"),
    "context_management": ((), "context compaction is not served"),
    "moderation": ((), "moderation is not served"),
    "image": ((), "there is no image input or output"),
    "access_programs": ((), "there are no access programs"),
    "background_options": ((), "responses run in the foreground"),
}
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
# the content part types a message of each role may hold (all text)
PART_TYPES = {"assistant": ("output_text", "refusal")}
INPUT_PART_TYPES = ("input_text",)
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


@dataclass(frozen=True)
class ResponseSpec:
    """What a response echoes and what it keeps, beyond the `Plan`."""

    id: str
    instructions: str | None
    conversation: Conversation  # the chat before the answer, without the instructions
    tools: tuple[dict[str, Any], ...]  # as the client sent them
    tool_choice: Any  # as the client sent it ("auto" when absent)
    text_format: dict[str, Any]
    temperature: float
    top_p: float
    parallel_tool_calls: bool
    store: bool
    previous_response_id: str | None
    metadata: dict[str, str]
    user: str | None
    safety_identifier: str | None
    prompt_cache_key: str | None


def new_id(prefix: str) -> str:
    """OpenAI's Responses ids: `resp_…`, `msg_…`, `fc_…`, `call_…`, `rs_…`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def check_fields(body: dict[str, Any]) -> None:
    """Every field is known and, where only its default is served, at that default."""
    for name, value in body.items():
        if name in HONOURED or name in EXTENSIONS or name in IGNORED:
            continue
        if name == "stream_options":
            if value not in (None, {}) and value != {"include_obfuscation": False}:
                raise bad_request(
                    "`stream_options` is not supported (events are never obfuscated: "
                    "only {include_obfuscation: false} is accepted)",
                    name,
                )
            continue
        if name == "reasoning":
            if value is not None and (
                not isinstance(value, dict) or any(v is not None for v in value.values())
            ):
                raise bad_request(
                    "`reasoning` options are not supported: whether the model thinks is its "
                    "chat template's (its reasoning comes back as a reasoning item)",
                    name,
                )
            continue
        if name == "top_logprobs":
            if value is not None and (type(value) is not int or not 0 <= value <= MAX_TOP_LOGPROBS):
                raise bad_request(
                    f"`top_logprobs` must be an integer in [0, {MAX_TOP_LOGPROBS}]", name
                )
            continue
        if name not in DEFAULT_ONLY:
            raise bad_request(f"`{name}` is not a field of /v1/responses served here", name)
        allowed, why = DEFAULT_ONLY[name]
        if value is not None and value not in allowed:
            shown = " or ".join(json.dumps(v) for v in allowed)
            accepted = f" (only {shown} is accepted)" if allowed else ""
            raise bad_request(f"`{name}` is not supported: {why}{accepted}", name)


def _string(body: dict[str, Any], name: str, limit: int | None = None) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or (limit is not None and len(value) > limit):
        bound = f" of at most {limit} characters" if limit else ""
        raise bad_request(f"`{name}` must be a string{bound}", name)
    return value


def metadata(value: Any) -> dict[str, str]:
    """OpenAI's rule: up to 16 pairs, keys of at most 64 characters, string values of at
    most 512; echoed in the response."""
    if value is None:
        return {}
    if (
        not isinstance(value, dict)
        or len(value) > 16
        or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in value.items()
        )
    ):
        raise bad_request(
            "`metadata` must be an object of up to 16 string values (keys up to 64 "
            "characters, values up to 512)",
            "metadata",
        )
    return dict(value)


# ---- input items -> chat messages ---------------------------------------------------------
def _text(content: Any, types: tuple[str, ...], where: str) -> str:
    """A message's content: a string, or a list of text parts of `types`."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") not in types
                or not isinstance(part.get("text", part.get("refusal")), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(
                    f"{where}.content[{i}]: a {kind!r} part is not supported "
                    f"(only text: {', '.join(types)})",
                    "input",
                )
            parts.append(part.get("text", part.get("refusal")))
        return "".join(parts)
    raise bad_request(f"{where}: content must be a string or a list of text parts", "input")


def _arguments(value: Any, where: str) -> dict[str, Any]:
    """A function_call item's `arguments` (a JSON object as a string)."""
    try:
        args = json.loads(value) if isinstance(value, str) and value.strip() else {}
    except ValueError:
        args = None
    if not isinstance(value, str) or not isinstance(args, dict):
        raise bad_request(f"{where}: `arguments` must be a JSON object as a string", "input")
    return args


def _reasoning(item: dict[str, Any]) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if isinstance(parts, list) and parts:
            return "".join(
                p["text"]
                for p in parts
                if isinstance(p, dict) and p.get("type") == kind and isinstance(p.get("text"), str)
            )
    return ""


class _Turns:
    """Chat messages built item by item (`input_messages`)."""

    def __init__(self) -> None:
        self.out: list[dict[str, Any]] = []
        self.names: dict[str, str] = {}  # call_id -> function name, for the tool messages
        self.reasoning = ""  # a reasoning item's text, for the assistant turn after it

    def assistant(self, content: str) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        self.reasoning = ""
        self.out.append(msg)
        return msg

    def message(self, item: dict[str, Any], where: str) -> None:
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise bad_request(f"{where}: role must be one of {', '.join(MESSAGE_ROLES)}", "input")
        text = _text(item.get("content"), PART_TYPES.get(role, INPUT_PART_TYPES), where)
        if role == "assistant":
            self.assistant(text)
        else:
            self.out.append({"role": "system" if role == "developer" else role, "content": text})

    def function_call(self, item: dict[str, Any], where: str) -> None:
        """A call joins the assistant turn just before it (its text, its other calls)."""
        name, call_id = item.get("name"), item.get("call_id")
        if not isinstance(name, str) or not isinstance(call_id, str):
            raise bad_request(f"{where}: a function_call needs `name` and `call_id`", "input")
        call = template_call(name, _arguments(item.get("arguments"), where), call_id)
        self.names[call_id] = name
        last = self.out[-1] if self.out else None
        turn = last if last and last["role"] == "assistant" and not self.reasoning else None
        (turn or self.assistant("")).setdefault("tool_calls", []).append(call)

    def function_call_output(self, item: dict[str, Any], where: str) -> None:
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise bad_request(f"{where}: a function_call_output needs `call_id`", "input")
        content = _text(item.get("output"), INPUT_PART_TYPES, where)
        self.out.append(tool_message(content, call_id, self.names.get(call_id)))


def input_messages(value: Any) -> tuple[dict[str, Any], ...]:
    """`input` as chat messages: a string is one user message; a list holds messages
    (any role, developer as system), and the items of a tool round trip: a
    ``function_call`` joins the assistant turn before it (or opens one), a
    ``function_call_output`` is a tool message, a ``reasoning`` item is the reasoning of
    the assistant turn after it."""
    if isinstance(value, str):
        return ({"role": "user", "content": value},)
    if not isinstance(value, list) or not value:
        raise bad_request("`input` must be a string or a non-empty list of items", "input")
    turns = _Turns()
    handle = {
        "message": turns.message,
        "function_call": turns.function_call,
        "function_call_output": turns.function_call_output,
    }
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind not in ITEM_TYPES:
            raise bad_request(
                f"{where}: item type {kind!r} is not supported ({', '.join(ITEM_TYPES)} are)",
                "input",
            )
        assert isinstance(item, dict)
        if kind == "reasoning":
            turns.reasoning += _reasoning(item)
        else:
            handle[kind](item, where)
    if turns.reasoning:  # a reasoning item last: the start of the turn being generated
        raise bad_request("input: a reasoning item must come before an assistant turn", "input")
    return tuple(turns.out)


# ---- tools and text format -> chat shapes -------------------------------------------------
def tools_of(tools: Any) -> tuple[dict[str, Any], ...] | None:
    """The Responses `tools` (flat function tools) in the shape http.tools reads; hosted
    tools (web_search, file_search, …) are refused. `strict` is accepted either way: a
    call's arguments are held to the tool's schema by the grammar whenever a call is
    written (http.tools), strict or not."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("`tools` must be a list of function tools", "tools")
    converted = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(
                f"tools[{i}]: only function tools are served (type {kind!r} is not)", "tools"
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}]: a function tool needs a `name`", "tools")
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise bad_request(f"tools[{i}]: `strict` must be a boolean", "tools")
        description = tool.get("description") or ""
        converted.append(function_tool(tool["name"], description, tool.get("parameters")))
    return checked_tools(converted)


def choice_of(choice: Any) -> ToolChoice:
    """`tool_choice`: "none" | "auto" | "required" or ``{"type": "function", "name"}``
    (OpenAI chat's, flat); the hosted tools' and ``allowed_tools`` are refused."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise bad_request('`tool_choice` {"type": "function"} needs a `name`', "tool_choice")
        return chat_tool_choice({"type": "function", "function": {"name": choice["name"]}})
    if choice is None or isinstance(choice, str):
        return chat_tool_choice(choice)
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise bad_request(
        f'`tool_choice` {kind!r} is not supported ("none", "auto", "required" or '
        '{"type": "function", "name": ...} are)',
        "tool_choice",
    )


def text_format(text: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """`text` as (its echo, the chat response_format it asks for). ``format`` is
    ``{"type": "text" | "json_object"}`` or ``{"type": "json_schema", "name", "schema",
    "strict"?, "description"?}``; `verbosity` is only accepted unset."""
    if text is None:
        return {"type": "text"}, None
    if not isinstance(text, dict) or not set(text) <= {"format", "verbosity"}:
        raise bad_request("`text` must be an object with `format`", "text")
    if text.get("verbosity") is not None:
        raise bad_request(
            "`text.verbosity` is not supported (the answer is as long as the model makes it; "
            "bound it with max_output_tokens)",
            "text",
        )
    fmt = text.get("format")
    if fmt is None:
        return {"type": "text"}, None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return fmt, {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise bad_request(
                "`text.format` json_schema needs a `name` and a `schema` object", "text"
            )
        return fmt, {
            "type": "json_schema",
            "json_schema": {"name": fmt["name"], "schema": fmt["schema"]},
        }
    raise bad_request(
        '`text.format` must be {"type": "text" | "json_object"} or '
        '{"type": "json_schema", "name": ..., "schema": {...}}',
        "text",
    )


# ---- the plan ---------------------------------------------------------------------------
def response_plan(
    body: Any,
    *,
    served: str,
    client: int,
    max_context: int,
    features: Features,
    store: ResponseStore,
) -> tuple[Plan, ResponseSpec]:
    body = _obj(body)
    model = check_model(body, served)
    check_fields(body)
    stream = flag(body, "stream", False)
    kept = flag(body, "store", True)
    previous = _string(body, "previous_response_id")
    history: Conversation = ()
    if previous is not None:
        found = store.get(previous)
        if found is None:
            raise bad_request(
                f"no stored response {previous!r}: the daemon keeps the last "
                f"{store.capacity} responses made with store: true, in memory, until it "
                "restarts",
                "previous_response_id",
            )
        history = found
    instructions = _string(body, "instructions")
    conversation = history + input_messages(body.get("input"))
    messages = conversation
    if instructions is not None:
        messages = ({"role": "system", "content": instructions}, *conversation)
    echo_format, response_format = text_format(body.get("text"))
    tools, choice = tools_of(body.get("tools")), choice_of(body.get("tool_choice"))
    answer = response_schema(response_format)
    shaped = plan_tools(messages, tools, choice, features, answer=answer, param="tools")
    # the response format's schema is named as this API names it
    checks = tuple(
        replace(c, where="text.format.schema", param="text") if c.param == "response_format" else c
        for c in shaped.checks
    )
    max_tokens = _int(body, "max_output_tokens")
    logprobs = body.get("top_logprobs")
    if logprobs is None and LOGPROBS in (body.get("include") or ()):
        logprobs = 0
    params = sampling(
        body, max_tokens=max_tokens, max_context=max_context, stop=(), logprobs=logprobs
    )
    response_id = new_id("resp")
    request = GenerateRequest(
        id=response_id,
        client=client,
        params=params,
        messages=shaped.messages,
        tools=shaped.tools,
        keep_alive=keep_alive(body),
        grammar=shaped.grammar,
        asked=shaped.asked,
    )
    plan = Plan(request, model, stream, False, max_tokens, shaped.features, checks)
    spec = ResponseSpec(
        id=response_id,
        instructions=instructions,
        conversation=conversation,
        tools=tuple(body.get("tools") or ()),
        tool_choice=body.get("tool_choice") or "auto",
        text_format=echo_format,
        temperature=params.temperature,
        top_p=1.0 if body.get("top_p") is None else float(body["top_p"]),
        parallel_tool_calls=flag(body, "parallel_tool_calls", True),
        store=kept,
        previous_response_id=previous,
        metadata=metadata(body.get("metadata")),
        user=_string(body, "user", 256),
        safety_identifier=_string(body, "safety_identifier", 256),
        prompt_cache_key=_string(body, "prompt_cache_key"),
    )
    return plan, spec
