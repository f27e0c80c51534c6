"""The live roofline's arithmetic (serve.roofline): how a pass's bytes are divided among
the requests in it, and what a request's figures are. The daemon test
(tests/invariance/test_roofline_live.py) checks the same figures end to end."""

from __future__ import annotations

import pytest

from colibrid.engine.events import GenStats
from colibrid.serve.roofline import Ceilings, PassMeter, RequestShare, as_extras
from colibrid.store.telemetry import Counters

CEILINGS = Ceilings(
    disk_gbs=2.0,
    memory_gbs=20.0,
    kernel_tok_s=50.0,
    dense_bytes=100,
    expert_bytes=10,
    probes=1,
    measured_at=0.0,
    probe_s=0.1,
)


def test_a_shared_pass_is_divided_by_rows_and_a_prompt_takes_its_part_uncounted() -> None:
    live = Counters()
    meter = PassMeter(live)
    a, b = RequestShare(), RequestShare()
    # one pass: a decodes 1 row, b verifies 3 rows, a prompt chunk takes 4 rows
    live.bytes_read, live.misses, live.hits_cache = 8000, 5, 3
    meter.charge(live, [(a, 1), (b, 3), (None, 4)], CEILINGS)
    weight = 100 + (5 + 3) * 10  # dense + looked-up experts
    assert (a.read_bytes, b.read_bytes) == (1000, 3000)
    assert (a.weight_bytes, b.weight_bytes) == (weight / 8, 3 * weight / 8)
    # the next pass counts only what happened since the last one
    live.bytes_read += 600
    meter.charge(live, [(a, 1), (b, 2)], CEILINGS)
    assert (a.read_bytes, b.read_bytes) == (1200, 3400)
    assert a.weight_bytes == weight / 8 + 100 / 3


def test_the_figures_are_the_shares_of_the_decode_time_and_the_larger_one_binds() -> None:
    share = RequestShare(read_bytes=1.6e9, weight_bytes=4e9)
    stats = GenStats.measure(prompt=5, generated=11, prefill_s=0.1, decode_s=1.0)
    got = share.figures(stats, CEILINGS)
    assert got["read_mb_tok"] == pytest.approx(160.0)  # 10 decoded tokens
    assert got["disk_share"] == pytest.approx(0.8)  # 1.6 GB/s of a 2 GB/s probe
    assert got["memory_share"] == pytest.approx(0.2)
    assert got["kernel_share"] == pytest.approx(0.2)  # 10 tok/s of the kernels' 50
    assert (got["roofline_share"], got["bound"]) == (got["disk_share"], "disk")
    # tok/s over the lowest limit: 10 tok/s against min(2e9/1.6e8, 20e9/4e8, 50) = 12.5
    assert got["roofline_share"] == pytest.approx(10 / 12.5)
    assert as_extras(got)["disk_share"] == "0.8" and as_extras(got)["bound"] == "disk"


def test_no_disk_figure_where_nothing_streams_and_none_without_decode_or_ceilings() -> None:
    resident = Ceilings(None, 20.0, None, 100, 10, 1, 0.0, 0.1)  # and not on the CPU
    stats = GenStats.measure(prompt=5, generated=3, prefill_s=0.1, decode_s=0.5)
    got = RequestShare(0.0, 2e9).figures(stats, resident)
    assert "disk_share" not in got and "kernel_share" not in got and got["bound"] == "memory"
    assert got["roofline_share"] == pytest.approx(2e9 / 0.5 / 20e9)
    one = GenStats.measure(prompt=5, generated=1, prefill_s=0.1, decode_s=0.0)
    assert RequestShare(1.0, 1.0).figures(one, CEILINGS) == {}
    assert RequestShare(1.0, 1.0).figures(stats, None) == {}


def test_slow_kernels_bind_a_resident_request_over_the_memory_bus() -> None:
    slow = Ceilings(None, 20.0, 5.0, 100, 10, 1, 0.0, 0.1)  # the kernels: 5 tok/s
    stats = GenStats.measure(prompt=5, generated=5, prefill_s=0.1, decode_s=1.0)
    got = RequestShare(0.0, 8e9).figures(stats, slow)  # 8 GB/s of 20: memory 40%
    assert got["memory_share"] == pytest.approx(0.4)
    assert got["kernel_share"] == pytest.approx(4 / 5)  # 4 decoded tok/s of 5
    assert (got["roofline_share"], got["bound"]) == (got["kernel_share"], "kernels")
    assert as_extras(got)["bound"] == "kernels"
