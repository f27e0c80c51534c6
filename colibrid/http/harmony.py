"""Splitting gpt-oss's output (OpenAI's Harmony format) into reasoning, answer and tool
calls, incrementally, with the interface of `parsing.OutputSplitter`.

Harmony output is a sequence of messages, each a header then a body:
``<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…
<|return|>``. The "analysis" channel is the reasoning, "final" (and a "commentary"
preamble) the answer; a message addressed ``to=functions.NAME`` (in its header, before or
after the channel, optionally with ``<|constrain|>json``) is a tool call whose body is the
JSON arguments, ended by ``<|call|>``. The engine keeps special tokens when it decodes,
so the markers are in the text. Output that does not start with a marker goes to the
GLM-style splitter (`parsing.OutputSplitter`): it is what a grammar-forced tool call
(``<tool_call>{…}</tool_call>``, structured.py) or a template not used as Harmony gives.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

from colibrid.http.parsing import Features, OutputSplitter, ToolCall, held_tag_prefix

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_FUNCTIONS = "functions."


class HarmonySplitter:
    """Feed text pieces; get ``("reasoning" | "content", text)`` pieces back."""

    def __init__(self, features: Features) -> None:
        self.features = features
        self.buf = ""
        self.mode = "start"  # start, header, body, plain
        self.kind = "content"  # where the current body goes: reasoning, content, call
        self.recipient = ""
        self.body = ""  # the current tool call's arguments text
        self.calls: list[tuple[str, str]] = []  # (function name, arguments text)
        self.plain: OutputSplitter | None = None  # output without Harmony markers

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        return self._drain(final=False)

    def finish(self, *, whole: bool = True) -> tuple[list[tuple[str, str]], list[ToolCall]]:
        """The rest, and the tool calls; an answer that is not `whole` makes no calls (its
        call text comes back as content), and neither does an arguments body that is not
        a JSON object."""
        pieces = self._drain(final=True)
        if self.plain is not None:
            rest, plain_calls = self.plain.finish(whole=whole)
            return pieces + rest, plain_calls
        # a header cut short (max_tokens inside it) is protocol, not text: dropped
        if self.mode == "body" and self.kind == "call":
            self.calls.append((self.recipient, self.body))
        calls: list[ToolCall] = []
        for name, text in self.calls:
            args = _object(text) if whole else None
            if args is None:
                pieces.append(("content", text))
            else:
                calls.append(ToolCall(name, args))
        return [p for p in pieces if p[1]], calls

    def _drain(self, *, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while self.buf:
            if self.mode == "start":
                head = self.buf.lstrip()
                if not head.startswith("<|") and not ("<|".startswith(head) and not final):
                    self.mode = "plain"
                    self.plain = OutputSplitter(replace(self.features, harmony=False, think=False))
                elif head.startswith("<|"):
                    self.mode = "header"
                else:
                    break
            elif self.plain is not None:
                out.extend(self.plain.feed(self.buf))
                self.buf = ""
            elif self.mode == "header":
                at = self.buf.find(MESSAGE)
                if at < 0:
                    break  # a header is a few tokens: held until its <|message|>
                self._open(self.buf[:at])
                self.buf = self.buf[at + len(MESSAGE) :]
                self.mode = "body"
            else:
                if not self._body(out, final):
                    break
        return out

    def _open(self, header: str) -> None:
        """A message starts: where its body goes, from its channel and recipient."""
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self.body = ""
        if recipient and recipient.group(1).startswith(_FUNCTIONS) and self.features.tools:
            self.kind, self.recipient = "call", recipient.group(1)[len(_FUNCTIONS) :]
        elif channel and channel.group(1) == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"

    def _body(self, out: list[tuple[str, str]], final: bool) -> bool:
        """Emit the body up to its end marker (holding back a possible partial marker);
        True when the message ended."""
        ends = [(i, tag) for tag in ENDS if (i := self.buf.find(tag)) >= 0]
        if ends:
            at, tag = min(ends)
            self._emit(self.buf[:at], out)
            self.buf = self.buf[at + len(tag) :]
            if self.kind == "call":
                self.calls.append((self.recipient, self.body))
            self.mode = "header"
            return True
        keep = 0 if final else max(held_tag_prefix(self.buf, tag) for tag in ENDS)
        self._emit(self.buf[: len(self.buf) - keep], out)
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _emit(self, text: str, out: list[tuple[str, str]]) -> None:
        if self.kind == "call":
            self.body += text
        elif text:
            out.append((self.kind, text))


def _object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
