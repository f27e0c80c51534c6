"""Reading the small text files of a model folder (tokenizer, its config, the chat
template, generation config) as untrusted input.

A model folder comes from whoever published it, so each file is checked before it is read:

- a symlink that resolves outside the model folder is refused, naming the file and its
  target (a published `chat_template.jinja -> ~/.ssh/id_rsa` must not become a prompt).
  Links inside the folder are fine, and so is the Hugging Face cache layout, where
  `snapshots/REV/NAME` links to `../../blobs/HASH` of the same repository;
- a file that is not a regular file (a link to `/dev/urandom`, a FIFO, a directory) is
  refused as "not a regular file", never reported as missing, and never blocks: it is
  opened non-blocking and only its type is looked at;
- every file has a size cap, checked before and while reading.

`config.json` is read for the weights by `colibrid.store.checkpoint_files`, with its own cap.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from colibrid.errors import CheckpointError

MAX_TOKENIZER_BYTES = 256 * 1024 * 1024  # tokenizer.json: the largest real ones are ~35 MB
MAX_JSON_BYTES = 64 * 1024 * 1024  # tokenizer_config.json (may list every added token) & co
MAX_TEMPLATE_BYTES = 4 * 1024 * 1024  # chat_template.jinja: real ones are under 100 KB

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def present(root: Path, name: str) -> bool:
    """Whether the folder has an entry `name` at all (a dangling link or a device counts:
    reading it then says what is wrong with it, instead of "missing")."""
    return os.path.lexists(root / name)


def read_model_file(root: Path, name: str, cap: int) -> bytes | None:
    """The bytes of `root/name`, None when there is no such entry; CheckpointError naming
    the file when it links outside the folder, is not a regular file, or is over `cap`."""
    path = root / name
    if not os.path.lexists(path):
        return None
    target = path.resolve()
    shown = f"{path} (a link to {target})" if path.is_symlink() else str(path)
    try:  # the type first, without opening: opening a device can do things
        before = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{shown} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"{shown} cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(before.st_mode):
        kind = next((what for test, what in _KINDS if test(before.st_mode)), "special")
        raise CheckpointError(f"{shown} is not a regular file ({kind})")
    if not _inside(target, root):
        raise CheckpointError(
            f"{shown} is outside the model folder: refused (copy the file into the folder "
            "if it is meant to be there)"
        )
    if before.st_size > cap:
        raise CheckpointError(f"{shown} is {before.st_size} bytes, over the {cap} byte cap")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise CheckpointError(f"{shown} cannot be opened: {exc.strerror or exc}") from None
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
            raise CheckpointError(f"{shown} changed while it was opened; try again")
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(cap + 1)
    except OSError as exc:
        raise CheckpointError(f"{shown} cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > cap:  # it grew while it was read
        raise CheckpointError(f"{shown} is over the {cap} byte cap")
    return data


def read_model_text(root: Path, name: str, cap: int) -> str | None:
    """`read_model_file` decoded as UTF-8 (CheckpointError naming the file if it is not)."""
    data = read_model_file(root, name, cap)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{root / name} is not UTF-8 text ({exc.reason})") from None


def _inside(target: Path, root: Path) -> bool:
    """Whether a resolved path lies in the model folder (or, for a folder in a Hugging Face
    cache, in its repository's blobs/)."""
    real = root.resolve()
    allowed = [real]
    if real.parent.name == "snapshots":
        allowed.append(real.parent.parent / "blobs")
    return any(target == base or base in target.parents for base in allowed)
