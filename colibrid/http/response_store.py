"""The Responses API's `store`: the last few responses' conversations, kept in memory so
that a request naming one as `previous_response_id` continues it.

Why in memory and bounded: a stored response is only worth its conversation (the chat
messages up to and including its answer), and continuing one is cheap anyway because the
daemon's prompt cache reuses the KV of any prefix it has seen; keeping them on disk would
make the daemon a database of its users' chats. So the store keeps at most `KEPT`
conversations, drops the least recently used first, and forgets everything on restart —
docs/api-fields.md says so to the user. A lock guards the map: plans for large bodies are
made in a worker thread (http/body.py) while answers are recorded on the trio loop.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

KEPT = 64  # conversations kept; each at most the model's context of text

Conversation = tuple[dict[str, Any], ...]


class ResponseStore:
    """Response id -> the conversation it ended (chat messages, the answer last)."""

    def __init__(self, capacity: int = KEPT) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, Conversation] = OrderedDict()
        self._lock = threading.Lock()

    def keep(self, response_id: str, conversation: Conversation) -> None:
        with self._lock:
            self._kept[response_id] = conversation
            self._kept.move_to_end(response_id)
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def get(self, response_id: str) -> Conversation | None:
        """The conversation, or None when it was never kept or has been dropped."""
        with self._lock:
            conversation = self._kept.get(response_id)
            if conversation is not None:
                self._kept.move_to_end(response_id)
            return conversation

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)
