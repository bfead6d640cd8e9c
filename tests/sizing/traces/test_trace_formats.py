"""Reading routing traces, format by format: replay order, padding, sequences, geometry, round
trips, and errors that say where and what.

Each test is written to fail on the naive implementation of its rule: reading records in file
order instead of replay order, sorting sequences by label instead of first appearance, dropping
padding or all-padding calls, reading an .npz as its first array only, parsing a gzip file as
text, trusting inferred geometry, letting json/numpy errors escape, or a Parquet reader that
orders, pads or names its errors otherwise than the JSONL one.
"""

from __future__ import annotations

import gzip
import json
import re
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pallas_cache.sizing import cli
from pallas_cache.sizing.synthetic import synthetic_trace
from pallas_cache.sizing.traces import Trace, TraceError, load_trace, save_trace

try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:  # the reader is optional: pip install 'pallas-cache[parquet]'
    pa = pq = None

needs_pyarrow = pytest.mark.skipif(
    pa is None, reason="pyarrow is not installed (pip install 'pallas-cache[parquet]')")


def write_jsonl(path, records, compress=False):
    """Write records (dicts, or raw strings written verbatim) one per line, gzipped or not."""
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    path.write_bytes(gzip.compress(text.encode()) if compress else text.encode())
    return path


def rec(layer, token, experts, **extra):
    return {"layer": layer, "token_idx": token, "experts": experts, **extra}


# ---- JSONL: order, padding, geometry --------------------------------------------------------


def test_jsonl_calls_are_in_replay_order_not_file_order(tmp_path):
    # Written layer-major and tokens descending, as a per-layer dump would be.
    path = write_jsonl(tmp_path / "t.jsonl", [
        rec(1, 1, [6, 7]), rec(0, 1, [4, 5]), rec(1, 0, [2, 3]), rec(0, 0, [0, 1]),
    ])
    trace = load_trace(path)
    assert trace.layers.tolist() == [0, 1, 0, 1]
    assert trace.token_idx.tolist() == [0, 0, 1, 1]
    assert trace.routes.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert trace.layers.dtype == np.int32 and trace.routes.dtype == np.int32


def test_jsonl_sequences_keep_first_appearance_order_and_tokens_sort_numerically(tmp_path):
    # "b" appears first in the file, so its calls come first although "a" < "b"; token 10 comes
    # after token 9 (numeric, not string order).
    path = write_jsonl(tmp_path / "t.jsonl", [
        rec(0, 10, [1], sequence="b"), rec(0, 0, [0], sequence="a"),
        rec(0, 9, [2], sequence="b"), rec(0, 1, [3], sequence="a"),
    ])
    trace = load_trace(path)
    assert trace.sequence_names == ("b", "a")
    assert trace.sequence.tolist() == [0, 0, 1, 1]
    assert trace.token_idx.tolist() == [9, 10, 0, 1]
    assert trace.routes[:, 0].tolist() == [2, 1, 0, 3]


def test_jsonl_problem_id_names_the_sequence_and_sequence_key_wins(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [
        rec(0, 0, [0], problem_id=7), rec(0, 0, [1], problem_id=3),
        rec(0, 1, [2], problem_id=7, sequence="s"),
    ])
    trace = load_trace(path)
    assert trace.sequence_names == (7, 3, "s")
    assert trace.routes[:, 0].tolist() == [0, 1, 2]


def test_jsonl_records_without_a_sequence_form_one_sequence_and_extra_keys_are_ignored(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [
        rec(0, 0, [0], weights=[0.5], note="x"), rec(0, 1, [1], sequence=None),
    ])
    trace = load_trace(path)
    assert trace.sequence_names == (None,)
    assert trace.sequence.tolist() == [0, 0]


def test_jsonl_pads_short_records_and_keeps_missing_records_absent(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [
        rec(0, 0, [3, 1, 2]), rec(2, 0, [5]),          # layer 1 of token 0 is missing
        rec(0, 1, []), rec(1, 1, [0, -1]),             # an empty call stays a call
    ])
    trace = load_trace(path)
    assert trace.layers.tolist() == [0, 2, 0, 1]
    assert trace.routes.tolist() == [[3, 1, 2], [5, -1, -1], [-1, -1, -1], [0, -1, -1]]
    assert trace.top_k == 3 and trace.num_calls == 4 and len(trace) == 4
    assert trace.num_layers == 3 and trace.num_experts == 6   # inferred: max + 1


def test_declared_geometry_overrides_inference(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [rec(1, 0, [2])])
    trace = load_trace(path, num_layers=4, num_experts=16)
    assert (trace.num_layers, trace.num_experts) == (4, 16)
    assert trace.routing_histogram().shape == (4, 16)


def test_blank_lines_are_skipped_and_do_not_shift_line_numbers(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [rec(0, 0, [0]), "", "  ", '{"layer": 0}'])
    with pytest.raises(TraceError, match=r"t\.jsonl:4: field 'token_idx': missing"):
        load_trace(path)


def test_gzip_jsonl_loads_by_suffix_and_by_magic_bytes(tmp_path):
    """FAILS if .jsonl.gz is an unknown format, or a gzip file named .jsonl is parsed as text."""
    records = [rec(1, 0, [3, 0], sequence="a"), rec(0, 0, [2, -1], sequence="a"),
               rec(0, 1, [1, 2], sequence="b")]
    plain = load_trace(write_jsonl(tmp_path / "t.jsonl", records))
    assert load_trace(write_jsonl(tmp_path / "t.jsonl.gz", records, compress=True)) == plain
    assert load_trace(write_jsonl(tmp_path / "m.jsonl", records, compress=True)) == plain
    assert load_trace(write_jsonl(tmp_path / "n.ndjson.gz", records, compress=True)) == plain


# ---- JSONL: errors name file, line and field ------------------------------------------------


BAD_LINES = [
    ("not json", {"layer": 0, "token_idx": 0, "experts": [0]}, "{oops", r"not valid JSON"),
    ("array", None, "[1, 2]", r"expected a JSON object"),
    ("no layer", None, '{"token_idx": 0, "experts": [0]}', r"field 'layer': missing"),
    ("no experts", None, '{"layer": 0, "token_idx": 0}', r"field 'experts': missing"),
    ("layer string", None, '{"layer": "0", "token_idx": 0, "experts": [0]}',
     r"field 'layer': expected an integer, got str"),
    ("layer bool", None, '{"layer": true, "token_idx": 0, "experts": [0]}',
     r"field 'layer': expected an integer, got bool"),
    ("token float", None, '{"layer": 0, "token_idx": 1.0, "experts": [0]}',
     r"field 'token_idx': expected an integer, got float"),
    ("experts not list", None, '{"layer": 0, "token_idx": 0, "experts": 3}',
     r"field 'experts': expected a list"),
    ("expert float", None, '{"layer": 0, "token_idx": 0, "experts": [1, 2.0]}',
     r"field 'experts': entry 1 is 2.0"),
    ("expert below -1", None, '{"layer": 0, "token_idx": 0, "experts": [-2]}',
     r"field 'experts': expert -2 is below -1"),
    ("negative layer", None, '{"layer": -1, "token_idx": 0, "experts": [0]}',
     r"field 'layer': layer -1 is negative"),
    ("negative token", None, '{"layer": 0, "token_idx": -3, "experts": [0]}',
     r"field 'token_idx': token_idx -3 is negative"),
    ("bad sequence", None, '{"layer": 0, "token_idx": 0, "experts": [0], "sequence": [1]}',
     r"field 'sequence': expected a string or integer"),
]


@pytest.mark.parametrize("name,_unused,line,message", BAD_LINES, ids=[b[0] for b in BAD_LINES])
def test_malformed_line_names_file_line_and_field(tmp_path, name, _unused, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [rec(0, 0, [0]), line])
    with pytest.raises(TraceError, match=r"bad\.jsonl:2: " + message):
        load_trace(path)


def test_expert_at_or_above_declared_num_experts_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [rec(0, 0, [0]), rec(0, 1, [7, 8])])
    assert load_trace(path).num_experts == 9  # inferred geometry accepts it
    with pytest.raises(TraceError, match=r"t\.jsonl:2: field 'experts': expert 8 is outside "
                                         r"\[-1, 8\) \(num_experts=8\)"):
        load_trace(path, num_experts=8)


def test_layer_at_or_above_declared_num_layers_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [rec(0, 0, [0]), rec(2, 0, [0])])
    with pytest.raises(TraceError, match=r"t\.jsonl:2: field 'layer': layer 2 is outside "
                                         r"\[0, 2\)"):
        load_trace(path, num_layers=2)


def test_duplicate_record_names_both_lines(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [rec(0, 0, [0]), rec(1, 0, [1]), rec(0, 0, [2])])
    with pytest.raises(TraceError, match=r"t\.jsonl:3: .*duplicate record.*line 1"):
        load_trace(path)
    # The same (token, layer) in two sequences is not a duplicate.
    path = write_jsonl(tmp_path / "u.jsonl", [rec(0, 0, [0], sequence=1),
                                              rec(0, 0, [0], sequence=2)])
    assert load_trace(path).num_calls == 2


def test_invalid_utf8_is_a_trace_error_with_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"layer": 0, "token_idx": 0, "experts": [0]}\n{"layer": "\xff"}\n')
    with pytest.raises(TraceError, match=r"t\.jsonl:2: not valid JSON"):
        load_trace(path)


@pytest.mark.parametrize("lines", [[], ["", "   "]], ids=["empty", "blank"])
def test_empty_jsonl_is_refused(tmp_path, lines):
    path = write_jsonl(tmp_path / "t.jsonl", lines)
    with pytest.raises(TraceError, match=r"t\.jsonl: the trace is empty"):
        load_trace(path)


def test_all_padding_without_declared_experts_cannot_infer_geometry(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [rec(0, 0, [-1])])
    with pytest.raises(TraceError, match=r"num_experts cannot be inferred"):
        load_trace(path)
    assert load_trace(path, num_experts=4).routes.tolist() == [[-1]]


def test_missing_file_and_unknown_suffix_are_trace_errors(tmp_path):
    with pytest.raises(TraceError, match=r"nope\.jsonl: cannot open"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match=r"nope\.npz: cannot open"):
        load_trace(tmp_path / "nope.npz")
    (tmp_path / "t.csv").write_text("1,2\n")
    with pytest.raises(TraceError, match=r"unknown trace format '\.csv'"):
        load_trace(tmp_path / "t.csv")


def test_bad_declared_geometry_is_a_value_error(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [rec(0, 0, [0])])
    with pytest.raises(ValueError, match="num_experts must be a positive integer"):
        load_trace(path, num_experts=0)


# ---- NumPy arrays ---------------------------------------------------------------------------


def test_npy_is_token_major_then_layer_and_keeps_all_padding_cells(tmp_path):
    routes = np.array([[[0, 1], [2, -1]], [[-1, -1], [3, 0]]], dtype=np.int16)  # [T=2, L=2, K=2]
    np.save(tmp_path / "t.npy", routes)
    trace = load_trace(tmp_path / "t.npy")
    assert trace.layers.tolist() == [0, 1, 0, 1]
    assert trace.token_idx.tolist() == [0, 0, 1, 1]
    assert trace.routes.tolist() == [[0, 1], [2, -1], [-1, -1], [3, 0]]
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (2, 4, 2)
    assert trace.routes.dtype == np.int32


def test_npz_every_array_is_one_sequence_in_archive_order(tmp_path):
    """FAILS if an .npz with several arrays reads only one of them (the old silent drop)."""
    a = np.zeros((2, 2, 1), np.int32)                 # 2 tokens, 2 layers, top-1
    b = np.array([[[1, 2], [3, -1]]], np.int16)       # 1 token, 2 layers, top-2
    np.savez(tmp_path / "two.npz", second=a, first=b)
    trace = load_trace(tmp_path / "two.npz")
    assert trace.sequence_names == ("second", "first")
    assert trace.sequence.tolist() == [0, 0, 0, 0, 1, 1]
    assert trace.token_idx.tolist() == [0, 0, 1, 1, 0, 0]
    assert trace.layers.tolist() == [0, 1, 0, 1, 0, 1]
    assert trace.routes.tolist() == [[0, -1], [0, -1], [0, -1], [0, -1], [1, 2], [3, -1]]
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (2, 4, 2)


def test_npz_arrays_of_different_layer_counts_are_refused_as_in_vllm(tmp_path, capsys):
    """FAILS if an .npz whose arrays route 4 layers and 2 layers is replayed as one model of 4
    layers (exit 0) while the same file as ``--trace-format vllm`` is refused: the arrays of one
    file are one model's routing, named with both shapes."""
    np.savez(tmp_path / "mixed.npz", a=np.zeros((3, 4, 2), np.int64),
             b=np.ones((3, 2, 2), np.int64))
    with pytest.raises(TraceError, match=r"array 'b': shape \(3, 2, 2\) but .*array 'a' has shape "
                                         r"\(3, 4, 2\): every sequence of one model routes the "
                                         r"same layers"):
        load_trace(tmp_path / "mixed.npz")
    for fmt in ("auto", "array", "vllm"):
        code = cli.main(["replay", "--trace", str(tmp_path / "mixed.npz"), "--trace-format", fmt,
                         "-q"])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, (fmt, err)


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


@pytest.mark.parametrize("array,message", [
    (np.zeros((2, 2, 2), np.float32), r"expected an integer array.*float32"),
    (np.zeros((2, 2), np.int32), r"expected shape \[tokens, layers, top_k\], got 2-D"),
    (np.zeros((0, 2, 2), np.int32), r"the trace is empty"),
    (np.array([[[0, -2]]]), r"token=0, layer=0, k=1\]: expert -2 is outside"),
], ids=["float", "2-D", "empty", "below -1"])
def test_bad_arrays_name_file_array_and_index(tmp_path, array, message):
    np.savez(tmp_path / "bad.npz", routes=array)
    with pytest.raises(TraceError, match=r"bad\.npz: array 'routes'(: |\[)" + message):
        load_trace(tmp_path / "bad.npz")


def test_array_against_declared_geometry(tmp_path):
    routes = np.array([[[0], [1]], [[5], [2]]])  # [T=2, L=2, K=1]
    np.save(tmp_path / "t.npy", routes)
    with pytest.raises(TraceError, match=r"\[token=1, layer=0, k=0\]: expert 5 is outside "
                                         r"\[-1, 4\)"):
        load_trace(tmp_path / "t.npy", num_experts=4)
    with pytest.raises(TraceError, match=r"2 layers in the array but num_layers=1"):
        load_trace(tmp_path / "t.npy", num_layers=1)
    assert load_trace(tmp_path / "t.npy", num_layers=3, num_experts=6).num_layers == 3


def test_corrupt_and_pickled_arrays_are_trace_errors(tmp_path):
    (tmp_path / "junk.npy").write_bytes(b"not numpy at all")
    with pytest.raises(TraceError, match=r"junk\.npy: not a readable NumPy"):
        load_trace(tmp_path / "junk.npy")
    np.save(tmp_path / "obj.npy", np.array([[[0]]], dtype=object), allow_pickle=True)
    with pytest.raises(TraceError, match=r"obj\.npy: not a readable NumPy"):
        load_trace(tmp_path / "obj.npy")
    np.savez(tmp_path / "none.npz")
    with pytest.raises(TraceError, match=r"holds no arrays"):
        load_trace(tmp_path / "none.npz")


# ---- the Trace type -------------------------------------------------------------------------


def test_trace_views_for_a_replay():
    trace = Trace(routes=[[1, 1, -1], [0, 2, -1]], layers=[1, 0], num_layers=2, num_experts=3)
    layers, routes = trace.to_array()
    assert layers.dtype == np.int32 and routes.dtype == np.int32
    assert [(layer, r.tolist()) for layer, r in trace] == [(1, [1, 1, -1]), (0, [0, 2, -1])]
    assert trace.flat_ids().tolist() == [[4, 4, -1], [0, 2, -1]]
    # Duplicates counted, padding not (docs/semantics.md §5.2 step 9).
    assert trace.routing_histogram().tolist() == [[1, 0, 1], [0, 2, 0]]
    with pytest.raises(ValueError):
        routes[0, 0] = 5  # read-only: a replay cannot corrupt the trace


@pytest.mark.parametrize("kwargs,message", [
    (dict(routes=np.zeros((0, 2), int), layers=np.zeros(0, int)), "the trace is empty"),
    (dict(routes=[[3]], layers=[0]), r"expert 3 at call 0, route 0 is outside \[-1, 3\)"),
    (dict(routes=[[0]], layers=[2]), r"layer 2 at call 0 is outside \[0, 2\)"),
    (dict(routes=[[0.0]], layers=[0]), "expected an integer array"),
    (dict(routes=[[0], [1]], layers=[0]), r"expected shape \(2,\)"),
], ids=["empty", "expert", "layer", "float", "shape"])
def test_trace_constructor_validates(kwargs, message):
    with pytest.raises(TraceError, match=message):
        Trace(num_layers=2, num_experts=3, **kwargs)


def test_dense_views_and_num_tokens():
    trace = Trace.from_dense(np.arange(12).reshape(3, 2, 2) % 5)
    assert trace.is_dense() and trace.num_tokens == 3
    assert np.array_equal(trace.to_dense(), np.arange(12).reshape(3, 2, 2) % 5)
    sparse = Trace(routes=[[0], [1]], layers=[0, 0], num_layers=2, num_experts=2,
                   token_idx=[0, 1])
    assert not sparse.is_dense() and sparse.num_tokens == 2
    with pytest.raises(TraceError, match="not a full"):
        sparse.to_dense()


# ---- round trips ----------------------------------------------------------------------------


@st.composite
def traces(draw):
    num_layers = draw(st.integers(1, 4))
    num_experts = draw(st.integers(1, 6))
    top_k = draw(st.integers(1, 3))
    calls = draw(st.integers(1, 12))
    # Unique, canonical (sequence, token, layer) keys, so the loader's order equals ours.
    keys = draw(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5),
                                   st.integers(0, num_layers - 1)),
                         min_size=calls, max_size=calls, unique=True))
    keys.sort()
    routes = draw(st.lists(st.lists(st.integers(-1, num_experts - 1), min_size=top_k,
                                    max_size=top_k), min_size=calls, max_size=calls))
    return Trace(routes=routes, layers=[k[2] for k in keys], token_idx=[k[1] for k in keys],
                 sequence=[k[0] for k in keys], sequence_names=("s0", "s1", "s2"),
                 num_layers=num_layers, num_experts=num_experts)


@given(traces())
def test_jsonl_round_trip(tmp_path_factory, trace):
    path = tmp_path_factory.mktemp("rt") / "t.jsonl"
    save_trace(trace, path)
    loaded = load_trace(path, num_layers=trace.num_layers, num_experts=trace.num_experts)
    # Sequences that never appear are not written, so compare through the names.
    assert [trace.sequence_names[s] for s in trace.sequence] == \
        [loaded.sequence_names[s] for s in loaded.sequence]
    assert np.array_equal(loaded.routes, trace.routes)
    assert np.array_equal(loaded.layers, trace.layers)
    assert np.array_equal(loaded.token_idx, trace.token_idx)


@pytest.mark.parametrize("suffix", [".npy", ".npz", ".jsonl"])
def test_dense_round_trip(tmp_path, suffix):
    trace = Trace.from_dense(np.array([[[0, -1], [2, 1]], [[1, 0], [-1, -1]]]), num_experts=3)
    save_trace(trace, tmp_path / f"t{suffix}")
    assert load_trace(tmp_path / f"t{suffix}", num_experts=3) == trace


def test_saved_traces_still_round_trip(tmp_path):
    """FAILS if the new readers change what save_trace wrote (one unnamed sequence)."""
    trace = synthetic_trace("mixtral-like", num_tokens=5)
    for suffix in (".npy", ".npz", ".jsonl"):
        save_trace(trace, tmp_path / f"t{suffix}")
        back = load_trace(tmp_path / f"t{suffix}", num_experts=trace.num_experts)
        assert back == trace, suffix


# ---- Parquet: the JSONL records as columns, read with the optional pyarrow ------------------


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


@needs_pyarrow
def test_parquet_reads_what_jsonl_reads_and_round_trips(tmp_path, capsys):
    """FAILS if the Parquet reader orders, pads, labels or splits across row groups the records
    otherwise than the JSONL reader does, --field does not rename its columns, or save_trace's
    .parquet does not read back equal."""
    expected = load_trace(write_jsonl(tmp_path / "t.jsonl", RECORDS))
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
        tmp_path, capsys, no_replay, change, message):
    """FAILS if a Parquet file with a missing or mistyped column, a null, an id below -1 or a
    repeated call reaches the replay, or the one line does not name the file, row and column."""
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
        save_trace(load_trace(write_jsonl(tmp_path / "t.jsonl", RECORDS)), tmp_path / "o.pq")
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
