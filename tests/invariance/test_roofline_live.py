"""The roofline, live, per request (issue 42 item 2), through the real daemon streaming a
tiny GLM-5 container at cache 1 (nearly every expert read from disk):

* the ceilings are measured after the load: STATUS carries the disk and memory probes
  and the kernel ceiling;
* a streamed request's `DONE … STAT` line carries its shares of them, in range, and the
  disk share is its own read bytes over its decode time and the disk probe;
* `/metrics` carries the same figures, `colibri logs` says them on the request's line,
  `colibri ps` beside the ceilings;
* the probes never run while a request does (their count in STATUS is unchanged through
  a slowed request although the refresh interval passes many times over), and do run
  again once the daemon is idle.

The agreement with `colibri bench stream` is a comparison of speeds on a shared 2-core
machine, so it is measured, not asserted: docs/performance.md "The live roofline".
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from math import isclose

from colibri_protocol.messages import Done, Submit
from daemon_helpers import Home, free_port, wait_for
from matrix_support import SETTINGS, matrix_model, status

from colibri_cli.client import Client

REFRESH_S = 0.3  # the idle refresh interval: a slowed request outlasts it many times


def _metric(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name + " ")]
    assert len(lines) == 1, [line for line in text.splitlines() if "roofline" in line]
    return float(lines[0].split()[-1])


def test_done_metrics_and_logs_carry_the_roofline_never_probed_during_a_request(
    request, tmp_path
) -> None:
    model = matrix_model(request, "glm_moe_dsa")
    port = free_port()
    home = Home(
        tmp_path / "home",
        model.path,
        http=str(port),
        cache=1,
        pilot="off",
        roofline_refresh_s=REFRESH_S,
        debug_layer_delay_s=0.05,  # a request of ~2 s: the refresh interval passes often
        **SETTINGS,
    )
    try:
        home.start()
        ceilings = status(home)["roofline"]["ceilings"]
        assert ceilings is not None and ceilings["probes"] >= 1, ceilings
        assert ceilings["disk_gbs"] > 0 and ceilings["memory_gbs"] > 0, ceilings
        assert ceilings["kernel_tok_s"] > 0, ceilings  # the CPU backend's kernels, timed
        assert ceilings["expert_mb"] > 0 and ceilings["dense_mb"] > 0, ceilings

        # The probe count, read from another connection all through the request.
        seen: list[tuple[int, int, float]] = []  # (probes, running, disk probe GB/s)
        finished = threading.Event()

        def watch() -> None:
            with Client.connect(home.socket, timeout_s=30) as other:
                while not finished.is_set():
                    st = other.query("STATUS")
                    ceilings = st["roofline"]["ceilings"]
                    seen.append((ceilings["probes"], st["running"], ceilings["disk_gbs"]))
                    time.sleep(0.005)  # a poll, not a timing: leave the engine its cores

        watcher = threading.Thread(target=watch)
        with Client.connect(home.socket, timeout_s=120) as client:
            # Wait for an idle refresh to have just happened, so the request starts with
            # the interval already running out.
            before = status(home)["roofline"]["ceilings"]["probes"]
            assert wait_for(lambda: status(home)["roofline"]["ceilings"]["probes"] > before, 30), (
                "the probes were not refreshed while idle"
            )
            watcher.start()
            replies = list(client.generate(Submit("r1", prompt="Hello there", max_tokens=12)))
        finished.set()
        watcher.join()
        done = [r for r in replies if isinstance(r, Done)]
        assert len(done) == 1, replies
        extras = done[0].extras
        during = {(probes, gbs) for probes, running, gbs in seen if running}
        assert seen and len(during) == 1, seen  # not one probe while the request ran

        steps = done[0].emitted - 1
        decode_s = float(extras["decode_s"])
        assert steps > 0 and decode_s > 0, extras
        disk, memory = float(extras["disk_share"]), float(extras["memory_share"])
        roof, read_mb = float(extras["roofline_share"]), float(extras["read_mb_tok"])
        kernels = float(extras["kernel_share"])
        assert 0 < disk <= 1.2 and 0 < memory <= 1.2 and 0 < kernels <= 1.2, extras
        assert roof == max(disk, memory, kernels), extras
        assert extras["bound"] in ("disk", "memory", "kernels"), extras
        assert read_mb > 0, extras
        last = status(home)["roofline"]["last"]
        assert isclose(last["disk_share"], disk, rel_tol=1e-3), (last, extras)
        # disk share = the request's read bytes / its decode time / the disk probe that
        # held while it ran (the figures as printed: four digits)
        (_, probe), *_ = during
        expect = read_mb * 1e6 * steps / decode_s / (probe * 1e9)
        assert isclose(expect, disk, rel_tol=0.01), (expect, probe, extras)

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        share = 'colibri_last_request_roofline_share{ceiling="disk"}'
        assert isclose(_metric(metrics, share), disk, rel_tol=1e-3), metrics
        assert _metric(metrics, "colibri_disk_probe_gbs") > 0
        assert _metric(metrics, "colibri_memory_probe_gbs") > 0
        assert _metric(metrics, "colibri_kernel_ceiling_tokens_per_second") > 0
        share = 'colibri_last_request_roofline_share{ceiling="kernel"}'
        assert isclose(_metric(metrics, share), kernels, rel_tol=1e-3), metrics
        per_token = _metric(metrics, "colibri_last_request_read_bytes_per_token")
        assert isclose(per_token / 1e6, read_mb, rel_tol=1e-3), metrics

        ps = home.colibri("ps")
        assert ps.returncode == 0 and "\nroofline: disk " in ps.stdout, ps.stdout
        assert f"% of the roofline ({extras['bound']}-bound)" in ps.stdout, ps.stdout
        assert " tok/s (probed" in ps.stdout and re.search(r"kernels \d+%", ps.stdout), ps.stdout

        logs = home.colibri("logs")
        assert logs.returncode == 0, logs.stderr
        line = [x for x in logs.stdout.splitlines() if "request r1 " in x]
        assert line and "% of probe" in line[-1] and "-bound)" in line[-1], logs.stdout[-2000:]
        assert re.search(r"of probe, kernels \d+%, roofline", line[-1]), line[-1]
    finally:
        home.close()


def test_a_resident_request_is_bound_by_the_kernels_or_the_memory_bus(request, tmp_path) -> None:
    """Nothing streams from disk where every expert is mapped in memory, so the lowest
    ceiling a resident request can meet is the memory bus or the kernels' arithmetic."""
    model = matrix_model(request, "glm_moe_dsa")
    # no placement key: resident. Slowed so the decode lasts long enough that DONE's
    # decode_s (four decimals) pins the request's tok/s to well under the 1% below
    home = Home(tmp_path / "home", model.path, debug_layer_delay_s=0.02, **SETTINGS)
    try:
        home.start()
        ceilings = status(home)["roofline"]["ceilings"]
        assert ceilings["disk_gbs"] is None and ceilings["kernel_tok_s"] > 0, ceilings
        with Client.connect(home.socket, timeout_s=120) as client:
            replies = list(client.generate(Submit("r1", prompt="Hello there", max_tokens=8)))
        (done,) = [r for r in replies if isinstance(r, Done)]
        extras = done.extras
        memory, kernels = float(extras["memory_share"]), float(extras["kernel_share"])
        assert "disk_share" not in extras and 0 < memory <= 1.2 and 0 < kernels <= 1.2, extras
        assert extras["bound"] in ("kernels", "memory"), extras
        assert float(extras["roofline_share"]) == max(memory, kernels), extras
        # the kernel share is the request's decode tok/s over the probed kernel ceiling
        tok_s = (done.emitted - 1) / float(extras["decode_s"])
        expect = tok_s / status(home)["roofline"]["ceilings"]["kernel_tok_s"]
        assert isclose(expect, kernels, rel_tol=0.01), (expect, extras)
    finally:
        home.close()
