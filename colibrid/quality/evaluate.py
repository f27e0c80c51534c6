"""Teacher-forced comparison of a model with a reference on a fixed text set.

Why this text set: it needs no download and is the same on every machine. The prompts
are the first few lines of each built-in domain profile (``profiles/<domain>/warm.txt``,
raw text, no chat template), and each is continued by the *reference's* own greedy
tokens; both models are then run teacher-forced over exactly those token sequences, so
they see identical inputs and differ only in the distributions they give. The scored
positions are the ones predicting the continuation (the last prompt token onwards).

The reference runs first and alone (its logits at the scored positions are kept, then it
is closed), so the two models never share the machine's memory; a :class:`Reference`
can be scored against many models (``requant --max-kl`` tries several plans).

Beside the quality figures: the *expert bytes a token* — the stored bytes of the routed
experts the model's router chose, per token (what a token reads when no expert is in
memory, so a plan's saving shows even on a machine where everything fits) — and,
optionally, the decode speed when the experts stream at a given RAM budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from colibrid.errors import ColibriError
from colibrid.quality.scores import Scores
from colibrid.store.options import StoreOptions

if TYPE_CHECKING:
    from colibrid.engine.engine import Engine

DOMAINS = ("chat", "code", "math", "prose")
Say = Callable[[str], None]


class EvalError(ColibriError):
    """An evaluation that cannot run (different vocabularies, a model that is no model)."""


@dataclass(frozen=True)
class EvalSettings:
    prompts: int = 4  # per built-in domain
    tokens: int = 32  # reference continuation per prompt


@dataclass
class Reference:
    """The reference's sequences and its logits where they are scored."""

    path: Path
    sequences: list[list[int]]
    starts: list[int]  # first scored position of each sequence (its last prompt token)
    logits: list[np.ndarray]  # [len - start - 1, V] per sequence
    vocab: int
    expert_bytes_per_token: float  # the reference's own, over the same sequences
    plan: dict[str, object]


def eval_texts(per_domain: int) -> list[str]:
    """The fixed prompts: the first ``per_domain`` lines of each built-in profile."""
    from colibri_cli.commands.profile import BUILTIN, read_prompt_file

    texts: list[str] = []
    for domain in DOMAINS:
        texts += read_prompt_file(BUILTIN / domain / "warm.txt")[:per_domain]
    return texts


def quiet_store() -> StoreOptions:
    """A store that learns nothing and writes nothing: evaluation must not change a
    user's profiles (placement never changes the logits, so any placement will do)."""
    return StoreOptions(save_profile=False, pin="off", pilot="off", profile=None)


def _scored(logits: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(logits[start:-1], dtype=np.float32)


def build_reference(
    path: Path, settings: EvalSettings, say: Say, store: StoreOptions | None = None
) -> Reference:
    """Run the reference: greedy continuations of the fixed prompts, then its logits over
    each whole sequence (one prefill each, as the model under test will see it)."""
    from colibrid.engine.engine import Engine
    from colibrid.engine.tokenizer import TextCodec

    texts = eval_texts(settings.prompts)
    codec = TextCodec.load(path)
    engine = Engine.load(path, store=store or quiet_store())
    try:
        sizes, counted = expert_sizes(engine), Counted(engine.experts.counts)
        sequences, starts, kept = [], [], []
        for i, text in enumerate(texts, 1):
            ids = codec.encode(text, add_special_tokens=False)
            if not ids:
                continue
            session = engine.new_session()
            logits = np.asarray(session.prefill(ids))
            seq = list(ids)
            for _ in range(settings.tokens):
                seq.append(int(np.argmax(logits.reshape(-1))))
                logits = np.asarray(session.decode(seq[-1]))
            engine.request_finished()
            # One teacher-forced pass over the whole sequence: the model under test gets
            # the same single prefill, so both sides use the same kernel paths.
            with counted:
                full = np.asarray(engine.new_session().prefill(seq, all_logits=True))
                engine.request_finished()
            sequences.append(seq)
            starts.append(len(ids) - 1)
            kept.append(_scored(full, len(ids) - 1))
            say(f"reference {i}/{len(texts)}: {len(ids)} prompt + {settings.tokens} tokens")
        tokens = sum(len(seq) for seq in sequences)
        per_token = counted.bytes(sizes) / max(1, tokens)
        plan = engine.info.plan.as_json()
        return Reference(path, sequences, starts, kept, engine.vocab_size, per_token, plan)
    finally:
        engine.close()


def expert_sizes(engine: Engine) -> np.ndarray:
    """Stored bytes of each routed expert [max layer + 1, n_experts] (data and scales of
    its three matrices, from the headers)."""
    from colibrid.store.experts import PROJECTIONS

    ckpt, layout = engine.checkpoint, engine.experts.layout
    sizes = np.zeros((max(layout.moe_layers, default=0) + 1, layout.n_experts), dtype=np.int64)
    for layer in layout.profiled_layers:
        for e in range(layout.n_experts):
            for proj in PROJECTIONS:
                name = layout.tensor_name(layer, e, proj)
                sizes[layer, e] += ckpt.info(name).nbytes
                if ckpt.has(name + ".qs"):
                    sizes[layer, e] += ckpt.info(name + ".qs").nbytes
    return sizes


class Counted:
    """Expert selections made inside ``with`` blocks (the store's running counts)."""

    def __init__(self, counts: np.ndarray) -> None:
        self.counts = counts
        self.total = np.zeros(counts.shape, dtype=np.int64)

    def __enter__(self) -> Counted:
        self.before = np.array(self.counts, dtype=np.int64, copy=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.total += np.array(self.counts, dtype=np.int64, copy=True) - self.before

    def bytes(self, sizes: np.ndarray) -> float:
        """Stored bytes of every selection counted."""
        rows = min(len(self.total), len(sizes))
        return float((self.total[:rows] * sizes[:rows]).sum())


@dataclass
class ModelRun:
    scores: Scores
    expert_bytes_per_token: float
    plan: dict[str, object]


def score_model(
    path: Path, ref: Reference, say: Say, store: StoreOptions | None = None
) -> ModelRun:
    """The model teacher-forced over the reference's sequences, scored against it."""
    from colibrid.engine.engine import Engine

    engine = Engine.load(path, store=store or quiet_store())
    try:
        if engine.vocab_size != ref.vocab:
            raise EvalError(
                f"{path}: vocabulary of {engine.vocab_size} tokens, the reference "
                f"{ref.path} has {ref.vocab}: not the same model"
            )
        sizes, counted = expert_sizes(engine), Counted(engine.experts.counts)
        scores = Scores()
        tokens = 0
        for i, (seq, start, want) in enumerate(
            zip(ref.sequences, ref.starts, ref.logits, strict=True), 1
        ):
            with counted:
                logits = np.asarray(engine.new_session().prefill(seq, all_logits=True))
                engine.request_finished()
            scores.add(want, _scored(logits, start), np.asarray(seq[start + 1 :]))
            tokens += len(seq)
            say(f"model {i}/{len(ref.sequences)}: mean KL so far {scores.summary()['kl_mean']:.5f}")
        per_token = counted.bytes(sizes) / max(1, tokens)
        return ModelRun(scores, per_token, engine.info.plan.as_json())
    finally:
        engine.close()


def stream_speed(path: Path, ram_gb: float, sequence: Sequence[int], start: int) -> dict:
    """Decode tok/s with the experts streamed at ``ram_gb`` of RAM: the sequence's prompt
    prefilled, its continuation decoded teacher-forced (so every plan decodes the same
    tokens), beside the disk probe's roofline for the bytes it read."""
    from colibrid.engine.engine import Engine
    from colibrid.store.read_probe import probe

    opts = StoreOptions(mode="tiered", ram_gb=ram_gb, save_profile=False, pin="off", pilot="off")
    engine = Engine.load(path, store=opts)
    try:
        store = engine.experts
        if not store.reads_experts():
            return {"ram_gb": ram_gb, "note": "every expert fits: nothing streams"}
        gbs, _ = probe(store, 32, store.pool.threads or 1)
        session = engine.new_session()
        session.prefill(list(sequence[: start + 1]))
        base = store.stats.copy()
        wall = 0.0
        steps = 0
        for token in sequence[start + 1 :]:
            t0 = time.perf_counter()
            session.decode(int(token))
            wall += time.perf_counter() - t0
            steps += 1
        st = store.statistics(since=base)
        gb_tok = st.bytes_read / 1e9 / max(1, steps)
        return {
            "ram_gb": ram_gb,
            "tok_s": steps / wall if wall > 0 else 0.0,
            "gb_read_per_token": gb_tok,
            "probe_gb_s": gbs,
            "roofline_tok_s": gbs / gb_tok if gb_tok > 0 else None,
        }
    finally:
        engine.close()
