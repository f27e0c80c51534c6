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
    shaped,
    whole,
)
from colibrid.http.parsing import Features, ToolCall
from colibrid.http.splitter import make_splitter
from colibrid.http.structured import ToolChoice
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
            calls.append(
                {
                    "type": "function",
                    "id": block.get("id"),
                    "function": {"name": block["name"], "arguments": block.get("input") or {}},
                }
            )
        elif kind == "tool_result" and role == "user":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": block.get("tool_use_id"),
                    "content": _text(block.get("content"), where),
                }
            )
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


def messages_plan(
    body: Any, *, served: str, client: int, max_context: int, features: Features
) -> Plan:
    body = _obj(body)
    model = check_model(body, served)
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
    tools = body.get("tools")
    choice = tool_choice(body.get("tool_choice"))
    template_tools = None
    if choice.forced and not tools:
        raise bad_request("`tool_choice` names tools but `tools` is empty", "tool_choice")
    if tools and choice.mode != "none":
        if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools
        ):
            raise bad_request(
                "`tools` must be a list of {name, description, input_schema}", "tools"
            )
        if not features.tools and not choice.forced:
            raise bad_request(
                "this model's chat template does not support tools (a forced call, "
                "`tool_choice` any or a named tool, works without)",
                "tools",
            )
        template_tools = tuple(
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema", {}),
                },
            }
            for t in tools
        )
    chat, shown_tools, grammar, checks = shaped(
        tuple(messages), template_tools, choice, None, features, param="tools"
    )
    params = sampling(
        body,
        max_tokens=max_tokens,
        max_context=max_context,
        stop=_stop(body.get("stop_sequences"), "stop_sequences"),
    )
    request = GenerateRequest(
        id=new_id("msg"),
        client=client,
        params=params,
        messages=chat,
        tools=shown_tools,
        keep_alive=keep_alive(body),
        grammar=grammar,
    )
    return Plan(
        request,
        model,
        stream,
        False,
        max_tokens,
        replace(features, tools=template_tools is not None),
        checks,
    )


def stop_reason(done: Done, calls: list[ToolCall]) -> str:
    if calls:
        return "tool_use"
    if done.stop_string is not None:
        return "stop_sequence"
    return "max_tokens" if done.finish == "length" else "end_turn"


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
        self.prompt_tokens = 0

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
                "input_tokens": done.prompt_tokens if done else self.prompt_tokens,
                "output_tokens": done.generated_tokens if done else 0,
            },
        }

    def start(self, prompt_tokens: int) -> list[tuple[str, dict[str, Any]]]:
        self.prompt_tokens = prompt_tokens
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
