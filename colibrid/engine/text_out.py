"""The text a request releases: the detokeniser's pieces, held back where a stop string
could start, cut at the first stop string that completes."""

from __future__ import annotations

from collections.abc import Sequence

from colibrid.engine.tokenizer import StreamingDetokenizer


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back what could start one.

    Text is released only once no stop string can begin in it, so a stop string split
    over several tokens is still caught and nothing of it is ever emitted. The stop string
    that completes first wins (on a tie, the one that starts first), so the result does
    not depend on how the text was split into tokens.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._held = ""
        self.matched: str | None = None  # the stop string found, once one is

    def feed(self, text: str, *, final: bool = False) -> tuple[str, bool]:
        """Returns (text to release, whether a stop string was found)."""
        buf = self._held + text
        hits = [(i + len(s), i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:
            self._held = ""
            _, start, self.matched = min(hits)
            return buf[:start], True
        keep = 0 if final else self._longest_stop_prefix_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best


class TextOut:
    """A request's text side: each sampled token's piece of text (none for a stop token's
    own), flushed at the last token, through the stop-string matcher. Without a
    detokeniser (ids in, ids out) there is no text and no stop string."""

    def __init__(self, detokenizer: StreamingDetokenizer | None, stops: Sequence[str]) -> None:
        self._detok = detokenizer
        self._matcher = StopStringMatcher(stops)

    @property
    def matched(self) -> str | None:
        """The stop string that ended the answer, once one did."""
        return self._matcher.matched

    def feed(self, token: int, *, is_stop: bool, last: bool) -> tuple[str, bool]:
        """The text ``token`` releases, and whether a stop string was found in it."""
        detok = self._detok
        piece = "" if detok is None or is_stop else detok.push(token)
        if last and detok is not None:
            piece += detok.flush()
        return self._matcher.feed(piece, final=last)
