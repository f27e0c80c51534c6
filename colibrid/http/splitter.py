"""Which splitter a template's output gets, and the whole-output helper over it.

This is the one module that knows both output formats: `parsing` (GLM-style tags, and the
types every splitter shares) and `harmony` (gpt-oss), which builds on `parsing`. Choosing
between them here, above both, keeps the dependency one way (harmony -> parsing): when the
choice lived in `parsing` it had to import `harmony` back, a cycle hidden in a function
(tests/test_layering.py fails on such cycles).
"""

from __future__ import annotations

from typing import Protocol

from colibrid.http.harmony import HarmonySplitter
from colibrid.http.parsing import Features, OutputSplitter, ToolCall


class Splitter(Protocol):
    """What the HTTP translators feed generated text to."""

    def feed(self, text: str) -> list[tuple[str, str]]: ...

    def finish(self, *, whole: bool = True) -> tuple[list[tuple[str, str]], list[ToolCall]]: ...


def make_splitter(features: Features) -> Splitter:
    """The splitter for the template's output format: Harmony or GLM-style tags."""
    if features.harmony:
        return HarmonySplitter(features)
    return OutputSplitter(features)


def split_all(text: str, features: Features) -> tuple[str, str, list[ToolCall]]:
    """The whole output at once: (reasoning, content, tool calls)."""
    splitter = make_splitter(features)
    pieces = splitter.feed(text)
    rest, calls = splitter.finish()
    pieces += rest
    reasoning = "".join(t for k, t in pieces if k == "reasoning")
    content = "".join(t for k, t in pieces if k == "content")
    return reasoning, content, calls
