"""The prompt cache across restarts: kept sessions saved when the daemon stops, read back
when it starts.

Why: an agent's long system prompt costs minutes of prefill on a model that streams its
experts; a daemon restart (an upgrade, a reboot) should not cost that again.

One ``.npz`` per session under ``$COLIBRI_HOME/kv/<model>/`` (numpy's zip of arrays, read
with pickling off): its tokens, the KV rows of every layer, the remembered prompt-end
logits, the identity of what computed them, and a SHA-256 digest of all of it. A file is
used only when its identity matches this engine's exactly (model config, weight files'
names, sizes and modification times, kernel family, backend, cache layout, precision
plan), so a
re-converted model, another kernel family or another backend (whose f32 sums differ in
their last bits) never inherits stale KV, and when its digest matches its
contents, so a damaged or edited file is never read as KV; anything else (a damaged or
hostile file) is skipped with a warning and removed. Even then a restored session is
trusted only after its first use recomputes its last positions (`Session.verify`, from
`SessionPool`). Only sessions of finished requests are saved (a failed request's session
is dropped before). Writes are atomic; files are rewritten at every stop. The folders are
private (0700) and the files 0600: the tokens are the user's prompts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from colibrid.engine.engine import Engine, Session
from colibrid.engine.kv import KVCache
from colibrid.paths import atomic_file

log = logging.getLogger("colibrid.kv")

SUFFIX = ".npz"
FORMAT = 2  # 2: a digest of the contents


def identity(engine: Engine) -> str:
    """What the KV of this engine depends on, as a hex digest."""
    ckpt = engine.checkpoint
    stats = [(f.path.name, f.path.stat()) for f in ckpt.files]
    files = sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats)
    facts = {
        "format": FORMAT,
        "config": ckpt.config,
        "files": files,
        "family": engine.family.name,
        "backend": engine.backend,
        "layouts": engine.model.cache_layouts(),
        # the precision plan (store/precision_plan.py): KV computed under one per-expert
        # precision plan is never reused under another, even if the files looked alike
        "plan": engine.info.plan.id,
    }
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def save(sessions: Iterable[Session], directory: Path, engine: Engine) -> int:
    """Write `sessions` (most valuable first) as 0.npz, 1.npz, ... replacing what was
    there; returns how many were written."""
    for private in (directory.parent, directory):  # token ids spell out the user's prompts
        private.mkdir(mode=0o700, parents=True, exist_ok=True)
        private.chmod(0o700)
    ident = identity(engine)
    written = 0
    for session in sessions:
        if not session.tokens:
            continue
        arrays = _arrays(session, ident)
        arrays["digest"] = np.frombuffer(digest(arrays).encode(), dtype=np.uint8)
        with atomic_file(directory / f"{written}{SUFFIX}") as handle:
            np.savez(handle, **arrays)
        written += 1
    for stale in directory.glob(f"*{SUFFIX}"):
        if not stale.stem.isdigit() or int(stale.stem) >= written:
            stale.unlink(missing_ok=True)
    return written


def load(directory: Path, engine: Engine) -> list[Session]:
    """The saved sessions this engine can use, in saved order; unusable files are
    reported, removed, and cost nothing else."""
    if not directory.is_dir():
        return []
    ident = identity(engine)
    sessions = []
    for path in sorted(
        directory.glob(f"*{SUFFIX}"), key=lambda p: int(p.stem) if p.stem.isdigit() else -1
    ):
        try:
            sessions.append(_session(path, engine, ident))
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as exc:
            log.warning("kept KV %s not used: %s", path, exc)
            path.unlink(missing_ok=True)
    return sessions


def _arrays(session: Any, ident: str) -> dict[str, np.ndarray]:
    length = len(session.tokens)
    out = {
        "identity": np.frombuffer(ident.encode(), dtype=np.uint8),
        "tokens": np.asarray(session.tokens, dtype=np.int64),
    }
    for layer, layout in enumerate(session.cache.layouts):
        for name in layout:
            out[f"kv.{layer}.{name}"] = session.cache.read(layer, name, length)
    for n, logits in session.remembered_logits().items():
        out[f"logits.{n}"] = logits
    return out


def digest(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 over every array but the digest itself: names, dtypes, shapes and bytes, in
    name order (what `save` stores and `load` checks)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        if name == "digest":
            continue
        array = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        h.update(array.tobytes())
    return h.hexdigest()


def _session(path: Path, engine: Engine, ident: str) -> Session:
    with np.load(path, allow_pickle=False) as z:
        if bytes(_member(z, "identity", 64)).decode("ascii", "replace") != ident:
            raise ValueError("computed by another model, kernel family or model version")
        read: dict[str, np.ndarray] = {"identity": _member(z, "identity", 64)}
        tokens = read["tokens"] = _member(z, "tokens", 8 * engine.max_context)
        if (
            tokens.ndim != 1
            or tokens.dtype != np.int64
            or not 0 < tokens.size <= engine.max_context
        ):
            raise ValueError("bad token array")
        if tokens.min() < 0 or tokens.max() >= engine.vocab_size:
            raise ValueError("token ids outside the vocabulary")
        n = int(tokens.size)
        layouts = engine.model.cache_layouts()
        cache = KVCache(layouts, engine.max_context, initial_tokens=n)
        for layer, layout in enumerate(layouts):
            for name, shape in layout.items():
                rows = read[f"kv.{layer}.{name}"] = _member(
                    z, f"kv.{layer}.{name}", 4 * n * int(np.prod(shape))
                )
                if rows.shape != (n, *shape) or rows.dtype != np.float32:
                    raise ValueError(
                        f"layer {layer} {name}: shape {rows.shape} {rows.dtype}, "
                        f"expected {(n, *shape)} float32"
                    )
                cache.write(layer, name, rows)
        for key in z.files:
            if key.startswith("logits."):
                read[key] = _member(z, key, 4 * engine.vocab_size)
            elif key not in read and key != "digest":
                raise ValueError(f"unexpected member {key!r}")
        stored = bytes(_member(z, "digest", 64)).decode("ascii", "replace")
        if stored != digest(read):
            raise ValueError("its contents do not match their digest (damaged or edited)")
        cache.advance(n)
        session = Session(engine, cache, tokens.tolist())
        for key, logits in read.items():
            if key.startswith("logits."):
                length = int(key.split(".", 1)[1])
                if 0 < length <= n and logits.shape == (engine.vocab_size,):
                    session.remember_logits(length, logits)
    return session


def _member(z: Any, key: str, payload_bytes: int) -> np.ndarray:
    """Array `key` of an open npz, refused before reading when its member is larger than
    `payload_bytes` plus a header (a damaged or hostile file must not fill memory)."""
    info = z.zip.getinfo(f"{key}.npy")
    if info.file_size > payload_bytes + 4096:
        raise ValueError(f"{key}: {info.file_size} bytes where at most {payload_bytes} belong")
    return z[key]
