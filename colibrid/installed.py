"""The models installed in $COLIBRI_HOME/models: what `colibri list` shows, what the HTTP
API's /v1/models lists and what a request may name.

A model is a folder (or a link to one) holding `config.json`: a colibri container (with
the converter's `manifest.json`) or a Hugging Face checkpoint the engine reads as it is;
or a remote model, a folder holding `remote.json` (an OpenAI-compatible endpoint,
`colibri pull URL`: colibrid.remote.spec), listed with its URL.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from colibrid.errors import ConfigError
from colibrid.paths import Paths
from colibrid.remote.keyfile import forget_key
from colibrid.remote.spec import REMOTE_FILE, RemoteSpec, read_spec


@dataclass(frozen=True)
class Installed:
    name: str
    path: Path  # the folder (a link's target)
    linked: bool  # models/NAME is a link to a folder elsewhere
    model_type: str
    size_bytes: int
    quantisation: str
    remote: RemoteSpec | None = None  # a remote model: its endpoint (no key)

    def identity_files(self) -> tuple[Path, ...]:
        """The files that say which model this is, first the one whose change marks a new
        model: a remote model's remote.json (its URL and the id served there), else
        config.json and manifest.json (the weights are checked by the manifest's own
        per-tensor digests). What the HTTP APIs' digests and modification times read."""
        if self.model_type == "remote":
            return (self.path / REMOTE_FILE,)
        return (self.path / "config.json", self.path / "manifest.json")


def _quantisation(folder: Path) -> str:
    """What the converter wrote ("experts int4-g64, attention int8, ..."), or the
    checkpoint's own dtype."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = None
    if isinstance(manifest, dict) and isinstance(manifest.get("params"), dict):
        p = manifest["params"]
        group = f"-g{p['group_size']}" if p.get("group_size") and p.get("expert_bits") == 4 else ""
        return (
            f"experts int{p.get('expert_bits')}{group}, attention int{p.get('attn_bits')}, "
            f"dense int{p.get('dense_bits')}"
        )
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "?"
    if isinstance(config, dict) and isinstance(config.get("quantization_config"), dict):
        return str(config["quantization_config"].get("quant_method", "quantised"))
    dtype = config.get("torch_dtype") or config.get("dtype") if isinstance(config, dict) else None
    return f"{dtype} (checkpoint)" if dtype else "checkpoint"


def _size(folder: Path) -> int:
    total = 0
    for item in folder.rglob("*"):
        try:
            if item.is_file():
                total += item.stat().st_size
        except OSError:
            pass
    return total


def describe(name: str, entry: Path) -> Installed | None:
    """The model at models/NAME, or None when it is no model (no config.json)."""
    folder = entry.resolve()
    try:
        spec = read_spec(folder)
    except ConfigError:  # an unreadable remote.json: listed, so that it can be removed
        return Installed(name, folder, entry.is_symlink(), "remote", 0, "unreadable remote.json")
    if spec is not None:
        # the server's own weights: colibri cannot say how they are stored
        return Installed(name, folder, entry.is_symlink(), "remote", 0, "", spec)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    model_type = str(config.get("model_type", "?")) if isinstance(config, dict) else "?"
    return Installed(
        name, folder, entry.is_symlink(), model_type, _size(folder), _quantisation(folder)
    )


def installed(paths: Paths) -> list[Installed]:
    """Every installed model, by name."""
    if not paths.models.is_dir():
        return []
    found = []
    for entry in sorted(paths.models.iterdir()):
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        model = describe(entry.name, entry)
        if model is not None:
            found.append(model)
    return found


def names(paths: Paths) -> list[str]:
    """Installed model names (cheap: no sizes)."""
    if not paths.models.is_dir():
        return []
    return sorted(
        e.name
        for e in paths.models.iterdir()
        if not e.name.startswith(".")
        and ((e / "config.json").is_file() or (e / REMOTE_FILE).is_file())
    )


def remote_spec(paths: Paths, name: str) -> RemoteSpec | None:
    """The remote model installed as `name`, or None (a local model, or none: a name
    that is no model is the caller's to refuse). ConfigError for an unreadable one."""
    if not name or name.startswith(".") or "/" in name:
        return None
    spec = read_spec(paths.models / name)
    return spec if spec is None else RemoteSpec(name, spec.url, spec.model)


class NotInstalled(LookupError):
    """`remove` was asked for a name that is no installed model."""


def remove(name: str, paths: Paths) -> str:
    """Take models/NAME away (renamed aside first, so a request arriving meanwhile finds
    no half-deleted model); what was removed, in words. A link loses only itself: its
    folder is the user's. A remote model's key file (keys/NAME) goes with it, so that a
    later model of that name is never sent it; a key file that cannot be deleted puts
    the model back and raises. Shared by `colibri rm` and the HTTP API's delete."""
    entry = paths.models / name
    if name.startswith(".") or "/" in name or not (entry.is_symlink() or entry.exists()):
        raise NotInstalled(f"no installed model {name!r} (`colibri list` shows them)")
    remote = (entry / REMOTE_FILE).is_file()
    aside = entry.with_name(f".{name}.removing-{os.getpid()}")
    os.replace(entry, aside)
    if remote:
        return _remove_remote(name, paths, entry, aside)
    if aside.is_symlink():
        target = os.readlink(aside)
        aside.unlink()
        return f"removed {name} (a link; its folder {target} is kept)"
    size = sum(f.stat().st_size for f in aside.rglob("*") if f.is_file() and not f.is_symlink())
    shutil.rmtree(aside)
    return f"removed {name} ({size / 1e6:.0f} MB freed)"


def _remove_remote(name: str, paths: Paths, entry: Path, aside: Path) -> str:
    """The rest of `remove` for a remote model set aside: its key file, then its folder."""
    try:
        key = forget_key(paths, name)
    except OSError as exc:
        os.replace(aside, entry)
        raise OSError(f"{name} is kept: its key file cannot be deleted ({exc})") from None
    if aside.is_symlink():
        aside.unlink()
    else:
        shutil.rmtree(aside)
    said = "" if key is None else f"; its key file {key} deleted"
    return f"removed {name} (a remote model{said})"
