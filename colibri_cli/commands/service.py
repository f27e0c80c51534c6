"""`colibri service install|uninstall|status`: run colibrid as a per-user service.

On Linux this writes a systemd user unit (~/.config/systemd/user/colibrid.service), on macOS
a launchd agent (~/Library/LaunchAgents/org.colibri.colibrid.plist), both filled in from the
templates shipped in packaging/ with this install's `colibrid` and `$COLIBRI_HOME`, and
starts it. The service runs `colibrid run` in the foreground: the service manager restarts
it on failure and stops it with SIGTERM, which lets running answers finish. Clients find it
on the usual socket; `colibri ask` never needs to start one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from colibri_protocol import home

from colibri_cli.packaged import packaged_file

UNIT_NAME = "colibrid.service"
AGENT_LABEL = "org.colibri.colibrid"


@dataclass(frozen=True)
class ServiceKind:
    """Where one service manager keeps its per-user definitions, and how it is driven."""

    name: str  # "systemd" or "launchd"
    template: str  # path under packaging/
    target: Path

    def start_commands(self) -> list[list[str]]:
        if self.name == "systemd":
            return [
                ["systemctl", "--user", "daemon-reload"],
                ["systemctl", "--user", "enable", "--now", UNIT_NAME],
            ]
        return [["launchctl", "bootstrap", f"gui/{os.getuid()}", str(self.target)]]

    def stop_commands(self) -> list[list[str]]:
        if self.name == "systemd":
            return [["systemctl", "--user", "disable", "--now", UNIT_NAME]]
        return [["launchctl", "bootout", f"gui/{os.getuid()}/{AGENT_LABEL}"]]

    def state_command(self) -> list[str]:
        if self.name == "systemd":
            return ["systemctl", "--user", "is-active", UNIT_NAME]
        return ["launchctl", "print", f"gui/{os.getuid()}/{AGENT_LABEL}"]


def service_kind(platform: str = sys.platform) -> ServiceKind:
    if platform.startswith("linux"):
        config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
        return ServiceKind(
            "systemd", "systemd/colibrid.service", config / "systemd/user" / UNIT_NAME
        )
    if platform == "darwin":
        agents = Path.home() / "Library/LaunchAgents"
        return ServiceKind(
            "launchd", "launchd/org.colibri.colibrid.plist", agents / f"{AGENT_LABEL}.plist"
        )
    raise SystemExit(
        f"colibri service: no service manager colibri knows on {platform!r}; "
        "run `colibrid run` from your own supervisor"
    )


def colibrid_executable() -> str:
    """This install's colibrid: beside the running Python first (a venv need not be on the
    service manager's PATH), then PATH."""
    beside = Path(sys.executable).parent / "colibrid"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside.absolute())
    found = shutil.which("colibrid")
    if found is None:
        raise SystemExit("colibri service: cannot find the colibrid executable of this install")
    return str(Path(found).absolute())


def render(kind: ServiceKind, colibrid: str, colibri_home: Path) -> str:
    text = packaged_file(kind.template).read_text(encoding="utf-8")
    return text.replace("@COLIBRID@", colibrid).replace("@COLIBRI_HOME@", str(colibri_home))


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _run_all(commands: list[list[str]]) -> str | None:
    """Run each command; the first failure as one line (None when all succeed)."""
    for cmd in commands:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"`{' '.join(cmd)}` could not run: {exc}"
        if done.returncode != 0:
            why = (done.stderr or done.stdout).strip().splitlines()
            return f"`{' '.join(cmd)}` failed: {why[-1] if why else f'exit {done.returncode}'}"
    return None


def _service_state(kind: ServiceKind) -> tuple[bool, str]:
    """Whether the service manager runs colibrid, and its first line about it."""
    try:
        done = subprocess.run(kind.state_command(), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"unknown ({exc})"
    lines = (done.stdout or done.stderr).strip().splitlines()
    return done.returncode == 0, lines[0] if lines else "unknown"


def _hand_started_daemon(kind: ServiceKind) -> bool:
    """A daemon answers on the socket, and the service manager did not start it."""
    from colibri_cli.client import daemon_status

    return daemon_status(timeout_s=5.0) is not None and not _service_state(kind)[0]


def install(args: argparse.Namespace) -> int:
    kind = service_kind()
    text = render(kind, colibrid_executable(), home.colibri_home().absolute())
    if args.print:
        sys.stdout.write(text)
        return 0
    _write_atomically(kind.target, text)
    print(f"colibri service: wrote {kind.target}")
    if args.no_start:
        print(
            "colibri service: not started (--no-start); "
            + " && ".join(" ".join(c) for c in kind.start_commands())
        )
        return 0
    if _hand_started_daemon(kind):
        print(
            "colibri service: warning: a colibrid started by hand is running; the service "
            "cannot take the socket until it stops (`colibrid stop`)",
            file=sys.stderr,
        )
    failure = _run_all(kind.start_commands())
    if failure:
        print(
            f"colibri service: installed but not started: {failure}\n"
            "colibri service: start it from your login session with: "
            + " && ".join(" ".join(c) for c in kind.start_commands()),
            file=sys.stderr,
        )
        return 0
    print(f"colibri service: {kind.name} runs colibrid now and at every login")
    return 0


def uninstall(args: argparse.Namespace) -> int:
    kind = service_kind()
    if not kind.target.exists():
        print(f"colibri service: not installed ({kind.target} does not exist)")
        return 0
    failure = _run_all(kind.stop_commands())
    if failure:
        print(f"colibri service: warning: {failure}", file=sys.stderr)
    kind.target.unlink()
    if kind.name == "systemd":
        _run_all([["systemctl", "--user", "daemon-reload"]])
    print(f"colibri service: removed {kind.target}")
    return 0


def status(args: argparse.Namespace) -> int:
    kind = service_kind()
    if not kind.target.exists():
        print(f"colibri service: not installed (`colibri service install` writes {kind.target})")
        return 3
    running, state = _service_state(kind)
    print(f"colibri service: installed at {kind.target}; {kind.name}: {state}")
    return 0 if running else 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="colibri service",
        description="run colibrid as a per-user service (systemd on Linux, launchd on macOS)",
    )
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    inst = sub.add_parser("install", help="write the unit/agent for this install and start it")
    inst.add_argument("--print", action="store_true", help="print the file instead of writing it")
    inst.add_argument("--no-start", action="store_true", help="write the file, do not start it")
    inst.set_defaults(run=install)
    sub.add_parser("uninstall", help="stop the service and remove its file").set_defaults(
        run=uninstall
    )
    sub.add_parser("status", help="installed? running? (exit 0 running, 3 not)").set_defaults(
        run=status
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))
