"""Hostile and lossy trace input: memory limits, outlier ids, gzip, multi-array .npz.

Every test here feeds the loader an input that, read naively, either allocates without bound
(one huge id or a lying .npy header sizes a dense table), or silently drops data (an .npz read as
its first array only), or does not load at all (gzip JSONL). The loader must estimate sizes from
the records or headers first and refuse with a one-line TraceError naming the file and the line
(JSONL) or array that set the size.
"""

from __future__ import annotations

import gzip
import io
import json
import re

import numpy as np
import pytest

from pallas_cache.sizing import traces as trace_mod
from pallas_cache.sizing.synthetic import synthetic_trace
from pallas_cache.sizing.traces import TraceError, load_trace, save_trace

MiB = 2**20


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


# ---- item 5: sizes are estimated before anything is allocated ---------------------------------


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
    floor, ratio = trace_mod.OUTLIER_FLOOR, trace_mod.OUTLIER_RATIO
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
    with pytest.raises(trace_mod.MemoryLimitError,
                       match=r"t\.jsonl: the geometry 10000000 layers x 64 experts \(declared\)"
                             r".* above the memory limit of 1\.0 MiB"):
        load_trace(path, num_layers=10_000_000, num_experts=64, max_memory=MiB)
    # Inferred: the line of the largest id is named.
    path = write_jsonl(tmp_path / "u.jsonl", [rec(0, 0, list(range(900))),
                                              rec(1, 0, [1000])])
    with pytest.raises(trace_mod.MemoryLimitError, match=r"u\.jsonl:2: the geometry 2 layers x "
                                                         r"1001 experts"):
        load_trace(path, max_memory=40_000)
    assert load_trace(path, max_memory=MiB).num_experts == 1001


def test_a_wide_record_names_its_line_when_the_routes_table_is_too_big(tmp_path):
    """FAILS if the [calls, top_k] table is allocated before its size is checked: one record with
    a long experts list widens every call's row."""
    records = [rec(0, t, [1, 2]) for t in range(2000)]
    records[1234] = rec(0, 1234, list(range(1000)))
    path = write_jsonl(tmp_path / "t.jsonl", records)
    with pytest.raises(trace_mod.MemoryLimitError,
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
    with pytest.raises(trace_mod.MemoryLimitError, match=r"real\.npy: array 'routes': the shape "
                                                         r"\(4096, 4, 8\) \(int64\) in its "
                                                         r"header"):
        load_trace(tmp_path / "real.npy", max_memory=2 * MiB)
    assert load_trace(tmp_path / "real.npy", max_memory=8 * MiB).num_calls == 4096 * 4


def test_synthetic_tokens_are_checked_before_generation():
    """FAILS if --tokens 100000000 starts generating a 25 GB array."""
    with pytest.raises(trace_mod.MemoryLimitError,
                       match=r"synthetic:mixtral-like: num_tokens=100000000 \(3200000000 calls "
                             r"x top_k 2\)"):
        synthetic_trace("mixtral-like", num_tokens=100_000_000)
    with pytest.raises(ValueError, match="memory limit"):
        synthetic_trace("mixtral-like", num_tokens=1000, max_memory=MiB)
    assert synthetic_trace("mixtral-like", num_tokens=8, max_memory=MiB).num_calls == 8 * 32


def test_default_limit_is_a_fraction_of_physical_memory(monkeypatch):
    """FAILS if the default limit ignores the machine, or breaks where it cannot be read."""
    pages = trace_mod.os.sysconf("SC_PHYS_PAGES") * trace_mod.os.sysconf("SC_PAGE_SIZE")
    assert trace_mod.default_memory_limit() == int(pages * trace_mod.DEFAULT_MEMORY_FRACTION)

    def no_sysconf(name):
        raise ValueError(name)

    monkeypatch.setattr(trace_mod.os, "sysconf", no_sysconf)
    meminfo = open("/proc/meminfo").read() if trace_mod.os.path.exists("/proc/meminfo") else ""
    total = re.search(r"MemTotal:\s+(\d+) kB", meminfo)
    expected = (int(int(total.group(1)) * 1024 * trace_mod.DEFAULT_MEMORY_FRACTION) if total
                else trace_mod.FALLBACK_MEMORY_LIMIT)
    assert trace_mod.default_memory_limit() == expected
    monkeypatch.setattr(trace_mod, "open", lambda *a, **k: (_ for _ in ()).throw(OSError()),
                        raising=False)
    assert trace_mod.default_memory_limit() == trace_mod.FALLBACK_MEMORY_LIMIT


def test_the_loader_holds_records_packed_not_as_python_lists(tmp_path):
    """FAILS if the JSONL reader does not count what it holds while reading (a gzip bomb of
    records would grow without bound): it holds packed int32/int64 columns, 28 bytes per record
    plus 4 per expert, so 20k top-8 records need about 1.2 MB, not 256 KiB."""
    records = [rec(t % 4, t // 4, [(t + i) % 16 for i in range(8)]) for t in range(20_000)]
    path = write_jsonl(tmp_path / "t.jsonl", records)
    with pytest.raises(trace_mod.MemoryLimitError, match=r"t\.jsonl:\d+: reading the records"):
        load_trace(path, max_memory=256 * 1024)
    trace = load_trace(path, max_memory=8 * MiB)
    assert trace.num_calls == 20_000 and trace.routes.dtype == np.int32


# ---- item 6: no silent drops ------------------------------------------------------------------


def test_npz_arrays_of_another_dtype_or_rank_are_errors_naming_them(tmp_path):
    """FAILS if an .npz's extra arrays are ignored instead of checked (silent drop)."""
    good = np.zeros((2, 2, 1), np.int32)
    np.savez(tmp_path / "f.npz", routes=good, scores=np.zeros((2, 2, 1), np.float32))
    with pytest.raises(TraceError, match=r"f\.npz: array 'scores': expected an integer array"):
        load_trace(tmp_path / "f.npz")
    np.savez(tmp_path / "r.npz", routes=good, meta=np.int32(3))
    with pytest.raises(TraceError, match=r"r\.npz: array 'meta': expected shape \[tokens, "
                                         r"layers, top_k\], got 0-D"):
        load_trace(tmp_path / "r.npz")


def test_npz_sequences_replay_like_the_same_jsonl(tmp_path):
    """FAILS if the arrays of an .npz are not each one sequence, in archive order, exactly as
    the equivalent JSONL with a sequence label per array."""
    rng = np.random.default_rng(3)
    arrays = {"p0": rng.integers(-1, 6, (3, 2, 2)), "p1": rng.integers(-1, 6, (2, 2, 2))}
    arrays["p1"][0, 0, 0] = 5
    np.savez(tmp_path / "s.npz", **arrays)
    records = [rec(layer, token, arrays[name][token, layer].tolist(), sequence=name)
               for name in arrays for token in reversed(range(arrays[name].shape[0]))
               for layer in (1, 0)]  # file order differs from replay order within a sequence
    via_jsonl = load_trace(write_jsonl(tmp_path / "s.jsonl", records))
    via_npz = load_trace(tmp_path / "s.npz")
    assert via_npz.sequence_names == ("p0", "p1")
    for name in ("routes", "layers", "token_idx", "sequence"):
        np.testing.assert_array_equal(getattr(via_npz, name), getattr(via_jsonl, name))
    assert via_npz.num_experts == via_jsonl.num_experts == 6


def test_gzip_jsonl_loads_by_suffix_and_by_magic_bytes(tmp_path):
    """FAILS if .jsonl.gz is an unknown format, or a gzip file named .jsonl is parsed as text."""
    records = [rec(1, 0, [3, 0], sequence="a"), rec(0, 0, [2, -1], sequence="a"),
               rec(0, 1, [1, 2], sequence="b")]
    plain = load_trace(write_jsonl(tmp_path / "t.jsonl", records))
    assert load_trace(write_jsonl(tmp_path / "t.jsonl.gz", records, compress=True)) == plain
    assert load_trace(write_jsonl(tmp_path / "m.jsonl", records, compress=True)) == plain
    assert load_trace(write_jsonl(tmp_path / "n.ndjson.gz", records, compress=True)) == plain


def test_corrupt_gzip_and_overlong_lines_name_file_and_line(tmp_path):
    """FAILS if a truncated gzip stream escapes as EOFError/BadGzipFile, or one endless line is
    read into memory whole."""
    records = [rec(0, t, [1, 2]) for t in range(3000)]
    data = gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match=r"cut\.jsonl\.gz:\d+: cannot read gzip data"):
        load_trace(tmp_path / "cut.jsonl.gz")
    line = b'{"layer": 0, "token_idx": 0, "experts": [' + b"1, " * trace_mod.MAX_LINE_BYTES
    (tmp_path / "long.jsonl.gz").write_bytes(gzip.compress(b"\n" + line + b"1]}\n"))
    with pytest.raises(TraceError, match=r"long\.jsonl\.gz:2: line is longer than"):
        load_trace(tmp_path / "long.jsonl.gz")


def test_saved_traces_still_round_trip(tmp_path):
    """FAILS if the new readers change what save_trace wrote (one unnamed sequence)."""
    trace = synthetic_trace("mixtral-like", num_tokens=5)
    for suffix in (".npy", ".npz", ".jsonl"):
        save_trace(trace, tmp_path / f"t{suffix}")
        back = load_trace(tmp_path / f"t{suffix}", num_experts=trace.num_experts)
        assert back == trace, suffix


# ---- blank content is skipped a block at a time -------------------------------------------------


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
        if event == "call" and frame.f_code is trace_mod._numbered_lines.__code__:
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
