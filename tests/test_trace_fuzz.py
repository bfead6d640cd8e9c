"""Fuzzing the trace loader: any bytes either load or raise TraceError naming the file.

Two sources of input: raw hypothesis bytes written under each suffix, and valid traces (JSONL,
gzip JSONL, .npy, .npz) mutated the way a corrupt disk, a truncated download or a hostile user
would (flipped and inserted bytes, truncation, extreme or ill-typed JSON values). The loader must
answer each with a :class:`Trace` or its own :class:`TraceError` -- never ``json``, ``gzip``,
``zipfile`` or ``numpy`` exceptions, ``MemoryError``, ``KeyError`` or the like -- and a JSONL error
about a record must name its line. A small ``max_memory`` keeps hostile sizes cheap to refuse.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import zipfile

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pallas_cache.sizing.traces import Trace, TraceError, load_trace

LIMIT = 16 * 2**20
INT32_MAX = 2**31 - 1
SUFFIXES = (".jsonl", ".jsonl.gz", ".npy", ".npz")
# Whole-file errors of JSONL carry no line; every other JSONL error names one.
FILE_LEVEL = ("the trace is empty", "every record has an empty list", "every route is padding",
              "cannot open trace file")


def check_load(tmp_path, suffix, data, **kwargs):
    """Write ``data`` and load it: a Trace, or a TraceError that names the file (and line)."""
    path = tmp_path / f"fuzz{suffix}"
    path.write_bytes(data)
    try:
        trace = load_trace(path, max_memory=LIMIT, **kwargs)
    except TraceError as error:
        message = str(error)
        assert message.startswith(str(path)), message
        assert "\n" not in message, message
        if suffix.startswith(".jsonl") and not any(text in message for text in FILE_LEVEL):
            assert re.match(re.escape(str(path)) + r":\d+: ", message), message
        for value in re.findall(r"(-?\d+) does not fit int32", message):
            assert int(value) > INT32_MAX, message  # 2**31 - 1 fits: its count does not
        return None
    assert isinstance(trace, Trace)
    assert trace.routes.dtype == np.int32 and trace.num_calls >= 1
    return trace


def jsonl_bytes(records):
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def npz_bytes(**arrays):
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def npy_bytes(array):
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


records = st.lists(st.fixed_dictionaries({
    "layer": st.integers(0, 5), "token_idx": st.integers(0, 6),
    "experts": st.lists(st.integers(-1, 9), min_size=0, max_size=4)},
    optional={"sequence": st.sampled_from(["a", "b", 7])}), min_size=1, max_size=12)

hostile_values = st.one_of(
    st.integers(-3, 3), st.sampled_from([2**27, 10**7, 2**31, 2**63, -2**40, 10**400,
                                         INT32_MAX]),
    st.floats(allow_nan=True), st.text(max_size=3), st.booleans(), st.none(),
    st.lists(st.integers(-2, 2**31), max_size=3), st.dictionaries(st.text(max_size=2),
                                                                   st.integers(), max_size=2))


@st.composite
def mutated(draw, data):
    """Apply 1-3 byte-level mutations: flip, insert, delete, truncate."""
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete" and data:
            del data[at:at + draw(st.integers(1, 8))]
        elif kind == "truncate":
            del data[at:]
    return bytes(data)


@given(suffix=st.sampled_from(SUFFIXES), data=st.binary(max_size=300))
def test_random_bytes_load_or_raise_trace_error(tmp_path_factory, suffix, data):
    """FAILS if arbitrary bytes escape as a non-TraceError exception."""
    check_load(tmp_path_factory.mktemp("raw"), suffix, data)


@given(rows=records, key=st.sampled_from(["layer", "token_idx", "experts", "sequence"]),
       value=hostile_values, at=st.integers(0, 11), compress=st.booleans())
def test_jsonl_with_hostile_values(tmp_path_factory, rows, key, value, at, compress):
    """FAILS if an extreme or ill-typed JSON value escapes as another exception, or an error
    about a record does not name its line."""
    rows = [dict(r) for r in rows]
    rows[at % len(rows)][key] = value
    data = jsonl_bytes(rows)
    check_load(tmp_path_factory.mktemp("hostile"), ".jsonl.gz" if compress else ".jsonl",
               gzip.compress(data) if compress else data)


@given(rows=records, data=st.data())
def test_mutated_jsonl_and_gzip(tmp_path_factory, rows, data):
    """FAILS if corrupted text or a corrupted/truncated gzip stream escapes as EOFError,
    BadGzipFile, zlib.error, UnicodeDecodeError or the like."""
    text = jsonl_bytes(rows)
    folder = tmp_path_factory.mktemp("mutjsonl")
    check_load(folder, ".jsonl", data.draw(mutated(text)))
    check_load(folder, ".jsonl.gz", data.draw(mutated(gzip.compress(text))))
    check_load(folder, ".jsonl.gz", gzip.compress(data.draw(mutated(text))))


arrays = st.builds(
    lambda shape, dtype, seed: np.random.default_rng(seed).integers(-1, 9, shape).astype(dtype),
    st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3)),
    st.sampled_from([np.int8, np.int16, np.int32, np.int64, np.uint8, ">i4"]),
    st.integers(0, 2**16))


@given(array=arrays, other=arrays, data=st.data())
def test_mutated_npy_and_npz(tmp_path_factory, array, other, data):
    """FAILS if a corrupted header (lying shape, bad dtype), truncated data or a corrupt zip
    escapes as ValueError/EOFError/BadZipFile/MemoryError or the like."""
    folder = tmp_path_factory.mktemp("mutnpy")
    check_load(folder, ".npy", data.draw(mutated(npy_bytes(array))))
    check_load(folder, ".npz", data.draw(mutated(npz_bytes(routes=array, more=other))))


@given(shape=st.tuples(st.integers(0, 10**12), st.integers(0, 10**6), st.integers(0, 10**4)),
       descr=st.sampled_from(["<i4", "|u1", ">i8", "<f4", "|b1", "<U3", "|O", "<i2"]),
       payload=st.binary(max_size=64), in_zip=st.booleans())
def test_lying_headers(tmp_path_factory, shape, descr, payload, in_zip):
    """FAILS if a header's claimed shape or dtype is trusted: allocation before the size check,
    or a non-integer dtype escaping as a numpy error."""
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        head, {"descr": descr, "fortran_order": False, "shape": shape})
    data = head.getvalue() + payload
    if in_zip:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            archive.writestr("routes.npy", data)
        data = buffer.getvalue()
    check_load(tmp_path_factory.mktemp("lying"), ".npz" if in_zip else ".npy", data)


@given(format=st.sampled_from([".jsonl", ".jsonl.gz", ".npy", ".npz"]),
       field=st.sampled_from(["layer", "experts"]),
       value=st.sampled_from([INT32_MAX, INT32_MAX + 1, 2**40]))
def test_an_id_at_or_past_the_int32_edge_says_why(tmp_path_factory, format, field, value):
    """FAILS if an id of 2**31 - 1 is refused as "does not fit int32" (it does; the count
    ``max + 1`` it implies does not) in any format, or an id past it is refused without
    saying it does not fit (checked in :func:`check_load` for every fuzzed input too)."""
    if format in (".npy", ".npz"):
        if field == "layer":
            return  # an array's layer is its position: no id to be too large
        routes = np.zeros((1, 1, 2), np.int64)
        routes[0, 0, 1] = value
        data = npy_bytes(routes) if format == ".npy" else npz_bytes(r=routes)
    else:
        row = {"layer": 0, "token_idx": 0, "experts": [1]}
        row[field] = [1, value] if field == "experts" else value
        data = jsonl_bytes([row])
        data = gzip.compress(data) if format == ".jsonl.gz" else data
    path = tmp_path_factory.mktemp("edge") / f"t{format}"
    path.write_bytes(data)
    try:
        load_trace(path, max_memory=LIMIT)
    except TraceError as error:
        message = str(error)
    else:
        raise AssertionError(f"{field} {value} loaded")
    name = "layer" if field == "layer" else "expert"
    if value == INT32_MAX:
        count = "num_layers" if field == "layer" else "num_experts"
        assert f"{name} {value} fits int32, but {count} = {value} + 1 = 2**31" in message, message
    else:
        assert f"{name} {value} does not fit int32" in message, message


def _lines_one_by_one(data: bytes, limit: int):
    """The line rule read naively, one line at a time: ``(line number, line)`` of each line that
    is not blank (``bytes.strip``), then the number of the first such line longer than
    ``limit`` bytes (newline included), if any."""
    parts = data.split(b"\n")
    lines = [part + b"\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    kept = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            if len(line) > limit:
                return kept, number
            kept.append((number, line))
    return kept, None


@given(pieces=st.lists(st.sampled_from([b"\n", b" ", b"\t", b"\r", b"\x0b", b"\x0c", b"\r\n",
                                        b"{}", b"x", b"ab  c", b"\n\n\n", b"    " * 5]),
                       max_size=40),
       block=st.integers(1, 12), limit=st.integers(1, 24), compress=st.booleans())
def test_the_block_reader_yields_the_lines_of_the_line_by_line_rule(tmp_path_factory, pieces,
                                                                    block, limit, compress):
    """FAILS if skipping blank content a block at a time changes which lines are read, their
    numbers, or which line is refused as too long (whitespace-only lines are skipped however
    long), whatever the block boundaries cut (blocks and the limit shrunk to a few bytes)."""
    from pallas_cache.sizing import traces

    data = b"".join(pieces)
    path = tmp_path_factory.mktemp("blocks") / "t.jsonl"
    path.write_bytes(gzip.compress(data) if compress else data)
    want, too_long = _lines_one_by_one(data, limit)
    saved = traces._BLOCK_BYTES, traces.MAX_LINE_BYTES
    traces._BLOCK_BYTES, traces.MAX_LINE_BYTES = block, limit
    got = []
    try:
        for item in traces._numbered_lines(str(path)):
            got.append(item)
        refused = None
    except TraceError as error:
        refused = int(re.search(r"t\.jsonl:(\d+): line is longer", str(error)).group(1))
    finally:
        traces._BLOCK_BYTES, traces.MAX_LINE_BYTES = saved
    assert (got, refused) == (want, too_long)
