"""Daemon settings: one table of names, defaults and descriptions, read once from
``$COLIBRI_HOME/config.toml`` (then command-line overrides) and passed down.

Unknown keys are an error naming the key, so a typo never silently does nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colibrid.errors import ConfigError
from colibrid.paths import Paths

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


@dataclass(frozen=True)
class Settings:
    default_model: str | None = None  # model NAME (under models/) or a directory
    ram_gb: float | None = None  # memory budget (default: 88% of available memory)
    cache: int | None = None  # experts per layer in the RAM cache (overrides the budget)
    memory_floor_gb: float | None = None  # MEMWATCH keeps this free (default: 5% RAM, >= 0.5)
    pilot: str | None = None  # lookahead prefetch: on | off | auto
    io_threads: int | None = None  # expert reader threads (0 = reads on the engine thread)
    direct: bool | None = None  # O_DIRECT / F_NOCACHE expert reads
    socket: str | None = None  # socket path; default $COLIBRI_HOME/run/colibrid.sock
    max_queue: int = 16  # requests waiting beyond the active ones; more answers BUSY
    max_active: int = 4  # requests decoding at once (one forward pass carries all of them)
    speculate: str = "auto"  # speculative decoding: auto | ngram | mtp | off (lossless)
    draft_max: int = 8  # the deepest speculative draft a step may verify (1-32)
    max_conversations: int = 8  # sessions whose KV is kept for the next turn / prompt
    prompt_cache: bool = True  # reuse the KV of earlier prompts for requests with no `conv`
    max_context: int | None = None  # context length (default: the engine's)
    shutdown_grace_s: float = 10.0  # how long `stop` lets running requests finish
    profile: str = "default"  # active usage profile at start
    pin: str = "auto"  # pins from the active profile: auto (AUTOPIN) | all | off
    profile_save_s: float = 60.0  # how often usage profiles are saved while serving
    http: str | None = None  # HTTP API: "HOST:PORT" or "PORT" (on 127.0.0.1); off if unset
    http_api_key: str | None = None  # bearer key the HTTP API requires (needed off loopback)
    http_cors: str | None = None  # comma-separated allowed CORS origins ("*" = any); off if unset
    http_max_body_bytes: int = 4 * 1024 * 1024  # larger HTTP request bodies answer 413
    http_body_timeout_s: float = 15.0  # time for headers, then the body (408); also keep-alive idle
    http_retry_after_s: int = 1  # Retry-After of a 429 (admission queue full)
    debug_layer_delay_s: float = 0.0  # tests only: slow every layer to make races visible
    debug_fail_prompt: str | None = None  # tests only: the first prompt holding this fails...
    debug_fail_after: int = 1  # ...at this between-layer check of its passes (injected fault)


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
    return settings


def speculation(settings: Settings):  # -> colibrid.engine.speculate.SpecSettings
    from colibrid.engine.speculate import SpecSettings
    from colibrid.errors import RequestError

    try:
        return SpecSettings(settings.speculate, settings.draft_max)
    except RequestError as exc:
        raise ConfigError(f"speculate/draft_max: {exc}") from None


def store_options(settings: Settings):  # -> colibrid.store.options.StoreOptions
    """The expert placement the settings ask for; any placement key selects the tiered
    store (so a knob is never silently ignored), none keeps the automatic choice. Pins
    follow the active usage profile (the daemon's profile book) by the store's one pin rule;
    the profile file itself is the book's to read and write, not the store's."""
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
            save_profile=False,
            pin_at_start=False,
            **given,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _type_ok(value: Any, annotation: str) -> bool:
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
    if named.is_dir():
        return named.resolve()
    raise ConfigError(f"model {name!r} is neither a directory nor a model in {paths.models}/")
