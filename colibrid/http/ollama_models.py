"""Pure translators for Ollama's model endpoints: ``/api/tags`` (what is installed),
``/api/show`` (one model: its chat template, defaults, figures from its config.json),
``/api/ps`` (what is loaded, where, until when) and ``/api/version``.

Ollama names models ``name:tag``; colibri's names carry no tag, so they are listed as
they are and ``:latest`` is read as the untagged name (`ollama.model_name`). A `digest`
here is the SHA-256 of the files that say which model it is (`Installed.identity_files`:
config.json and manifest.json, whose per-tensor digests check the weights, `colibri
inspect --verify`; a remote model's remote.json), not of an Ollama registry manifest, and
its `modified_at` the first one's mtime. Figures colibri does not know are left out
rather than made up: a parameter count (a quantised container does not record it), a
remote model's quantisation (the server's own).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from colibrid.http.errors import bad_request
from colibrid.http.ollama import DEFAULTS
from colibrid.http.parsing import Features
from colibrid.installed import Installed

SHOW_FIELDS = frozenset({"model", "name", "verbose"})
FOREVER = "9999-12-31T23:59:59Z"  # a model kept loaded with keep_alive -1 (Ollama: far future)
# config.json keys as Ollama's model_info names them (after "<architecture>.")
CONFIG_FIGURES = {
    "max_position_embeddings": "context_length",
    "hidden_size": "embedding_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "intermediate_size": "feed_forward_length",
    "moe_intermediate_size": "expert_feed_forward_length",
    "n_routed_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "n_shared_experts": "expert_shared_count",
    "first_k_dense_replace": "leading_dense_block_count",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "vocab_size": "vocab_size",
}


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def config_of(model: Installed) -> dict[str, Any]:
    try:
        config = json.loads(_read(model.path / "config.json") or b"{}")
    except ValueError:
        return {}
    return config if isinstance(config, dict) else {}


def digest(model: Installed) -> str:
    h = hashlib.sha256()
    for path in model.identity_files():
        h.update(_read(path))
    return h.hexdigest()


def modified_at(model: Installed) -> str:
    try:
        return _iso(model.identity_files()[0].stat().st_mtime)
    except OSError:
        return _iso(0)


def details(model: Installed) -> dict[str, Any]:
    remote = model.remote is not None  # its weights and their format are the server's
    return {
        "parent_model": "",
        "format": "remote" if remote else "safetensors",
        "family": model.model_type,
        "families": [model.model_type],
        "quantization_level": "" if remote else model.quantisation,
    }


def tags(models: list[Installed]) -> dict[str, Any]:
    return {
        "models": [
            {
                "name": m.name,
                "model": m.name,
                "modified_at": modified_at(m),
                "size": m.size_bytes,
                "digest": digest(m),
                "details": details(m),
            }
            for m in models
        ]
    }


def chat_template(folder: Path) -> str | dict[str, str] | None:
    """The checkpoint's chat template as it ships (tokenizer_config.json or a .jinja)."""
    try:
        config = json.loads(_read(folder / "tokenizer_config.json") or b"{}")
    except ValueError:
        config = {}
    raw = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(raw, list):  # named templates: [{"name": ..., "template": ...}]
        raw = {t["name"]: t["template"] for t in raw if isinstance(t, dict) and "name" in t}
    if raw is None and (folder / "chat_template.jinja").is_file():
        raw = _read(folder / "chat_template.jinja").decode("utf-8", errors="replace")
    return raw if isinstance(raw, (str, dict)) else None


def model_info(model: Installed, config: dict[str, Any]) -> dict[str, Any]:
    arch = model.model_type
    info: dict[str, Any] = {"general.architecture": arch, "general.basename": model.name}
    for key, name in CONFIG_FIGURES.items():
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            info[f"{arch}.{name}"] = value
    return info


def parameters() -> str:
    """The defaults a request's options fall back to, as a Modelfile lists them."""
    return "\n".join(f"{name} {value}" for name, value in DEFAULTS.items())


def show(body: Any, model: Installed) -> dict[str, Any]:
    """`/api/show` of an installed model (`verbose` adds nothing: there are no token lists
    to add)."""
    extra = sorted(set(body) - SHOW_FIELDS)
    if extra:
        raise bad_request(f"`{extra[0]}` is not a field of /api/show", extra[0])
    if not isinstance(body.get("verbose", False), bool):
        raise bad_request("`verbose` must be a boolean", "verbose")
    template = chat_template(model.path)
    text = template if isinstance(template, str) else json.dumps(template or "")
    features = Features.of_template(template)
    params = parameters()
    modelfile = "\n".join(
        [
            f"# {model.name}, served by colibri",
            f"FROM {model.path if model.remote is None else model.remote.url}",
            f'TEMPLATE """{text}"""',
            *(f"PARAMETER {line}" for line in params.splitlines()),
        ]
    )
    capabilities = ["completion", "tools"]  # tools: on any template (http.tools)
    if features.think:
        capabilities.append("thinking")
    return {
        "modelfile": modelfile,
        "parameters": params,
        "template": text,
        "details": details(model),
        "model_info": model_info(model, config_of(model)),
        "capabilities": capabilities,
        "modified_at": modified_at(model),
    }


def expires_at(unload_in_s: float | None, keep_alive_s: float) -> str:
    """When the loaded model goes: its idle deadline, or (busy) keep_alive after now."""
    if unload_in_s is None:
        if keep_alive_s < 0:
            return FOREVER
        unload_in_s = keep_alive_s
    when = datetime.now(timezone.utc) + timedelta(seconds=unload_in_s)
    return when.isoformat().replace("+00:00", "Z")


def ps(
    model: Installed | None,
    *,
    memory_bytes: int,
    vram_bytes: int,
    context: int,
    unload_in_s: float | None,
    keep_alive_s: float,
) -> dict[str, Any]:
    """The loaded model (none: an empty list). `size` is the daemon's memory for it (its
    resident set plus what sits in VRAM), `size_vram` the VRAM part."""
    if model is None:
        return {"models": []}
    return {
        "models": [
            {
                "name": model.name,
                "model": model.name,
                "size": memory_bytes + vram_bytes,
                "size_vram": vram_bytes,
                "digest": digest(model),
                "details": details(model),
                "expires_at": expires_at(unload_in_s, keep_alive_s),
                "context_length": context,
            }
        ]
    }


def version(daemon_version: str) -> dict[str, Any]:
    """colibri's own version (a client that gates features on Ollama's version numbers
    sees colibri's, which are not Ollama's)."""
    return {"version": daemon_version}
