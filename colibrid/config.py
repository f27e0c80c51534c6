"""Daemon settings: one table of names, defaults and descriptions, read once from
``$COLIBRI_HOME/config.toml`` (then command-line overrides) and passed down.

Unknown keys are an error naming the key, so a typo never silently does nothing.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colibrid.engine.backend import BACKEND_HELP, BACKENDS
from colibrid.errors import ConfigError
from colibrid.paths import Paths

VRAM_HELP = (
    "GB of device memory the cuda, webgpu or mlx backend may keep weights in (unset: cuda "
    "80% of the GPU memory free at start, webgpu 2 (WebGPU reports no memory size), mlx no "
    "limit)"
)


def add_backend_flag(p: Any, *, config_key: bool = False) -> None:
    """--backend and --vram-gb, as every command that loads a model takes them."""
    tail = " (config.toml key `backend`, default auto)" if config_key else " (default auto)"
    p.add_argument("--backend", choices=BACKENDS, help=BACKEND_HELP + tail)
    p.add_argument(
        "--vram-gb",
        type=float,
        metavar="GB",
        help=VRAM_HELP.replace("%", "%%") + (" (config.toml key `vram_gb`)" if config_key else ""),
    )


KERNEL_FAMILIES = ("f32", "i8")
KERNEL_FAMILY_HELP = (
    "kernel arithmetic: f32 (activations stay float) or i8 (int8 activations and integer "
    "dots: lossy, so opt-in; faster on a few cores, and on the cuda backend the experts "
    "VRAM does not keep may then be computed on the CPU with the same bits)"
)


def add_kernel_family_flag(p: Any, *, config_key: bool = False) -> None:
    """--kernel-family, as every command that decodes with a chosen arithmetic takes it."""
    tail = " (config.toml key `kernel_family`, default f32)" if config_key else " (default f32)"
    p.add_argument(
        "--kernel-family",
        choices=KERNEL_FAMILIES,
        default=None if config_key else "f32",
        help=KERNEL_FAMILY_HELP + tail,
    )


# The --pilot help of every command that places experts (kept here: help must not import
# the store).
PILOT_HELP = (
    "lookahead prefetch (auto: when experts stream, decode is measured with and without "
    "it and the faster kept, re-checked as the run goes; on/off: always)"
)

SPECULATE_HELP = (
    "speculative decoding, lossless (the same tokens, sooner when drafts are accepted): "
    "ngram drafts by prompt lookup, mtp with the checkpoint's multi-token-prediction layer, "
    "auto = mtp where the model has one, else ngram; off (config.toml key `speculate`, "
    "default auto)"
)


def add_speculate_flags(p: Any) -> None:
    """--speculate and --draft-max, as every command that decodes takes them."""
    p.add_argument("--speculate", choices=("auto", "ngram", "mtp", "off"), help=SPECULATE_HELP)
    p.add_argument(
        "--draft-max",
        type=int,
        metavar="N",
        help="deepest draft a step may verify, 1-32 (the depth is chosen each step from "
        "measured pass times and acceptance; config.toml key `draft_max`, default 8)",
    )


try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def setting(default: Any, help: str) -> Any:
    """A config key: its default and what it means (`colibri config` and
    docs/configuration.md are made from these)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Settings:
    """Every key of $COLIBRI_HOME/config.toml; the daemon's flags override them."""

    default_model: str | None = setting(
        None,
        "the model served when none is named: a NAME under models/ or a folder "
        "(unset: the built-in demo)",
    )
    ram_gb: float | None = setting(
        None,
        "memory budget in GiB for dense weights, experts, KV and work buffers "
        "(unset: 88% of available memory)",
    )
    cache: int | None = setting(
        None, "experts per layer in the RAM cache (overrides what the budget gives)"
    )
    memory_floor_gb: float | None = setting(
        None,
        "MEMWATCH keeps this much memory free, shrinking the cache (unset: 5% of "
        "RAM, at least 0.5 GiB)",
    )
    pilot: str | None = setting(
        None,
        "lookahead prefetch when experts stream: on | off | auto (unset: auto, "
        "measured both ways and the faster kept)",
    )
    io_threads: int | None = setting(
        None, "expert reader threads (0: reads on the engine thread; unset: 4)"
    )
    direct: bool | None = setting(
        None, "O_DIRECT / F_NOCACHE expert reads, past the page cache (unset: true)"
    )
    verify_weights: bool = setting(
        True,
        "hold weight bytes to the digests in the model's manifest.json: what is mapped "
        "when the model loads (a mismatch refuses the load), each streamed expert the first "
        "time it is read (a mismatch fails the request; the expert is not cached); folders "
        "without digests load unchecked, with a note in the log",
    )
    socket: str | None = setting(
        None, "the SERVE socket's path (unset: $COLIBRI_HOME/run/colibrid.sock)"
    )
    backend: str = setting(
        "auto",
        "what computes: cpu (native SIMD kernels) | mlx (MLX: Apple silicon, or mlx[cpu] on "
        "Linux) | cuda (NVIDIA GPU via pycuda) | auto (mlx on Apple silicon when installed, "
        "else cpu)",
    )
    vram_gb: float | None = setting(None, VRAM_HELP)
    kernel_family: str = setting("f32", KERNEL_FAMILY_HELP)
    max_queue: int = setting(16, "requests waiting beyond the active ones; more answer BUSY")
    max_active: int = setting(
        4, "requests decoded at once: one forward pass carries the next token of each"
    )
    speculate: str = setting(
        "auto",
        "speculative decoding, lossless: auto (MTP where the model has it, else "
        "ngram) | ngram (prompt lookup) | mtp | off",
    )
    draft_max: int = setting(8, "the deepest speculative draft a step may verify (1-32)")
    chat_repeat_penalty: float = setting(
        1.1,
        "the repetition penalty of `colibri ask`, `run` and `repl` (1 is off; their "
        "--repeat-penalty overrides it): a small model decoding greedily loops without one. "
        "SERVE and the HTTP APIs keep their own defaults (off)",
    )
    chat_repeat_last_n: int = setting(
        64, "the window of that penalty: the last N tokens of the context (-1: all of it)"
    )
    max_conversations: int = setting(
        8, "finished requests whose KV is kept for a next turn or a shared prompt"
    )
    prompt_cache: bool = setting(
        True, "requests without a conversation start from the kept KV sharing their prefix"
    )
    max_context: int | None = setting(
        None, "context length in tokens (unset: the model's, at most 4096)"
    )
    keep_alive: float = setting(
        -1.0,
        "seconds an idle model stays loaded: 0 unloads it after each request, a "
        "negative value (the default: a large model takes minutes to map) keeps it; "
        "Ollama's habit is 300 (a request's own keep_alive overrides this)",
    )
    shutdown_grace_s: float = setting(
        10.0, "how long `colibrid stop` lets running requests finish before cancelling them"
    )
    profile: str = setting(
        "default",
        "the active usage profile at the first start (later: the last `colibri profile use`)",
    )
    pin: str = setting(
        "auto",
        "pins from the active profile: auto (AUTOPIN) | all (as many used experts as fit) | off",
    )
    profile_save_s: float = setting(60.0, "how often usage profiles are saved while serving")
    roofline_refresh_s: float = setting(
        300.0,
        "how old the disk, memory and kernel probes (the live roofline's ceilings, measured "
        "after each load) may grow before they are measured again, only while no request runs "
        "(0: only at load)",
    )
    http: str | None = setting(
        None,
        'the OpenAI/Anthropic HTTP API and the page at /: "HOST:PORT", or "PORT" on '
        "127.0.0.1 (unset: off)",
    )
    http_api_key: str | None = setting(
        None,
        "bearer key the HTTP API requires (needed to listen off the loopback); better kept "
        "out of this file: http_api_key_file or $COLIBRI_HTTP_API_KEY",
    )
    http_api_key_file: str | None = setting(
        None,
        "a file whose first line is the HTTP API key, read at start (relative: to "
        "$COLIBRI_HOME); refused if group or others can read it (chmod 600); "
        "$COLIBRI_HTTP_API_KEY overrides both",
    )
    remote: dict[str, Any] | None = setting(
        None,
        "API keys of remote models (`colibri pull URL --name NAME`), one table each: "
        "[remote.NAME] holding api_key_file, a file whose first line is the key (relative: to "
        "$COLIBRI_HOME; refused if others can read it), or api_key, the key itself (unset: the "
        "file keys/NAME under $COLIBRI_HOME, which `colibri pull URL --api-key-env VAR` "
        "writes; none: no key is sent)",
    )
    http_cors: str | None = setting(
        None, 'comma-separated origins allowed by CORS, "*" for any (unset: off)'
    )
    http_max_body_bytes: int = setting(4 * 1024 * 1024, "larger HTTP request bodies answer 413")
    http_body_timeout_s: float = setting(
        15.0,
        "seconds for an HTTP request's headers, then its body (408); also the keep-alive idle time",
    )
    http_retry_after_s: int = setting(1, "the Retry-After of a 429 (admission queue full)")
    grammar_timeout_s: float = setting(
        5.0, "longest a request's grammar may take to compile; longer is refused (400)"
    )
    grammar_memory_mb: int = setting(
        2048, "address space of a grammar compiler process; more is refused (400)"
    )
    grammar_workers: int = setting(2, "grammar compiler processes (each compiles one at a time)")
    debug_layer_delay_s: float = setting(
        0.0, "tests only: sleep this long at every layer to make races visible"
    )
    debug_fail_prompt: str | None = setting(
        None, "tests only: the first prompt holding this text fails inside its pass..."
    )
    debug_fail_after: int = setting(
        1, "tests only: ...at this between-layer check (an injected fault)"
    )


DEMO_MODEL = "demo"  # the default model when none is configured (colibri pull demo)
FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def load_settings(paths: Paths, **overrides: Any) -> Settings:
    values: dict[str, Any] = {}
    if paths.config.is_file():
        try:
            values = tomllib.loads(paths.config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{paths.config}: {exc}") from None
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise ConfigError(
            f"{paths.config}: unknown setting(s) {', '.join(unknown)} (known: {', '.join(FIELDS)})"
        )
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        settings = Settings(**values)
    except TypeError as exc:
        raise ConfigError(f"{paths.config}: {exc}") from None
    for name, value in values.items():
        want = FIELDS[name].type
        if value is not None and not _type_ok(value, str(want)):
            raise ConfigError(f"{paths.config}: {name} has the wrong type ({value!r})")
    speculation(settings)  # a bad mode or depth is refused now, not at the first request
    if not settings.chat_repeat_penalty > 0 or settings.chat_repeat_last_n < -1:
        raise ConfigError(
            f"{paths.config}: chat_repeat_penalty must be > 0 and chat_repeat_last_n >= -1"
        )
    check_remote_tables(settings.remote, paths)
    settings = with_api_key(settings, paths)
    if settings.vram_gb is not None and not settings.vram_gb > 0:
        raise ConfigError(
            f"vram_gb must be positive, not {settings.vram_gb!r} (--vram-gb, or the key in "
            f"{paths.config})"
        )
    if settings.kernel_family not in KERNEL_FAMILIES:
        raise ConfigError(
            f"{paths.config}: kernel_family must be one of {', '.join(KERNEL_FAMILIES)}, "
            f"not {settings.kernel_family!r}"
        )
    if settings.backend not in BACKENDS:
        raise ConfigError(
            f"{paths.config}: backend must be one of {', '.join(BACKENDS)}, "
            f"not {settings.backend!r}"
        )
    return settings


API_KEY_ENV = "COLIBRI_HTTP_API_KEY"
MAX_KEY_FILE_BYTES = 4096


def with_api_key(settings: Settings, paths: Paths) -> Settings:
    """`settings` with `http_api_key` taken from where the user keeps it: the environment
    ($COLIBRI_HTTP_API_KEY) over `http_api_key_file` over the key in config.toml (which
    any local user may read under the usual umask: `api_key_warning` says so)."""
    if settings.http_api_key and settings.http_api_key_file:
        raise ConfigError(f"{paths.config}: give http_api_key or http_api_key_file, not both")
    key = os.environ.get(API_KEY_ENV, "").strip()
    if not key and settings.http_api_key_file:
        key = read_key_file(paths.home / Path(settings.http_api_key_file).expanduser())
    return dataclasses.replace(settings, http_api_key=key) if key else settings


def read_key_file(path: Path, what: str = "http_api_key_file") -> str:
    """The key in `path` (its first line), refusing a file others can read: a key that
    any local user can copy guards nothing. `what` names the file in errors."""
    try:  # non-blocking: a FIFO in its place must not hang the start
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as handle:
            st = os.fstat(handle.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{what} {path} is not a regular file")
            if st.st_mode & 0o077:
                raise ConfigError(
                    f"{what} {path} is open to other users (mode "
                    f"{stat.S_IMODE(st.st_mode):o}): `chmod 600 {path}`, then start again"
                )
            data = handle.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from None
    lines = data[:MAX_KEY_FILE_BYTES].decode("utf-8", errors="replace").splitlines()
    key = lines[0].strip() if lines else ""
    if len(data) > MAX_KEY_FILE_BYTES or not key:
        raise ConfigError(f"{what} {path} must hold the key on its first line")
    return key


REMOTE_KEYS = ("api_key", "api_key_file")


def check_remote_tables(tables: dict[str, Any] | None, paths: Paths) -> None:
    """Each [remote.NAME] table holds one of `REMOTE_KEYS`, a string (the key itself is
    read when a request needs it: colibrid.remote.keys)."""
    for name, table in (tables or {}).items():
        where = f"{paths.config}: [remote.{name}]"
        if not isinstance(table, dict):
            raise ConfigError(f"{where} must be a table (api_key_file = PATH)")
        unknown = sorted(set(table) - set(REMOTE_KEYS))
        if unknown:
            known = ", ".join(REMOTE_KEYS)
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {known})")
        if len(table) != 1 or not all(isinstance(v, str) and v for v in table.values()):
            raise ConfigError(f"{where} must hold one of api_key_file or api_key, a string")


def api_key_warning(paths: Paths) -> str | None:
    """One line when config.toml holds `http_api_key` and group or others can read it
    (0644 under the usual umask); None otherwise. Said at start, not refused: the file
    is the user's, and tightening it is one chmod."""
    try:
        mode = stat.S_IMODE(paths.config.stat().st_mode)
        if not mode & 0o044:
            return None
        values = tomllib.loads(paths.config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    remote = values.get("remote")
    in_file = [
        f"remote.{name}.api_key"
        for name, table in (remote.items() if isinstance(remote, dict) else ())
        if isinstance(table, dict) and table.get("api_key")
    ]
    if values.get("http_api_key"):
        in_file.insert(0, "http_api_key")
    if not in_file:
        return None
    return (
        f"{paths.config} holds {', '.join(in_file)} and other users can read it (mode {mode:o}): "
        f"`chmod 600 {paths.config}`, or keep the key in http_api_key_file or ${API_KEY_ENV}"
    )


def speculation(settings: Settings):  # -> colibrid.engine.speculate.SpecSettings
    from colibrid.engine.speculate import SpecSettings
    from colibrid.errors import RequestError

    try:
        return SpecSettings(settings.speculate, settings.draft_max)
    except RequestError as exc:
        raise ConfigError(f"speculate/draft_max: {exc}") from None


def store_options(settings: Settings, profiles: Path | None = None):  # -> StoreOptions
    """The expert placement the settings ask for; any placement key selects the tiered
    store (so a knob is never silently ignored), none keeps the automatic choice. Pins
    follow the active usage profile (the daemon's profile book) by the store's one pin rule;
    the profile file itself is the book's to read and write, not the store's. ``profiles``:
    the profiles folder, where PILOT remembers its measurements per model."""
    from colibrid.store.options import StoreOptions

    given = {
        k: getattr(settings, k)
        for k in ("ram_gb", "cache", "pilot", "io_threads", "direct")
        if getattr(settings, k) is not None
    }
    try:
        return StoreOptions(
            mode="tiered" if given else "auto",
            pin=settings.pin,
            memory_floor_gb=settings.memory_floor_gb,  # MEMWATCH's, not a placement knob
            verify=settings.verify_weights,  # nor is this: a check, the same either way
            save_profile=False,
            pin_at_start=False,
            profiles_dir=profiles,
            **given,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _type_ok(value: Any, annotation: str) -> bool:
    if "dict" in annotation:
        return isinstance(value, dict)
    if "bool" in annotation:
        return isinstance(value, bool)
    if "float" in annotation:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if "int" in annotation:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, str)


def resolve_model(paths: Paths, name: str | None) -> Path:
    """A model NAME under models/ or a directory; with none configured, the built-in demo
    (``models/demo``, made by ``colibri pull demo``; ``colibri ask`` pulls it on first use)."""
    if not name:
        if not (paths.models / DEMO_MODEL).is_dir():
            raise ConfigError(
                f"no model given and no default configured, and the demo model is not in "
                f"{paths.models / DEMO_MODEL}: run `colibri pull demo`, pass --model NAME|DIR "
                f'or add `default_model = "NAME"` to {paths.config}'
            )
        name = DEMO_MODEL
    candidate = Path(name).expanduser()
    if candidate.is_dir():
        return candidate.resolve()
    named = paths.models / name
    if named.is_dir():  # a link keeps its name: models/NAME -> a folder elsewhere
        return named.absolute()
    raise ConfigError(f"model {name!r} is neither a directory nor a model in {paths.models}/")
