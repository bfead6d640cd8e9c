"""Routing from engines: router logits -> trace arrays, equal to jax.lax.top_k ties included."""

import jax
import numpy as np
import pytest

from pallas_cache.sizing import Trace, routes_from_router_logits
from tests.sizing.conftest import one_line_error


def test_router_logits_pick_what_jax_lax_top_k_picks_ties_included():
    """FAILS if the selection or its order differs from jax.lax.top_k on logits full of ties
    (an unstable or ascending sort puts the higher index first), or the layout is not
    [tokens, layers, top_k] int32."""
    rng = np.random.default_rng(0)
    tokens, layers, experts, k = 37, 3, 16, 4
    per_layer = [rng.integers(-3, 4, (tokens, experts)).astype(np.float32) for _ in range(layers)]
    routes = routes_from_router_logits(per_layer, k)
    assert routes.dtype == np.int32 and routes.shape == (tokens, layers, k)
    for layer, logits in enumerate(per_layer):
        _, expected = jax.lax.top_k(logits, k)
        np.testing.assert_array_equal(routes[:, layer, :], np.asarray(expected))
    # The same from one stacked [layers, tokens, E] array, and as a replayable trace.
    np.testing.assert_array_equal(routes_from_router_logits(np.stack(per_layer), k), routes)
    trace = Trace.from_dense(routes, num_experts=experts)
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (layers, experts, k)


def test_router_logits_misuse_names_the_shapes():
    """FAILS if mismatched layers, a bad top_k or NaN logits pass silently."""
    good = np.zeros((5, 8), np.float32)
    with pytest.raises(ValueError, match=r"layer 1 have shape \(4, 8\), layer 0 has \(5, 8\)"):
        routes_from_router_logits([good, np.zeros((4, 8))], 2)
    with pytest.raises(ValueError, match=r"top_k=9 is outside \[1, num_experts=8\]"):
        routes_from_router_logits([good], 9)
    with pytest.raises(TypeError, match="top_k must be an int"):
        routes_from_router_logits([good], 2.0)
    with pytest.raises(ValueError, match="expected \\[tokens, num_experts\\], got shape \\(8,\\)"):
        routes_from_router_logits([np.zeros(8)], 2)
    bad = good.copy()
    bad[2, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        routes_from_router_logits([bad], 2)


RECORDS = [{"layer": 0, "token_idx": 0, "experts": [1, 2], "sequence": "a"},
           {"layer": 1, "token_idx": 0, "experts": [0, 3], "sequence": "a"},
           {"layer": 0, "token_idx": 1, "experts": [1, 3], "sequence": "a"},
           {"layer": 0, "token_idx": 0, "experts": [2, 3], "sequence": "b"}]
NAMES = {"layer": "layer_idx", "token_idx": "pos", "experts": "topk_ids", "sequence": "req"}


def _write(path, records, names=None, extra=None):
    import json

    names = names or {}
    path.write_text("".join(json.dumps({**{names.get(k, k): v for k, v in r.items()},
                                        **(extra or {})}) + "\n" for r in records))
    return path


def test_field_names_read_a_generic_jsonl_as_the_canonical_one(tmp_path, capsys):
    """FAILS if --field / fields= does not map every key (the sequence included), or a canonical
    key left in the file overrides the renamed one."""
    import json

    from pallas_cache.sizing import cli, load_trace

    canonical = load_trace(_write(tmp_path / "c.jsonl", RECORDS))
    # A decoy 'layer' key must not win over layer_idx.
    renamed = _write(tmp_path / "g.jsonl", RECORDS, NAMES, extra={"layer": 7})
    spec = "layer=layer_idx,token_idx=pos,experts=topk_ids,sequence=req"
    from pallas_cache.sizing.traces import parse_fields

    assert parse_fields(spec) == NAMES
    got = load_trace(renamed, fields=NAMES)
    assert got.sequence_names == ("a", "b") and got.num_layers == 2
    np.testing.assert_array_equal(got.routes, canonical.routes)
    np.testing.assert_array_equal(got.layers, canonical.layers)
    np.testing.assert_array_equal(got.sequence, canonical.sequence)
    args = ["replay", "--cache-size", "4", "--policy", "full", "--format", "jsonl"]
    assert cli.main(args + ["--trace", str(renamed), "--field", spec]) == 0
    ours = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--trace", str(tmp_path / "c.jsonl")]) == 0
    theirs = json.loads(capsys.readouterr().out)
    assert {k: v for k, v in ours.items() if k != "source"} == {
        k: v for k, v in theirs.items() if k != "source"}


def test_field_mistakes_fail_before_the_replay_naming_the_files_keys(tmp_path, capsys):
    """FAILS if a bad --field reaches the loader, a message names the canonical key instead of
    the file's, or --field is accepted for an array trace or without --trace."""
    from pallas_cache.sizing import cli, load_trace

    renamed = _write(tmp_path / "g.jsonl", RECORDS, {"layer": "layer_idx"})
    cases = [(["--trace", str(renamed), "--field", "lyr=x"], "unknown key 'lyr'"),
             (["--trace", str(renamed), "--field", "layer"], "expected KEY=NAME"),
             (["--trace", str(renamed), "--field", "layer=a,layer=b"], "given twice"),
             (["--field", "layer=layer_idx"], "--field names the keys of a JSONL or Parquet --trace"),
             (["--trace", str(renamed), "--field", "layer=layer_idx,experts=topk"],
              "field 'topk': missing")]
    for argv, message in cases:
        assert cli.main(["replay", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (argv, err)
    np.save(tmp_path / "r.npy", np.zeros((2, 2, 2), np.int32))
    with pytest.raises(ValueError, match="JSONL and Parquet traces only"):
        load_trace(tmp_path / "r.npy", fields={"layer": "layer_idx"})


# ---- vLLM routed experts ---------------------------------------------------------------------

LAYERS, TOP_K = 3, 2


def _vllm_requests():
    """Three requests as vLLM returns them: int16 [gen_len, layers, top_k], one of gen_len 0."""
    rng = np.random.default_rng(1)
    return {"cmpl-a": rng.integers(0, 8, (4, LAYERS, TOP_K)).astype(np.int16),
            "cmpl-b": np.zeros((0, LAYERS, TOP_K), np.int16),
            "cmpl-c": rng.integers(0, 8, (2, LAYERS, TOP_K)).astype(np.int16)}


def _vllm_dir(root, requests):
    root.mkdir()
    for name, routes in requests.items():
        np.save(root / f"{name}.npy", routes)
    (root / "README.txt").write_text("not a request")  # other files are ignored
    return root


def test_vllm_directory_and_npz_become_one_sequence_per_request(tmp_path, capsys):
    """FAILS if a directory (or an .npz read as vllm) of vLLM requests is not read as one
    sequence per request, in name / archive order, token-major then layer, with an empty
    request skipped; or the CLI does not autodetect the directory."""
    import json

    from pallas_cache.sizing import cli, load_trace

    requests = _vllm_requests()
    folder = _vllm_dir(tmp_path / "routes", requests)
    np.savez(tmp_path / "routes.npz", **requests)
    kept = {k: v for k, v in requests.items() if len(v)}
    expected = np.concatenate([v.reshape(-1, TOP_K) for v in kept.values()])
    for trace in (load_trace(folder), load_trace(tmp_path / "routes.npz", trace_format="vllm")):
        assert trace.sequence_names == tuple(kept)
        np.testing.assert_array_equal(trace.routes, expected)
        assert trace.layers.tolist() == list(range(LAYERS)) * 6
        assert trace.token_idx.tolist() == [t for t in range(4) for _ in range(LAYERS)] + [
            t for t in range(2) for _ in range(LAYERS)]
        assert trace.sequence.tolist() == [0] * 12 + [1] * 6
        assert (trace.num_layers, trace.top_k, trace.num_tokens) == (LAYERS, TOP_K, 6)
    args = ["replay", "--cache-size", "8", "--policy", "full", "--format", "jsonl"]
    assert cli.main(args + ["--trace", str(folder)]) == 0
    from_dir = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--trace", str(tmp_path / "routes.npz"), "--trace-format",
                            "vllm"]) == 0
    from_npz = json.loads(capsys.readouterr().out)
    assert from_dir["sequences"] == 2 and from_dir["tokens"] == 6
    assert {k: v for k, v in from_dir.items() if k != "source"} == {
        k: v for k, v in from_npz.items() if k != "source"}


@pytest.mark.parametrize("name,array,message", [
    ("cmpl-c", np.zeros((2, LAYERS, TOP_K), np.float32),
     r"cmpl-c\.npy: expected an integer array of expert ids, got dtype float32 "
     r"\(shape \(2, 3, 2\)\)"),
    ("cmpl-c", np.zeros((2, LAYERS), np.int16),
     r"cmpl-c\.npy: expected shape \[gen_len, layers, top_k\], got 2-D shape \(2, 3\)"),
    ("cmpl-c", np.zeros((2, LAYERS + 1, TOP_K), np.int16),
     r"cmpl-c\.npy: shape \(2, 4, 2\) but \S*cmpl-a\.npy has shape \(4, 3, 2\): every request"),
    ("cmpl-c", np.array([[[0, 1]] * LAYERS, [[3, -2]] * LAYERS], np.int16),
     r"cmpl-c\.npy\[token=1, layer=0, k=1\]: expert -2 is outside .*only padding value"),
], ids=["float", "2-D", "layers-differ", "negative-id"])
def test_vllm_bad_requests_fail_before_the_replay_naming_file_and_shapes(
        tmp_path, capsys, no_replay, name, array, message):
    """FAILS if a float or 2-D request, requests of different layer counts, or an id below -1
    reach the replay, or the one-line message does not name the file and the shapes."""
    import re

    from pallas_cache.sizing import cli

    requests = _vllm_requests()
    requests[name] = array
    folder = _vllm_dir(tmp_path / "routes", requests)
    line = one_line_error(capsys, cli.main(["replay", "--trace", str(folder), "--cache-size", "8"]))
    assert re.search(message, line), line
    assert str(folder) in line


def test_vllm_empty_inputs_are_trace_errors(tmp_path):
    """FAILS if a directory without requests, or only empty requests, yields an empty trace or
    a bare numpy error instead of a TraceError naming the path."""
    from pallas_cache.sizing import TraceError, load_trace

    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match=r"empty: no \.npy files in the directory"):
        load_trace(tmp_path / "empty")
    np.savez(tmp_path / "none.npz", a=np.zeros((0, 2, 2), np.int16))
    with pytest.raises(TraceError, match=r"none\.npz: every request has gen_len 0"):
        load_trace(tmp_path / "none.npz", trace_format="vllm")
