"""Pure translators for the Anthropic Messages API (``POST /v1/messages``).

Requests become the same `Plan` as OpenAI chat (system + messages + tools rendered by
the chat template); events become a Message object or the Messages streaming events
(message_start, content_block_start/delta/stop, message_delta, message_stop).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from colibrid.http.errors import bad_request
from colibrid.http.fields import ANTHROPIC as ANTHROPIC_REFUSED
from colibrid.http.fields import refuse_unsupported
from colibrid.http.openai import (
    Plan,
    _int,
    _obj,
    _stop,
    _text,
    check_model,
    keep_alive,
    new_id,
    sampling,
    whole,
)
from colibrid.http.parsing import Features, ToolCall
from colibrid.http.splitter import make_splitter
from colibrid.http.structured import ToolChoice
from colibrid.http.tools import function_tool, plan_tools, template_call, tool_message
from colibrid.serve.events import Done
from colibrid.serve.requests import GenerateRequest


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise bad_request(f"{where}: content must be a string or a list of blocks", where)
    return content


def _convert(role: str, content: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as template messages (tool results become tool messages)."""
    out: list[dict[str, Any]] = []
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in _blocks(content, where):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "thinking" and role == "assistant":
            reasoning.append(str(block.get("thinking", "")))
        elif kind == "tool_use" and role == "assistant" and isinstance(block.get("name"), str):
            calls.append(template_call(block["name"], block.get("input") or {}, block.get("id")))
        elif kind == "tool_result" and role == "user":
            result = _text(block.get("content"), where)
            if block.get("is_error"):  # the tool failed: the model reads that it did
                result = f"Error: {result}"
            out.append(tool_message(result, block.get("tool_use_id")))
        else:
            raise bad_request(
                f"{where}: unsupported content block {kind!r} (text, "
                "thinking, tool_use and tool_result are)",
                where,
            )
    if text or calls or not out:
        msg: dict[str, Any] = {"role": role, "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        out.append(msg)
    return out


def tool_choice(value: Any) -> ToolChoice:
    """Anthropic's `tool_choice` checked for shape: ``{"type": "auto" | "any" | "none"}``
    or ``{"type": "tool", "name": str}``; `any` and `tool` force a call."""
    if value is None:
        return ToolChoice()
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("auto", "none"):
        return ToolChoice(kind)
    if kind == "any":
        return ToolChoice("required")
    if kind == "tool" and isinstance(value.get("name"), str):
        return ToolChoice("required", value["name"])
    raise bad_request(
        '`tool_choice` must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}',
        "tool_choice",
    )


def one_call(choice: Any) -> bool:
    """`tool_choice.disable_parallel_tool_use`: at most one call (the first)."""
    value = choice.get("disable_parallel_tool_use") if isinstance(choice, dict) else None
    if value is not None and not isinstance(value, bool):
        raise bad_request(
            "`tool_choice.disable_parallel_tool_use` must be a boolean", "tool_choice"
        )
    return bool(value)


def anthropic_tools(value: Any) -> tuple[dict[str, Any], ...] | None:
    """Anthropic's `tools` (`{name, description, input_schema}`) as template tools; None
    for none. Server tools (a `type` other than custom) run on Anthropic's side: refused."""
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and t["name"]
        and t.get("type", "custom") == "custom"
        and isinstance(t.get("input_schema", {}), dict)
        for t in value
    ):
        raise bad_request(
            "`tools` must be a list of {name, description, input_schema} (custom tools; "
            "Anthropic's server tools are not available here)",
            "tools",
        )
    return tuple(
        function_tool(t["name"], t.get("description", ""), t.get("input_schema", {})) for t in value
    )


def messages_plan(
    body: Any, *, served: str, client: int, max_context: int, features: Features
) -> Plan:
    body = _obj(body)
    model = check_model(body, served)
    refuse_unsupported(body, ANTHROPIC_REFUSED)
    max_tokens = _int(body, "max_tokens")
    if max_tokens is None:
        raise bad_request("`max_tokens` is required", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean", "stream")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _text(system, "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("`messages` must be a non-empty list", "messages")
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where}: role must be user or assistant", where)
        messages += _convert(message["role"], message.get("content"), where)
    choice = tool_choice(body.get("tool_choice"))
    template_tools = anthropic_tools(body.get("tools")) if choice.mode != "none" else None
    tool_plan = plan_tools(messages, template_tools, choice, features)
    chat, shown_tools, grammar, checks = (
        tool_plan.messages,
        tool_plan.tools,
        tool_plan.grammar,
        tool_plan.checks,
    )
    params = sampling(
        body,
        max_tokens=max_tokens,
        max_context=max_context,
        stop=_stop(body.get("stop_sequences"), "stop_sequences"),
        extensions=False,  # Anthropic has no penalties or min_p: a 400 names the field
    )
    request = GenerateRequest(
        id=new_id("msg"),
        client=client,
        params=params,
        messages=chat,
        tools=shown_tools,
        keep_alive=keep_alive(body),
        grammar=grammar,
        asked=tool_plan.asked,
    )
    return Plan(
        request,
        model,
        stream,
        False,
        max_tokens,
        replace(features, tools=template_tools is not None),
        checks,
        one_call=one_call(body.get("tool_choice")),
    )


def count_plan(
    body: Any, *, served: str, client: int, max_context: int, features: Features
) -> Plan:
    """`POST /v1/messages/count_tokens`: the body of a message request without
    `max_tokens`, planned as one (the same template, system note and tools), to count
    its prompt's tokens."""
    body = _obj(body)
    if "max_tokens" in body or "stream" in body:
        field = "max_tokens" if "max_tokens" in body else "stream"
        raise bad_request(f"`{field}` is not a field of count_tokens", field)
    return messages_plan(
        {**body, "max_tokens": 1},
        served=served,
        client=client,
        max_context=max_context,
        features=features,
    )


def stop_reason(done: Done, calls: list[ToolCall]) -> str:
    if calls:
        return "tool_use"
    if done.stop_string is not None:
        return "stop_sequence"
    return "max_tokens" if done.finish == "length" else "end_turn"


def input_usage(prompt_tokens: int, cached_tokens: int) -> dict[str, int]:
    """Anthropic's input counts: the prompt's tokens the conversation's KV cache already
    held are `cache_read_input_tokens` (not in `input_tokens`: the three add up to the
    prompt). colibri keeps every conversation's KV on its own, at no extra cost, so
    nothing is ever a paid cache write: `cache_creation_input_tokens` is 0."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
    }


def _tool_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": new_id("toolu"), "name": call.name, "input": call.arguments}


class MessageStream:
    """Events -> Anthropic streaming events `(name, payload)` or one Message."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.id = plan.request.id
        self.splitter = make_splitter(plan.features)
        self.blocks: list[dict[str, Any]] = []
        self.open: str | None = None  # type of the open content block
        self.prompt_tokens = self.cached_tokens = 0

    def _message(self, done: Done | None, calls: list[ToolCall]) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.plan.model,
            "content": self.blocks,
            "stop_reason": stop_reason(done, calls) if done else None,
            "stop_sequence": done.stop_string if done else None,
            "usage": {
                **input_usage(
                    done.prompt_tokens if done else self.prompt_tokens,
                    done.cached_tokens if done else self.cached_tokens,
                ),
                "output_tokens": done.generated_tokens if done else 0,
            },
        }

    def start(self, prompt_tokens: int, cached_tokens: int = 0) -> list[tuple[str, dict[str, Any]]]:
        self.prompt_tokens, self.cached_tokens = prompt_tokens, cached_tokens
        return [("message_start", {"message": {**self._message(None, []), "content": []}})]

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"index": len(self.blocks) - 1})]

    def _pieces(self, pieces: list[tuple[str, str]]) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for kind, text in pieces:
            btype = "thinking" if kind == "reasoning" else "text"
            if self.open != btype:
                out += self._close()
                self.blocks.append(
                    {"type": btype, btype: ""}
                    if btype == "text"
                    else {"type": "thinking", "thinking": "", "signature": ""}
                )
                self.open = btype
                out.append(
                    (
                        "content_block_start",
                        {"index": len(self.blocks) - 1, "content_block": dict(self.blocks[-1])},
                    )
                )
            self.blocks[-1][btype] += text
            delta = (
                {"type": "text_delta", "text": text}
                if btype == "text"
                else {"type": "thinking_delta", "thinking": text}
            )
            out.append(("content_block_delta", {"index": len(self.blocks) - 1, "delta": delta}))
        return out

    def token(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        return self._pieces(self.splitter.feed(text))

    def finish(self, done: Done) -> list[tuple[str, dict[str, Any]]]:
        pieces, self.calls = self.splitter.finish(whole=whole(self.plan, done))
        self.calls = self.calls[:1] if self.plan.one_call else self.calls
        out = self._pieces(pieces) + self._close()
        for call in self.calls:
            block = _tool_block(call)
            self.blocks.append(block)
            index = len(self.blocks) - 1
            out += [
                ("content_block_start", {"index": index, "content_block": {**block, "input": {}}}),
                (
                    "content_block_delta",
                    {
                        "index": index,
                        "delta": {
                            "type": "input_json_delta",
                            "partial_json": json.dumps(call.arguments),
                        },
                    },
                ),
                ("content_block_stop", {"index": index}),
            ]
        out.append(
            (
                "message_delta",
                {
                    "delta": {
                        "stop_reason": stop_reason(done, self.calls),
                        "stop_sequence": done.stop_string,
                    },
                    "usage": {"output_tokens": done.generated_tokens},
                },
            )
        )
        out.append(("message_stop", {}))
        return out

    def response(self, done: Done) -> dict[str, Any]:
        self.finish(done)
        if not self.blocks:
            self.blocks.append({"type": "text", "text": ""})
        return self._message(done, self.calls)
