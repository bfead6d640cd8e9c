"""`pallas-cache replay` as a sizing tool: bytes, modeled ms per token, best, notes, budgets."""

import json

import numpy as np
import pytest

from pallas_cache.sizing import cli

MIB = 2**20
W_MIXTRAL = 3 * 4096 * 14336 * 2  # bytes of one Mixtral-8x7B expert in bf16 (336 MiB)
TIMED = ["--model", "mixtral-8x7b", "--link-bandwidth", "25GB/s", "--cpu-bandwidth", "60GB/s"]
KEYS = {"cache_size", "policy", "order", "admission", "calls", "routes", "active", "missing",
        "fetched", "cpu_routes", "empty_slots", "hit_rate", "belady_hit_rate",
        "bypass_optimum_hit_rate", "oracle_hit_rate", "tokens", "cpu_experts", "pair_counts",
        "cache_bytes", "fetched_bytes_per_token", "cpu_bytes_per_token", "modeled_ms_per_token",
        "best", "budget_best", "note"}


def table_keys(out):
    """The column names of the printed table: a header may wrap onto two lines above the rule
    of dashes; the rule's dash runs give each column's span."""
    lines = out.splitlines()
    rule = next(i for i, line in enumerate(lines) if set(line) <= {"-", " "} and "---" in line)
    spans, start = [], None
    for i, char in enumerate(lines[rule] + " "):
        if char == "-" and start is None:
            start = i
        elif char != "-" and start is not None:
            spans.append((start, i))
            start = None
    above = lines[rule - 2]  # a header's top line, or the last line of the preamble
    header = lines[rule - 1:rule] if ":" in above or "=" in above else lines[rule - 2:rule]
    return ["".join(line[a:b].strip() for line in header) for a, b in spans[:-1]] + [
        lines[rule - 1][spans[-1][0]:].strip()]


def run(capsys, *argv):
    code = cli.main(["replay", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_rows_carry_every_cost_key_and_flag_undersized_rows(capsys):
    """FAILS if a key is missing, cache_bytes is not S*W, the modeled time is not the per-call
    max summed per token, fraction:auto is not resolved, `best` is not per cache size, the
    budget pick ignores cache_bytes, or a size below L*k (= 64 on mixtral-like) is not flagged
    while one at L*k is."""
    code, out, err = run(capsys, "--synthetic", "mixtral-like", "--tokens", "6", *TIMED,
                         "--cache-size", "8", "64", "--device-budget", "20GiB", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert len(rows) == 6
    for row in rows:
        assert KEYS <= set(row), KEYS - set(row)
        assert row["cache_bytes"] == row["cache_size"] * W_MIXTRAL
        seconds = sum(n * max(f * W_MIXTRAL / 25e9, c * W_MIXTRAL / 60e9)
                      for f, c, n in row["pair_counts"])
        assert row["modeled_ms_per_token"] == pytest.approx(1e3 * seconds / 6)
        assert row["fetched_bytes_per_token"] == pytest.approx(row["fetched"] * W_MIXTRAL / 6)
        assert row["cpu_bytes_per_token"] == pytest.approx(
            (row["missing"] - row["fetched"]) * W_MIXTRAL / 6)
    # Default policies once both bandwidths are known; auto = 25 / (25 + 60) = 0.2941.
    assert [r["policy"] for r in rows[:3]] == ["full", "fraction:0.2941", "fraction:0.4"]
    for size in (8, 64):
        group = [r for r in rows if r["cache_size"] == size]
        fastest = min(r["modeled_ms_per_token"] for r in group)
        assert [r["best"] for r in group] == [r["modeled_ms_per_token"] == fastest for r in group]
    # 20 GiB holds the 8-slot pool (2.6 GiB) but not the 64-slot one (21 GiB).
    small = [r for r in rows if r["cache_size"] == 8]
    assert [r["budget_best"] for r in rows[3:]] == [False] * 3
    assert [r["budget_best"] for r in small] == [r["best"] for r in small]
    assert all("L*k = 64" in r["note"] and "oracle" in r["note"] for r in small)
    assert all(r["note"] == "" for r in rows if r["cache_size"] == 64)


def test_the_table_names_the_columns_by_their_keys_and_says_what_bounds_what(capsys):
    """FAILS if the table loses a cost column, hides the resolved auto split or the byte-size
    rounding, or does not say which bound applies to which rows and which row the budget picks.

    12 GiB of 336 MiB experts: 12 * 1024 / 336 = 36.57 -> 36 slots."""
    code, out, err = run(capsys, "--synthetic", "mixtral-like", "--tokens", "4", *TIMED,
                         "--cache-size", "12GiB", "--device-budget", "24GiB")
    assert code == 0, err
    flat = " ".join(out.split())
    for key in ("cache_size", "cache_bytes", "hit_rate", "belady_hit_rate",
                "bypass_optimum_hit_rate", "oracle_hit_rate", "fetched_bytes_per_token",
                "cpu_bytes_per_token", "modeled_ms_per_token", "best", "note"):
        assert key in table_keys(out), key
    assert "12GiB = 36 slots of 336MiB" in out
    assert "fraction:auto = B_link/(B_link+B_cpu) = 0.2941" in out
    assert "belady_hit_rate bounds the `full` rows" in flat
    assert "bypass_optimum_hit_rate bounds every row" in flat
    assert "Best within 24.0GiB: cache_size=36" in flat
    assert "S < L*k = 64" in out


def test_cli_mistakes_fail_before_the_replay_with_one_line(capsys):
    """FAILS if a cost flag that cannot be honoured reaches the replay (or a traceback)."""
    cases = [
        (["--policy", "fraction:auto"], "fraction:auto needs both"),
        (["--cache-size", "12GiB"], "give --model or --expert-bytes"),
        (["--model", "mixtral-8x7b", "--device-budget", "24GiB"], "--device-budget needs"),
        (["--link-bandwidth", "25Gb/s"], "means bits"),
        (["--model", "mixtral-8x7b", "--cache-size", "2GiB"], "fewer than one layer's 8"),
        (["--model", "gpt-5"], "unknown model"),
    ]
    for argv, message in cases:
        code, out, err = run(capsys, "--synthetic", "mixtral-like", "--tokens", "2", *argv)
        assert code == 2 and out == "", argv
        assert message in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_a_model_that_does_not_match_the_trace_is_warned_about(capsys):
    """FAILS if a geometry mismatch between --model and the trace passes silently, or a match
    is warned about."""
    code, _, err = run(capsys, "--synthetic", "mixtral-like", "--tokens", "2", "--cache-size",
                       "64", "--policy", "full", "--model", "qwen3-30b-a3b", "--json")
    assert code == 0 and "warning" in err and "qwen3-30b-a3b has 48 MoE layers" in err
    code, _, err = run(capsys, "--synthetic", "mixtral-like", "--tokens", "2", "--cache-size",
                       "64", "--policy", "full", "--model", "mixtral-8x7b", "--json")
    assert code == 0 and "warning" not in err


def test_the_default_sizes_are_the_auto_grid_of_the_trace(tmp_path, capsys):
    """FAILS if `--cache-size` does not default to auto, i.e. max(E, L*k) .. L*E by sqrt(2).

    L = 2, E = 4, top-1: from max(4, 2) = 4: 4, 5.66 -> 6, then L*E = 8."""
    path = tmp_path / "tiny.npy"
    rng = np.random.default_rng(0)
    np.save(path, rng.integers(0, 4, size=(20, 2, 1)).astype(np.int32))
    code, out, err = run(capsys, "--trace", str(path), "--num-experts", "4", "--policy", "full",
                         "--json")
    assert code == 0, err
    assert [r["cache_size"] for r in json.loads(out)] == [4, 6, 8]


def test_bench_bandwidth_prints_flags_that_replay_accepts(capsys):
    """FAILS if the measured bandwidths are printed in a form --link-bandwidth/--cpu-bandwidth
    refuse (e.g. bits, or no /s), or a bad size reaches the measurement."""
    from pallas_cache.sizing.units import parse_bandwidth

    assert cli.main(["bench-bandwidth", "--mib", "1", "--d-model", "64", "--d-expert", "128",
                     "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    flags = next(line for line in out.splitlines() if line.startswith("flags:")).split()
    assert flags[1] == "--link-bandwidth" and flags[3] == "--cpu-bandwidth"
    assert parse_bandwidth(flags[2]) > 0 and parse_bandwidth(flags[4]) > 0
    assert cli.main(["bench-bandwidth", "--mib", "0"]) == 2
    assert ">= 1" in capsys.readouterr().err


KNN_SWEEP = ["--synthetic", "mixtral-realistic", "--tokens", "24", "--cache-size", "64", "96",
             "128", "--policy", "full", "fraction:0.4", "-q"]


def knn_legend_lines(out):
    return [line for line in out.splitlines() if line.startswith("route_knn (")]


def test_an_lru_only_table_says_in_one_line_what_route_knn_changes_at_each_size(capsys):
    """FAILS if the legend of an LRU-only table lacks the route_knn line, spreads it over
    several lines, gives a size's change other than route_knn's hit rate (from its own rows of
    a sweep that includes it) minus LRU's, or prints the line when another eviction is swept."""
    code, out, _ = run(capsys, *KNN_SWEEP, "--format", "json")
    lru = {r["cache_size"]: r["hit_rate"] for r in json.loads(out) if r["policy"] == "full"}
    code, out, _ = run(capsys, *KNN_SWEEP, "--eviction", "lru", "route_knn", "--format", "json")
    assert code == 0
    knn = {r["cache_size"]: r["hit_rate"] for r in json.loads(out)
           if r["policy"] == "full" and r["eviction"] == "route_knn"}
    changes = [knn[size] - lru[size] for size in (64, 96, 128)]
    assert any(abs(change) >= 0.001 for change in changes)  # the trace tells them apart
    code, out, _ = run(capsys, *KNN_SWEEP)
    assert code == 0
    [line] = knn_legend_lines(out)
    assert "policy full: hit rate " + ", ".join(
        f"{change:+.3f} at {size}" for change, size in zip(changes, (64, 96, 128))) in line
    assert line.endswith("(add --eviction lru route_knn to see its rows).")
    code, out, _ = run(capsys, *KNN_SWEEP, "--eviction", "route_knn")  # compiled above
    assert code == 0 and "hit_rate = 1 - missing/active" in out
    assert knn_legend_lines(out) == []


def test_json_and_csv_of_an_lru_sweep_are_the_lru_replays_records_exactly(capsys):
    """FAILS if the route_knn legend's replay leaks into the machine-readable output (an extra
    record, or an LRU row's value changed, e.g. its budget pick): json and csv must be the
    records of the LRU configurations' replay, byte for byte."""
    from pallas_cache.sizing.cost import CostModel
    from pallas_cache.sizing.report import format_records, records
    from pallas_cache.sizing.sweep import config_grid, replay
    from pallas_cache.sizing.synthetic import synthetic_trace

    trace = synthetic_trace("mixtral-realistic", num_tokens=24, seed=0)
    cost = CostModel(W_MIXTRAL, 25e9, 60e9, 20 * 2**30)
    results = replay(trace, config_grid([64, 96, 128], ["full", "fraction:0.4"]), cost=cost,
                     progress=lambda status: None)
    rows = records(results, trace, cost)
    for fmt in ("json", "csv"):
        code, out, _ = run(capsys, *KNN_SWEEP, *TIMED, "--device-budget", "20GiB",
                           "--format", fmt)
        assert code == 0
        assert out == format_records(rows, fmt) + "\n"
