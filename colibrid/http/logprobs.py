"""Per-token logprobs in the OpenAI shapes: chat's `logprobs.content` list and the legacy
completions object (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

The numbers are the engine's (engine.logprobs: the distribution the sampler starts from,
after the grammar's mask and the penalties, before temperature and the filters); a token
is shown as its bytes decoded as UTF-8 (U+FFFD where a token holds part of a character:
`bytes` then says which bytes). Every generated token is listed, reasoning included.
Streaming, a chunk carries the entries of the tokens generated since the previous chunk
(text a parser holds back, a tool call, is listed with the chunk that comes next).
"""

from __future__ import annotations

from typing import Any

from colibri_protocol.messages import Alternative, Logprobs


def _text(item: Alternative) -> str:
    return item.bytes.decode("utf-8", errors="replace")


def _entry(item: Alternative) -> dict[str, Any]:
    return {"token": _text(item), "logprob": item.logprob, "bytes": list(item.bytes)}


class ChatLogprobs:
    """Chat's entries: all of them (the whole response) and those not yet streamed."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self._sent = 0

    def add(self, lp: Logprobs) -> None:
        self.entries.append({**_entry(lp.chosen), "top_logprobs": [_entry(t) for t in lp.top]})

    def pending(self) -> dict[str, Any] | None:
        """The entries since the last call, as a chunk's `logprobs` (None: none)."""
        new, self._sent = self.entries[self._sent :], len(self.entries)
        return {"content": new, "refusal": None} if new else None

    def whole(self) -> dict[str, Any]:
        return {"content": self.entries, "refusal": None}


class CompletionLogprobs:
    """The legacy completions object; `text_offset` counts characters of the answer."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top_logprobs: list[dict[str, float]] = []
        self.text_offset: list[int] = []
        self._offset = 0
        self._sent = 0

    def add(self, lp: Logprobs) -> None:
        text = _text(lp.chosen)
        self.tokens.append(text)
        self.token_logprobs.append(lp.chosen.logprob)
        top: dict[str, float] = {}
        for alt in lp.top:  # two tokens may show as the same text: the likelier is kept
            top.setdefault(_text(alt), alt.logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self._offset)
        self._offset += len(text)

    def _slice(self, start: int) -> dict[str, Any]:
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }

    def pending(self) -> dict[str, Any]:
        start, self._sent = self._sent, len(self.tokens)
        return self._slice(start)

    def whole(self) -> dict[str, Any]:
        return self._slice(0)
