"""A mixed-precision container (issue 41: `colibri requant --by-heat`) through the real
daemon: its plan changes no invariant, and its identity is shown wherever the model is.

The model is tiny GLM-5 requantised by a fixed skewed profile into three expert formats
(hot int8, middle int4-g64, cold int3-affine-g64; matrix_support.mixed_model):

* placement, batching and speculation: the invariance matrix's cell (test_daemon_matrix.
  run_cell) streams it at cache 1 (eviction on nearly every expert) with a warmed profile
  and `profile use` switches, SERVE and HTTP at once (batched), speculation at the daemon's
  default `auto`, and compares every greedy answer byte for byte with the resident store's
  one-at-a-time answers with speculation off; `colibrid generate --pin all|auto` too;
* identity: STATUS, `colibri ps`, every `DONE … STAT` line and `/metrics` name the plan id
  the requant recorded in the manifest, and it is not the uniform container's.
"""

from __future__ import annotations

import json
import urllib.request

from colibri_protocol.messages import Done, Submit
from daemon_helpers import Home, free_port
from matrix_support import MIXED_FROM, MIXED_KIND, SETTINGS, matrix_model, status
from test_daemon_matrix import Cell, GenCell, run_cell, run_generate

from colibri_cli.client import Client


def test_mixed_plan_streamed_cache1_matches_resident(request, reference, tmp_path) -> None:
    run_cell(request, reference, tmp_path, Cell(MIXED_KIND, 1, "warmed"))


def test_mixed_plan_generate_pin_all_and_auto(request, reference, tmp_path) -> None:
    run_generate(
        request,
        reference,
        tmp_path,
        [GenCell(MIXED_KIND, "all", cache=1), GenCell(MIXED_KIND, "auto")],
    )


def test_plan_identity_in_status_ps_stat_and_metrics(request, tmp_path) -> None:
    mixed = matrix_model(request, MIXED_KIND)
    uniform = matrix_model(request, MIXED_FROM)
    recorded = json.loads((mixed.path / "manifest.json").read_text())["precision_plan"]
    plan = recorded["id"]
    port = free_port()
    home = Home(tmp_path / "home", mixed.path, http=str(port), cache=1, **SETTINGS)
    try:
        home.start()
        st = status(home)
        assert st["plan"]["id"] == plan and st["plan"]["uniform"] is False, st["plan"]
        # (the tiny down_proj has 64 inputs: its one int4 group reads as int4-row)
        kinds = {fmt.split("-")[0] for fmt in st["plan"]["experts"]}
        assert kinds == {"int8", "int4", "int3"}, st["plan"]
        ps = home.colibri("ps")
        assert ps.returncode == 0 and f"plan: {plan} (mixed: " in ps.stdout, ps.stdout
        with Client.connect(home.socket, timeout_s=60) as client:
            done = [
                r
                for r in client.generate(Submit("p1", prompt="Hello", max_tokens=3))
                if isinstance(r, Done)
            ]
        assert done and done[0].extras.get("plan") == plan, done
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        line = (
            f'colibri_precision_plan_info{{model="{mixed.name}",plan="{plan}",uniform="false"}} 1.0'
        )
        assert line in metrics, [m for m in metrics.splitlines() if "plan" in m]
    finally:
        home.close()
    # The uniform container the plan came from has another identity.
    home = Home(tmp_path / "uniform", uniform.path, **SETTINGS)
    try:
        home.start()
        other = status(home)["plan"]
        assert other["uniform"] is True and other["id"] != plan, other
    finally:
        home.close()
