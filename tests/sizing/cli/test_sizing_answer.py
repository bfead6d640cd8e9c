"""The answer ``pallas-cache replay`` gives a buyer: a size named for each common expert-pool
budget right under the table (without ``--device-budget``), the one pick on the first screen
(with it), both and ``best`` ranked by the figure the run models most completely (the timed
``overlap_ms_per_token`` with the GPU flags); and no line untrue at its row: the eviction line
per size and absent where the rows reach Belady's misses, ``prefetch_bound`` not given on rows
whose CPU computes experts, sizes past every expert clamped with a line, complete tokens only,
every timing input in the records, and rows within 100 columns."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

from pallas_cache.sizing import cli
from pallas_cache.sizing.report import TABLE_WIDTH, format_records
from pallas_cache.sizing.sweep.cost import modeled_seconds, overlap_times
from pallas_cache.sizing.traces import Trace

# C = 5 ms per device-computed expert: the GPU's time reorders the rows, so the timed figure and
# the copy-and-CPU-only one pick different rows at some size (checked below).
TIMED = ["replay", "--synthetic", "mixtral-realistic", "--tokens", "60", "--model", "mixtral-8x7b",
         "--link-bandwidth", "25GB/s", "--cpu-bandwidth", "60GB/s", "--gpu-layer-ms", "0.07",
         "--gpu-expert-ms", "5", "--cache-size", "64", "128", "200", "256", "-q"]
GIB = 2 ** 30


def _run(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(argv)
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def timed():
    """``(records, table)`` of one timed replay."""
    status, out, _ = _run(TIMED + ["--json"])
    assert status == 0
    status, table, _ = _run(TIMED)
    assert status == 0
    return json.loads(out), table


def _fastest(rows, key):
    return min(rows, key=lambda r: (r[key], r["cache_bytes"]))


def test_best_ranks_by_the_timed_figure(timed):
    """FAILS if ``best`` ranks by ``modeled_ms_per_token`` (no GPU time) when the GPU flags are
    given: at some size of this run the two figures pick different rows."""
    rows, _ = timed
    sizes = sorted({r["cache_size"] for r in rows})
    disagree = 0
    for size in sizes:
        at = [r for r in rows if r["cache_size"] == size]
        fastest = min(r["overlap_ms_per_token"] for r in at)
        assert {r["policy"] for r in at if r["best"]} == {
            r["policy"] for r in at if r["overlap_ms_per_token"] == fastest}
        disagree += (_fastest(at, "modeled_ms_per_token")["policy"]
                     != _fastest(at, "overlap_ms_per_token")["policy"])
    assert disagree, "the run must tell the two figures apart"


def test_a_size_is_named_for_each_budget_right_under_the_table(timed):
    """FAILS if a table without --device-budget names no size (the fastest row alone names the
    largest), names one by the untimed figure, or not right under the rows: each budget's line
    names the size that fits with the lowest overlap_ms_per_token, its bytes and ms/token."""
    rows, table = timed
    lines = table.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("Fastest within each"))
    assert "by overlap_ms_per_token" in lines[head]
    assert re.match(r"^ +\d+ ", lines[head - 1]), "the line right above is a row of the table"
    named = {}
    for line in lines[head + 1:]:
        if re.match(r"^  [\d.]+GiB: nothing fits \(the smallest pool takes 21.0GiB\)$", line):
            continue
        match = re.match(r"^  ([\d.]+)GiB: cache_size=(\d+) \(([\d.]+GiB)\) policy=(\S+): "
                         r"([\d.]+) ms/token$", line)
        if not match:
            break
        named[float(match.group(1))] = match.groups()[1:]
    assert {16.0, 24.0, 48.0, 72.0} & set(named), named
    for gib, (size, nbytes, policy, ms) in named.items():
        pick = _fastest([r for r in rows if r["cache_bytes"] <= gib * GIB],
                        "overlap_ms_per_token")
        assert (int(size), policy) == (pick["cache_size"], pick["policy"]), gib
        assert float(ms) == pytest.approx(pick["overlap_ms_per_token"], abs=0.051)
        assert nbytes == f"{pick['cache_bytes'] / GIB:.1f}GiB"


def test_the_budget_pick_is_on_the_first_screen_by_the_timed_figure():
    """FAILS if --device-budget's pick is far down the legend (line 47 of 61) or quotes the
    untimed modeled figure when the GPU flags are given."""
    status, table, _ = _run(TIMED + ["--device-budget", "48GiB"])
    assert status == 0
    lines = table.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith("Best within 48.0GiB")]
    assert at < 20, at
    status, out, _ = _run(TIMED + ["--device-budget", "48GiB", "--json"])
    (pick,) = [r for r in json.loads(out) if r["budget_best"]]
    assert pick == _fastest([r for r in json.loads(out) if r["cache_bytes"] <= 48 * GIB],
                            "overlap_ms_per_token")
    text = " ".join(lines[at:at + 3])
    assert f"{pick['overlap_ms_per_token']:.1f} ms/token with the GPU's time" in text
    assert "Fastest within each" not in table  # one budget: one answer


def _eviction_sizes(table):
    text = " ".join(table.split())
    (line,) = re.findall(r"Eviction: (.*?\.)(?: [A-Z]|$)", text)
    saves = [int(s) for s in re.findall(r"% at S = (\d+)", line)]
    reached = re.search(r"at S = ([\d, ]+) the full row already misses no more than Belady", line)
    return saves, [int(s) for s in reached.group(1).split(",")] if reached else []


def test_the_eviction_line_is_per_size_and_absent_where_belady_is_reached(timed):
    """FAILS if the eviction line quotes a saving at a size whose full row already misses no
    more than Belady (31% at S = 256 with hit rate = Belady's), or vanishes when hybrid rows
    are fastest: every size's full row gets its part of the line."""
    rows, table = timed
    saves, reached = _eviction_sizes(table)
    for row in rows:
        if row["policy"] != "full":
            continue
        belady_misses = round(row["active"] * (1 - row["belady_hit_rate"]))
        where = reached if row["missing"] <= belady_misses else saves
        assert row["cache_size"] in where, (row["cache_size"], saves, reached)
    assert 256 in reached  # every expert resident: only cold misses, Belady's own
    assert not any(r["best"] for r in rows if r["policy"] == "full" and r["cache_size"] < 256)


def test_the_eviction_line_stays_beside_hybrid_rows_alone():
    """FAILS if a sweep of hybrid rows only drops the eviction line without a word: Belady's
    optimum bounds only full rows, and the line says how to see them."""
    argv = TIMED[:TIMED.index("--cache-size")] + ["--cache-size", "64", "128", "--policy",
                                                    "fraction:0.4", "-q"]
    status, table, _ = _run(argv)
    assert status == 0
    assert ("Eviction: Belady's optimum bounds only the full rows, and this sweep has none: add "
            "--policy full") in " ".join(table.split())


def test_prefetch_bound_is_not_given_on_rows_whose_cpu_computes_experts(timed):
    """FAILS if a hybrid row carries a prefetch_bound (there 1 - busiest/overlap measures how
    unevenly the link and the CPU share the work, not what prefetch could save), or the legend
    does not say so."""
    rows, table = timed
    assert any(r["cpu_experts"] for r in rows)
    for row in rows:
        assert (row["prefetch_bound"] is None) == bool(row["cpu_experts"]), row["policy"]
    assert "on rows whose CPU computes no expert" in " ".join(table.split())


def test_a_size_past_every_expert_is_clamped_with_a_line():
    """FAILS if a pool larger than every expert (L*E slots) is replayed and priced as given
    (a 384-slot pool with rows equal to 256's): it is replayed as L*E, and a line says so."""
    argv = ["replay", "--synthetic", "mixtral-like", "--tokens", "4", "--policy", "full",
            "--model", "mixtral-8x7b", "--cache-size", "64", "256", "384", "-q"]
    status, out, _ = _run(argv + ["--json"])
    assert status == 0
    assert sorted(r["cache_size"] for r in json.loads(out)) == [64, 256]
    status, table, _ = _run(argv)
    text = " ".join(table.split())
    assert ("size: 384 slots is more than every expert (L*E = 32*8): replayed as 256 (84.0GiB), "
            "every expert resident") in text


def _jsonl(path, tokens, layers, last_layers):
    lines = []
    for t in range(tokens):
        for layer in range(layers if t < tokens - 1 else last_layers):
            lines.append(json.dumps({"layer": layer, "token_idx": t,
                                     "experts": [(t + layer) % 8, (3 * t + layer + 1) % 8]}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_trailing_partial_token_is_not_a_token(tmp_path):
    """FAILS if a trace's last token with only some of its layer-calls (a trace cut mid-forward)
    counts as a token and its calls as the cost of the complete ones: the per-token figures
    would read 1/tokens low. It is dropped, with a line on stderr, and the rows equal the
    complete tokens' replay."""
    cut = _jsonl(tmp_path / "cut.jsonl", 9, 4, 3)
    whole = _jsonl(tmp_path / "whole.jsonl", 8, 4, 4)
    argv = ["replay", "--cache-size", "8", "16", "--model", "mixtral-8x7b", "--json",
            "--link-bandwidth", "25GB/s", "--cpu-bandwidth", "60GB/s"]
    status, out, err = _run(argv + ["--trace", cut])
    assert status == 0
    assert "dropped the trailing partial token of 1 sequence (3 layer-calls" in err
    status, want, _ = _run(argv + ["--trace", whole, "-q"])
    strip = lambda rows: [dict(r, source=None) for r in json.loads(rows)]  # noqa: E731
    assert strip(out) == strip(want)
    assert {r["tokens"] for r in json.loads(out)} == {8}


def test_only_a_sequences_last_token_is_dropped_when_partial():
    """FAILS if a partial token between complete ones is dropped (its calls happened), or a
    sequence's complete last token is: only each sequence's last partial token goes."""
    # sequence 0: tokens 0 (2 layers), 1 (1 layer: partial, kept), 2 (1 layer: partial, dropped);
    # sequence 1: tokens 0, 1 complete
    layers = [0, 1, 0, 1, 0, 1, 0, 1]
    token = [0, 0, 1, 2, 0, 0, 1, 1]
    sequence = [0, 0, 0, 0, 1, 1, 1, 1]
    trace = Trace(routes=[[0, 1]] * 8, layers=layers, num_layers=2, num_experts=4,
                  token_idx=token, sequence=sequence, sequence_names=("a", "b"))
    kept, tokens, calls = trace.without_partial_tokens()
    assert (tokens, calls) == (1, 1)
    assert kept.num_calls == 7 and kept.num_tokens == 4
    assert list(kept.token_idx) == [0, 0, 1, 0, 0, 1, 1]
    complete = Trace(routes=[[0, 1]] * 4, layers=[0, 1, 0, 1], num_layers=2, num_experts=4,
                     token_idx=[0, 0, 1, 1])
    assert complete.without_partial_tokens() == (complete, 0, 0)


def test_every_timing_input_is_in_the_records():
    """FAILS if a record lacks one of the inputs that time it (--cpu-fixed-cost was not
    recorded): each row's call_counts and pair_counts, with the record's own W, bandwidths, T_cpu,
    A and C, give back its overlap_ms_per_token and modeled_ms_per_token."""
    argv = TIMED[:TIMED.index("--gpu-layer-ms")]
    status, out, _ = _run(argv + ["--gpu-layer-ms", "0.07", "--gpu-expert-ms", "0.09",
                                  "--cpu-fixed-cost", "1ms", "--cache-size", "64", "128", "-q",
                                  "--json"])
    assert status == 0
    for row in json.loads(out):
        assert row["cpu_fixed_seconds"] == pytest.approx(1e-3)
        times = overlap_times(row["call_counts"], row["expert_bytes"], row["link_bandwidth"],
                              row["cpu_bandwidth"], row["cpu_fixed_seconds"],
                              row["gpu_layer_seconds"], row["gpu_expert_seconds"])
        assert 1e3 * times.total / row["tokens"] == pytest.approx(row["overlap_ms_per_token"],
                                                                   rel=1e-12)
        seconds = modeled_seconds(row["pair_counts"], row["expert_bytes"],
                                  row["link_bandwidth"], row["cpu_bandwidth"],
                                  row["cpu_fixed_seconds"])
        assert 1e3 * seconds / row["tokens"] == pytest.approx(row["modeled_ms_per_token"],
                                                              rel=1e-12)


def _wide_rows():
    """Records shaped like a timed LRU + route_knn sweep of Mixtral (the widest common table)."""
    rows = []
    for size in (64, 91, 128, 181, 256):
        for eviction in ("lru", "route_knn"):
            for policy in ("full", "fraction:0.2941", "fraction:0.4"):
                cpu = 0 if policy == "full" else 3
                rows.append({
                    "source": "synthetic:mixtral-realistic(tokens=338, seed=0)", "layers": 32,
                    "experts": 8, "top_k": 2, "tokens": 338, "calls": 10816, "sequences": 1,
                    "cache_size": size, "policy": policy, "order": "recency",
                    "admission": "promote_one", "eviction": eviction, "expert_bytes": 352321536,
                    "link_bandwidth": 25e9, "cpu_bandwidth": 60e9, "cpu_fixed_seconds": 0.0,
                    "device_budget": None, "routes": 21632, "active": 21632, "missing": 9000,
                    "fetched": 9000 - cpu, "cpu_routes": cpu, "cpu_experts": cpu,
                    "empty_slots": 0, "hit_rate": 0.39834, "belady_hit_rate": 0.6216,
                    "bypass_optimum_hit_rate": 0.6244, "oracle_hit_rate": 0.4648,
                    "fetched_per_token": 37.5, "cpu_experts_per_token": 0.01,
                    "cache_bytes": size * 352321536, "fetched_bytes_per_token": 13.5e9,
                    "cpu_bytes_per_token": 15.8e9, "modeled_ms_per_token": 542.71,
                    "best": policy == "fraction:0.4", "budget_best": None, "note": "",
                    "pair_counts": [], "gpu_layer_seconds": 7e-5, "gpu_expert_seconds": 9e-5,
                    "overlap_ms_per_token": 548.21, "stall_ms_per_token": 540.21,
                    "prefetch_bound": None if cpu else 0.359, "call_counts": []})
    return rows


def test_every_table_line_is_within_100_columns():
    """FAILS if a timed table with an eviction column is wider than 100 columns (108-113 before):
    the columns that do not fit continue in a table under the first."""
    table = format_records(_wide_rows(), "table")
    assert max(len(line) for line in table.splitlines()) <= TABLE_WIDTH
    for key in ("eviction", "overlap_", "prefetch_", "stall_"):
        assert key in table
