"""``pallas-cache replay --per-layer``: each configuration's hit rate per layer, from the
sweep's own final states (``pallas_cache.per_layer_stats``), under a text table or as one more
key of each record, and nothing of it without the flag."""

from __future__ import annotations

import json

import pytest

from tests.sizing.conftest import one_line_error
from pallas_cache.sizing import cli
from pallas_cache.sizing.sweep import config_grid, replay
from pallas_cache.sizing.synthetic import synthetic_trace

ARGS = ["replay", "--synthetic", "mixtral-like", "--tokens", "12", "--cache-size", "16", "64",
        "--policy", "full", "fraction:0.4", "-q"]


def run(capsys, *argv):
    code = cli.main([*ARGS, *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_library_keeps_each_layers_counters_on_request():
    """FAILS if ``replay(per_layer=True)`` does not give each configuration's per-layer counters
    summing exactly to its own, or keeps them when not asked."""
    trace = synthetic_trace("mixtral-like", num_tokens=12, seed=0)
    configs = config_grid([16, 64], ["full", "fraction:0.4"])
    quiet = lambda status: None  # noqa: E731
    plain = replay(trace, configs, progress=quiet)
    kept = replay(trace, configs, progress=quiet, per_layer=True)
    assert all(r.layer_stats == () for r in plain)
    for result, counted in zip(plain, kept):
        assert len(counted.layer_stats) == trace.num_layers
        assert sum(s.active for s in counted.layer_stats) == result.active
        assert sum(s.missing for s in counted.layer_stats) == result.missing
        assert sum(s.fetched for s in counted.layer_stats) == result.fetched


def test_per_layer_hit_rates_come_under_the_table_only_when_asked(capsys):
    """FAILS if ``--per-layer`` is unknown, prints no per-layer block under the table, changes
    anything above it, goes past 100 columns, or if the block appears without the flag."""
    code, plain, _ = run(capsys)
    assert code == 0 and "Hit rate per layer" not in plain
    code, out, err = run(capsys, "--per-layer")
    assert code == 0, err
    lines = out.splitlines()
    start = lines.index("Hit rate per layer (- where no call routed the layer):")
    assert lines[:start] == plain.splitlines()
    block = lines[start + 1:]
    labels = [line for line in block if not line.startswith("  ")]
    assert labels == ["cache_size=16 policy=full", "cache_size=16 policy=fraction:0.4",
                      "cache_size=64 policy=full", "cache_size=64 policy=fraction:0.4"]
    assert [line.split()[1] for line in block[1:4]] == ["0-11", "12-23", "24-31"]
    assert max(map(len, lines)) <= 100


def test_records_gain_layer_hit_rates_with_the_flag_alone(capsys):
    """FAILS if json records change without ``--per-layer``, or with it gain anything but
    ``layer_hit_rates`` (one rate per layer, each ``1 - missing/active`` of the sweep's own
    per-layer counters), or if csv does not carry them as one JSON cell."""
    code, plain, _ = run(capsys, "--format", "json")
    assert code == 0
    plain = json.loads(plain)
    assert all("layer_hit_rates" not in row for row in plain)
    code, out, _ = run(capsys, "--format", "json", "--per-layer")
    assert code == 0
    rows = json.loads(out)
    assert [{k: v for k, v in row.items() if k != "layer_hit_rates"} for row in rows] == plain
    trace = synthetic_trace("mixtral-like", num_tokens=12, seed=0)
    results = replay(trace, config_grid([16, 64], ["full", "fraction:0.4"]),
                     progress=lambda status: None, per_layer=True)
    for row, result in zip(rows, results):
        assert row["layer_hit_rates"] == [None if not s.active else 1 - s.missing / s.active
                                          for s in result.layer_stats]
    code, out, _ = run(capsys, "--format", "csv", "--per-layer")
    assert code == 0
    header, first = out.splitlines()[:2]
    assert header.split(",")[-1] == "layer_hit_rates"
    assert first.endswith('"' + json.dumps(rows[0]["layer_hit_rates"]).replace('"', '""') + '"')


@pytest.mark.parametrize("flags", [["--batch", "2", "--requests", "4"],
                                   ["--devices", "2", "--parallel", "expert"]],
                         ids=["batch", "expert-parallel"])
def test_per_layer_where_it_is_not_computed_is_refused(capsys, flags):
    """FAILS if ``--per-layer`` with rows it does not compute (a batched decode, a table per
    device) is not one line and exit 2."""
    code = cli.main([*ARGS, "--per-layer", *flags])
    assert one_line_error(capsys, code).startswith("pallas-cache: --per-layer is not computed for")
