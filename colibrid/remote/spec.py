"""A remote model: an OpenAI-compatible endpoint installed under a name.

`colibri pull http://host:port --name team` writes ``models/team/remote.json`` (the
endpoint's base URL and the id it serves the model under) in place of a checkpoint; every
front end of the daemon then answers requests for `team` by streaming from that endpoint
(serve.remote_runs). The file holds no key: a key lives in config (remote.keys), so a
model folder can be listed, copied or shown without it.

Why a folder under models/ rather than a config table: `colibri list`, `rm`, the HTTP
model lists and every name check already read that folder, so a remote model is
installed, listed and removed as any other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from colibrid.errors import ConfigError
from colibrid.paths import atomic_write

REMOTE_FILE = "remote.json"
SCHEMES = ("http", "https")


@dataclass(frozen=True)
class RemoteSpec:
    """`name`: the installed name; `url`: the endpoint's base (its routes are under
    ``/v1``); `model`: the id the endpoint serves the model under (sent as `model`)."""

    name: str
    url: str
    model: str

    def endpoint(self, route: str) -> str:
        """The URL of one of its OpenAI routes, e.g. ``chat/completions``."""
        return f"{self.url}/v1/{route}"


def is_url(target: str) -> bool:
    """Whether `colibri pull TARGET` names an endpoint rather than a model or a path."""
    return target.lower().startswith(tuple(f"{s}://" for s in SCHEMES))


def base_url(url: str) -> str:
    """The endpoint's base URL, as given or with the ``/v1`` of its routes (both are what
    users copy from a server's banner); a bad one is a ConfigError naming it."""
    parts = urlsplit(url.strip())
    if parts.scheme.lower() not in SCHEMES or not parts.hostname:
        raise ConfigError(f"{url!r} is no http:// or https:// URL of a server")
    if parts.username or parts.password:
        raise ConfigError(
            f"{url!r} carries credentials; give the URL without them and keep the key in "
            "config (`colibri pull URL --api-key-env VAR`)"
        )
    if parts.query or parts.fragment:
        raise ConfigError(f"{url!r}: a server's base URL has no ?query or #fragment")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{parts.scheme.lower()}://{parts.netloc}{path}"


def read_spec(folder: Path) -> RemoteSpec | None:
    """The remote model installed in `folder`, or None when it holds none. A file that
    cannot be read is a ConfigError naming it (never a model that silently vanishes)."""
    path = folder / REMOTE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        spec = RemoteSpec(folder.name, base_url(str(data["url"])), str(data["model"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: not a remote model's file ({exc})") from None
    return spec


def write_spec(folder: Path, url: str, model: str) -> Path:
    """Write `folder`/remote.json atomically (0600); the file written."""
    path = folder / REMOTE_FILE
    atomic_write(path, json.dumps({"url": url, "model": model}, indent=2) + "\n")
    return path
