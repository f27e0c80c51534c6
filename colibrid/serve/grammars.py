"""Grammars compiled for requests: in worker processes, under a deadline and a memory
limit, off the event loop and off the engine thread, each content compiled once.

A request that carries a grammar (SERVE's grammar payload, HTTP `response_format` and
forced tool calls) is prepared here before it is queued: its `Grammar` goes to a grammar
worker process (colibrid.engine.grammar_worker), which compiles and validates it and
builds it once into a matcher for the loaded model's tokenizer; then a matcher of the
request's own is built here in a worker thread (llguidance drops the GIL for it), and the
request reaches the engine thread with its `Constraint` ready. What a crafted grammar can
do (overflow the stack, allocate without bound, run for minutes) happens in a worker
process and costs that request one line, "grammar too complex: ...", and that process:
the next grammar gets a fresh one.

Verdicts are cached by content (the grammar's digest and the tokenizer it was built
for): a repeated schema compiles once, and a repeated bomb is refused at once. A missed
deadline is remembered for `TIMEOUT_MEMORY_S` only, since a loaded machine may be the
cause; everything else a grammar does is deterministic and is remembered as long as it
stays among the last `CACHE_ENTRIES` grammars.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import signal
import subprocess
import sys
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from colibrid.engine.constraint import Constraint, Vocabulary
from colibrid.engine.engine import Engine
from colibrid.engine.grammar import CompiledGrammar, Grammar
from colibrid.engine.tokenizer import TextCodec
from colibrid.errors import ConfigError, NoModel, RequestError

log = logging.getLogger("colibrid.grammars")

CACHE_ENTRIES = 256
TIMEOUT_MEMORY_S = 60.0  # how long a grammar that missed its deadline stays refused
START_TIMEOUT_S = 60.0  # a worker's start, and its reading of a model's tokenizer
MAX_REPLY_BYTES = 64 << 20  # a compiled grammar is about as large as its text
MIN_MEMORY_MB = 768  # the interpreter, llguidance and the compiling thread's stack


@dataclass(frozen=True)
class GrammarLimits:
    """`workers` processes at most (each compiles one grammar at a time), `timeout_s` for
    one grammar, `memory_mb` of address space each (config.toml `grammar_workers`,
    `grammar_timeout_s`, `grammar_memory_mb`)."""

    workers: int = 2
    timeout_s: float = 5.0
    memory_mb: int = 2048

    @classmethod
    def of(cls, settings: Any) -> GrammarLimits:
        """The limits config.toml sets (ConfigError for a value that is not positive)."""
        limits = cls(
            settings.grammar_workers, settings.grammar_timeout_s, settings.grammar_memory_mb
        )
        for name, value in (
            ("grammar_workers", limits.workers),
            ("grammar_timeout_s", limits.timeout_s),
            ("grammar_memory_mb", limits.memory_mb),
        ):
            if not value > 0:
                raise ConfigError(f"{name} must be positive, not {value!r}")
        if limits.memory_mb < MIN_MEMORY_MB:
            raise ConfigError(
                f"grammar_memory_mb must be at least {MIN_MEMORY_MB} (a compiler process "
                f"with a model's tokenizer needs about that), not {limits.memory_mb}"
            )
        return limits


class _WorkerGone(Exception):
    """The worker process ended (crashed, killed by its memory limit) mid-request."""


class _Worker:
    """One grammar worker process and the line-protocol conversation with it."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.tokenizer: str | None = None  # the key of the tokenizer it holds
        self._buffer = bytearray()

    async def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        line = json.dumps(request, ensure_ascii=False).encode() + b"\n"
        try:
            await self.process.stdin.send_all(line)
            while b"\n" not in self._buffer:
                chunk = await self.process.stdout.receive_some(1 << 20)
                if not chunk or len(self._buffer) > MAX_REPLY_BYTES:
                    raise _WorkerGone
                self._buffer += chunk
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise _WorkerGone from None
        end = self._buffer.index(b"\n")
        try:
            reply = json.loads(bytes(self._buffer[:end]))
        except ValueError:
            raise _WorkerGone from None
        del self._buffer[: end + 1]
        if not isinstance(reply, dict):
            raise _WorkerGone
        return reply

    async def end(self) -> str:
        """Stop the process (if it still runs) and say how it ended, for a message."""
        with trio.CancelScope(shield=True):
            if self.process.returncode is None:
                self.process.kill()
            code = await self.process.wait()
            for pipe in (self.process.stdin, self.process.stdout):
                if pipe is not None:
                    await pipe.aclose()
        if code < 0:
            try:
                return signal.Signals(-code).name
            except ValueError:
                return f"signal {-code}"
        return f"exit status {code}"


@dataclass
class _Verdict:
    compiled: CompiledGrammar | None
    error: str | None
    expires: float = math.inf


@dataclass
class _ModelVocabulary:
    owner: int  # id() of the engine it is for
    key: str  # what the workers call its tokenizer
    vocabulary: Vocabulary
    tokenizer_json: str
    stop_ids: list[int]


class GrammarService:
    """The daemon's grammar compiler (one per daemon; `aclose` ends its processes)."""

    def __init__(self, limits: GrammarLimits = GrammarLimits()) -> None:
        self.limits = limits
        self._slots = trio.CapacityLimiter(max(1, limits.workers))
        self._threads = trio.CapacityLimiter(max(1, limits.workers))
        self._idle: list[_Worker] = []
        self._cache: OrderedDict[tuple[str, str], _Verdict] = OrderedDict()
        self._model: _ModelVocabulary | None = None
        self._model_lock = trio.Lock()
        self._keys = itertools.count(1)
        self.compiled = self.refused = self.cache_hits = 0

    # ---- what requests ask ------------------------------------------------------------
    async def check(self, grammar: Grammar) -> CompiledGrammar:
        """`grammar` compiled and validated without a model (a tool's parameters
        schema, checked by itself so an error can name the tool); RequestError else."""
        return await self._compiled(grammar, None)

    async def constraint(
        self, grammar: Grammar, engine: Engine | None, codec: TextCodec | None
    ) -> Constraint:
        """A fresh matcher of `grammar` for the model `engine` serves (its `codec` holds
        the tokenizer); RequestError with the one-line reason when it cannot be had."""
        if engine is None or codec is None:
            raise NoModel("no model is loaded")
        model = await self._vocabulary(engine, codec)
        compiled = await self._compiled(grammar, model)
        build = partial(model.vocabulary.constraint, compiled)
        return await trio.to_thread.run_sync(build, limiter=self._threads)

    def statistics(self) -> dict[str, Any]:
        return {
            "compiled": self.compiled,
            "refused": self.refused,
            "cache_hits": self.cache_hits,
            "workers": len(self._idle),
        }

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for worker in idle:
            await worker.end()

    # ---- the model's vocabulary ---------------------------------------------------------
    async def _vocabulary(self, engine: Engine, codec: TextCodec) -> _ModelVocabulary:
        async with self._model_lock:
            if self._model is None or self._model.owner != id(engine):
                self._model = None
                text = await trio.to_thread.run_sync(codec.tokenizer_json)
                stops = codec.stop_token_ids
                build = partial(Vocabulary, text, engine.vocab_size, stops, id(engine))
                vocabulary = await trio.to_thread.run_sync(build)
                key = f"t{next(self._keys)}"
                self._model = _ModelVocabulary(id(engine), key, vocabulary, text, sorted(stops))
            return self._model

    # ---- compiling ----------------------------------------------------------------------
    async def _compiled(self, grammar: Grammar, model: _ModelVocabulary | None) -> CompiledGrammar:
        key = (grammar.key, model.key if model else "")
        verdict = self._cache.get(key)
        if verdict is not None and verdict.expires < trio.current_time():
            del self._cache[key]
            verdict = None
        if verdict is None:
            verdict = await self._compile(grammar, model)
            self._cache[key] = verdict
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
            self.cache_hits += 1
        if verdict.compiled is None:
            raise RequestError(verdict.error or "invalid grammar")
        return CompiledGrammar(grammar.kind, verdict.compiled.source)

    async def _compile(self, grammar: Grammar, model: _ModelVocabulary | None) -> _Verdict:
        request = {
            "op": "compile",
            "kind": grammar.kind,
            "form": grammar.form,
            "text": grammar.text,
            "tokenizer": model.key if model else None,
        }
        async with self._slots:
            worker = self._idle.pop() if self._idle else None
            kept = False
            try:
                if worker is None:
                    worker = await self._start()
                if model is not None and worker.tokenizer != model.key:
                    await self._send_tokenizer(worker, model)
                with trio.move_on_after(self.limits.timeout_s) as deadline:
                    reply = await worker.ask(request)
                if deadline.cancelled_caught:
                    return self._refuse(
                        grammar,
                        f"compiling it took longer than {self.limits.timeout_s:g} s "
                        "(grammar_timeout_s)",
                        expires=trio.current_time() + TIMEOUT_MEMORY_S,
                    )
                kept = True
            except _WorkerGone:
                how = await worker.end() if worker is not None else "no process"
                return self._refuse(
                    grammar,
                    f"compiling it stopped the grammar compiler ({how}; its limit is "
                    f"grammar_memory_mb = {self.limits.memory_mb})",
                )
            finally:
                if worker is not None and kept:
                    self._idle.append(worker)
                elif worker is not None:
                    await worker.end()
        if "source" in reply:
            self.compiled += 1
            return _Verdict(CompiledGrammar(grammar.kind, reply["source"]), None)
        return _Verdict(None, str(reply.get("error") or "invalid grammar"))

    def _refuse(self, grammar: Grammar, why: str, *, expires: float = math.inf) -> _Verdict:
        self.refused += 1
        log.warning("a %s grammar (%d bytes) was refused: %s", grammar.kind, len(grammar.text), why)
        return _Verdict(None, f"grammar too complex: {why}", expires)

    async def _start(self) -> _Worker:
        env = {**os.environ, "RUST_BACKTRACE": "0", "MALLOC_ARENA_MAX": "2"}
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "colibrid.engine.grammar_worker", str(self.limits.memory_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        worker = _Worker(process)
        with trio.move_on_after(START_TIMEOUT_S):
            try:
                await worker.ask({"op": "ping"})
                return worker
            except _WorkerGone:
                pass
        how = await worker.end()
        raise RequestError(f"the grammar compiler did not start ({how}); see the daemon's log")

    async def _send_tokenizer(self, worker: _Worker, model: _ModelVocabulary) -> None:
        request = {
            "op": "tokenizer",
            "key": model.key,
            "json": model.tokenizer_json,
            "n_vocab": model.vocabulary.vocab_size,
            "eos": model.stop_ids,
        }
        reply: dict[str, Any] = {
            "error": "the grammar compiler took too long to read the tokenizer"
        }
        with trio.move_on_after(START_TIMEOUT_S):
            reply = await worker.ask(request)
        if "error" in reply:
            raise RequestError(str(reply["error"]))
        worker.tokenizer = model.key
