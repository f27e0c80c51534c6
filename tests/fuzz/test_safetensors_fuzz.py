"""Malicious safetensors / config.json never crash, hang or read outside the file.

Every input must either load or raise CheckpointError / ConfigError; any other
exception (IndexError, ValueError, MemoryError, OverflowError...) is a bug. Examples are
bounded so the whole module runs in a few seconds; the deadline catches hangs.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save

from colibrid.errors import CheckpointError, ConfigError
from colibrid.store.checkpoint import Checkpoint
from colibrid.store.container_format import resolve_container_format
from colibrid.store.safetensors_file import SafetensorsFile
from colibrid.store.safetensors_header import DTYPES, MAX_NUMEL, _Header, _plain_entry

FUZZ = settings(
    max_examples=150,
    deadline=2000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

VALID = save(
    {
        "a.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.arange(5, dtype=np.uint8),
        "c": np.ones((2, 2), dtype=np.float16),
        "e": np.zeros((0, 3), dtype=np.int32),
    },
    metadata={"k": "v"},
)


@pytest.fixture(scope="module")
def scratch():
    with tempfile.TemporaryDirectory() as d:
        yield d


def load_all(path: str) -> None:
    """Open and touch every byte of every tensor; only CheckpointError may escape."""
    try:
        with SafetensorsFile.open(path) as f:
            for name, info in f.tensors.items():
                arr = f.array(name)
                raw = f.raw(name)
                assert raw.nbytes == info.nbytes
                assert f.data_start <= info.file_begin <= info.file_end <= f.size
                np.asarray(raw).sum()
                assert arr.size * arr.itemsize == info.nbytes or arr.dtype == np.uint8
    except CheckpointError as exc:
        assert "\n" not in str(exc)


def write(scratch: str, blob: bytes) -> str:
    path = os.path.join(scratch, "f.safetensors")
    with open(path, "wb") as fh:
        fh.write(blob)
    return path


@FUZZ
@given(
    flips=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=6),
    cut=st.one_of(st.none(), st.integers(0, len(VALID))),
)
def test_mutated_valid_file(scratch, flips, cut):
    blob = bytearray(VALID)
    for pos, byte in flips:
        blob[pos] = byte
    if cut is not None:
        blob = blob[:cut]
    load_all(write(scratch, bytes(blob)))


@FUZZ
@given(length=st.integers(0, 2**64 - 1), body=st.binary(max_size=200))
def test_random_header_length_and_bytes(scratch, length, body):
    load_all(write(scratch, struct.pack("<Q", length) + body))


ints = st.one_of(st.integers(-3, 40), st.integers(-(2**70), 2**70))
json_scalars = st.one_of(
    st.none(), st.booleans(), ints, st.floats(allow_nan=False), st.text(max_size=8)
)
entries = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.one_of(st.sampled_from(sorted(DTYPES)), json_scalars),
        "shape": st.one_of(st.lists(ints, max_size=10), json_scalars),
        "data_offsets": st.one_of(st.lists(ints, min_size=0, max_size=3), json_scalars),
    },
)
headers = st.dictionaries(
    st.text(max_size=12),
    st.one_of(entries, json_scalars, st.dictionaries(st.text(max_size=4), st.text(max_size=4))),
    max_size=6,
)


@FUZZ
@given(header=headers, data=st.binary(max_size=96), slack=st.integers(-4, 4))
def test_random_headers(scratch, header, data, slack):
    blob = json.dumps(header).encode()
    length = max(0, len(blob) + slack)
    load_all(write(scratch, struct.pack("<Q", length) + blob + data))


near_valid_entries = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(sorted(DTYPES)),
        "shape": st.lists(
            st.sampled_from([0, 1, 2, 3, 7, 64, MAX_NUMEL, MAX_NUMEL + 1, -1]), max_size=9
        ),
        "data_offsets": st.lists(st.integers(-2, 600), min_size=2, max_size=2),
    }
)


@st.composite
def sized_entries(draw):
    """Entries whose offsets hold exactly their shape's bytes, give or take one."""
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    shape = draw(st.lists(st.integers(0, 9), max_size=4))
    nbytes = (int(np.prod(shape)) * DTYPES[dtype][0]) // 8
    begin = draw(st.integers(0, 40))
    end = begin + nbytes + draw(st.sampled_from([0, 0, 0, -1, 1]))
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@FUZZ
@given(
    entry=st.one_of(entries, near_valid_entries, sized_entries(), json_scalars),
    data_size=st.integers(0, 600),
)
def test_fast_entry_path_agrees_with_the_checked_one(entry, data_size):
    """The header's one-pass path for plain entries accepts exactly what the checked path
    accepts, with the same record; anything else falls through to the checked path."""
    fast = _plain_entry("t", entry, data_size, 8)
    try:
        checked = _Header("f.safetensors", 8 + data_size, 8)._parse_entry("t", entry, data_size)
    except CheckpointError:
        assert fast is None
    else:
        assert fast == checked


@FUZZ
@given(
    config=st.one_of(st.binary(max_size=64), headers.map(lambda h: json.dumps(h).encode())),
    index=st.one_of(
        st.none(),
        st.binary(max_size=64),
        st.dictionaries(
            st.text(max_size=6), st.one_of(st.text(max_size=30), json_scalars), max_size=4
        ).map(lambda m: json.dumps({"weight_map": m}).encode()),
    ),
)
def test_random_config_and_index(scratch, config, index):
    d = os.path.join(scratch, "model")
    os.makedirs(d, exist_ok=True)
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    with open(os.path.join(d, "config.json"), "wb") as fh:
        fh.write(config)
    with open(os.path.join(d, "model.safetensors"), "wb") as fh:
        fh.write(VALID)
    if index is not None:
        with open(os.path.join(d, "model.safetensors.index.json"), "wb") as fh:
            fh.write(index)
    try:
        with Checkpoint.open(d) as ck:
            ck.weight("a.weight", (3, 4))
    except (CheckpointError, ConfigError) as exc:
        assert "\n" not in str(exc)


@settings(max_examples=300, deadline=1000)
@given(
    out_f=st.integers(1, 5000),
    in_f=st.integers(1, 10000),
    nbytes=st.integers(0, 10**8),
    n_scales=st.integers(0, 10**6),
    scale_dtype=st.sampled_from(["F32", "F8_E8M0", "BF16", "U8"]),
    stamp=st.one_of(
        st.none(),
        st.sampled_from(["int8-row", "int4-row", "int4-grouped", "fp8-e4m3-b128", "mxfp4", "??"]),
    ),
    hint=st.one_of(st.none(), st.integers(1, 5000)),
)
def test_container_format_resolution_total(out_f, in_f, nbytes, n_scales, scale_dtype, stamp, hint):
    try:
        fmt = resolve_container_format(
            "t", (out_f, in_f), nbytes, n_scales, scale_dtype, stamp=stamp, hint=hint
        )
    except CheckpointError:
        return
    if fmt.name == "int4-grouped":
        assert nbytes == out_f * ((in_f + 1) // 2)
        assert n_scales == out_f * -(-in_f // fmt.group_size)


@FUZZ
@given(
    n_bytes=st.integers(0, 300),
    n_scales=st.integers(0, 40),
    out_f=st.integers(-1, 20),
    in_f=st.integers(-1, 40),
    meta=st.one_of(st.none(), st.text(max_size=12), st.sampled_from(["64", "3", "0", "999999"])),
)
def test_container_weights_end_to_end(scratch, n_bytes, n_scales, out_f, in_f, meta):
    d = os.path.join(scratch, "container")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as fh:
        fh.write("{}")
    tensors = {"x": np.full(n_bytes, 0x88, np.uint8), "x.qs": np.ones(n_scales, np.float32)}
    metadata = None if meta is None else {"colibri.group_size": meta, "colibri.fmt": meta}
    with open(os.path.join(d, "out-00001.safetensors"), "wb") as fh:
        fh.write(save(tensors, metadata=metadata))
    try:
        with Checkpoint.open(d) as ck:
            w = ck.weight("x", (out_f, in_f))
            assert ck.dense_f32("x", (out_f, in_f)).shape == (out_f, in_f)
            assert w.shape == (out_f, in_f)
    except (CheckpointError, ConfigError) as exc:
        assert "\n" not in str(exc)


def _weight_or_error(ck: Checkpoint, name: str, shape: tuple[int, int]):
    try:
        w = ck.weight(name, shape)
    except (CheckpointError, ConfigError) as exc:
        return str(exc)
    scales = None if w.scales is None else (w.scales.dtype.str, w.scales.tobytes())
    return (w.fmt, w.shape, w.group_size, w.data.dtype.str, w.data.tobytes(), scales)


@st.composite
def container_sizes(draw):
    """(O, I, data bytes, scales): mostly sizes some format holds, sometimes any."""
    out_f, in_f = draw(st.integers(1, 12)), draw(st.integers(1, 40))
    kind = draw(st.sampled_from(["q8", "q4-row", "q4-g16", "q4-g32", "any"]))
    q4 = out_f * ((in_f + 1) // 2)
    if kind == "q8":
        return out_f, in_f, out_f * in_f, out_f
    if kind == "q4-row":
        return out_f, in_f, q4, out_f
    if kind.startswith("q4-g"):
        return out_f, in_f, q4, out_f * -(-in_f // int(kind[4:]))
    return out_f, in_f, draw(st.integers(1, 160)), draw(st.integers(1, 24))


@FUZZ
@given(
    sizes=container_sizes(),
    bad=st.lists(st.sampled_from([np.nan, np.inf, 0.0, 2.5]), min_size=3, max_size=3),
    stamps=st.lists(
        st.sampled_from([None, "int8-row", "int4-row", "int4-grouped"]), min_size=3, max_size=3
    ),
)
def test_weights_of_one_signature_read_as_each_alone(scratch, sizes, bad, stamps):
    """Three tensors of one size signature, each with its own bytes, stamp and a scale
    that may be NaN: reading them in one checkpoint (the later ones rebuilt from the
    first's recipe) gives, tensor by tensor, the weight or the error line that a fresh
    checkpoint gives for that tensor alone."""
    out_f, in_f, n_bytes, n_scales = sizes
    d = os.path.join(scratch, "signature")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as fh:
        fh.write("{}")
    tensors, stamp_map = {}, {}
    for k in range(3):
        tensors[f"t{k}"] = np.arange(n_bytes, dtype=np.uint8) * (k + 1)
        scales = np.full(n_scales, 0.5 + k, np.float32)
        scales[k % n_scales] = bad[k]
        tensors[f"t{k}.qs"] = scales
        if stamps[k] is not None:
            stamp_map[f"t{k}"] = stamps[k]
    metadata = {"colibri.fmt": json.dumps(stamp_map)} if stamp_map else None
    with open(os.path.join(d, "out-00001.safetensors"), "wb") as fh:
        fh.write(save(tensors, metadata=metadata))
    with Checkpoint.open(d) as ck:
        together = [_weight_or_error(ck, f"t{k}", (out_f, in_f)) for k in range(3)]
    for k in range(3):
        with Checkpoint.open(d) as alone:
            assert together[k] == _weight_or_error(alone, f"t{k}", (out_f, in_f))
