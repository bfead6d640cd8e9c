"""Routing from engines: router logits -> trace arrays, equal to jax.lax.top_k ties included."""

import jax
import numpy as np
import pytest

from pallas_cache.sizing import Trace, routes_from_router_logits


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
             (["--field", "layer=layer_idx"], "--field names the keys of a JSONL --trace"),
             (["--trace", str(renamed), "--field", "layer=layer_idx,experts=topk"],
              "field 'topk': missing")]
    for argv, message in cases:
        assert cli.main(["replay", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (argv, err)
    np.save(tmp_path / "r.npy", np.zeros((2, 2, 2), np.int32))
    with pytest.raises(ValueError, match="JSONL traces only"):
        load_trace(tmp_path / "r.npy", fields={"layer": "layer_idx"})
