"""Replay records and their formats (pallas_cache.sizing.report, ``replay --format``): one schema,
every key in every machine format, table headers equal to the record keys, exact round trips."""

import csv
import dataclasses
import io
import json

import pytest

from pallas_cache.sizing import cli
from pallas_cache.sizing.sweep.cost import CostModel
from pallas_cache.sizing.sweep import ReplayResult, config_grid, replay
from pallas_cache.sizing.report import (COLUMN_LEGEND, FORMATS, GPU_RECORD_KEYS, NOT_RECORDED,
                                        RECORD_KEYS, format_records, records, table_columns)
from pallas_cache.sizing.synthetic import synthetic_trace

W = 3 * 4096 * 14336 * 2
ARGS = ["replay", "--synthetic", "mixtral-like", "--tokens", "3", "--cache-size", "16", "64",
        "--policy", "full", "fraction:0.4"]


@pytest.fixture(scope="module")
def rows():
    trace = synthetic_trace("mixtral-like", num_tokens=3)
    cost = CostModel(W, 25e9, 60e9)
    results = replay(trace, config_grid([16, 64], ["full", "fraction:0.4"]), cost=cost,
                     progress=lambda status: None)
    return trace, results, records(results, trace, cost)


def test_records_carry_trace_metadata_configuration_and_every_result_field(rows):
    """FAILS if a ReplayResult field, the trace metadata or the cost configuration is missing,
    the keys are out of schema order, or a value differs from the result it came from."""
    trace, results, recs = rows
    # the GPU-time fields are record keys of a cost model with the GPU's time only; the
    # per-layer counters kept on request are no record key
    assert ({f.name for f in dataclasses.fields(ReplayResult)} - set(NOT_RECORDED)
            <= set(RECORD_KEYS) | set(GPU_RECORD_KEYS))
    assert len(recs) == len(results) == 4
    for rec, result in zip(recs, results):
        assert tuple(rec) == RECORD_KEYS
        assert (rec["source"], rec["layers"], rec["experts"], rec["top_k"], rec["calls"],
                rec["tokens"], rec["sequences"]) == (trace.source, 32, 8, 2, trace.num_calls, 3, 1)
        assert (rec["expert_bytes"], rec["link_bandwidth"], rec["cpu_bandwidth"],
                rec["device_budget"]) == (W, 25e9, 60e9, None)
        for field in dataclasses.fields(ReplayResult):
            if field.name in GPU_RECORD_KEYS or field.name in NOT_RECORDED:
                continue
            value = getattr(result, field.name)
            if field.name == "pair_counts":
                value = [list(pair) for pair in value]
            assert rec[field.name] == value, field.name


def test_every_key_has_a_legend_line_in_help(capsys):
    """FAILS if a record key is not explained in ``replay --help``."""
    with pytest.raises(SystemExit):
        cli.main(["replay", "--help"])
    text = capsys.readouterr().out
    legend = text[text.index("Columns (the keys"):]
    assert set(COLUMN_LEGEND) == set(RECORD_KEYS)
    for key in RECORD_KEYS:
        assert f"\n  {key} " in legend, key


def test_json_and_jsonl_hold_the_records_exactly(rows):
    """FAILS if a format drops, renames or rounds a value."""
    _, _, recs = rows
    assert json.loads(format_records(recs, "json")) == recs
    assert [json.loads(line) for line in format_records(recs, "jsonl").splitlines()] == recs


def test_csv_round_trips_through_the_stdlib(rows):
    """FAILS if the csv header is not the record keys, a number is rounded, None is not an empty
    cell, or pair_counts is not one JSON cell."""
    _, _, recs = rows
    read = list(csv.DictReader(io.StringIO(format_records(recs, "csv"))))
    assert len(read) == len(recs)
    for got, rec in zip(read, recs):
        assert tuple(got) == RECORD_KEYS
        assert json.loads(got["pair_counts"]) == rec["pair_counts"]
        assert got["device_budget"] == "" and rec["device_budget"] is None
        for key in ("cache_size", "fetched", "cpu_routes", "empty_slots", "expert_bytes"):
            assert int(got[key]) == rec[key], key
        for key in ("hit_rate", "belady_hit_rate", "bypass_optimum_hit_rate",
                    "modeled_ms_per_token", "fetched_bytes_per_token"):
            assert float(got[key]) == rec[key], key
        assert got["source"] == rec["source"] and got["policy"] == rec["policy"]


def test_machine_formats_round_trip_through_pandas(rows):
    """FAILS if pandas reads a column name or a value other than the record's."""
    pandas = pytest.importorskip("pandas")
    _, _, recs = rows
    exact = {"precise_float": True}  # pandas' default json float parser rounds the last digits
    for frame in (pandas.read_json(io.StringIO(format_records(recs, "json")), **exact),
                  pandas.read_json(io.StringIO(format_records(recs, "jsonl")), lines=True, **exact),
                  pandas.read_csv(io.StringIO(format_records(recs, "csv")))):
        assert tuple(frame.columns) == RECORD_KEYS
        for key in ("cache_size", "fetched", "hit_rate", "modeled_ms_per_token", "policy"):
            assert frame[key].tolist() == [r[key] for r in recs], key


def test_table_and_markdown_headers_are_record_keys(rows):
    """FAILS if a table or markdown header is not a record key (``belady`` for
    ``belady_hit_rate``), or markdown loses a row."""
    from tests.sizing.cli.test_cli import all_table_keys, table_keys

    _, _, recs = rows
    columns = table_columns(recs)
    assert set(columns) <= set(RECORD_KEYS)
    text = format_records(recs, "table")
    # Within 100 columns, the per-size columns may be a second table's, in the same order.
    assert table_keys(text) == [key for key in columns if key in table_keys(text)]
    assert set(all_table_keys(text)) == set(columns)
    lines = format_records(recs, "markdown").splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| "))
    assert [c.strip() for c in lines[header].strip("|").split("|")] == columns
    assert len([line for line in lines[header + 2:] if line.startswith("| ")]) == len(recs)
    with pytest.raises(ValueError, match="unknown format 'xml'"):
        format_records(recs, "xml")


def test_cli_formats_and_the_json_alias(capsys):
    """FAILS if ``--json`` is not ``--format json``, a format prints something else than
    format_records of the same records, or ``--json --format csv`` is accepted."""
    outputs = {}
    for fmt in FORMATS:
        assert cli.main(ARGS + ["--format", fmt]) == 0
        outputs[fmt] = capsys.readouterr().out
    assert cli.main(ARGS + ["--json"]) == 0
    assert capsys.readouterr().out == outputs["json"]
    recs = json.loads(outputs["json"])
    assert tuple(recs[0]) == RECORD_KEYS
    assert outputs["jsonl"].rstrip("\n") == format_records(recs, "jsonl")
    assert outputs["csv"].rstrip("\n") == format_records(recs, "csv")
    assert outputs["markdown"].rstrip("\n") == format_records(recs, "markdown")
    assert "hit_rate" in outputs["table"] and "Bounds:" in outputs["table"]
    assert cli.main(ARGS + ["--json", "--format", "csv"]) == 2
    err = capsys.readouterr().err
    assert "not allowed with" in err and len(err.strip().splitlines()) == 1, err


def test_readme_column_legend_is_the_schema():
    """FAILS if docs/replay.md's column table misses a record key or says something else than
    ``--help`` (both come from COLUMN_LEGEND)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "docs" / "replay.md").read_text(encoding="utf-8")
    rows = [line for line in readme.splitlines() if line.startswith("| `")]
    legend = {line.split("`")[1]: line.split(" | ", 1)[1].rstrip(" |").replace("\\|", "|")
              for line in rows}
    assert {key: legend.get(key) for key in RECORD_KEYS} == COLUMN_LEGEND


def test_plot_draws_every_series_both_bounds_and_the_traffic(rows):
    """FAILS if a configuration's series is missing or merged, a bound (bypass, Belady) is not
    drawn, the traffic panel or the modeled-ms axis is missing, 11+ series repeat a style, or
    the legend sits inside a data panel."""
    pytest.importorskip("matplotlib")
    from pallas_cache.sizing import plot
    from pallas_cache.sizing.plotting import series_style

    trace, results, recs = rows
    figure = plot(recs)
    hit_axes, traffic_axes, ms_axes = figure.axes
    gids = [line.get_gid() for line in hit_axes.get_lines()]
    assert sorted(g for g in gids if g.startswith("series:")) == sorted(
        f"series:{p} / recency / promote_one / lru" for p in ("full", "fraction:0.4"))
    assert {"belady_hit_rate", "bypass_optimum_hit_rate"} <= set(gids)
    bypass = next(l for l in hit_axes.get_lines() if l.get_gid() == "bypass_optimum_hit_rate")
    assert list(bypass.get_ydata()) == [r["bypass_optimum_hit_rate"] for r in recs[::2]]
    assert list(bypass.get_xdata()) == [r["cache_bytes"] / 2**30 for r in recs[::2]]
    # Fetched traffic of both series, CPU traffic of fraction:0.4 only (full's is 0 throughout).
    assert len(traffic_axes.get_lines()) == 3 and len(ms_axes.get_lines()) == 2
    assert hit_axes.get_legend() is None and traffic_axes.get_legend() is None
    assert len(figure.legends) == 1
    styles = {tuple(series_style(i).values()) for i in range(40)}
    assert len(styles) == 40
    # The same results without W: slots on x, no ms axis; a caller's pair of axes is used.
    from matplotlib.figure import Figure

    mine = Figure()
    pair = mine.subplots(1, 2)
    untimed = [dataclasses.replace(r, cache_bytes=None, fetched_bytes_per_token=None,
                                   cpu_bytes_per_token=None, modeled_ms_per_token=None)
               for r in results]
    assert plot(untimed, axes=pair) is mine
    assert pair[0].get_xlabel() == "cache size (slots)" and len(mine.axes) == 2
    assert len([l for l in pair[0].get_lines() if l.get_gid().startswith("series:")]) == 2


def test_plot_draws_one_line_per_eviction_and_the_cpu_traffic_beside_the_fetched(rows):
    """FAILS if two evictions' rows share a line (it zig-zags between their points at each
    size), an eviction has no line style of its own or is missing from the legend, or the
    traffic panel lacks a row's CPU-computed experts (a hybrid row would look cheaper than
    ``full``)."""
    pytest.importorskip("matplotlib")
    from pallas_cache.sizing import plot
    from pallas_cache.sizing.plotting import EVICTION_LINESTYLES

    trace, results, _ = rows
    cost = CostModel(W, 25e9, 60e9)
    # The same sweep as if route_knn had run too, with its own hit rates (no replay needed).
    knn = [dataclasses.replace(r, eviction="route_knn", hit_rate=r.hit_rate / 2) for r in results]
    recs = records(results + knn, trace, cost)
    figure = plot(recs)
    hit_axes, traffic_axes = figure.axes[:2]
    series = {l.get_gid(): l for l in hit_axes.get_lines() if l.get_gid().startswith("series:")}
    expected = {}
    for rec in recs:
        label = f"{rec['policy']} / {rec['order']} / {rec['admission']} / {rec['eviction']}"
        expected.setdefault(label, []).append(rec)
    assert sorted(series) == sorted(f"series:{label}" for label in expected)
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    for label, group in expected.items():
        group = sorted(group, key=lambda r: r["cache_size"])
        line = series[f"series:{label}"]
        assert list(line.get_xdata()) == [r["cache_bytes"] / 2**30 for r in group]
        assert list(line.get_ydata()) == [r["hit_rate"] for r in group]
        assert line.get_linestyle() == EVICTION_LINESTYLES[group[0]["eviction"]]
        assert label in legend
        cpu = next((l for l in traffic_axes.get_lines() if l.get_gid() == f"cpu:{label}"),
                   None)
        if all(r["cpu_bytes_per_token"] == 0 for r in group):  # `full`: no row of zeros drawn
            assert cpu is None
            continue
        assert list(cpu.get_ydata()) == [r["cpu_bytes_per_token"] / 2**30 for r in group]
        assert cpu.get_color() == line.get_color()
    assert len(set(EVICTION_LINESTYLES.values())) == len(EVICTION_LINESTYLES)
    assert any(r["cpu_bytes_per_token"] > 0 for r in recs)  # a hybrid row's CPU side is drawn
