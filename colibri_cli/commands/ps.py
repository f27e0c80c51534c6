"""`colibri ps`: what the daemon runs right now, from its STATUS reply."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from colibri_cli.client import Client, ClientError
from colibri_cli.commands.ask import speculation_line
from colibri_cli.render import duration, table


def pins_line(status: dict) -> str:
    """STATUS's pins line (`pins (auto): 454 of capacity 480`), or "" without one."""
    ram = status["tiers"].get("ram", {})
    return f"pins ({ram.get('pin_mode', '-')}): {ram['pins']}" if ram.get("pins") else ""


def model_state(status: dict) -> str:
    """Loaded, loading or none, and when an idle model unloads (its keep_alive)."""
    if status.get("loading"):
        return f"loading {status['loading']}"
    if not status.get("model"):
        return "none loaded (a request or `colibri run NAME` loads one)"
    unload_in = status.get("unload_in_s")
    keep = status.get("keep_alive_s")
    if unload_in is not None:
        return f"idle; unloads in {duration(unload_in)}"
    if keep is not None and keep < 0:
        return "stays loaded (keep_alive < 0)"
    if status.get("running") or status.get("preparing"):
        return f"busy; unloads {duration(keep)} after its last request" if keep else "busy"
    return "loaded"


def plan_line(status: dict) -> str:
    """The loaded container's precision plan (`\nplan: 3fa2c1d90b7e (uniform
    int4-grouped-g64)`), or "" with no model: its identity, never changed by placement."""
    plan = status.get("plan")
    if not plan:
        return ""
    experts = plan.get("experts") or {}
    if plan.get("uniform"):
        what = "uniform " + next(iter(experts), "-") if experts else "no routed experts"
    else:
        what = "mixed: " + ", ".join(f"{n} {fmt}" for fmt, n in experts.items())
    return f"\nplan: {plan['id']} ({what})"


def roofline_line(roofline: dict) -> str:
    """The ceilings the daemon probed for the model and the last request's shares of
    them (`\nroofline: disk 2.28 GB/s, memory 33.3 GB/s, kernels 41.0 tok/s; last
    request: disk 83%, ...`), or "" before the first probe (docs/performance.md "The live
    roofline")."""
    ceilings = roofline.get("ceilings")
    if not ceilings:
        return ""
    disk = ceilings.get("disk_gbs")
    line = "\nroofline: " + ("" if disk is None else f"disk {disk:.2f} GB/s, ")
    line += f"memory {ceilings['memory_gbs']:.1f} GB/s"
    kernels = ceilings.get("kernel_tok_s")
    line += "" if kernels is None else f", kernels {kernels:.1f} tok/s"
    line += " (probed after the load and when idle)"
    last = roofline.get("last")
    if last:
        on_disk = f"disk {100 * last['disk_share']:.0f}%, " if "disk_share" in last else ""
        kernels = last.get("kernel_share")
        on_cpu = "" if kernels is None else f"kernels {100 * kernels:.0f}%, "
        line += (
            f"; last request: {on_disk}memory {100 * last['memory_share']:.0f}%, {on_cpu}"
            f"{100 * last['roofline_share']:.0f}% of the roofline ({last['bound']}-bound)"
        )
    return line


def remote_lines(remote: dict) -> str:
    """The remote models used since the daemon started (`\nremote: team at
    http://host:8080 (model demo): 1 running, 3 done, 0 failed, last 31.2 tok/s`), or ""."""
    return "".join(
        f"\nremote: {name} at {r['url']} (model {r['model']}): {r['running']} running, "
        f"{r['requests_done']} done, {r['failed']} failed, last {r['last_tok_s']:.1f} tok/s"
        for name, r in remote.items()
    )


def render(status: dict) -> str:
    hit = status.get("hit_rate")
    head = table(
        [
            ["MODEL", "UPTIME", "PROFILE", "RUNNING", "QUEUED", "LAST TOK/S", "HIT RATE"],
            [
                status["model"] or "-",
                duration(status["uptime_s"]),
                status["profile"] or "-",
                status["running"],
                status["queued"],
                f"{status['last_tok_s']:.1f}",
                "-" if hit is None else f"{100 * hit:.1f}%",
            ],
        ]
    )
    rows = [["TIER", "EXPERTS", "GB", "PINNED"]]
    for tier in ("vram", "ram", "disk"):
        t = status["tiers"].get(tier, {})
        rows.append([tier, t.get("experts", 0), f"{t.get('gb', 0.0):.3f}", t.get("pinned", "-")])
    pins = pins_line(status)
    pins = f"\n{pins}" if pins else ""
    store = status["tiers"].get("store", {})
    if store.get("streams"):
        pins += f"\nPILOT: {store.get('pilot_note', 'off')}"
    if status.get("shared_passes"):
        pins += (
            f"\nbatch: {status['shared_passes']} passes shared by several requests; "
            f"{status.get('batch_rows', 0)} rows in the last decode pass"
        )
    vram = status["tiers"].get("vram", {})
    if "budget_gb" in vram:
        budget = "no budget" if vram["budget_gb"] is None else f"budget {vram['budget_gb']:.3g} GB"
        hit = vram.get("hit_rate")
        pins += (
            f"\nvram: {vram['weights_gb']:.3f} GB of weights on "
            f"{vram.get('device') or 'the device'} ({budget}), "
            f"{vram['hits']} uses from it"
            + ("" if hit is None else f" ({100 * hit:.1f}% of uses)")
            + f", {vram['copies']} copies in ({vram['copied_gb']:.3f} GB), "
            f"{vram.get('passed', 0)} of them expert weights used once and not kept"
            + (
                f"; {vram['host_experts']} expert uses computed on the host"
                if vram.get("host_experts")
                else ""
            )
            + (f"\nvram: {vram['host_rule']}" if vram.get("host_rule") else "")
        )
    if status.get("speculate"):
        last = speculation_line(status.get("speculation") or {})
        pins += f"\nspeculate: {status['speculate']}" + (f" (last request: {last})" if last else "")
    pins += roofline_line(status.get("roofline") or {})
    pins += remote_lines(status.get("remote") or {})
    http = ", ".join(status.get("http") or []) or "off"
    computes = ""
    if status.get("backend"):
        computes = f"; on the {status['backend']} backend, {status['kernel_family']} kernels"
    return (
        f"{head}\nmodel: {model_state(status)}{computes}{plan_line(status)}"
        f"\n\n{table(rows)}{pins}\n\n"
        f"rss {status['rss_gb']:.2f} GB, pid {status['pid']}, http {http}"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri ps", description=__doc__)
    p.add_argument("--json", action="store_true", help="the raw STATUS reply")
    return p


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        with Client.connect(timeout_s=10) as client:
            status = client.query("STATUS")
    except ClientError as exc:
        print(f"colibri ps: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0
