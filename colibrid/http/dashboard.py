"""The page at ``/`` and the two JSON endpoints it (and any script) uses.

Why a page at all: what colibri does that other servers do not (which experts are hot,
what each memory tier holds, how often PILOT guessed right) happens while a model
answers; `colibri ps` shows it as numbers after the fact, the page shows it as it moves.

The page is three static files shipped in the package (``colibrid/http/page/``): no
build step, no third-party request (the Content-Security-Policy below forbids any), and
it talks only to this daemon: chat through its own ``/v1/chat/completions`` (streamed),
the tiers through ``GET /colibri/status`` polled once a second, profile switching through
``POST /colibri/profile``. Both JSON endpoints are documented for scripts in
docs/web-page.md.

The static files carry no data, so they are served without the API key (a browser
cannot attach one to a page load); everything the page then asks for goes through the
key like any other API call. The Host and Origin gate (gate.py) applies to all of them.
"""

from __future__ import annotations

from importlib.resources import files
from typing import TYPE_CHECKING, Any

from colibri_protocol.codec import is_valid_id

from colibrid.errors import ColibriError
from colibrid.http import errors
from colibrid.http.errors import bad_request

if TYPE_CHECKING:
    from colibrid.serve.state import DaemonState

STATUS_PATH = "/colibri/status"
PROFILE_PATH = "/colibri/profile"
# path -> (file under page/, content type)
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/page/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/page/style.css": ("style.css", "text/css; charset=utf-8"),
}
ROUTES = {**dict.fromkeys(ASSETS, "GET"), STATUS_PATH: "GET", PROFILE_PATH: "POST"}
# Only this daemon may be reached, nothing runs inline, and no other site may frame the
# page (a frame could drive its buttons: clickjacking).
ASSET_HEADERS = (
    (
        "content-security-policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("cache-control", "no-cache"),
)
PROFILE_FIELDS = frozenset({"name", "create"})


def asset(path: str) -> tuple[bytes, str]:
    """The bytes and content type of the static file served at `path`."""
    name, content_type = ASSETS[path]
    return (files("colibrid.http") / "page" / name).read_bytes(), content_type


def snapshot(state: DaemonState) -> dict[str, Any]:
    """What the page shows: the STATUS object exactly as `colibri ps --json` prints it
    (the same `DaemonState.status()`), the active profile's counts per MoE layer (the
    heat map) and the model's profiles (the switch). ``heat`` and ``profiles`` are null
    and empty while no model is loaded."""
    status = state.status()
    loaded = state.models.current
    if loaded is None:
        return {"status": status, "heat": None, "profiles": []}
    book = loaded.book
    active = book.active
    counts = book.counts(active)
    layers = list(loaded.engine.experts.layers)
    return {
        "status": status,
        "heat": {
            "profile": active,
            "layers": layers,
            "counts": [counts[layer].tolist() for layer in layers],
        },
        "profiles": book.listing(),
    }


def profile_choice(body: Any) -> tuple[str, bool]:
    """The body of ``POST /colibri/profile``, ``{"name": NAME, "create": false}``, checked:
    every field is used or refused with a 400 naming it."""
    if not isinstance(body, dict):
        raise bad_request('the body must be a JSON object like {"name": "general"}')
    unknown = sorted(set(body) - PROFILE_FIELDS)
    if unknown:
        raise bad_request(
            f"unknown field {unknown[0]!r}: this endpoint takes name and create", unknown[0]
        )
    name, create = body.get("name"), body.get("create", False)
    if not isinstance(name, str) or not is_valid_id(name):
        raise bad_request("name must be a profile name (1 to 63 letters, digits, - _ . :)", "name")
    if not isinstance(create, bool):
        raise bad_request("create must be true or false", "create")
    return name, create


async def use_profile(state: DaemonState, body: Any) -> dict[str, Any]:
    """What `colibri profile use NAME [--create]` does (the same `DaemonState.profile`
    call as the SERVE command ``PROFILE USE``): the profile becomes the active one,
    is remembered, and the pins are re-chosen from it before the reply."""
    name, create = profile_choice(body)
    try:
        await state.profile("USE", name, create)
    except ColibriError as exc:
        if exc.code == "NOT_FOUND":  # no such profile (and create was false)
            raise errors.ApiError(404, str(exc), code="not_found", param="name") from None
        if exc.code == "NO_MODEL":  # profiles belong to a model
            raise errors.ApiError(409, str(exc), code="no_model") from None
        raise errors.from_code(exc.code, str(exc)) from None
    return {"profile": name}
