"""One exception class per layer, each carrying a short code.

Every error a user can provoke with bad input (a missing file, a lying safetensors
header, a config with absurd sizes) is raised as one of these with a one-line message
naming the problem; the command-line entry points print that line and exit non-zero
instead of showing a traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none): what a
    one-line error quotes of a library's multi-line message."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


class ColibriError(Exception):
    """Base of every expected, user-facing error."""

    code = "ERROR"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class CheckpointError(ColibriError):
    """A checkpoint or container file is missing, malformed or inconsistent."""

    code = "BAD_CHECKPOINT"


class ConfigError(ColibriError):
    """config.json (or another configuration) is missing, malformed or out of range."""

    code = "BAD_CONFIG"


class ModelLoadError(ColibriError):
    """The model cannot be built: unknown architecture, missing or mis-shaped tensors."""

    code = "MODEL_LOAD"


class NativeBuildError(ColibriError):
    """The native kernels could not be compiled or loaded."""

    code = "NATIVE_BUILD"


class BackendError(ColibriError):
    """The chosen compute backend is not installed, has no device here, or cannot compute
    what was asked (e.g. the i8 kernel family on MLX)."""

    code = "BACKEND"


class RequestError(ColibriError):
    """A generation request is invalid (empty prompt, bad sampling parameters...)."""

    code = "BAD_REQUEST"


class Cancelled(ColibriError):
    """A request was cancelled (by its client, a STOP, or a vanished connection)."""

    code = "CANCELLED"


class ConvertError(ColibriError):
    """A conversion (or synthetic container build) cannot proceed: bad source, refused
    parameters, a full disk. The destination is never left looking complete."""

    code = "CONVERT"


class ClusterError(ColibriError):
    """The hand-off beyond one machine cannot go on: llama.cpp's RPC binaries cannot be
    built (no compiler, no cmake, no sdist), or a cluster plan lacks what it needs."""

    code = "CLUSTER"


class TemplateError(RequestError):
    """A model's chat template failed on a request or went over a limit (output size,
    render time, a huge repeat or range). It costs that request only; a template that
    fails its probe render at load time is refused with the same message."""

    code = "TEMPLATE"


class PersistError(ColibriError):
    """A write of persistent state (profile, prompt cache, config, log) failed: a full
    disk, an I/O error, a read-only home. The message names the path; nothing already on
    disk is damaged (writes are atomic) and the daemon goes on serving."""

    code = "IO"

    @classmethod
    def of(cls, path: object, exc: OSError) -> PersistError:
        reason = exc.strerror or type(exc).__name__
        return cls(f"cannot write {path}: {reason}")


class ModelBusy(ColibriError):
    """Another model answers requests; the one asked for loads when the daemon is idle."""

    code = "MODEL_BUSY"


class NoModel(ColibriError):
    """No model is loaded (after `colibri stop` or a keep_alive unload) for a query."""

    code = "NO_MODEL"


class ModelNotFound(ColibriError):
    """A request names a model that is not installed."""

    code = "NOT_FOUND"


class NativePanic(ColibriError):
    """A native library (tokenizers, llguidance: Rust, through pyo3) panicked. pyo3 raises
    a panic as `PanicException`, a BaseException that passes every `except Exception`;
    `contain_panics` turns it into this at each call into such a library, so it costs the
    one request that met it."""

    code = "INTERNAL"


def is_native_panic(exc: BaseException) -> bool:
    """Whether `exc` is a Rust panic surfaced by pyo3 (each pyo3 library defines its own
    `pyo3_runtime.PanicException` class, so it is recognised by name)."""
    kind = type(exc)
    return kind.__name__ == "PanicException" and kind.__module__ == "pyo3_runtime"


@contextmanager
def contain_panics(what: str) -> Iterator[None]:
    """Inside: a native panic leaves as `NativePanic("<what> failed: <its message>")`."""
    try:
        yield
    except BaseException as exc:
        if is_native_panic(exc):
            raise NativePanic(f"{what} failed: {first_line(exc)}") from None
        raise


class CorruptWeights(CheckpointError):
    """Weight bytes differ from the digest their writer recorded in manifest.json: the
    file was damaged after it was written (bit rot, a bad copy, an edit). The message names
    the shard and the tensor. A request that needed those bytes fails with it (it is never
    answered from them); a model whose resident weights fail is not loaded. The SERVE
    protocol has no code of its own for it yet: INTERNAL, its message says what failed."""

    code = "INTERNAL"
