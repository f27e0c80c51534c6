"""Installing and removing models over HTTP (Ollama's ``/api/pull`` and ``/api/delete``).

A pull runs ``colibri pull NAME`` as a child process and relays what it says as Ollama's
``{"status": …}`` lines. Why a child: the same code gives the same honest answers as the
command (what it can install, and a name it cannot fetch refused with the one line that
says what it can do), a conversion's memory and any crash stay out of the daemon, and the
event loop keeps serving meanwhile. Only a model name is taken, never a path (a path names
a folder on the daemon's machine: ``colibri pull PATH`` installs that there), and the
child runs in an empty folder, so a name cannot resolve to a folder either.

The status of the answer is chosen once the child has said a second line (or ended): a
pull that fails at once is an HTTP error of its own; one that fails later ends its
stream with an ``{"error": …}`` line, as Ollama's does.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import trio

from colibrid.http.errors import ApiError, bad_request
from colibrid.installed import NotInstalled, remove

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
PULL_FIELDS = frozenset({"model", "name", "stream", "insecure"})
_PREFIX = "colibri pull: "
_SPLIT = re.compile(rb"[\r\n]")


class PullFailed(ApiError):
    """The child ended in failure; its last line says why."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message, code="pull_failed", param="model")


def pull_request(body: Any) -> tuple[str, bool]:
    """(name, stream) of a pull body; a path or a tag other than ``latest`` is refused."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    extra = sorted(set(body) - PULL_FIELDS)
    if extra:
        raise bad_request(f"`{extra[0]}` is not a field of /api/pull", extra[0])
    stream = body.get("stream", True)
    if not isinstance(stream, bool) or not isinstance(body.get("insecure", False), bool):
        raise bad_request("`stream` and `insecure` must be booleans", "stream")
    name = body.get("model", body.get("name"))
    if not isinstance(name, str) or not name:
        raise bad_request("`model` is required (a string)", "model")
    name = name.removesuffix(":latest")
    if not NAME.match(name):
        raise PullFailed(
            f"cannot fetch {name!r}: over the API colibri pulls a model by name (`demo`); "
            "it fetches no model registry, and a folder or .gguf on the daemon's machine "
            "is installed there with `colibri pull PATH`"
        )
    return name, stream


async def pull(name: str) -> AsyncIterator[dict[str, Any]]:
    """`colibri pull NAME`'s lines as status objects, then ``{"status": "success"}``;
    raises PullFailed with its last line when it fails. Each line is held until the next
    arrives, so a pull that fails with its first line raises before anything is yielded."""
    with tempfile.TemporaryDirectory(prefix="colibri-pull-") as cwd:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "colibri_cli", "pull", name],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=cwd,
        )
        held: str | None = None
        try:
            assert process.stdout is not None
            async for text in _lines(process.stdout):
                if held is not None:
                    yield {"status": held}
                held = text
            code = await process.wait()
        finally:
            if process.returncode is None:  # the client went away: the pull stops too
                process.kill()
                with trio.CancelScope(shield=True):
                    await process.wait()
        if code != 0:
            raise PullFailed(held or f"colibri pull {name} failed (exit status {code})")
        if held is not None:
            yield {"status": held}
        yield {"status": "success"}


async def _lines(stream: trio.abc.ReceiveStream) -> AsyncIterator[str]:
    """Non-empty lines (a progress bar's carriage returns end a line too), without the
    command's "colibri pull: " prefix."""
    buf = b""
    while chunk := await stream.receive_some(65536):
        buf += chunk
        *done, buf = _SPLIT.split(buf)
        for raw in done:
            text = raw.decode("utf-8", errors="replace").strip().removeprefix(_PREFIX)
            if text:
                yield text
    text = buf.decode("utf-8", errors="replace").strip().removeprefix(_PREFIX)
    if text:
        yield text


async def delete(state: Any, body: Any) -> str:
    """Remove an installed model (unloaded first when it is the one loaded, once idle);
    its prompt cache goes with it, its usage profiles stay (as `colibri rm`)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    extra = sorted(set(body) - {"model", "name"})
    if extra:
        raise bad_request(f"`{extra[0]}` is not a field of /api/delete", extra[0])
    name = body.get("model", body.get("name"))
    if not isinstance(name, str) or not name:
        raise bad_request("`model` is required (a string)", "model")
    name = name.removesuffix(":latest")
    paths = state.models.paths
    if not (paths.models / name).exists() or not NAME.match(name):
        raise ApiError(404, f"model {name!r} not found", code="model_not_found", param="model")
    if state.model_name == name:
        await state.models.unload("deleted over the HTTP API")
    try:
        said = await trio.to_thread.run_sync(lambda: remove(name, paths))
    except NotInstalled as exc:
        raise ApiError(404, str(exc), code="model_not_found", param="model") from None
    await trio.to_thread.run_sync(lambda: shutil.rmtree(paths.kv / name, ignore_errors=True))
    return said
