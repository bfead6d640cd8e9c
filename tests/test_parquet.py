"""Parquet traces: the JSONL records as columns, read (and written) with the optional pyarrow."""

from __future__ import annotations

import importlib
import json
import re
import sys

import pytest

from pallas_cache.sizing import TraceError, cli, load_trace
from pallas_cache.sizing.traces import save_trace

try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:  # the reader is optional: pip install 'pallas-cache[parquet]'
    pa = pq = None
needs_pyarrow = pytest.mark.skipif(
    pa is None, reason="pyarrow is not installed (pip install 'pallas-cache[parquet]')")

# Two sequences, written out of replay order, ragged expert lists, an int16 list column.
RECORDS = [{"sequence": "b", "token_idx": 0, "layer": 1, "experts": [2, 0]},
           {"sequence": "a", "token_idx": 1, "layer": 0, "experts": [3]},
           {"sequence": "a", "token_idx": 0, "layer": 1, "experts": [1, -1]},
           {"sequence": "a", "token_idx": 0, "layer": 0, "experts": [0, 2]},
           {"sequence": "b", "token_idx": 0, "layer": 0, "experts": [4, 1]},
           {"sequence": None, "token_idx": 0, "layer": 0, "experts": [1, 3]}]


def _write_parquet(path, records, names=None, experts_type=None, row_group_size=2):
    names = names or {}
    columns = {names.get(key, key): [r[key] for r in records] for key in records[0]}
    types = {names.get("experts", "experts"): experts_type or pa.list_(pa.int16())}
    table = pa.table({name: pa.array(values, type=types.get(name))
                      for name, values in columns.items()})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@needs_pyarrow
def test_parquet_reads_what_jsonl_reads_and_round_trips(tmp_path, capsys):
    """FAILS if the Parquet reader orders, pads, labels or splits across row groups the records
    otherwise than the JSONL reader does, --field does not rename its columns, or save_trace's
    .parquet does not read back equal."""
    expected = load_trace(_write_jsonl(tmp_path / "t.jsonl", RECORDS))
    got = load_trace(_write_parquet(tmp_path / "t.parquet", RECORDS))
    assert got == expected and got.sequence_names == ("b", "a", None)
    assert got.routes.tolist() == expected.routes.tolist() and got.top_k == 2
    names = {"layer": "layer_idx", "token_idx": "pos", "experts": "topk_ids", "sequence": "req"}
    renamed = _write_parquet(tmp_path / "r.parquet", RECORDS, names,
                             experts_type=pa.large_list(pa.int64()), row_group_size=4)
    assert load_trace(renamed, fields=names) == expected
    save_trace(expected, tmp_path / "back.parquet")
    assert load_trace(tmp_path / "back.parquet") == expected
    args = ["replay", "--cache-size", "5", "--policy", "full", "--format", "jsonl"]
    assert cli.main(args + ["--trace", str(renamed), "--field",
                            "layer=layer_idx,token_idx=pos,experts=topk_ids,sequence=req"]) == 0
    ours = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--trace", str(tmp_path / "t.jsonl")]) == 0
    theirs = json.loads(capsys.readouterr().out)
    assert ours["sequences"] == 3
    assert {k: v for k, v in ours.items() if k != "source"} == {
        k: v for k, v in theirs.items() if k != "source"}


@needs_pyarrow
@pytest.mark.parametrize("change,message", [
    (lambda: ([{k: v for k, v in r.items() if k != "layer"} for r in RECORDS], {}),
     r"column 'layer': missing \(required columns: 'layer', 'token_idx', 'experts'; the file "
     r"has sequence, token_idx, experts\)"),
    (lambda: (RECORDS, {"experts_type": pa.list_(pa.float32())}),
     r"column 'experts': expected a list of integers, got list<\w+: float>"),
    (lambda: ([{**r, "layer": str(r["layer"])} for r in RECORDS], {}),
     r"column 'layer': expected integers, got string"),
    (lambda: (RECORDS[:3] + [{**RECORDS[3], "token_idx": None}] + RECORDS[4:], {}),
     r": row 3: column 'token_idx': null"),
    (lambda: (RECORDS[:4] + [{**RECORDS[4], "experts": [1, -2]}] + RECORDS[5:], {}),
     r": row 4: field 'experts': expert -2 is below -1"),
    (lambda: (RECORDS + [RECORDS[2]], {}),
     r": row 6: field 'layer': duplicate record for token_idx 0, layer 1 \(first seen on row "
     r"2\)"),
], ids=["missing-column", "float-experts", "string-layer", "null", "below-padding", "duplicate"])
def test_bad_parquet_fails_before_the_replay_naming_file_row_and_column(
        tmp_path, capsys, monkeypatch, change, message):
    """FAILS if a Parquet file with a missing or mistyped column, a null, an id below -1 or a
    repeated call reaches the replay, or the one line does not name the file, row and column."""
    def replay(*args, **kwargs):
        raise AssertionError("the replay ran before the error was reported")

    monkeypatch.setattr(importlib.import_module("pallas_cache.sizing.sweep"), "replay", replay)
    records, options = change()
    path = _write_parquet(tmp_path / "bad.parquet", records, **options)
    assert cli.main(["replay", "--trace", str(path), "--cache-size", "5"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"pallas-cache: {path}"), lines[0]
    assert re.search(message, lines[0]), lines[0]


def test_without_pyarrow_a_parquet_trace_names_the_extra(tmp_path, capsys, monkeypatch):
    """FAILS if a missing pyarrow escapes as an ImportError traceback, or the line does not say
    which extra to install (runs with or without pyarrow: the import is made to fail)."""
    for name in [m for m in sys.modules if m == "pyarrow" or m.startswith("pyarrow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    assert cli.main(["replay", "--trace", str(tmp_path / "t.parquet")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["pallas-cache: reading or writing a Parquet trace needs pyarrow: "
                     "pip install 'pallas-cache[parquet]'"]
    with pytest.raises(ValueError, match=r"pallas-cache\[parquet\]"):
        save_trace(load_trace(_write_jsonl(tmp_path / "t.jsonl", RECORDS)), tmp_path / "o.pq")
    with pytest.raises(TraceError, match="not a readable Parquet file") if pa else \
            pytest.raises(ValueError):
        monkeypatch.undo()
        load_trace(tmp_path / "t.parquet")


@needs_pyarrow
def test_parquet_size_is_refused_from_the_metadata(tmp_path, monkeypatch):
    """FAILS if a Parquet trace above the memory limit is read before it is refused (the
    estimate must come from the row count and the list values in the file's metadata)."""
    many = [{**r, "token_idx": r["token_idx"] + 2 * copy} for copy in range(50) for r in RECORDS]
    path = _write_parquet(tmp_path / "t.parquet", many)
    read = pq.ParquetFile.read

    def no_read(self, *args, **kwargs):
        raise AssertionError("the data was read before the size was checked")

    monkeypatch.setattr(pq.ParquetFile, "read", no_read)
    with pytest.raises(TraceError, match=r"t\.parquet: reading 300 rows with \d+ expert entries "
                                         r"would need about .* above the memory limit of 1\.0 KiB"):
        load_trace(path, max_memory=1024)
    monkeypatch.setattr(pq.ParquetFile, "read", read)
    assert load_trace(path, max_memory=1024 * 1024).num_calls == 300
