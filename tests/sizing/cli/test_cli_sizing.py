"""``pallas-cache replay``'s sizing flags in-process: the legend's route_knn line from the
sweep's own programs (one replay, nothing beside it), and how the sizing flags fail before the
trace is read (one line, exit 2)."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

from pallas_cache import Eviction
from tests.sizing.conftest import one_line_error
from pallas_cache.sizing import cli
from pallas_cache.sizing.cli import output as cli_output

sweep_mod = importlib.import_module("pallas_cache.sizing.sweep")  # the module of replay()

KNN_BASE = ["--synthetic", "mixtral-realistic", "--tokens", "24", "--cache-size", "64", "96",
             "128", "--policy", "full", "fraction:0.4", "-q"]
KNN_SWEEP = KNN_BASE + ["--route-knn-legend"]


def run(capsys, *argv):
    code = cli.main(["replay", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def knn_lines(out):
    """The legend's route_knn paragraph (its last, wrapped within 100 columns) as one line."""
    lines = out.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("route_knn (")]
    return [" ".join(lines[i:]) for i in starts]


def without_knn(out):
    lines = out.splitlines()
    return next((lines[:i] for i, line in enumerate(lines) if line.startswith("route_knn (")),
                lines)


@pytest.fixture
def replays(monkeypatch):
    """Every call of the sweep's ``replay``, as the list of its configurations' evictions and
    sizes (the call itself runs)."""
    calls = []
    real = sweep_mod.replay

    def spy(trace, configs, **kwargs):
        calls.append([(c.eviction, c.cache_size, c.policy) for c in configs])
        return real(trace, configs, **kwargs)

    monkeypatch.setattr(sweep_mod, "replay", spy)
    return calls


def test_the_route_knn_legend_comes_from_the_sweeps_own_replay(capsys, replays, monkeypatch):
    """FAILS if the legend's route_knn line is computed by anything but the sweep's one replay
    (a second engine beside it: a replay of the library's step outside ``replay``), or if the
    sweep's route_knn lanes are not the line's series (policy full, every size)."""
    import pallas_cache.ops as ops

    outside = []
    real_step = ops.ensure_with_rules

    def step(*args, **kwargs):  # the sweep's program holds its own reference: not this one
        outside.append(1)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(ops, "ensure_with_rules", step)
    code, out, err = run(capsys, *KNN_SWEEP)
    assert code == 0, err
    [line] = knn_lines(out)
    assert len(replays) == 1
    knn = [(size, policy) for eviction, size, policy in replays[0]
           if eviction is Eviction.ROUTE_KNN]
    assert knn == [(64, "full"), (96, "full"), (128, "full")]
    assert outside == []


@pytest.mark.parametrize("off", [[], ["--no-route-knn-legend"]], ids=["default", "no-flag"])
def test_the_route_knn_legend_is_off_unless_asked_for(capsys, replays, off):
    """FAILS if the default table (or --no-route-knn-legend) replays route_knn lanes or prints
    their line instead of the pointer to the flag, or if the flag changes anything else of the
    table."""
    code, with_line, _ = run(capsys, *KNN_SWEEP)
    assert code == 0
    code, without, _ = run(capsys, *KNN_BASE, *off)
    assert code == 0
    assert knn_lines(without) == [cli_output.KNN_POINTER] and len(knn_lines(with_line)) == 1
    assert knn_lines(with_line) != knn_lines(without)
    assert without_knn(with_line) == without_knn(without)
    assert max(map(len, with_line.splitlines() + without.splitlines())) <= 100
    assert [e for e, _, _ in replays[1]] == [Eviction.LRU] * 6


@pytest.mark.parametrize("flags", [["--format", "json"], ["--eviction", "lru", "route_knn"],
                                   ["--batch", "2", "--requests", "4"]],
                         ids=["json", "other-eviction", "batch"])
def test_the_route_knn_legend_where_there_is_none_is_refused(capsys, flags, no_trace):
    """FAILS if --route-knn-legend is accepted (ignored) where no LRU-only table legend of
    one-token calls is printed, or refused only after the trace is read."""
    code, _, err = run(capsys, *KNN_SWEEP, *flags)
    assert code == 2 and err.count("\n") == 1 and "--route-knn-legend" in err


def test_the_route_knn_lanes_are_counted_in_the_replays_progress(capsys):
    """FAILS if the legend's route_knn replay runs outside the replay's reported phases (its
    lanes not among the configurations the compile line counts)."""
    argv = [a for a in KNN_SWEEP if a != "-q"]
    code, _, err = run(capsys, *argv)
    assert code == 0
    assert "compiling 2 programs for 9 configurations" in err
    code, _, err = run(capsys, *[a for a in KNN_BASE if a != "-q"])  # the default: no lanes
    assert code == 0
    assert "compiling 1 program for 6 configurations" in err


@pytest.fixture
def no_trace(monkeypatch):
    """Make reading or generating a trace fail the test: flag errors come before it."""
    import pallas_cache.sizing.cli.replay as cli_replay

    def load(*args, **kwargs):
        raise AssertionError("the trace was read before the flag error was reported")

    monkeypatch.setattr(cli_replay, "_trace", load)


TIMED = ["--model", "mixtral-8x7b", "--link-bandwidth", "25GB/s", "--cpu-bandwidth", "60GB/s"]


@pytest.mark.parametrize("argv,message", [
    (["--cpu-fixed-cost", "0.08ms"], "--cpu-fixed-cost needs an expert size"),
    (["--cpu-fixed-cost", "0.08ms", "--model", "mixtral-8x7b"], "--cpu-fixed-cost needs"),
    (TIMED + ["--cpu-fixed-cost", "5"], "--cpu-fixed-cost: bad duration '5'"),
    (TIMED + ["--cpu-fixed-cost=-1ms"], "--cpu-fixed-cost: bad duration '-1ms'"),
], ids=["untimed", "no-bandwidths", "no-unit", "negative"])
def test_a_bad_cpu_fixed_cost_fails_before_the_trace(capsys, no_trace, argv, message):
    """FAILS if --cpu-fixed-cost is accepted where it cannot apply (no modeled time), without a
    unit or negative, or checked only after the trace is read."""
    line = one_line_error(capsys, cli.main(["replay", "--cache-size", "64", *argv]))
    assert message in line, line


def test_fraction_auto_with_a_fixed_cost_uses_the_traces_routes_per_call(tmp_path, capsys):
    """FAILS if fraction:auto ignores the fixed CPU cost, or balances another call size than the
    trace file's min(top_k, E) (known only once the file is read)."""
    from pallas_cache.sizing.sweep.cost import CostModel

    path = tmp_path / "t.npy"
    np.save(path, np.random.default_rng(0).integers(0, 8, size=(6, 4, 2)).astype(np.int32))
    code, out, err = run(capsys, "--trace", str(path), "--num-experts", "8", "--cache-size", "8",
                         "--policy", "fraction:auto", *TIMED, "--cpu-fixed-cost", "1ms",
                         "--format", "json", "-q")
    assert code == 0, err
    w = 3 * 4096 * 14336 * 2
    expected = CostModel(w, 25e9, 60e9, cpu_fixed_seconds=1e-3).auto_policy(2)
    assert expected != CostModel(w, 25e9, 60e9).auto_policy()
    assert [r["policy"] for r in json.loads(out)] == [expected]


def test_bench_bandwidth_prints_a_fixed_cpu_cost_that_replay_accepts(capsys):
    """FAILS if bench-bandwidth leaves out T_cpu, or prints it in a form --cpu-fixed-cost
    refuses."""
    from pallas_cache.sizing.units import parse_duration

    assert cli.main(["bench-bandwidth", "--mib", "1", "--d-model", "64", "--d-expert", "128",
                     "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    flags = next(line for line in out.splitlines() if line.startswith("flags:")).split()
    assert flags[5] == "--cpu-fixed-cost" and parse_duration(flags[6]) >= 0
    assert any(line.startswith("T_cpu") for line in out.splitlines())


def test_new_models_default_to_their_released_format_with_its_scales():
    """FAILS if a new model's W leaves out its block scales, or defaults to bf16, or an existing
    model's default changes from bf16.

    deepseek-v3 fp8-b128: 3 matrices of 7168 x 2048 bytes plus one float32 per 128 x 128 block
    (56 x 16 blocks): 3 * (14680064 + 896 * 4) = 44050944 (42.0 MiB).
    gpt-oss-120b mxfp4: 3 matrices of 2880 x 2880 at 4 bits plus one byte per 32 weights:
    3 * (4147200 + 259200) = 13219200 (4.25 bits per weight).
    qwen3-235b-a22b bf16: 3 * 4096 * 1536 * 2 = 37748736 (36 MiB)."""
    from pallas_cache.sizing.models import MODELS, resolve_model

    assert MODELS["deepseek-v3"].expert_bytes() == 44050944
    assert MODELS["gpt-oss-120b"].expert_bytes() == 13219200
    assert 13219200 * 8 / (3 * 2880 * 2880) == 4.25
    assert MODELS["qwen3-235b-a22b"].expert_bytes() == 37748736
    assert resolve_model("deepseek-v3") == (MODELS["deepseek-v3"], "fp8-b128")
    assert resolve_model("deepseek-v3:bf16")[0].expert_bytes("bf16") == 3 * 7168 * 2048 * 2
    assert resolve_model("mixtral-8x7b") == (MODELS["mixtral-8x7b"], "bf16")
    geometry = {name: (m.moe_layers, m.routed_experts, m.top_k) for name, m in MODELS.items()}
    assert geometry["deepseek-v3"] == (58, 256, 8)
    assert geometry["qwen3-235b-a22b"] == (94, 128, 8)
    assert geometry["gpt-oss-120b"] == (36, 128, 4)


def records_of(capsys, *argv):
    code, out, err = run(capsys, *argv, "--format", "json", "-q")
    assert code == 0, err
    return json.loads(out)


def test_a_synthetic_trace_takes_the_models_geometry(capsys):
    """FAILS if --model's layers, experts and top-k do not reach a synthetic trace (the preset's
    48 x 128 replayed instead), or its W is not the model's released format."""
    [row] = records_of(capsys, "--model", "deepseek-v3", "--synthetic", "fine-grained",
                       "--tokens", "2", "--cache-size", "256", "--policy", "full")
    assert (row["layers"], row["experts"], row["top_k"], row["calls"]) == (58, 256, 8, 2 * 58)
    assert row["expert_bytes"] == 44050944
    assert "[layers=58, experts=256, top_k=8]" in row["source"]


def test_explicit_geometry_flags_shape_a_synthetic_trace(capsys):
    """FAILS if --num-layers / --num-experts / --top-k are ignored by --synthetic (or by the
    default trace), or a geometry equal to the preset's changes the trace's label."""
    [row] = records_of(capsys, "--synthetic", "fine-grained", "--num-layers", "6",
                       "--num-experts", "20", "--top-k", "3", "--tokens", "4",
                       "--cache-size", "40", "--policy", "full")
    assert (row["layers"], row["experts"], row["top_k"], row["calls"]) == (6, 20, 3, 24)
    [row] = records_of(capsys, "--num-layers", "4", "--tokens", "3", "--cache-size", "8",
                       "--policy", "full")
    assert (row["layers"], row["experts"], row["top_k"]) == (4, 8, 2)
    [row] = records_of(capsys, "--num-layers", "32", "--tokens", "3", "--cache-size", "8",
                       "--policy", "full")
    assert row["source"] == "synthetic:mixtral-realistic(tokens=3, seed=0)"


@pytest.mark.parametrize("argv,message", [
    (["--trace", "missing.npy", "--top-k", "2"], "--top-k applies to a synthetic trace"),
    (["--synthetic", "fine-grained", "--model", "deepseek-v3", "--num-experts", "128"],
     "--num-experts 128 contradicts --model deepseek-v3 (256 routed experts)"),
    (["--synthetic", "fine-grained", "--top-k", "129"], "--top-k 129 exceeds --num-experts 128"),
    (["--synthetic", "fine-grained", "--num-experts", "4"], "--top-k 8 exceeds --num-experts 4"),
    (["--num-layers", "0"], "--num-layers 0: must be at least 1"),
    (["--model", "deepseek-v3:fp9"], "unknown dtype 'fp9'"),
], ids=["top-k-with-trace", "contradicts-model", "top-k-above-experts", "experts-below-top-k",
        "zero-layers", "bad-dtype"])
def test_a_geometry_flag_that_does_not_apply_fails_before_the_trace(capsys, no_trace, argv,
                                                                     message):
    """FAILS if a geometry flag that cannot apply is ignored (or fails late) instead of exiting 2
    with one line naming it."""
    line = one_line_error(capsys, cli.main(["replay", *argv]))
    assert message in line, line


BUDGET = ["--synthetic", "mixtral-like", "--tokens", "4", *TIMED, "--policy", "full"]


def test_the_device_budgets_exact_fit_is_replayed_beside_the_grid(capsys):
    """FAILS if --device-budget only chooses among the grid's sizes (36 slots, 11.8 GiB of a
    24 GiB budget), or the added size is not floor(budget / W) = floor(24 * 1024 / 336) = 73,
    or it is not the one picked (a bigger full-policy pool is never slower here)."""
    rows = records_of(capsys, *BUDGET, "--cache-size", "12GiB", "--device-budget", "24GiB")
    assert [r["cache_size"] for r in rows] == [36, 73]
    assert [r["budget_best"] for r in rows] == [False, True]
    code, out, _ = run(capsys, *BUDGET, "--cache-size", "12GiB", "--device-budget", "24GiB",
                       "-q")
    assert code == 0
    assert ("size: --device-budget 24.0GiB fits 73 slots of 336MiB (24.0GiB): replayed beside "
            "the grid") in out


def test_the_exact_fit_stops_at_every_expert_and_is_not_repeated(capsys):
    """FAILS if a budget above the whole model adds a pool bigger than L*E = 256 slots, or a
    budget that fits a grid size exactly replays that size twice, or one below a layer's
    experts adds a size."""
    rows = records_of(capsys, *BUDGET, "--cache-size", "64", "--device-budget", "1TiB")
    assert [r["cache_size"] for r in rows] == [64, 256]
    rows = records_of(capsys, *BUDGET, "--cache-size", "64", "--device-budget", "21504MiB")
    assert [r["cache_size"] for r in rows] == [64]
    rows = records_of(capsys, *BUDGET, "--cache-size", "64", "--device-budget", "1GiB")
    assert [r["cache_size"] for r in rows] == [64]


CLIFF = ["--synthetic", "mixtral-like", "--tokens", "48", "--policy", "full", "fraction:0.4",
         "--no-route-knn-legend"]


def test_the_cliff_note_carries_the_rows_measured_hit_rate(capsys):
    """FAILS if a row below L*k = 64 is not flagged, its note lacks its own measured hit rate,
    or a row at L*k is flagged."""
    rows = records_of(capsys, *CLIFF, "--cache-size", "32", "64")
    for row in rows:
        if row["cache_size"] == 32:
            assert (f"S < L*k = 64: LRU thrashes on the cyclic layer sweep (hit rate "
                    f"{row['hit_rate']:.3f} here)") in row["note"]
        else:
            assert row["note"] == ""


def test_the_table_names_the_sizes_past_each_cliff_with_measured_hit_rates(capsys):
    """FAILS if the line under the table misses a size below L*k (or names one at it), gives
    another hit rate than the best row's of that size, or if the per-layer cliff uses floor(S/L)
    instead of round(S/L) (S = 91: 2.84 -> 3 slots, S = 181: 5.66 -> 6, not below 3*top_k = 6),
    or quotes a per-layer LRU rate other than per_layer_lru_hit_rate at round(S/L) slots."""
    from pallas_cache.sizing.synthetic import synthetic_trace
    from pallas_cache.sizing.trace_stats import per_layer_lru_hit_rate

    rows = records_of(capsys, *CLIFF, "--cache-size", "32", "64", "91", "181")
    best32 = max(r["hit_rate"] for r in rows if r["cache_size"] == 32)
    code, out, _ = run(capsys, *CLIFF, "--cache-size", "32", "64", "91", "181", "-q")
    assert code == 0
    flat = " ".join(out.split())
    assert (f"Below one token's working set (S < L*k = 64): S = 32 (hit rate {best32:.3f}): "
            f"LRU evicts") in flat
    trace = synthetic_trace("mixtral-like", num_tokens=48)
    rate64 = per_layer_lru_hit_rate(trace, 64)
    rate91 = per_layer_lru_hit_rate(trace, 96)
    assert rate91 != per_layer_lru_hit_rate(trace, 64)
    assert (f"per-layer LRU measured on this trace, S = 32: 1 < top_k slots per layer; "
            f"S = 64: {rate64:.3f}; S = 91: {rate91:.3f}.") in flat
    assert "S = 181:" not in flat


def test_the_plot_explains_its_markers_skips_zero_cpu_series_and_clears_the_labels(capsys):
    """FAILS if the legend has no entry for the right panel's CPU marker (x) or the hollow
    modeled-ms markers, the `full` policy's CPU series (0 at every size) is drawn as a row of
    markers along zero, or the title overlaps the right panel's y-label."""
    pytest.importorskip("matplotlib")
    from pallas_cache.sizing import plot
    from pallas_cache.sizing.plotting import CPU_MARKER

    rows = records_of(capsys, "--synthetic", "mixtral-like", "--tokens", "8", "--cache-size",
                      "64", "128", *TIMED, "--policy", "full", "fraction:0.4")
    figure = plot(rows)  # titled by the records' source
    legend = figure.legends[0]
    keys = [(text.get_text(), handle) for text, handle in
            zip(legend.get_texts(), legend.legend_handles) if text.get_text().startswith("right:")]
    assert [handle.get_marker() for _, handle in keys] == ["o", CPU_MARKER, "o"]
    assert keys[2][1].get_markerfacecolor() == "none"
    assert "CPU" in keys[1][0] and "modeled ms" in keys[2][0]
    traffic_axes = figure.axes[1]
    cpu_lines = [l.get_gid() for l in traffic_axes.get_lines() if l.get_gid().startswith("cpu:")]
    assert cpu_lines == ["cpu:fraction:0.4 / recency / promote_one / lru"]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    title = figure._suptitle.get_window_extent(renderer)
    right_label = figure.axes[1].yaxis.label.get_window_extent(renderer)
    assert title.x1 < right_label.x0  # the title ends before the right panel's y-label begins


def test_the_notebooks_replay_text_names_columns_of_the_table_it_prints():
    """FAILS if the notebook's reading of its replay table names a record key the printed
    table does not show (e.g. `cpu_routes`, `fetched`: keys of the CSV/JSON records only)."""
    import os
    import re

    from pallas_cache.sizing.report import RECORD_KEYS, table_columns

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
                        "examples", "explore_cache.ipynb")
    cells = json.load(open(path, encoding="utf-8"))["cells"]
    outro = "".join(next(c["source"] for c in cells if c.get("id") == "c-outro"))
    named = [key for key in re.findall(r"`([a-z_]+)`", outro) if key in RECORD_KEYS]
    assert named  # the text does name columns
    untimed = [{key: None for key in RECORD_KEYS} | {"order": "recency",
                                                      "admission": "promote_one",
                                                      "eviction": "lru"}]
    shown = table_columns(untimed)
    assert [key for key in named if key not in shown] == []


SMALL = ["--synthetic", "mixtral-like", "--tokens", "6", "--cache-size", "64", "--policy",
         "full", "fraction:0.4", "-q"]


@pytest.mark.parametrize("fmt", ["table", "json", "jsonl", "csv", "markdown"])
def test_batch_one_is_the_plain_replay_byte_for_byte(capsys, fmt):
    """FAILS if --batch 1 changes any byte of any format (an added column or key, a merged
    trace's label, the legend's route_knn line dropped)."""
    code, plain, _ = run(capsys, *SMALL, *TIMED, "--format", fmt)
    assert code == 0
    code, one, _ = run(capsys, *SMALL, *TIMED, "--format", fmt, "--batch", "1")
    assert code == 0
    assert one == plain


def test_batched_rows_count_per_generated_token_and_per_step(capsys):
    """FAILS if a batched row is not the replay of the merged calls, counts per step where it
    says per generated token (tokens = the requests' 40 tokens), or its per-step time is not
    the per-token time times tokens / steps; or B = 1's rows differ from the plain replay's."""
    from pallas_cache.sizing.batching import batched_trace, split_requests
    from pallas_cache.sizing.sweep import config_grid, replay
    from pallas_cache.sizing.synthetic import synthetic_trace

    argv = ["--synthetic", "mixtral-like", "--tokens", "40", "--requests", "6", "--cache-size",
            "128", "--policy", "full", *TIMED]
    rows = records_of(capsys, *argv, "--batch", "1", "4")
    plain = records_of(capsys, *argv)
    assert [r["batch"] for r in rows] == [1, 4]
    one, four = rows
    assert {k: v for k, v in one.items() if k not in ("batch", "steps", "modeled_ms_per_step")} \
        == plain[0]
    merged = batched_trace(split_requests(synthetic_trace("mixtral-like", num_tokens=40), 6), 4)
    [result] = replay(merged.trace, config_grid([128], ["full"]), progress=lambda s: None)
    assert (four["active"], four["missing"], four["fetched"]) == (
        result.active, result.missing, result.fetched)
    assert four["tokens"] == 40 and four["steps"] == merged.steps < 40
    assert four["fetched_per_token"] == pytest.approx(result.fetched / 40)
    assert four["modeled_ms_per_step"] == pytest.approx(
        four["modeled_ms_per_token"] * 40 / merged.steps)
    assert four["sequences"] == 6 and four["top_k"] == 2


@pytest.mark.parametrize("argv,message", [
    (["--batch", "0"], "--batch 0: must be at least 1"),
    (["--trace", "missing.npy", "--requests", "3"], "--requests applies to a synthetic trace"),
    (["--requests", "0"], "--requests 0: must be at least 1"),
], ids=["zero-batch", "requests-with-trace", "zero-requests"])
def test_a_bad_batch_flag_fails_before_the_trace(capsys, no_trace, argv, message):
    """FAILS if a bad --batch or --requests is found only after the trace is read."""
    line = one_line_error(capsys, cli.main(["replay", *argv]))
    assert message in line, line


def test_batching_a_one_request_trace_says_it_needs_several(capsys):
    """FAILS if --batch on a one-request trace replays (B = 4 of one request is B = 1) instead
    of saying in one line that batching needs several requests."""
    line = one_line_error(capsys, cli.main(["replay", *SMALL, "--batch", "4"]))
    assert "--batch needs several requests; the trace has one (give --requests N)" in line


def test_lines_say_a_trace_is_synthetic_and_which_sizes_it_is_too_short_for():
    """FAILS if a synthetic trace stretched to another model's geometry is not called a guess
    of the Mixtral-calibrated generator, or a size where most of a ``full`` row's misses are
    cold (the first use of an expert) is not named, or a recorded trace is called synthetic."""
    from pallas_cache.sizing import synthetic
    from pallas_cache.sizing.cli.findings import coverage
    from pallas_cache.sizing.cli.output import trace_lines
    from pallas_cache.sizing.synthetic import RealisticParams

    trace = synthetic.synthetic_trace(RealisticParams(num_layers=4, num_experts=16, top_k=2,
                                                      num_tokens=6))
    distinct = len({(int(layer), int(e)) for layer, routes in zip(trace.layers, trace.routes)
                    for e in routes if e >= 0})
    rows = [{"cache_size": 16, "policy": "full", "missing": 4 * distinct},
            {"cache_size": 64, "policy": "full", "missing": distinct},  # every expert: plain
            {"cache_size": 32, "policy": "full", "missing": distinct},
            {"cache_size": 32, "policy": "fraction:0.4", "missing": distinct}]
    lines = trace_lines(coverage(rows, trace, "mixtral-realistic"))
    assert len(lines) == 2
    assert "calibrated on Mixtral-8x7B" in lines[0] and "stretched" in lines[0]
    assert lines[1].startswith("The trace is too short for cache_size 32:")
    assert f"{distinct} experts" in lines[1]
    assert trace_lines(coverage(rows[:1], trace, None)) == []
