"""An OpenAI stream's chunks folded into the text colibri's front ends read (pure).

The daemon's front ends read one stream of text per request and split it themselves
(http.splitter): an optional ``<think>…</think>`` block, the answer, then
``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` blocks. A remote engine has done
that split already (``reasoning_content``, ``content`` and ``tool_calls`` deltas), so
`ChunkReader` writes its parts back in exactly that form: every dialect (OpenAI,
Anthropic, Ollama, Responses) and every SERVE client then shows a remote model's
reasoning and calls the way it shows a local model's, through the same code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class _Call:
    """One tool call as its deltas build it up."""

    name: str = ""
    arguments: str = ""


@dataclass
class Usage:
    """What the endpoint reported of the request (zeros until its usage chunk)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


@dataclass
class ChunkReader:
    """Feed each chunk (a decoded ``data:`` object) to `feed`, then call `finish`; each
    returns the text to stream now. `chat`: chunks of /v1/chat/completions (deltas),
    else of /v1/completions (``text``)."""

    chat: bool = True
    finish_reason: str | None = None
    # the stop string the endpoint says ended the answer: vLLM's `stop_reason`, SGLang's
    # `matched_stop` (colibrid's OpenAI API writes vLLM's); llama-server's stream says none
    stop_string: str | None = None
    usage: Usage = field(default_factory=Usage)
    pieces: int = 0  # chunks that carried text: the token count when no usage comes
    _thinking: bool = False
    _calls: dict[int, _Call] = field(default_factory=dict)

    def feed(self, chunk: dict[str, Any]) -> str:
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details")
            self.usage = Usage(
                _int(usage.get("prompt_tokens")),
                _int(usage.get("completion_tokens")),
                _int(details.get("cached_tokens")) if isinstance(details, dict) else 0,
            )
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return ""
        choice = choices[0]
        if isinstance(choice.get("finish_reason"), str):
            self.finish_reason = choice["finish_reason"]
        for name in ("stop_reason", "matched_stop"):  # a token id there is no stop string
            if isinstance(choice.get(name), str):
                self.stop_string = choice[name]
        if not self.chat:
            text = choice.get("text")
            return self._count(text if isinstance(text, str) else "")
        delta = choice.get("delta")
        return self._delta(delta) if isinstance(delta, dict) else ""

    def _count(self, text: str) -> str:
        if text:
            self.pieces += 1
        return text

    def _delta(self, delta: dict[str, Any]) -> str:
        out = ""
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            if not self._thinking:
                self._thinking = True
                out += THINK_OPEN
            out += reasoning
        content = delta.get("content")
        if isinstance(content, str) and content:
            out += self._close_thinking() + content
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            out += self._close_thinking()
            for call in calls:
                self._add_call(call)
        return self._count(out)

    def _close_thinking(self) -> str:
        if not self._thinking:
            return ""
        self._thinking = False
        return THINK_CLOSE

    def _add_call(self, call: Any) -> None:
        if not isinstance(call, dict):
            return
        index = _int(call.get("index"))
        built = self._calls.setdefault(index, _Call())
        fn = call.get("function")
        if isinstance(fn, dict):
            if isinstance(fn.get("name"), str):
                built.name += fn["name"]
            if isinstance(fn.get("arguments"), str):
                built.arguments += fn["arguments"]

    def finish(self) -> str:
        """The end of the stream: a reasoning block left open is closed and the calls
        are written out, each with its arguments as an object."""
        out = self._close_thinking()
        for index in sorted(self._calls):
            call = self._calls[index]
            try:
                arguments = json.loads(call.arguments) if call.arguments.strip() else {}
            except ValueError:
                arguments = call.arguments  # what the engine wrote, for the client to see
            body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
            out += f"{TOOL_OPEN}{body}{TOOL_CLOSE}"
        return out
