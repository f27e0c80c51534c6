"""The engine seam: what requests, the batcher, the MTP drafter and the daemon's host use
of an engine and its sessions (`colibrid.engine.engine.Engine` and `Session` implement
these; the tests' fakes implement what they need of them)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from colibrid.backends.base import KernelFamily
from colibrid.engine.batch import Forward
from colibrid.models.base import Model

Hook = Callable[[int], None]  # called before each layer of a pass with its index


class SessionLike(Protocol):
    """One sequence's KV cache and position."""

    @property
    def length(self) -> int: ...

    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        all_logits: bool = False,
        cancel: threading.Event | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> np.ndarray: ...
    def decode(self, token_id: int, *, cancel: threading.Event | None = None) -> np.ndarray: ...
    def common_prefix(self, token_ids: Sequence[int]) -> int: ...
    def truncate(self, length: int) -> None: ...
    def remember_logits(self, length: int, logits: np.ndarray) -> None: ...
    def logits_at(self, length: int) -> np.ndarray | None: ...


class PassInfo(Protocol):
    n_layers: int


class EngineLike(Protocol):
    """What a request (engine.request_run) and the batcher need of an engine."""

    max_context: int
    mtp_on: bool  # the MTP layer drafts (speculation "mtp"/"auto" uses it)
    info: PassInfo

    @property
    def vocab_size(self) -> int: ...

    def new_session(self) -> SessionLike: ...

    def run(self, forwards: Sequence[Forward], hook: Hook | None = None) -> list[np.ndarray | None]:
        """Every forward's new rows in one pass; each forward's logits (or None)."""
        ...

    def request_finished(self) -> None:
        """A request left (its driver's call): the store saves its usage, re-pins."""
        ...


class DraftingEngine(Protocol):
    """What the MTP drafter (engine.mtp_draft) needs of an engine: its model (whose MTP
    layer drafts), the kernel family, the head, and passes the store counts as drafts."""

    model: Model
    family: KernelFamily

    def logits(self, hidden: np.ndarray) -> np.ndarray: ...

    def draft_pass(self, run: Callable[[], np.ndarray]) -> np.ndarray: ...
