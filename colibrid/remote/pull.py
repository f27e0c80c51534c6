"""``colibri pull http://host:port --name NAME``: install an OpenAI-compatible endpoint
(llama-server, vLLM, SGLang, another colibrid) as the remote model NAME.

The endpoint is asked for its models (``GET /v1/models``) first, so a wrong URL, a
server that is down or a key it refuses is one line now, not at the first question. The
model it serves is chosen from that list (``--remote-model ID`` where it serves several).
A key is never a command-line argument: ``--api-key-env VAR`` reads it from the
environment once and stores it in ``$COLIBRI_HOME/keys/NAME`` (0600), where the daemon
reads it per request (remote.keys).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from colibrid.errors import ConfigError, ConvertError
from colibrid.paths import Paths
from colibrid.remote.client import CONNECT_S, error_text
from colibrid.remote.keyfile import default_key_file, store_key
from colibrid.remote.keys import remote_key, where_keys_go
from colibrid.remote.spec import RemoteSpec, base_url, read_spec, write_spec

PROBE_S = 30.0  # a server that takes longer to list its models is not ready


@dataclass(frozen=True)
class Registration:
    """What `register` was asked: the endpoint, the name, the key's source, the model."""

    url: str
    name: str
    api_key_env: str | None = None
    remote_model: str | None = None
    force: bool = False


def default_name(url: str) -> str:
    """The name an endpoint installs under without --name: its host, made a name."""
    host = urlsplit(url).hostname or "remote"
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in host.lower())
    return cleaned.strip("-.")[:64] or "remote"


def _key(paths: Paths, reg: Registration) -> str | None:
    """The key to probe with: from --api-key-env (it must be set), else one already
    configured for the name."""
    if reg.api_key_env is None:
        return remote_key(paths, reg.name)
    key = os.environ.get(reg.api_key_env, "").strip()
    if not key:
        raise ConvertError(f"--api-key-env {reg.api_key_env}: that variable is not set or empty")
    return key


def served_models(url: str, name: str, key: str | None, paths: Paths) -> list[str]:
    """The ids the endpoint at `url` lists (GET /v1/models), or a ConvertError saying
    why it could not be asked."""
    spec = RemoteSpec(name, url, "")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        with httpx.Client(timeout=httpx.Timeout(PROBE_S, connect=CONNECT_S), trust_env=False) as c:
            response = c.get(spec.endpoint("models"), headers=headers)
    except httpx.HTTPError as exc:
        raise ConvertError(f"cannot reach {url}: {exc or type(exc).__name__}") from None
    if response.status_code in (401, 403):
        said = error_text(response.content)
        raise ConvertError(
            f"{url} refused {'the key' if key else 'a request without a key'} "
            f"({response.status_code}: {said}); {where_keys_go(paths, name)}"
        )
    if response.status_code != 200:
        raise ConvertError(
            f"{url}/v1/models answered {response.status_code} ({error_text(response.content)}): "
            "not an OpenAI-compatible endpoint (llama-server, vLLM, SGLang, colibrid)"
        )
    try:
        data = response.json().get("data")
        ids = [str(m["id"]) for m in data]
    except (ValueError, AttributeError, KeyError, TypeError):
        raise ConvertError(
            f"{url}/v1/models is not an OpenAI model list: not an OpenAI-compatible endpoint"
        ) from None
    return ids


def choose_model(ids: list[str], wanted: str | None, url: str) -> str:
    """The model to send requests for: `wanted` (it must be listed), else the only one."""
    if wanted is not None:
        if wanted not in ids:
            raise ConvertError(f"{url} serves no model {wanted!r} (it serves: {', '.join(ids)})")
        return wanted
    if len(ids) == 1:
        return ids[0]
    if not ids:
        raise ConvertError(f"{url} lists no model; is it still loading one?")
    raise ConvertError(f"{url} serves {', '.join(ids)}: choose one with --remote-model ID")


def forget_stale_key(
    paths: Paths, reg: Registration, dst: Path, url: str, log: Callable[[str], None]
) -> None:
    """A key file left by an earlier model of this name for another endpoint (or none,
    removed since) is deleted, so that it is never sent to this one."""
    stored = default_key_file(paths, reg.name)
    if reg.api_key_env is not None or not (stored.is_file() or stored.is_symlink()):
        return
    try:
        previous = read_spec(dst) if dst.is_dir() else None
    except ConfigError:
        previous = None
    if previous is None or previous.url != url:
        stored.unlink()
        log(f"removed {stored}: the key of an earlier {reg.name!r} at another endpoint")


def register(reg: Registration, paths: Paths, log: Callable[[str], None]) -> Path:
    """Ask the endpoint, then install it as models/NAME (atomically: a folder written
    aside and renamed into place); the installed folder."""
    try:
        url = base_url(reg.url)
    except ConfigError as exc:  # the URL itself, named
        raise ConvertError(str(exc)) from None
    dst = paths.models / reg.name
    if (dst.is_symlink() or dst.exists()) and not reg.force:
        raise ConvertError(
            f"a model named {reg.name!r} is installed ({dst}); choose another --name, or "
            f"--force to replace it"
        )
    forget_stale_key(paths, reg, dst, url, log)
    key = _key(paths, reg)
    log(f"asking {url} for its models")
    model = choose_model(served_models(url, reg.name, key, paths), reg.remote_model, url)
    if reg.api_key_env is not None:
        assert key is not None
        stored = store_key(paths, reg.name, key)
        log(f"the key from ${reg.api_key_env} is stored in {stored} (0600)")
    aside = dst.with_name(f".{reg.name}.remote-{os.getpid()}")
    write_spec(aside, url, model)
    if dst.is_symlink() or dst.is_file():
        dst.unlink()
    elif dst.is_dir():
        shutil.rmtree(dst)
    os.replace(aside, dst)
    return dst
