"""A deterministic stand-in for the engine, and the real daemon parts around it in-process.

FakeEngine speaks the engine's interface (sessions with prefill/decode, cancel checked
between "layers", an expert store with counts) over a byte vocabulary: a raw prompt is
its UTF-8 bytes, and each generated token is the ASCII character after the previous
token (wrapping from `~` to `!`), so transcripts are predictable: prompt "a" -> "bcd...".
`open_daemon` runs the real EngineHost, Scheduler and SERVE sessions on top of it, with
connections over in-memory streams: the protocol is tested without sockets or a model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import trio
import trio.testing
from structured_cases import byte_tokenizer_json

from colibrid.backends.base import KernelFamily
from colibrid.config import Settings
from colibrid.engine.batch import LOGITS_ALL, LOGITS_NONE, Forward
from colibrid.errors import Cancelled, RequestError
from colibrid.paths import Paths
from colibrid.serve.host import EngineHost
from colibrid.serve.models import Loaded, ModelSlot
from colibrid.serve.profiles import ProfileBook
from colibrid.serve.scheduler import Scheduler
from colibrid.serve.session import serve_connection
from colibrid.serve.state import DaemonState
from colibrid.store.pins import PinBudget, PinController
from colibrid.store.precision_plan import PrecisionPlan
from colibrid.store.recorder import UsageRecorder
from colibrid.store.telemetry import Counters, StoreStats, snapshot

VOCAB = 256
N_LAYERS = 2


@dataclass(frozen=True)
class Layout:
    moe_layers: tuple[int, ...] = (0, 1)
    n_experts: int = 4
    hidden: int = 8
    ffn: int = 4


class FakeExperts:
    """The parts of the ExpertStore protocol the daemon uses, on the real usage recorder
    and pin controller (pins are recorded, nothing moves)."""

    def __init__(self) -> None:
        self.layout = Layout()
        self.layers = self.layout.moe_layers
        self.recorder = UsageRecorder(N_LAYERS, self.layout.n_experts, self.layers)
        self.counts = self.recorder.counts
        self.pins = PinController(PinBudget("all", 2, 2))
        self.stats = Counters()
        self._pinned: list[tuple[int, int]] = []

    def record(self, layer: int, experts: Sequence[int]) -> None:
        self.recorder.record(layer, experts)

    def take_usage(self) -> list[tuple[int, np.ndarray]]:
        return self.recorder.take()

    def pinned_keys(self) -> list[tuple[int, int]]:
        return list(self._pinned)

    def apply_pins(self, counts: np.ndarray) -> int:
        self._pinned = self.pins.choose(counts, self.layers)
        return len(self._pinned)

    def request_finished(self) -> None:
        pass

    def statistics(self, since: Counters | None = None) -> StoreStats:
        snap = snapshot(
            self.stats,
            cache_per_layer=4,
            cache_bytes=0,
            pinned=len(self._pinned),
            io_mode="fake",
            policy="-",
            memwatch="off",
        )
        return replace(
            snap, total_experts=N_LAYERS * 4, resident_experts=N_LAYERS * 4, pin_note=self.pins.note
        )


@dataclass(frozen=True)
class Info:
    model_type: str = "fake"
    n_layers: int = N_LAYERS
    load_s: float = 0.0
    # every fake expert "stored" alike: a uniform plan, as a real container has by default
    plan: PrecisionPlan = field(
        default_factory=lambda: PrecisionPlan.of(
            {(layer, e): "int4-g64" for layer in range(N_LAYERS) for e in range(4)}
        )
    )


def next_token(last: int) -> int:
    return last + 1 if 33 <= last < 126 else 33


class FakeSession:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.tokens: list[int] = []
        self.prefilled = 0  # tokens computed, for KV-reuse tests

    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        all_logits: bool = False,
        cancel: threading.Event | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> np.ndarray:
        for layer in range(N_LAYERS):
            time.sleep(self.engine.layer_delay_s)
            if cancel is not None and cancel.is_set():
                raise Cancelled("request cancelled")
            if progress is not None:
                progress(layer, N_LAYERS)
            self.engine.experts.record(layer, [int(token_ids[-1]) % 4])
        self.tokens.extend(int(t) for t in token_ids)
        self.prefilled += len(token_ids)
        self.engine.computed += len(token_ids)
        logits = np.zeros(VOCAB, dtype=np.float32)
        logits[next_token(self.tokens[-1])] = 50.0
        return logits

    def decode(self, token_id: int, *, cancel: threading.Event | None = None) -> np.ndarray:
        return self.prefill([token_id], cancel=cancel)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def check(self, token_ids: Sequence[int]) -> np.ndarray:
        if self.length + len(token_ids) > self.engine.max_context:
            raise RequestError("past the context", code="CONTEXT_EXCEEDED")
        return np.asarray(token_ids, dtype=np.int64)

    def logits_after(self) -> np.ndarray:
        logits = np.zeros(VOCAB, dtype=np.float32)
        logits[next_token(self.tokens[-1])] = 50.0
        return logits

    def common_prefix(self, token_ids: Sequence[int]) -> int:
        n = 0
        for held, new in zip(self.tokens, token_ids, strict=False):
            if held != new:
                break
            n += 1
        return n

    def truncate(self, length: int) -> None:
        del self.tokens[length:]

    def kv_bytes(self) -> int:
        return 0  # no KV held: the pool's byte budget never binds

    def verify(self) -> str | None:
        return None

    def fork(self, length: int) -> FakeSession:
        copy = FakeSession(self.engine)
        copy.tokens = self.tokens[:length]
        return copy

    def remember_logits(self, length: int, logits: np.ndarray) -> None:
        pass  # every logits vector here is a function of the last token: nothing to keep

    def logits_at(self, length: int) -> np.ndarray | None:
        return None


class NoDevice:
    """The ops' one question the host asks: what device memory holds (nothing)."""

    def device_tier(self) -> None:
        return None


class FakeEngine:
    def __init__(self, *, max_context: int = 512, layer_delay_s: float = 0.0) -> None:
        self.max_context = max_context
        self.vocab_size = VOCAB
        self.experts = FakeExperts()
        self.info = Info()
        self.layer_delay_s = layer_delay_s
        self.computed = 0
        self.kv_budget_bytes = None
        self.ops = NoDevice()  # no backend: nothing held in device memory for `ps`
        self.backend = "fake"
        self.family = KernelFamily.F32
        self.mtp_on = False

    def request_finished(self) -> None:
        self.experts.request_finished()

    def apply_profile(self, counts: np.ndarray) -> None:
        self.experts.apply_pins(counts)  # no backend, so no device tier to promote into

    def new_session(self) -> FakeSession:
        return FakeSession(self)

    def run(self, forwards: Sequence[Forward], hook: Callable[[int], None] | None = None) -> list:
        """Every forward in one 'pass': the hook before each layer, as the engine does."""
        for layer in range(N_LAYERS):
            time.sleep(self.layer_delay_s)
            if hook is not None:
                hook(layer)
            for f in forwards:
                self.experts.record(layer, [int(f.tokens[-1]) % 4])
        out = []
        for f in forwards:
            rows = []
            for t in f.tokens:
                f.session.tokens.append(int(t))
                rows.append(f.session.logits_after())
            f.session.prefilled += len(f.tokens)
            self.computed += len(f.tokens)
            out.append(
                None
                if f.logits == LOGITS_NONE
                else np.stack(rows)
                if f.logits == LOGITS_ALL
                else rows[-1]
            )
        return out


class FakeCodec:
    stop_token_ids = frozenset({0})

    def tokenizer_json(self) -> str:
        return byte_tokenizer_json()

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_chat(self, messages: Sequence[dict[str, Any]], **kw: Any) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@dataclass
class InProcessDaemon:
    state: DaemonState
    nursery: trio.Nursery

    async def connect(self) -> trio.testing.MemoryStapledStream:  # type: ignore[name-defined]
        client, server = trio.testing.memory_stream_pair()
        self.nursery.start_soon(serve_connection, server, self.state)
        return client


@asynccontextmanager
async def open_daemon(
    tmp: Path, *, max_queue: int = 16, max_active: int = 4, layer_delay_s: float = 0.0
) -> AsyncIterator[InProcessDaemon]:
    engine = FakeEngine(layer_delay_s=layer_delay_s)
    codec = FakeCodec()
    book = ProfileBook(tmp / "profiles", (N_LAYERS, 4), "test", "default")
    host = EngineHost(engine, codec, usage=book)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(host.serve)
        scheduler = Scheduler(host, max_queue=max_queue, max_active=max_active)
        await nursery.start(scheduler.serve)
        models = ModelSlot(Settings(), Paths(home=tmp, socket=tmp / "s"), host, scheduler)
        models.current = Loaded("fake", tmp, engine, codec, book, tmp / "kv")
        state = DaemonState(host, scheduler, models)
        try:
            yield InProcessDaemon(state, nursery)
        finally:
            host.close()
            nursery.cancel_scope.cancel()


class LineReader:
    """Reads protocol lines (and DATA payload lines) from a stream, for assertions."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buf = b""

    async def line(self, timeout_s: float = 5.0) -> str:
        with trio.fail_after(timeout_s):
            while b"\n" not in self.buf:
                data = await self.stream.receive_some(65536)
                if not data:
                    raise EOFError(f"stream closed; pending {self.buf!r}")
                self.buf += data
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode("utf-8")

    async def until(self, prefix: str, timeout_s: float = 5.0) -> list[str]:
        """Lines up to and including the first that starts with `prefix`."""
        seen = []
        while True:
            line = await self.line(timeout_s)
            seen.append(line)
            if line.startswith(prefix):
                return seen
