"""The engine: loads a model directory and runs prefill/decode for sessions.

Synchronous and confined to one thread (the daemon's engine host owns that thread); the
heavy arithmetic runs in native kernels that release the GIL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from colibrid.backends.base import KernelFamily, require_family
from colibrid.engine import batch
from colibrid.engine.blas_threads import BLAS
from colibrid.engine.kv import KVCache, bytes_per_position
from colibrid.engine.layout import expert_layout, mtp_prefix
from colibrid.engine.mtp_draft import MTPState
from colibrid.engine.validate import validate
from colibrid.errors import Cancelled, RequestError
from colibrid.models import family as model_family
from colibrid.models.base import Model, Ops, PassClock, Segment, Step
from colibrid.models.transformer import planned_cache_layouts
from colibrid.store.checkpoint import Checkpoint
from colibrid.store.options import StoreOptions, open_store
from colibrid.store.pins import hottest
from colibrid.store.precision_plan import PrecisionPlan, plan_of
from colibrid.store.protocol import ExpertStore

log = logging.getLogger("colibri.engine")

DEFAULT_MAX_CONTEXT = 4096
Hook = Callable[[int], None]  # called before each layer of a pass with its index
PROMPT_LOGITS_KEPT = 2  # prompt ends remembered per session (a vocabulary of floats each)
VERIFY_RTOL = 1e-3  # relative L2 error a recomputed KV row or logits vector may show


@dataclass(frozen=True)
class LoadInfo:
    model_type: str
    n_layers: int
    load_s: float
    # The per-expert formats the container computes with (store/precision_plan.py): part
    # of the model's identity (ps, DONE STAT, /metrics, the prompt cache's identity).
    plan: PrecisionPlan


class Engine:
    """Implements engine.protocols.EngineLike: what requests, the batcher, the daemon's
    host and the benches use of a loaded model."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        model: Model,
        args: Any,
        experts: ExpertStore,
        family: KernelFamily,
        max_context: int,
        info: LoadInfo,
        ops: Ops,
        *,
        kv_budget_bytes: int | None = None,
        mtp_on: bool = False,
    ) -> None:
        self.checkpoint = checkpoint
        self.model = model
        self.args = args  # the family's ModelArgs (each family its own class)
        self.experts = experts
        self.family = family
        self.max_context = max_context
        self.info = info
        # The KV share of the memory budget (one sequence at the full context): what kept
        # sessions may hold between requests (engine.sessions.SessionPool).
        self.kv_budget_bytes = kv_budget_bytes
        self.mtp_on = mtp_on and model.mtp is not None  # the MTP layer drafts
        self.ops = ops  # the backend's ops (models.base.Ops)
        self.backend = ops.name  # its name as `--backend` spells it

    @property
    def vocab_size(self) -> int:
        return self.model.vocab

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        *,
        family: KernelFamily = KernelFamily.F32,
        max_context: int | None = None,
        ops: Ops | None = None,
        store: StoreOptions | None = None,
        mtp: bool = False,
    ) -> Engine:
        """Open a model directory; `ops` defaults to the CPU backend (native kernels);
        `store` chooses where routed experts live (default: StoreOptions(), see there).
        `mtp`: run the checkpoint's MTP layer (speculative drafts), when it has one: its
        experts then join the store's layout and budget."""
        if ops is None:
            from colibrid.backends.cpu import CpuOps

            ops = CpuOps()
        require_family(ops.name, ops.families, family)
        started = time.perf_counter()
        checkpoint = Checkpoint.open(model_dir)
        try:
            validate(checkpoint)  # every tensor vs config.json before any weight is mapped
        except BaseException:
            checkpoint.close()
            raise
        config = checkpoint.config
        model_type = config.get("model_type")
        module = model_family(model_type)
        args = module.ModelArgs.from_config(config)
        store_opts = store or StoreOptions()
        idle = mtp_prefix(args, checkpoint)  # loaded, not run unless drafting: no budget
        mtp_on = bool(mtp and idle)
        context = min(max_context or DEFAULT_MAX_CONTEXT, args.trunk.max_position_embeddings)
        kv = bytes_per_position(planned_cache_layouts(args, checkpoint)) * context
        experts = open_store(
            checkpoint,
            expert_layout(args, checkpoint, with_mtp=mtp_on),
            store_opts,
            str(model_type),
            kv_bytes=kv,
            idle_prefixes=(idle,) if idle and not mtp_on else (),
        )
        model = module.build(args, checkpoint, experts, ops)
        ops.prepare(checkpoint.matrix_layouts)
        if pilot_wanted(store_opts.pilot, experts):
            from colibrid.engine.pilot import attach

            attach(model, experts)
        info = LoadInfo(
            str(model_type),
            args.trunk.num_hidden_layers,
            time.perf_counter() - started,
            plan_of(checkpoint, experts.layout),
        )
        engine = cls(
            checkpoint, model, args, experts, family, context, info, ops,
            kv_budget_bytes=kv, mtp_on=mtp_on,
        )  # fmt: skip
        engine.promote_hottest(experts.counts)  # the profile's pins, on the device too
        return engine

    def apply_profile(self, counts: np.ndarray) -> None:
        """A usage profile's selection counts take effect: the store pins its hottest
        experts in RAM (store/pins.py's rule), then the backend's device tier is offered
        them, hottest first (``promote_hottest``). Placement only: no token changes."""
        self.experts.apply_pins(counts)
        self.promote_hottest(counts)

    def promote_hottest(self, counts: np.ndarray) -> int:
        """Offer the backend's device tier (Ops.promote) the experts in RAM by heat: every
        used expert when the store holds them all, else the pinned ones. Returns the
        weights it copied (0 on the cpu backend, or without a profile)."""
        store = self.experts
        layers = store.layout.profiled_layers
        if all(store.resident(layer) is not None for layer in layers):
            keys = hottest(counts, layers, counts.size)
        else:
            keys = sorted(store.pinned_keys(), key=lambda k: (-int(counts[k]), k))
        if not keys:
            return 0
        copied = self.ops.promote([store.get(layer, expert) for layer, expert in keys])
        if copied:
            log.info(
                "colibri: %d weights of the profile's hottest experts copied to the %s "
                "device tier", copied, self.ops.name,
            )  # fmt: skip
        return copied

    def new_session(self) -> Session:
        return Session(self)

    def hidden_states(
        self, tokens: np.ndarray, parts: Sequence[tuple[Session, int]], hook: Hook | None
    ) -> np.ndarray:
        """One forward pass over ``parts`` (a session and how many of ``tokens`` are its
        new rows, in order): each session's rows are written after what it holds; commits
        nothing (the caller advances the caches it keeps). Final-normed hidden [S, D]."""
        clock = PassClock()
        segments = [
            Segment(s.cache, Step(s.cache.length, self.family, hook, clock), rows)
            for s, rows in parts
        ]
        BLAS.before_pass(len(tokens))  # decode: numpy's BLAS threads off the kernels' cores
        t0 = time.perf_counter()
        try:  # a failed pass leaves every length unchanged, so rows it wrote are never read
            return self.model.hidden_states(tokens, segments)
        except BaseException:
            self.experts.abort_pass()  # reads land, slots free: the store is as before
            raise
        finally:  # a token boundary: the store may resize, never mid-layer
            self.experts.between_tokens(time.perf_counter() - t0, clock.attention_s, len(tokens))

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return self.model.logits(hidden, self.family)

    def draft_pass(self, run: Callable[[], np.ndarray]) -> np.ndarray:
        """A speculative drafter's pass through model layers (the MTP layer): the store
        keeps its experts as after any pass, but counts it as no step of an answer."""
        t0 = time.perf_counter()
        try:
            return run()
        except BaseException:
            self.experts.abort_pass()
            raise
        finally:
            self.experts.between_tokens(time.perf_counter() - t0, 0.0, 0)

    def run(
        self, forwards: Sequence[batch.Forward], hook: Hook | None = None
    ) -> list[np.ndarray | None]:
        """Every forward's new rows in one pass (engine.batch.run)."""
        return batch.run(self, forwards, hook)

    def request_finished(self) -> None:
        """A request ended (its driver says so, once: the daemon's host, `generate`): the
        store persists its usage profile and re-pins."""
        self.experts.request_finished()

    def close(self) -> None:
        self.experts.close()
        self.checkpoint.close()


def pilot_wanted(mode: str, store: ExpertStore) -> bool:
    """PILOT "auto" is on exactly when experts stream (the cache cannot hold them all): there
    it measured as a win (`colibri bench stream` on a synthetic GLM-5 container 3x larger
    than the budget: 1.52 vs 0.91 tok/s); with every expert cached it can only cost."""
    if mode != "auto":
        return mode == "on"
    return store.streams()


class Session:
    """One sequence: its KV cache and position. Not thread-safe; one engine thread uses it."""

    def __init__(
        self, engine: Engine, cache: KVCache | None = None, tokens: Sequence[int] = ()
    ) -> None:
        self.engine = engine
        self.cache = cache or KVCache(engine.model.cache_layouts(), engine.max_context)
        self.tokens: list[int] = list(tokens)  # what the KV cache holds, for prefix reuse
        self.mtp: MTPState | None = None  # the MTP drafter's side, when the engine drafts
        if engine.mtp_on:
            self.mtp = MTPState(engine.model.mtp.cache_layout(), engine.max_context + 64)
        # Logits at the end of recent prompts, by length: a repeated prompt is answered
        # from them, so it samples from exactly the numbers its first run did.
        self._prompt_logits: dict[int, np.ndarray] = {}

    @property
    def length(self) -> int:
        return self.cache.length

    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        all_logits: bool = False,
        cancel: threading.Event | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> np.ndarray:
        """Run the new tokens as one batch; logits of the last one [V] (or all: [S, V]).

        With `cancel`, a set event abandons the pass between layers with `Cancelled`; the
        session then holds exactly the tokens it held before the call. `progress(done,
        total)` is called before each layer with the layers done so far.
        """
        mode = batch.LOGITS_ALL if all_logits else batch.LOGITS_LAST
        hook = pass_hook(self.engine.info.n_layers, cancel, progress)
        return batch.run(self.engine, [batch.Forward.of(self, token_ids, mode)], hook)[0]

    def decode(self, token_id: int, *, cancel: threading.Event | None = None) -> np.ndarray:
        return self.prefill([token_id], cancel=cancel)

    def truncate(self, length: int) -> None:
        """Forget everything after the first `length` tokens (prefix reuse, cancelled turns)."""
        self.cache.truncate(length)
        del self.tokens[length:]
        if self.mtp is not None:
            self.mtp.truncate(length)
        self._prompt_logits = {n: v for n, v in self._prompt_logits.items() if n <= length}

    def fork(self, length: int) -> Session:
        """A new session holding a copy of this one's first `length` tokens: their KV, the
        MTP layer's rows and hidden states for them, and the logits remembered after any
        of them (a prompt answered here is answered from the same numbers there, so it
        repeats exactly); this one is left as it is."""
        copy = Session(self.engine, self.cache.copy_prefix(length), self.tokens[:length])
        if self.mtp is not None:
            copy.mtp = self.mtp.copy_prefix(length)
        copy._prompt_logits = {n: v for n, v in self._prompt_logits.items() if n <= length}
        return copy

    def kv_bytes(self) -> int:
        return self.cache.nbytes()

    def remember_logits(self, length: int, logits: np.ndarray) -> None:
        """Keep the logits after the first `length` tokens (the end of a prompt)."""
        self._prompt_logits[length] = np.array(logits, copy=True)
        while len(self._prompt_logits) > PROMPT_LOGITS_KEPT:
            del self._prompt_logits[min(self._prompt_logits)]

    def remembered_logits(self) -> dict[int, np.ndarray]:
        """Every remembered prompt end, by length (what a saved prompt cache keeps)."""
        return dict(self._prompt_logits)

    def logits_at(self, length: int) -> np.ndarray | None:
        """The remembered logits after exactly `length` held tokens, if any (`truncate`
        forgets those past what is held)."""
        return self._prompt_logits.get(length)

    def common_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` the cache already holds."""
        n = 0
        for held, new in zip(self.tokens, token_ids, strict=False):
            if held != new:
                break
            n += 1
        return n

    def verify(self) -> str | None:
        """Recompute the last held position, and every position whose logits are
        remembered, from the KV before it; None when the results agree with what is held,
        else why they do not. The session is left exactly as it was either way.

        Why: KV kept across a restart (or computed by a pass that went wrong) is trusted
        only after the weights, as loaded now, give the same rows and logits again. A
        position is recomputed as a one-token step, which may differ from the batched
        prefill that made it in the last bits, hence a tolerance, far below what a wrong
        expert, a stale weight file or a damaged row changes.
        """
        n = len(self.tokens)
        if n == 0 or self.cache.length != n:
            return f"holds {self.cache.length} rows for {n} tokens"
        for p in sorted({*self._prompt_logits, n}):
            reason = self._verify_position(p)
            if reason is not None:
                return reason
        return None

    def _verify_position(self, p: int) -> str | None:
        cache, held = self.cache, self.cache.length
        saved = cache.position(p - 1)
        cache.truncate(p - 1)  # rows stay in memory; the pass rewrites row p - 1
        try:
            hidden = self._pass(np.asarray(self.tokens[p - 1 : p], dtype=np.int64), None)
            logits = self.engine.logits(hidden[-1:])[0]
            again = cache.position(p - 1)
        finally:
            cache.put_position(p - 1, saved)
            cache.length = held
        for layer, (before, now) in enumerate(zip(saved, again, strict=True)):
            for name, row in before.items():
                if _relative_error(now[name], row) > VERIFY_RTOL:
                    return f"layer {layer} {name} at position {p - 1} does not recompute"
        remembered = self._prompt_logits.get(p)
        if remembered is not None and _relative_error(logits, remembered) > VERIFY_RTOL:
            return f"the logits after {p} tokens do not recompute"
        return None

    def _pass(self, tokens: np.ndarray, hook: Hook | None) -> np.ndarray:
        """One forward pass writing rows [length, length + S); commits nothing."""
        return self.engine.hidden_states(tokens, [(self, len(tokens))], hook)

    def commit(self, tokens: np.ndarray, hidden: np.ndarray | None = None) -> None:
        """The rows a pass wrote after what the session held are now held (`hidden`:
        their final hidden states, which the MTP drafter feeds on)."""
        if self.mtp is not None and hidden is not None:
            self.mtp.note(self.cache.length, hidden)
        self.cache.advance(len(tokens))
        self.tokens.extend(int(t) for t in tokens)

    def check(self, token_ids: Sequence[int]) -> np.ndarray:
        """`token_ids` as the int64 rows a pass takes, refused when out of range or when
        they would not fit the context (before any pass runs, so a pass shared with other
        sessions never fails for one of them)."""
        return self._check(token_ids)

    def _check(self, token_ids: Sequence[int]) -> np.ndarray:
        tokens = np.asarray(list(token_ids), dtype=np.int64)
        if tokens.ndim != 1 or tokens.size == 0:
            raise RequestError("no tokens to run")
        vocab = self.engine.vocab_size
        if tokens.min() < 0 or tokens.max() >= vocab:
            raise RequestError(f"token id out of range [0, {vocab})")
        if self.cache.length + tokens.size > self.engine.max_context:
            raise RequestError(
                f"{self.cache.length + tokens.size} tokens exceed the context limit of "
                f"{self.engine.max_context}",
                code="CONTEXT_EXCEEDED",
            )
        return tokens


def pass_hook(
    layers: int,
    cancel: threading.Event | None,
    progress: Callable[[int, int], None] | None = None,
) -> Hook | None:
    """The hook a pass calls before each layer: a set `cancel` abandons the pass with
    `Cancelled` (the sessions hold what they held before), `progress(done, layers)`
    follows it."""
    if cancel is None and progress is None:
        return None

    def hook(index: int) -> None:
        if cancel is not None and cancel.is_set():
            raise Cancelled("request cancelled")
        if progress is not None:
            progress(index, layers)

    return hook


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """‖got − want‖ / ‖want‖ (inf when the shapes differ or either is not finite)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape or not (np.isfinite(got).all() and np.isfinite(want).all()):
        return float("inf")
    scale = float(np.linalg.norm(want))
    return float(np.linalg.norm(got - want)) / max(scale, 1e-30)
