"""Per-layout kernel choice (backends/calibrate.py, dispatch.c): a registered layout runs
on its ISA whatever O and S are, a forced ISA overrides every choice, the first choice for
a layout stands, and `tune` measures a layout once per machine and reuses the file.

Each test uses a layout no model in the suite has (odd I), because choices are process
wide and never cleared: a model loaded earlier must keep computing what it computed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from colibrid.backends import calibrate
from colibrid.backends.base import KernelFamily
from colibrid.formats.weights import WeightFormat, WeightLayout

native = pytest.importorskip("colibrid.backends.native")


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=np.float32).tobytes()


def test_registered_layout_runs_on_its_choice_for_every_o_and_s(kit):
    i, gs = 1000 + 37, 64
    fam = KernelFamily.F32
    assert native.isa_setting() == "auto"
    assert native.choice(WeightFormat.Q4, gs, i, fam) == native.current_isa()
    # the portable reference: its F32 sums differ from a SIMD ISA's, so the bits show it ran
    assert native.set_choice(WeightFormat.Q4, gs, i, fam, "ref")
    assert native.choice(WeightFormat.Q4, gs, i, fam) == "ref"
    assert native.choice(WeightFormat.Q4, gs, i, KernelFamily.I8) == native.current_isa()
    rng = np.random.default_rng(3)
    differs = []
    for o, s in ((64, 1), (300, 3), (17, 5)):
        w = kit.make_weight(WeightFormat.Q4, o, i, gs, seed=o)
        x = rng.standard_normal((s, i), dtype=np.float32)
        auto = native.matmul(w, x, fam)
        with native.use_isa("ref"):
            ref = native.matmul(w, x, fam)
        assert _bits(auto) == _bits(ref)
        rows = np.concatenate([native.matmul(w, x[r : r + 1], fam) for r in range(s)])
        assert _bits(rows) == _bits(auto), "S rows must run what S single rows run"
        with native.use_isa(native.current_isa()):
            differs.append(_bits(native.matmul(w, x, fam)) != _bits(ref))
    assert any(differs) or native.current_isa() == "ref"


def test_forced_isa_overrides_choices_and_auto_restores_them(kit):
    i, gs, fam = 1000 + 41, 64, KernelFamily.F32
    native.set_choice(WeightFormat.Q4, gs, i, fam, "ref")
    best = native.available_isas()[-1]
    with native.use_isa(best):
        assert native.isa_setting() == best
        assert native.choice(WeightFormat.Q4, gs, i, fam) == best
    assert native.isa_setting() == "auto"
    assert native.choice(WeightFormat.Q4, gs, i, fam) == "ref"


def test_first_choice_stands():
    i, fam = 1000 + 43, KernelFamily.I8
    isas = native.available_isas()
    assert native.set_choice(WeightFormat.Q8, 0, i, fam, isas[0])
    assert native.set_choice(WeightFormat.Q8, 0, i, fam, isas[0])  # the same again: fine
    if len(isas) > 1:
        assert not native.set_choice(WeightFormat.Q8, 0, i, fam, isas[-1])
    assert native.choice(WeightFormat.Q8, 0, i, fam) == isas[0]
    with pytest.raises(ValueError, match="not available"):
        native.set_choice(WeightFormat.Q8, 0, i, fam, "nosuch")


def test_group_is_part_of_the_key_and_per_row_q4_is_one_layout():
    i, fam = 1000 + 47, KernelFamily.F32
    assert WeightLayout.of(WeightFormat.Q4, 0, i) == WeightLayout.of(WeightFormat.Q4, i, i)
    assert WeightLayout.of(WeightFormat.Q8, 64, i).group == 0
    native.set_choice(WeightFormat.Q4, 0, i, fam, "ref")
    assert native.choice(WeightFormat.Q4, i, i, fam) == "ref"  # per row, spelled both ways
    assert native.choice(WeightFormat.Q4, 64, i, fam) == native.current_isa()


def test_pick_keeps_the_default_within_the_margin():
    assert calibrate.pick({"avx2": 100.0, "avx512vnni": 102.0}, "avx512vnni") == "avx512vnni"
    assert calibrate.pick({"avx2": 100.0, "avx512vnni": 110.0}, "avx512vnni") == "avx2"
    assert calibrate.pick({"ref": 5.0}, "avx512vnni") == "ref"


def test_tune_measures_once_then_reads_the_file(tmp_path, monkeypatch):
    i, rows = 1000 + 53, 512  # a q4-g64 matrix of ~280 KB: worth tuning
    layout = WeightLayout.of(WeightFormat.Q4, 64, i)
    small = WeightLayout.of(WeightFormat.Q4, 64, 1000 + 59)
    monkeypatch.setattr(calibrate, "WORKING_SET_BYTES", 2 << 20)
    path = tmp_path / "calibration.json"
    chosen = calibrate.tune({layout: rows, small: 8}, path=path)
    saved = json.loads(path.read_text())
    assert set(saved) == {f"q4:64:{i}:f32", f"q4:64:{i}:i8"}, "small matrices keep the default"
    for key, entry in saved.items():
        assert entry["isa"] in native.available_isas()
        assert set(entry["us"]) <= set(native.available_isas())
        assert chosen[key] == entry["isa"]
        fam = KernelFamily(key.rsplit(":", 1)[1])
        assert native.choice(WeightFormat.Q4, 64, i, fam) == entry["isa"]

    def no_measuring(*_args):
        raise AssertionError("a layout in the file must not be measured again")

    monkeypatch.setattr(calibrate, "measure", no_measuring)
    assert calibrate.tune({layout: rows}, path=path) == chosen
    with native.use_isa("ref"):
        assert calibrate.tune({layout: rows}, path=path) == {}, "a forced ISA tunes nothing"


def test_tune_survives_a_broken_file(tmp_path, monkeypatch):
    i = 1000 + 61
    layout = WeightLayout.of(WeightFormat.Q8, 0, i)
    monkeypatch.setattr(calibrate, "WORKING_SET_BYTES", 2 << 20)
    path = tmp_path / "calibration.json"
    path.write_text("{not json")
    chosen = calibrate.tune({layout: 256}, path=path)
    assert set(json.loads(path.read_text())) == {f"q8:0:{i}:f32", f"q8:0:{i}:i8"}
    assert chosen
