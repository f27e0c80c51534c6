"""SafetensorsFile: library-written files read back identically; lying files refused."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from colibrid.errors import CheckpointError
from colibrid.store.safetensors_file import MAX_HEADER_BYTES, SafetensorsFile

TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}


def raw_view(t: torch.Tensor) -> np.ndarray:
    """What SafetensorsFile.array should return for ``t``: same bytes, numpy-able dtype."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy()
    return t.numpy()


def write_raw(path, header, data: bytes = b"", *, length: int | None = None) -> str:
    """A safetensors file by hand: header as a dict (JSON-encoded) or raw bytes."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(blob) if length is None else length
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", n) + blob + data)
    return str(path)


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def refused(path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as info:
        SafetensorsFile.open(path)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


# ---- valid files ------------------------------------------------------------------


def test_all_dtypes_written_by_the_library_read_back(tmp_path):
    torch.manual_seed(0)
    tensors = {}
    for code, dt in TORCH_DTYPES.items():
        if dt.is_floating_point:
            tensors[code.lower()] = (torch.randn(3, 5) * 4).to(dt)
        elif dt == torch.bool:
            tensors[code.lower()] = torch.rand(3, 5) > 0.5
        else:
            tensors[code.lower()] = torch.randint(0, 100, (3, 5)).to(dt)
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.zeros(0, 4)
    tensors["rank4"] = torch.randn(2, 1, 3, 2)
    path = tmp_path / "all.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "k": "v"})
    with SafetensorsFile.open(path) as f:
        assert f.metadata == {"format": "pt", "k": "v"}
        assert set(f.tensors) == set(tensors)
        for name, t in tensors.items():
            info = f.tensors[name]
            assert info.shape == tuple(t.shape)
            assert info.nbytes == t.numel() * t.element_size()
            assert info.file_end - info.file_begin == info.nbytes
            arr = f.array(name)
            assert not arr.flags.writeable
            assert arr.shape == tuple(t.shape)
            assert np.array_equal(arr, raw_view(t)), name
            if name.upper() in TORCH_DTYPES:
                assert info.dtype == name.upper()
        # absolute offsets: the bytes at [file_begin, file_end) are the tensor
        with open(path, "rb") as fh:
            info = f.tensors["f32"]
            fh.seek(info.file_begin)
            assert fh.read(info.nbytes) == tensors["f32"].numpy().tobytes()


def test_arrays_are_zero_copy_views_and_outlive_close(tmp_path):
    path = tmp_path / "a.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, str(path))
    f = SafetensorsFile.open(path)
    a = f.array("a")
    assert a.base is not None and not a.flags.owndata
    f.close()
    assert a.sum() == 15.0  # the mapping lives as long as the view
    f.close()  # idempotent


def test_missing_tensor_and_no_metadata(tmp_path):
    path = tmp_path / "a.safetensors"
    save_file({"a": torch.zeros(2)}, str(path))
    with SafetensorsFile.open(path) as f:
        assert f.metadata == {}
        with pytest.raises(CheckpointError, match="'nope'"):
            f.array("nope")


def test_gaps_between_tensors_and_trailing_bytes_are_allowed(tmp_path):
    header = {"a": entry(offsets=(0, 8)), "b": entry(offsets=(16, 24))}
    path = write_raw(tmp_path / "gap.safetensors", header, bytes(32))
    with SafetensorsFile.open(path) as f:
        assert f.array("b").tolist() == [0.0, 0.0]


# ---- malformed files --------------------------------------------------------------


def test_missing_file_and_directory_and_fifo(tmp_path):
    refused(tmp_path / "nope.safetensors", "not found")
    refused(tmp_path, "not a regular file")
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    refused(fifo, "not a regular file")  # and does not block


def test_too_small_and_truncated(tmp_path):
    p = tmp_path / "small.safetensors"
    p.write_bytes(b"\x10\x00")
    refused(p, "too small")
    good = tmp_path / "good.safetensors"
    save_file({"a": torch.randn(16)}, str(good))
    blob = good.read_bytes()
    for cut in (len(blob) - 1, len(blob) - 40, 12):
        p.write_bytes(blob[:cut])
        refused(p)


def test_header_length_zero_too_big_or_past_end(tmp_path):
    refused(write_raw(tmp_path / "z", b"", length=0), "length is 0")
    refused(write_raw(tmp_path / "b", b"{}", length=MAX_HEADER_BYTES + 1), "cap")
    refused(write_raw(tmp_path / "p", b"{}", length=3), "past the end")
    refused(write_raw(tmp_path / "h", b"{}", length=2**64 - 1), "cap")


def test_non_json_non_object_non_utf8_duplicates(tmp_path):
    refused(write_raw(tmp_path / "a", b"not json"), "invalid JSON")
    refused(write_raw(tmp_path / "b", b"[1, 2]"), "expected a JSON object")
    refused(write_raw(tmp_path / "c", b'{"\xff": 1}'), "UTF-8")
    dup = b'{"a": ' + json.dumps(entry()).encode() + b', "a": ' + json.dumps(entry()).encode()
    refused(write_raw(tmp_path / "d", dup + b"}", bytes(8)), "duplicate key 'a'")
    refused(write_raw(tmp_path / "e", b'{"a": NaN}'), "NaN")
    refused(write_raw(tmp_path / "f", b'{"a": ' + b"1" * 5000 + b"}"), "digits")
    refused(write_raw(tmp_path / "g", b"[" * 100000 + b"]" * 100000))
    refused(write_raw(tmp_path / "i", b'{"a": 1.5}'), "non-integer number")
    refused(write_raw(tmp_path / "j", {"t": entry(shape=(2.0,))}, bytes(8)), "non-integer number")


def test_header_parse_cost_is_capped(tmp_path, monkeypatch):
    """A header dense in tiny values (``[0,0,...]``, ``{},{}``) would cost ~10-30x its
    size as Python objects; it is refused before json.loads allocates anything."""
    import colibrid.store.safetensors_file as sf

    monkeypatch.setattr(sf, "PARSE_BUDGET_BYTES", 1 << 20)
    ints = b'{"a": [' + b"0," * 40000 + b"0]}"
    refused(write_raw(tmp_path / "i", ints), "to parse")
    dicts = b'{"a": [' + b"{}," * 10000 + b"{}]}"
    refused(write_raw(tmp_path / "d", dicts), "to parse")
    # a real-looking header of the same size still parses
    header = {
        f"model.layers.{i}.mlp.experts.{i}.up_proj.weight": entry(offsets=(8 * i, 8 * i + 8))
        for i in range(400)
    }
    with SafetensorsFile.open(write_raw(tmp_path / "ok", header, bytes(3200))) as f:
        assert len(f.tensors) == 400


def test_metadata_must_map_strings_to_strings(tmp_path):
    refused(write_raw(tmp_path / "a", {"__metadata__": {"k": 1}}), "__metadata__")
    refused(write_raw(tmp_path / "b", {"__metadata__": ["x"]}), "__metadata__")


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [
        ({"dtype": "F32", "shape": [2]}, "missing 'data_offsets'"),
        ("x", "not an object"),
        (entry(dtype="F128"), "unknown dtype"),
        (entry(dtype=7), "unknown dtype"),
        (entry(shape=(-2,)), "bad dimension"),
        (entry(shape=(True,)), "bad dimension"),
        ({"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}, "shape is not a list"),
        (entry(shape=(1,) * 9), "9 dimensions"),
        (entry(shape=(2**40, 2**40)), "2^48"),
        (entry(shape=(2**62, 2**62, 2**62)), "bad dimension"),
        (entry(shape=(2**30, 2**30, 2**30, 0)), "2^48"),
        (entry(shape=(3,)), "needs 12"),
        (entry(offsets=(8, 0)), "bad data_offsets"),
        (entry(offsets=(-8, 0)), "bad data_offsets"),
        (entry(offsets=(0,)), "pair"),
        (entry(offsets=(0, "8")), "bad data_offsets"),
        (entry(shape=(4,), offsets=(0, 16)), "past the data region"),
        (entry(shape=(2**45,), offsets=(2**60, 2**60 + 2**47)), "past the data region"),
        (entry(dtype="F4", shape=(3,), offsets=(0, 1)), "whole number of bytes"),
    ],
)
def test_bad_entries(tmp_path, bad, fragment):
    path = write_raw(tmp_path / "bad.safetensors", {"t.weight": bad}, bytes(8))
    msg = refused(path, fragment)
    assert "'t.weight'" in msg


def test_overlapping_tensors(tmp_path):
    header = {"a": entry(offsets=(0, 8)), "b": entry(offsets=(4, 12))}
    refused(write_raw(tmp_path / "o", header, bytes(12)), "overlaps")
    header = {"a": entry(shape=(4,), offsets=(0, 16)), "b": entry(offsets=(4, 12))}
    refused(write_raw(tmp_path / "n", header, bytes(16)), "overlaps")
    # empty tensors overlap nothing
    header = {"a": entry(offsets=(0, 8)), "e": entry(shape=(0,), offsets=(4, 4))}
    with SafetensorsFile.open(write_raw(tmp_path / "ok", header, bytes(8))) as f:
        assert f.array("e").shape == (0,)


def test_huge_names_are_truncated_in_messages(tmp_path):
    name = "x" * 10000 + "\n"
    path = write_raw(tmp_path / "n", {name: entry(dtype="nope")}, bytes(8))
    msg = refused(path)
    assert len(msg) < 400
