"""`colibri config`: every key of config.toml with its type, default and meaning, made from
the one definition (`colibrid.config.Settings`), as a table, a commented example file
(`--toml`) or the Markdown of docs/configuration.md (`--markdown`; a test keeps that page
equal to it)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from colibrid.config import FIELDS, Settings
from colibrid.paths import Paths


def _type(annotation: str) -> str:
    kind = annotation.replace(" | None", "")
    if kind.startswith("dict"):
        return "table"
    return {"str": "string", "int": "integer", "float": "number", "bool": "true/false"}.get(
        kind, kind
    )


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def rows() -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) for every setting, in definition order."""
    defaults = Settings()
    out = []
    for name, f in FIELDS.items():
        value = getattr(defaults, name)
        shown = "unset" if value is None else _toml(value)
        out.append((name, _type(str(f.type)), shown, f.metadata["help"]))
    return out


def markdown() -> str:
    lines = [
        "# Configuration",
        "",
        "`$COLIBRI_HOME/config.toml` (default `~/.colibri/config.toml`) holds these keys; a",
        "key the daemon does not know is an error naming it, so a typo never silently does",
        "nothing. The flags of `colibrid start` and `colibrid run` override the keys of the",
        "same names. `colibri config` prints this table, `colibri config --toml` an example",
        "file with every key commented out. (This page is generated from",
        "`colibrid/config.py`: `colibri config --markdown`.)",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{k}` | {cell(t)} | `{cell(d)}` | {cell(m)} |" for k, t, d, m in rows()]
    return "\n".join(lines + ["", *NOTES]) + "\n"


NOTES = [
    "## The HTTP API key",
    "",
    "config.toml is usually readable by every local user (0644 under the common umask), so",
    "a key written there is everyone's. Keep it elsewhere: `http_api_key_file` names a file",
    "whose first line is the key (relative paths are under `$COLIBRI_HOME`); the daemon",
    "refuses a key file that group or others can read (`chmod 600 FILE`). The environment",
    "variable `COLIBRI_HTTP_API_KEY` overrides both keys (e.g. a systemd `Environment=` or",
    "`LoadCredential=`). Giving both `http_api_key` and `http_api_key_file` is an error.",
    "When config.toml holds `http_api_key` and others can read it, `colibrid start` prints",
    "a warning and the daemon logs it.",
    "",
    "## Remote models' keys",
    "",
    "A remote model (`colibri pull http://host:port --name NAME`, docs/remote-models.md)",
    "sends the key of its endpoint, read per request from `[remote.NAME]`:",
    "",
    "```toml",
    "[remote.team]",
    'api_key_file = "keys/team"   # first line; chmod 600; relative: to $COLIBRI_HOME',
    "```",
    "",
    '(or `api_key = "..."`, which the start-up warning names when others can read this',
    "file). Without a table, `$COLIBRI_HOME/keys/NAME` is read when it exists: that is where",
    "`colibri pull URL --name NAME --api-key-env VAR` stores the key it reads from `$VAR`.",
    "A key is never a command-line argument, and never written to models/NAME or the log.",
    "",
    "## What the daemon checks and bounds",
    "",
    "- The socket's directory (`$COLIBRI_HOME/run/`, or the folder of `socket`) must belong",
    "  to the daemon's user and must not be writable by group or others: whoever can write",
    "  it can move the socket aside and answer in the daemon's place. Otherwise the start",
    "  is refused with what to fix (`chmod 700 DIR`, or remove a folder another user made).",
    "  Our own `run/` that others can merely enter is made 0700.",
    "- The soft open-file limit (`RLIMIT_NOFILE`) is raised to the hard limit (at most",
    "  65536) and logged. When descriptors still run out, accepting connections backs off",
    "  (0.1 s to 1 s) and logs one line per 30 s, without a traceback.",
    "- The detached daemon's log `$COLIBRI_HOME/colibrid.log` (0600) is rotated at 10 MiB:",
    "  `colibrid.log.1` to `colibrid.log.3` keep the previous ones. In the foreground",
    "  (`colibrid run`) the log is stderr, for the service manager to keep.",
    "- A model folder's tokenizer and template files (`tokenizer.json`,",
    "  `tokenizer_config.json`, `special_tokens_map.json`, `chat_template.jinja`,",
    "  `generation_config.json`, and `config.json` for the stop ids) are refused, naming the",
    "  file, when a link takes them outside the folder (links inside it, and a Hugging Face",
    "  cache's `snapshots/REV/` -> `blobs/`, are fine), when they are not regular files (a",
    "  device, a FIFO, a directory), or when they are over a size cap (256 MiB for",
    "  `tokenizer.json`, 64 MiB for the other JSON files, 4 MiB for the template).",
    "- Weight bytes (`verify_weights`, on by default) are held to the digests in the",
    "  model's `manifest.json` (docs/formats.md, section Digests): every tensor read through",
    "  the memory map (the dense part; every expert when all are resident) when the model",
    "  loads, a mismatch refusing the load; each streamed expert the first time it is read",
    "  from disk, in the reader thread, a mismatch failing the request that needed it",
    "  (`INTERNAL`, naming the shard and the tensor) without the expert being cached, so the",
    "  next request reads and checks it again. The load-time cost and the streamed decode",
    "  speed with and without it are in docs/performance.md. A folder without digests",
    "  (older containers, upstream colibri's, Hugging Face checkpoints) loads unchecked, with",
    "  a note in the log. `colibri inspect --verify` checks every byte of a container.",
]


def cell(text: str) -> str:
    """Text inside a Markdown table cell: a `|` (as in `cpu|mlx`) would end the cell."""
    return text.replace("|", "\\|")


def toml_example() -> str:
    out = ["# colibri config.toml: every key, commented out at its default", ""]
    for key, kind, default, meaning in rows():
        out.append(f"# {meaning} ({kind})")
        out.append(f"# {key} = {default if default != 'unset' else '...'}")
        out.append("")
    return "\n".join(out)


def table(current: dict[str, object] | None = None) -> str:
    """Key, default, meaning; with `current` (the file's values) a column of what is set."""
    width = max(len(k) for k in FIELDS)
    lines = []
    for key, kind, default, meaning in rows():
        now = ""
        if current is not None and key in current:
            shown = "(hidden)" if key in ("http_api_key", "remote") else _toml(current[key])
            now = f"  [set: {shown}]"
        lines.append(f"{key:<{width}}  {kind:<10} {default:<12} {meaning}{now}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="colibri config",
        description="Every key of $COLIBRI_HOME/config.toml: type, default, meaning, and "
        "what this home's file sets.",
    )
    form = p.add_mutually_exclusive_group()
    form.add_argument("--toml", action="store_true", help="a commented example config.toml")
    form.add_argument("--markdown", action="store_true", help="the table of docs/configuration.md")
    return p


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    if args.toml:
        print(toml_example())
        return 0
    if args.markdown:
        sys.stdout.write(markdown())
        return 0
    paths = Paths.from_env(None)
    current = None
    if paths.config.is_file():
        from colibrid.config import tomllib

        current = tomllib.loads(paths.config.read_text(encoding="utf-8"))
    print(f"{paths.config}{'' if current is not None else ' (not there: every default)'}")
    print(table(current))
    return 0
