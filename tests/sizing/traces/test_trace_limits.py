"""Hostile and lossy trace input: memory limits, outlier ids, corrupt files, fuzzing, blank lines.

Every test feeds the loader an input that, read naively, either allocates without bound (one
huge id or a lying .npy header sizes a dense table), or escapes as a bare ``json``, ``gzip``,
``zipfile`` or ``numpy`` exception, or costs Python work per blank line. The loader must estimate
sizes from the records or headers first and answer any bytes with a :class:`Trace` or a one-line
TraceError naming the file and the line (JSONL) or array that set the size. The fuzz tests write
raw hypothesis bytes under each suffix, and valid traces mutated the way a corrupt disk, a
truncated download or a hostile user would; a small ``max_memory`` keeps hostile sizes cheap.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import zipfile

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pallas_cache.sizing.synthetic import synthetic_trace
from pallas_cache.sizing.traces import (MemoryLimitError, Trace, TraceError, geometry, jsonl,
                                        load_trace, memory)

MiB = 2**20


LIMIT = 16 * 2**20


INT32_MAX = 2**31 - 1


SUFFIXES = (".jsonl", ".jsonl.gz", ".npy", ".npz")


# Whole-file errors of JSONL carry no line; every other JSONL error names one.
FILE_LEVEL = ("the trace is empty", "every record has an empty list", "every route is padding",
              "cannot open trace file")


def write_jsonl(path, records, compress=False):
    text = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(text) if compress else text)
    return path


def rec(layer, token, experts, **extra):
    return {"layer": layer, "token_idx": token, "experts": experts, **extra}


def npy_with_header(path, shape, dtype="<i4", payload=b"\0" * 64):
    """A small .npy whose header claims ``shape`` whatever the payload holds."""
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        head, {"descr": dtype, "fortran_order": False, "shape": shape})
    path.write_bytes(head.getvalue() + payload)  # the header writer adds the magic
    return path


# ---- sizes are estimated before anything is allocated ---------------------------------------


def test_a_huge_layer_id_is_an_outlier_error_with_file_and_line(tmp_path):
    """FAILS if one record with layer 10000000 silently sizes num_layers (the old loader inferred
    L = 10000001, and every per-layer table of the replay with it)."""
    path = write_jsonl(tmp_path / "t.jsonl", [rec(0, 0, [1, 2]), rec(1, 0, [0, 3]),
                                               rec(10_000_000, 0, [1, 2]), rec(2, 0, [1, 2])])
    with pytest.raises(TraceError, match=r"t\.jsonl:3: field 'layer': layer 10000000 is an "
                                         r"outlier \(the next largest layer is 2\)"):
        load_trace(path)


def test_a_huge_expert_id_is_an_outlier_error_with_file_and_line(tmp_path):
    """FAILS if an expert id of 2**27 on one line sizes num_experts (a 34 GB replay state)."""
    path = write_jsonl(tmp_path / "t.jsonl", [rec(0, 0, [1, 2]), rec(0, 1, [2**27, 5]),
                                               rec(0, 2, [7, 3])])
    with pytest.raises(TraceError, match=r"t\.jsonl:2: field 'experts': expert 134217728 is an "
                                         r"outlier \(the next largest expert is 7\)"):
        load_trace(path)


def test_outlier_rule_boundaries_and_override(tmp_path):
    """FAILS if the outlier rule fires on a dense large-E trace, below the floor, or when the
    geometry is declared (the documented escape)."""
    floor, ratio = geometry.OUTLIER_FLOOR, geometry.OUTLIER_RATIO
    # At the ratio (m + 1 == ratio * (n + 1)) it is not an outlier; one above it is.
    n = floor // ratio
    edge = ratio * (n + 1) - 1
    path = write_jsonl(tmp_path / "edge.jsonl", [rec(0, 0, [n]), rec(0, 1, [edge])])
    assert load_trace(path).num_experts == edge + 1
    path = write_jsonl(tmp_path / "over.jsonl", [rec(0, 0, [n]), rec(0, 1, [edge + 1])])
    with pytest.raises(TraceError, match=r"over\.jsonl:2: .*outlier"):
        load_trace(path)
    assert load_trace(path, num_experts=edge + 2).num_experts == edge + 2
    # Below the floor a gap is allowed: a small test trace using experts 0 and 9 is fine.
    path = write_jsonl(tmp_path / "small.jsonl", [rec(0, 0, [0]), rec(0, 1, [floor - 1])])
    assert load_trace(path).num_experts == floor
    # Arrays: the same rule, located by [token, layer, k].
    routes = np.zeros((3, 2, 2), np.int32)
    routes[2, 1, 0] = 2**27
    np.save(tmp_path / "t.npy", routes)
    with pytest.raises(TraceError, match=r"t\.npy: array 'routes'\[token=2, layer=1, k=0\]: "
                                         r"field 'experts': expert 134217728 is an outlier"):
        load_trace(tmp_path / "t.npy")


def test_declared_geometry_above_the_limit_is_refused_before_allocation(tmp_path):
    """FAILS if a declared (or outlier-free) geometry is allocated whatever its size."""
    path = write_jsonl(tmp_path / "t.jsonl", [rec(0, 0, [1]), rec(5, 0, [2])])
    with pytest.raises(MemoryLimitError,
                       match=r"t\.jsonl: the geometry 10000000 layers x 64 experts \(declared\)"
                             r".* above the memory limit of 1\.0 MiB"):
        load_trace(path, num_layers=10_000_000, num_experts=64, max_memory=MiB)
    # Inferred: the line of the largest id is named.
    path = write_jsonl(tmp_path / "u.jsonl", [rec(0, 0, list(range(900))),
                                              rec(1, 0, [1000])])
    with pytest.raises(MemoryLimitError, match=r"u\.jsonl:2: the geometry 2 layers x "
                                                         r"1001 experts"):
        load_trace(path, max_memory=40_000)
    assert load_trace(path, max_memory=MiB).num_experts == 1001


def test_a_wide_record_names_its_line_when_the_routes_table_is_too_big(tmp_path):
    """FAILS if the [calls, top_k] table is allocated before its size is checked: one record with
    a long experts list widens every call's row."""
    records = [rec(0, t, [1, 2]) for t in range(2000)]
    records[1234] = rec(0, 1234, list(range(1000)))
    path = write_jsonl(tmp_path / "t.jsonl", records)
    with pytest.raises(MemoryLimitError,
                       match=r"t\.jsonl:1235: field 'experts': the routes table \[2000 calls, "
                             r"top_k 1000 set by this line\]"):
        load_trace(path, num_experts=1000, max_memory=4 * MiB)
    assert load_trace(path, num_experts=1000, max_memory=64 * MiB).top_k == 1000


def test_a_lying_npy_header_is_refused_without_allocating(tmp_path):
    """FAILS if the loader trusts a 500-byte .npy that claims shape (1e9, 32, 2) (MemoryError or
    a 238 GiB allocation), or reads a header above the limit."""
    path = npy_with_header(tmp_path / "big.npy", (10**9, 32, 2))
    with pytest.raises(TraceError, match=r"big\.npy: array 'routes': the header claims shape "
                                         r"\(1000000000, 32, 2\) \(238\.4 GiB\) but the file "
                                         r"holds only 64 bytes"):
        load_trace(path)
    # A real array above the limit: refused from its header, naming the array.
    np.save(tmp_path / "real.npy", np.zeros((4096, 4, 8), np.int64))  # 1 MiB of data
    with pytest.raises(MemoryLimitError, match=r"real\.npy: array 'routes': the shape "
                                                         r"\(4096, 4, 8\) \(int64\) in its "
                                                         r"header"):
        load_trace(tmp_path / "real.npy", max_memory=2 * MiB)
    assert load_trace(tmp_path / "real.npy", max_memory=8 * MiB).num_calls == 4096 * 4


def test_synthetic_tokens_are_checked_before_generation():
    """FAILS if --tokens 100000000 starts generating a 25 GB array."""
    with pytest.raises(MemoryLimitError,
                       match=r"synthetic:mixtral-like: num_tokens=100000000 \(3200000000 calls "
                             r"x top_k 2\)"):
        synthetic_trace("mixtral-like", num_tokens=100_000_000)
    with pytest.raises(ValueError, match="memory limit"):
        synthetic_trace("mixtral-like", num_tokens=1000, max_memory=MiB)
    assert synthetic_trace("mixtral-like", num_tokens=8, max_memory=MiB).num_calls == 8 * 32


def test_default_limit_is_a_fraction_of_physical_memory(monkeypatch):
    """FAILS if the default limit ignores the machine, or breaks where it cannot be read."""
    pages = memory.os.sysconf("SC_PHYS_PAGES") * memory.os.sysconf("SC_PAGE_SIZE")
    assert memory.default_memory_limit() == int(pages * memory.DEFAULT_MEMORY_FRACTION)

    def no_sysconf(name):
        raise ValueError(name)

    monkeypatch.setattr(memory.os, "sysconf", no_sysconf)
    meminfo = open("/proc/meminfo").read() if memory.os.path.exists("/proc/meminfo") else ""
    total = re.search(r"MemTotal:\s+(\d+) kB", meminfo)
    expected = (int(int(total.group(1)) * 1024 * memory.DEFAULT_MEMORY_FRACTION) if total
                else memory.FALLBACK_MEMORY_LIMIT)
    assert memory.default_memory_limit() == expected
    monkeypatch.setattr(memory, "open", lambda *a, **k: (_ for _ in ()).throw(OSError()),
                        raising=False)
    assert memory.default_memory_limit() == memory.FALLBACK_MEMORY_LIMIT


def test_the_loader_holds_records_packed_not_as_python_lists(tmp_path):
    """FAILS if the JSONL reader does not count what it holds while reading (a gzip bomb of
    records would grow without bound): it holds packed int32/int64 columns, 28 bytes per record
    plus 4 per expert, so 20k top-8 records need about 1.2 MB, not 256 KiB."""
    records = [rec(t % 4, t // 4, [(t + i) % 16 for i in range(8)]) for t in range(20_000)]
    path = write_jsonl(tmp_path / "t.jsonl", records)
    with pytest.raises(MemoryLimitError, match=r"t\.jsonl:\d+: reading the records"):
        load_trace(path, max_memory=256 * 1024)
    trace = load_trace(path, max_memory=8 * MiB)
    assert trace.num_calls == 20_000 and trace.routes.dtype == np.int32


def test_corrupt_gzip_and_overlong_lines_name_file_and_line(tmp_path):
    """FAILS if a truncated gzip stream escapes as EOFError/BadGzipFile, or one endless line is
    read into memory whole."""
    records = [rec(0, t, [1, 2]) for t in range(3000)]
    data = gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match=r"cut\.jsonl\.gz:\d+: cannot read gzip data"):
        load_trace(tmp_path / "cut.jsonl.gz")
    line = b'{"layer": 0, "token_idx": 0, "experts": [' + b"1, " * jsonl.MAX_LINE_BYTES
    (tmp_path / "long.jsonl.gz").write_bytes(gzip.compress(b"\n" + line + b"1]}\n"))
    with pytest.raises(TraceError, match=r"long\.jsonl\.gz:2: line is longer than"):
        load_trace(tmp_path / "long.jsonl.gz")


# ---- fuzzing: any bytes load or raise a TraceError naming the file --------------------------


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


# ---- blank content is skipped a block at a time ---------------------------------------------


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
    data = b"".join(pieces)
    path = tmp_path_factory.mktemp("blocks") / "t.jsonl"
    path.write_bytes(gzip.compress(data) if compress else data)
    want, too_long = _lines_one_by_one(data, limit)
    got = []
    try:
        for item in jsonl.numbered_lines(str(path), block_bytes=block, max_line_bytes=limit):
            got.append(item)
        refused = None
    except TraceError as error:
        refused = int(re.search(r"t\.jsonl:(\d+): line is longer", str(error)).group(1))
    assert (got, refused) == (want, too_long)


def test_blank_lines_cost_no_python_work_per_line_and_keep_the_line_numbers(tmp_path):
    """FAILS if each blank line still passes through the Python line loop (a gzip of 1 GiB of
    blank lines, about 1 MB, then read for ~6 minutes, 100 MB for 38 s), counted here as the
    resumes of the line generator; or if skipping them in blocks loses count of the lines, so
    that the record after a million blank (and whitespace-only) lines is misnumbered."""
    import sys

    blank = b"\n" * (1 << 20) + b" \t\r\n" * 1000 + b"\x0b\x0c\n"
    body = blank + json.dumps(rec(0, 0, [1, 2])).encode() + b"\n" + blank
    bad = body + b'{"layer": 0, "token_idx": 0, "experts": [1, 1.5]}\n'
    path = tmp_path / "blank.jsonl.gz"
    path.write_bytes(gzip.compress(body))
    resumes = []

    def count(frame, event, arg):
        if event == "call" and frame.f_code is jsonl.numbered_lines.__code__:
            resumes.append(1)

    sys.setprofile(count)
    try:
        trace = load_trace(path)
    finally:
        sys.setprofile(None)
    assert trace.num_calls == 1
    assert len(resumes) <= 4, len(resumes)  # start, the record, the end: not one per line
    blank_lines = (1 << 20) + 1000 + 1
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(bad))
    with pytest.raises(TraceError, match=rf"bad\.jsonl\.gz:{2 * blank_lines + 2}: field "
                                         r"'experts': entry 1 is 1\.5"):
        load_trace(tmp_path / "bad.jsonl.gz")
