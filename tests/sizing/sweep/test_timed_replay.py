"""The replay timed with the GPU's compute beside the copies (docs/semantics.md §11.6): the event
rules evaluated on the exact ``(hits, fetched, cpu_experts, calls)`` histogram agree with a
literal, call-by-call simulation of the same rules over the NumPy reference's plans; the prefetch
bound is the busiest resource's; a mixtral-8x7b replay's rows agree with an independent
implementation of the rules; the flags' refusals; and every output without the flags is
today's, byte for byte.

The simulation below knows nothing of the histogram or of the closed form in
``pallas_cache.sizing.sweep.cost``: it keeps the link's free time, each expert's arrival (the end of
the copy that last brought it) and the device's clock, as the rules are written.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os

import numpy as np
import pytest

from tests.sizing.conftest import one_line_error
from pallas_cache.reference import ReferenceCache, ReferencePolicy
from pallas_cache.sizing import cli
from pallas_cache.sizing.sweep.cost import CostModel, call_seconds, overlap_times
from pallas_cache.sizing.report import (GPU_LEGEND, GPU_RECORD_KEYS, RECORD_KEYS, format_records,
                                        records)
from pallas_cache.sizing.sweep import config_grid, replay
from pallas_cache.sizing.synthetic import synthetic_trace
from pallas_cache.sizing.traces import Trace

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "data")
MIXTRAL_W = 3 * 4096 * 14336 * 2  # mixtral-8x7b bf16, 336 MiB


def simulate(trace, config, W, B_link, B_cpu=None, T_cpu=0.0, A=0.0, C=0.0):
    """The event rules, literally, one call after the other over the reference cache's plans:
    ``(t_end of the last call, gpu_busy, link_busy, cpu_busy)`` in seconds."""
    cache = ReferenceCache(trace.num_layers, trace.num_experts, config.cache_size,
                           eviction=config.eviction)
    kind, _, value = config.policy.partition(":")
    policy = {"full": ReferencePolicy.full,
              "fraction": lambda: ReferencePolicy.fraction(float(value)),
              "cap": lambda: ReferencePolicy.fixed_cap(int(value))}[kind]()
    tau = W / B_link
    t_end = link_free = 0.0
    arrival = {}  # (layer, expert) -> end of the most recent copy that brought it
    gpu = link = cpu = 0.0
    layers, routes = trace.to_array()
    for layer, route in zip(layers.tolist(), routes):
        plan = cache.ensure_hybrid(layer, route, policy, order=config.order,
                                   admission=config.admission)
        if plan.error:  # a refused call adds nothing
            continue
        t_route = t_end + A
        for expert in np.asarray(plan.copy.src_rows)[:plan.copy.count].tolist():
            start = max(link_free, t_route)  # one link, first in, first out
            link_free = start + tau
            arrival[(layer, expert)] = link_free
            link += tau
        route = np.asarray(route)
        on_device = {int(e) for e, slot in zip(route, np.asarray(plan.slots)) if slot >= 0}
        on_cpu = {int(e) for e, is_cpu in zip(route, np.asarray(plan.cpu)) if is_cpu}
        t = t_route
        for when in sorted(arrival[(layer, e)] for e in on_device):  # KeyError: never copied
            t = max(t, when) + C
        gpu += A + C * len(on_device)
        cpu_end = t_route
        if on_cpu:
            partial = len(on_cpu) * W / B_cpu + T_cpu
            cpu_end += partial
            cpu += partial
        t_end = max(t, cpu_end)
    return t_end, gpu, link, cpu


def small_trace():
    """3 layers x 6 experts, top-3 routes with padding and duplicate routes."""
    rng = np.random.default_rng(11)
    tokens, layers, top_k, experts = 50, 3, 3, 6
    routes = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens * layers)])
    routes[rng.random(routes.shape) < 0.1] = -1
    routes[::7, 1] = routes[::7, 0]
    return Trace.from_dense(routes.reshape(tokens, layers, top_k), num_layers=layers,
                            num_experts=experts)


# ---- one call, by hand ------------------------------------------------------------------------

@pytest.mark.parametrize("hits,fetched,cpu,expected", [
    # A = 1, C = 2, tau = 10, W/B_cpu = 5, T_cpu = 1 (seconds)
    (2, 1, 0, 1 + 12),  # hits until 4, the copy arrives at 10, its expert ends at 12
    (0, 2, 0, 1 + 22),  # copies end at 10 and 20; 10+2, then max(12, 20)+2
    (5, 2, 0, 1 + 22),  # hits until 10; max(10, 10)+2 = 12; max(12, 20)+2 = 22
    (1, 0, 2, 1 + 11),  # device 2 beside the CPU's 2*5+1 = 11
    (3, 1, 1, 1 + 12),  # device: hits until 6, copy at 10, ends 12; CPU 5+1 = 6
    (0, 0, 0, 1),       # an all-padding call: A alone
])
def test_one_call_overlaps_copies_compute_and_the_cpu(hits, fetched, cpu, expected):
    """FAILS if a call's copies and compute are summed (2 hits + 1 copy would take 1+10+6 = 17,
    not 13), if the CPU partial is added after the device instead of beside it (1+2+11 = 14,
    not 12), or if hits are computed after the copies instead of while they run."""
    assert call_seconds(hits, fetched, cpu, 10, 1.0, 2.0, cpu_fixed_seconds=1.0,
                        gpu_layer_seconds=1.0, gpu_expert_seconds=2.0) == expected


def test_the_bound_is_the_busiest_resource():
    """FAILS if prefetch_bound leaves out a resource: in each case another one is the busiest
    (the device, the link, the CPU) and only the max of all three gives the bound."""
    W, link, cpu = 10, 1.0, 2.0  # tau = 10, W/B_cpu = 5
    cases = {
        # (hits, fetched, cpu_experts, calls)
        "gpu": ([(8, 1, 0, 3)], dict(A=1.0, C=4.0)),     # 3*(1 + 9*4) = 111 of device work
        "link": ([(0, 3, 0, 2)], dict(A=0.5, C=0.1)),    # 2*3*10 = 60 on the link
        "cpu": ([(1, 0, 6, 2), (0, 1, 0, 1)], dict(A=0.5, C=0.1)),  # 2*30 on the CPU
    }
    for busiest, (counts, gpu) in cases.items():
        times = overlap_times(counts, W, link, cpu, 0.0, gpu["A"], gpu["C"])
        busy = dict(gpu=times.gpu_busy, link=times.link_busy, cpu=times.cpu_busy)
        assert max(busy, key=busy.get) == busiest, busy
        assert times.prefetch_bound == pytest.approx(1 - busy[busiest] / times.total)
        for other in busy:
            assert times.total >= busy[other] - 1e-12
            if other != busiest:
                assert times.prefetch_bound < 1 - busy[other] / times.total


def test_the_packed_table_indexes_every_triple_once():
    """FAILS if two (hits, fetched, cpu_experts) triples share an entry of the replay's packed
    table, an entry is left unused, or its decoding is not the inverse."""
    from pallas_cache.sizing.sweep.program import hit_index, hit_table_size, hit_triples

    for distinct in (0, 1, 2, 8, 17):
        triples = [(h, f, n - h - f) for n in range(distinct + 1) for h in range(n + 1)
                   for f in range(n - h + 1)]
        assert sorted(hit_index(*t) for t in triples) == list(range(hit_table_size(distinct)))
        assert hit_triples([hit_index(*t) for t in triples]) == triples


# ---- the histogram against the literal simulation -----------------------------------------------

PARAMETERS = {
    # W, B_link, B_cpu, T_cpu, A, C: one regime each, so that a different resource is busiest
    "link-bound": (336.0, 25.0, 60.0, 0.0, 0.07, 0.09),
    "gpu-bound": (9.0, 400.0, 60.0, 0.0, 0.07, 0.09),
    "cpu-bound": (42.0, 100.0, 20.0, 0.08, 0.01, 0.02),
}


@pytest.fixture(scope="module")
def small_rows():
    trace = small_trace()
    configs = config_grid([6, 9], ["full", "fraction:0.4", "cap:1", "fraction:0"],
                          ["recency", "lowest_id"], ["promote_one", "reuse"])
    results = replay(trace, configs, chunk_calls=64, progress=lambda s: None, hit_counts=True)
    return trace, configs, results


@pytest.mark.parametrize("regime", sorted(PARAMETERS))
def test_the_histogram_times_every_row_as_the_literal_simulation_does(small_rows, regime):
    """FAILS if the event rules' closed form (cost.overlap_times on the replay's exact
    (hits, fetched, cpu_experts, calls) histogram) differs from simulating the calls one by one:
    copies summed with compute, the CPU partial serialised, hits counted as fetched or as CPU
    experts, padding calls of the last chunk timed, or the histogram's hits wrong; or if the
    bound is not the busiest of the three resources' (each regime has another one busiest)."""
    trace, configs, results = small_rows
    W, B_link, B_cpu, T_cpu, A, C = PARAMETERS[regime]
    cost = CostModel(W, B_link, B_cpu, cpu_fixed_seconds=T_cpu, gpu_layer_seconds=A,
                     gpu_expert_seconds=C)
    busiest = set()
    for config, result in zip(configs, results):
        t_end, gpu, link, cpu = simulate(trace, config, W, B_link, B_cpu, T_cpu, A, C)
        assert sum(n for *_, n in result.call_counts) == trace.num_calls
        # the pairs are the histogram summed over hits
        pairs = {}
        for h, f, c, n in result.call_counts:
            pairs[(f, c)] = pairs.get((f, c), 0) + n
        assert sorted((f, c, n) for (f, c), n in pairs.items()) == sorted(result.pair_counts)
        times = cost.overlap(result.call_counts)
        assert times.total == pytest.approx(t_end, rel=1e-12), config
        assert (times.gpu_busy, times.link_busy, times.cpu_busy) == pytest.approx(
            (gpu, link, cpu), rel=1e-12), config
        bound = 1 - max(gpu, link, cpu) / t_end
        assert times.prefetch_bound == pytest.approx(bound, rel=1e-9, abs=1e-12), config
        busy = dict(gpu=gpu, link=link, cpu=cpu)
        busiest.add(max(busy, key=busy.get))
        (row,) = [r for r in _costed([result], cost)]
        assert row.overlap_ms_per_token == pytest.approx(1e3 * t_end / trace.num_tokens)
        assert row.stall_ms_per_token == pytest.approx(1e3 * (t_end - gpu) / trace.num_tokens)
    assert busiest, regime
    assert regime.split("-")[0] in busiest, (regime, busiest)


def _costed(results, cost):
    from pallas_cache.sizing.sweep.cost import with_costs

    return with_costs(results, cost)


# ---- the acceptance rows ------------------------------------------------------------------------

ACCEPTANCE = ["replay", "--model", "mixtral-8x7b", "--policy", "full", "--eviction", "lru",
              "route_knn", "--cache-size", "64", "96", "128", "--gpu-layer-ms", "0.07",
              "--gpu-expert-ms", "0.09", "--link-bandwidth", "25GB/s", "--json", "-q"]
#: overlap_ms_per_token of (LRU, route_knn) at S = 64, 96, 128, from an independent
#: implementation of the same rules (issue 45), at 25 GB/s and 50 GB/s.
INDEPENDENT = {25e9: {64: (561.7, 476.4), 96: (552.2, 345.5), 128: (356.7, 242.7)},
               50e9: {64: (283.6, 241.1), 96: (278.8, 175.9), 128: (181.4, 124.7)}}


@pytest.fixture(scope="module")
def acceptance_rows():
    import contextlib

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(ACCEPTANCE) == 0
    return json.loads(out.getvalue())


def test_acceptance_rows_agree_with_the_independent_implementation(acceptance_rows):
    """FAILS if a row of the ``ACCEPTANCE`` command is more than 1% from the independent
    implementation's, at 25 GB/s (the replay) or at 50 GB/s (the same call counts re-timed on
    the host, no replay). Naive versions miss by far more: copies and compute summed would add
    most of the 8 ms of device work per token back."""
    rows = acceptance_rows
    assert len(rows) == 6 and all(tuple(r) == RECORD_KEYS + GPU_RECORD_KEYS for r in rows)
    for bandwidth, expected in INDEPENDENT.items():
        for r in rows:
            want = expected[r["cache_size"]][("lru", "route_knn").index(r["eviction"])]
            if bandwidth == 25e9:
                got = r["overlap_ms_per_token"]
            else:
                got = 1e3 * overlap_times(r["call_counts"], MIXTRAL_W, bandwidth, None, 0.0,
                                          7e-5, 9e-5).total / r["tokens"]
            assert got == pytest.approx(want, rel=0.01), (bandwidth, r["cache_size"],
                                                          r["eviction"])
            # the device's own work is 32 layers x (A + 2 C) = 8.0 ms per token (every hit
            # and copy computed on the device, top-2 of 8 experts, no duplicates)
            assert r["overlap_ms_per_token"] - r["stall_ms_per_token"] == pytest.approx(8.0)


@pytest.mark.parametrize("cache_size", [64, 96])
def test_two_acceptance_rows_by_hand_from_the_rules(acceptance_rows, cache_size):
    """FAILS if the replay's LRU row at this size is not what simulating the rules call by call
    over the NumPy reference's plans gives (the trace regenerated, the cache replayed by the
    reference, the time kept by the literal rules: nothing of the compiled replay or of the
    histogram's closed form)."""
    from pallas_cache.sizing.sweep.records import ReplayConfig

    (row,) = [r for r in acceptance_rows
              if r["cache_size"] == cache_size and r["eviction"] == "lru"]
    trace = synthetic_trace("mixtral-realistic")
    assert trace.source == row["source"]
    t_end, gpu, link, cpu = simulate(trace, ReplayConfig(cache_size, "full"), MIXTRAL_W, 25e9,
                                     A=7e-5, C=9e-5)
    assert row["overlap_ms_per_token"] == pytest.approx(1e3 * t_end / trace.num_tokens,
                                                        rel=1e-12)
    assert row["stall_ms_per_token"] == pytest.approx(1e3 * (t_end - gpu) / trace.num_tokens,
                                                      rel=1e-12)
    assert row["prefetch_bound"] == pytest.approx(1 - max(gpu, link, cpu) / t_end, rel=1e-9)
    assert cpu == 0 and link == pytest.approx(row["fetched"] * MIXTRAL_W / 25e9, rel=1e-12)


# ---- the CLI ------------------------------------------------------------------------------------

SMALL = ["replay", "--synthetic", "mixtral-like", "--tokens", "6", "--cache-size", "16", "64",
         "--model", "mixtral-8x7b", "--link-bandwidth", "25GB/s"]


def test_the_table_shows_the_columns_and_the_prefetch_line(capsys):
    """FAILS if the table lacks the new columns, the line under it, or the line's numbers are
    not the fastest row's bound at each size."""
    from tests.sizing.cli.test_cli import table_keys

    assert cli.main(SMALL + ["--policy", "full", "--gpu-layer-ms", "0.07", "-q"]) == 0
    out = capsys.readouterr().out
    assert table_keys(out)[-5:] == ["overlap_ms_per_token", "best", "stall_ms_per_token",
                                    "prefetch_bound", "note"]
    assert "gpu: A=0.07ms per layer-call  C=0ms" in out
    text = " ".join(out.split())
    assert "any prefetch of the next layers could save at most" in text
    assert "Eviction: " in text
    assert "tau = W/B_link = 14.1 ms" in text
    assert cli.main(SMALL + ["--policy", "full", "--gpu-layer-ms", "0.07", "--json", "-q"]) == 0
    rows = json.loads(capsys.readouterr().out)
    for size in (16, 64):
        (r,) = [r for r in rows if r["cache_size"] == size]
        assert f"{100 * r['prefetch_bound']:.1f}% at S = {size}" in text
        assert r["gpu_layer_seconds"] == 7e-5 and r["gpu_expert_seconds"] == 0.0


def test_csv_carries_the_new_keys_after_the_old_ones(capsys):
    """FAILS if the csv header does not end with the GPU keys, or call_counts is not one cell of
    JSON that reads back."""
    assert cli.main(SMALL + ["--cpu-bandwidth", "60GB/s", "--gpu-expert-ms", "90us",
                             "--format", "csv", "-q"]) == 0
    read = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert tuple(read[0]) == RECORD_KEYS + GPU_RECORD_KEYS
    for row in read:
        counts = json.loads(row["call_counts"])
        assert sum(n for *_, n in counts) == int(row["calls"])
        assert float(row["gpu_expert_seconds"]) == pytest.approx(9e-5)
        if int(row["cpu_experts"]):  # a hybrid row: not what prefetch could save, not given
            assert row["prefetch_bound"] == ""
        else:
            assert 0 <= float(row["prefetch_bound"]) < 1


def test_batched_rows_time_the_merged_calls(capsys):
    """FAILS if --batch drops the GPU-time model (its replays not asked for the hit counts)."""
    assert cli.main(SMALL + ["--policy", "full", "--gpu-layer-ms", "0.07", "--requests", "3",
                             "--batch", "1", "2", "--json", "-q"]) == 0
    rows = json.loads(capsys.readouterr().out)
    for r in rows:
        assert r["overlap_ms_per_token"] is not None
        times = overlap_times(r["call_counts"], MIXTRAL_W, 25e9, None, 0.0, 7e-5, 0.0)
        assert r["overlap_ms_per_token"] == pytest.approx(1e3 * times.total / r["tokens"])
    assert {r["batch"] for r in rows} == {1, 2}


@pytest.mark.parametrize("extra,message", [
    (["--gpu-layer-ms", "fast"], r"--gpu-layer-ms 'fast': expected milliseconds"),
    (["--gpu-layer-ms", "-1"], r"--gpu-layer-ms '-1': must be a finite time"),
    (["--gpu-expert-ms", "nan"], r"--gpu-expert-ms 'nan': must be a finite time"),
    (["--gpu-expert-ms", "inf"], r"--gpu-expert-ms 'inf': must be a finite time"),
    (["--gpu-layer-ms", "0.07", "--policy", "full", "fraction:0.4"],
     r"CPU partial of policy fraction:0.4: give --cpu-bandwidth"),
    (["--gpu-layer-ms", "0.07", "--policy", "full", "--devices", "2", "--parallel", "tensor"],
     r"--gpu-layer-ms times one device's decode; it does not combine with --devices 2"),
], ids=["not-a-number", "negative", "nan", "inf", "hybrid-without-b-cpu", "devices"])
def test_bad_gpu_flags_are_one_line_before_the_replay(capsys, no_replay, extra, message):
    """FAILS if a bad GPU time, a hybrid policy without the CPU's bandwidth, or several devices
    reach the replay instead of one line and exit 2."""
    import re

    line = one_line_error(capsys, cli.main(SMALL + extra))
    assert re.search(message, line), line


def test_gpu_flags_need_the_expert_size_and_the_link(capsys):
    """FAILS if the GPU time is accepted without W or B_link (nothing to overlap it with)."""
    base = ["replay", "--synthetic", "mixtral-like", "--tokens", "4", "--cache-size", "64"]
    line = one_line_error(capsys, cli.main(base + ["--gpu-expert-ms", "0.09"]))
    assert "--gpu-expert-ms needs an expert size" in line
    line = one_line_error(capsys, cli.main(base + ["--model", "mixtral-8x7b",
                                                   "--gpu-layer-ms", "0.07"]))
    assert "--link-bandwidth" in line


def test_the_docs_and_help_explain_every_new_key(capsys):
    """FAILS if docs/replay.md's column table or ``replay --help`` misses a GPU key or says
    something else than GPU_LEGEND."""
    with open(os.path.join(os.path.dirname(DATA), "..", "docs", "replay.md"),
              encoding="utf-8") as handle:
        rows = [line for line in handle.read().splitlines() if line.startswith("| `")]
    legend = {line.split("`")[1]: line.split(" | ", 1)[1].rstrip(" |").replace("\\|", "|")
              for line in rows}
    assert {key: legend.get(key) for key in GPU_RECORD_KEYS} == GPU_LEGEND
    with pytest.raises(SystemExit):
        cli.main(["replay", "--help"])
    text = capsys.readouterr().out
    for key in GPU_RECORD_KEYS:
        assert f"\n  {key} " in text, key


def test_records_without_the_gpu_time_have_no_new_key():
    """FAILS if a cost model without the GPU's time adds a key (or an empty one) to a record, or
    if counting the hits changes any other field of a result (the replay's other program)."""
    trace = small_trace()
    configs = config_grid([6, 9], ["full", "fraction:0.4"])
    untimed = CostModel(10, 1.0, 2.0)
    plain = replay(trace, configs, cost=untimed, progress=lambda s: None, bounds=False,
                   chunk_calls=64)
    assert all(r.call_counts == () for r in plain)
    assert all(tuple(r) == RECORD_KEYS for r in records(plain, trace, untimed))
    timed = CostModel(10, 1.0, 2.0, gpu_expert_seconds=0.5)
    results = replay(trace, configs, cost=timed, progress=lambda s: None, bounds=False,
                     chunk_calls=64)
    for result, before in zip(results, plain):
        assert result.call_counts and result.overlap_ms_per_token is not None
        assert sum(n for *_, n in result.call_counts) == result.calls == trace.num_calls
        assert dataclasses.replace(result, call_counts=(), overlap_ms_per_token=None,
                                   stall_ms_per_token=None, prefetch_bound=None) == before
    rows = records(results, trace, timed)
    assert all(tuple(r) == RECORD_KEYS + GPU_RECORD_KEYS for r in rows)
    assert json.loads(format_records(rows, "json")) == rows


# ---- today's outputs, byte for byte -------------------------------------------------------------

MIXTRAL_BUDGET = ["--model", "mixtral-8x7b", "--link-bandwidth", "25GB/s", "--cpu-bandwidth",
                  "60GB/s", "--device-budget", "48GiB"]


@pytest.mark.parametrize("args,name", [
    (["--json"], "replay_default.json"),
    (MIXTRAL_BUDGET + ["--json"], "replay_mixtral_budget.json"),
    (MIXTRAL_BUDGET + ["--format", "csv"], "replay_mixtral_budget.csv"),
], ids=["default-json", "mixtral-budget-json", "mixtral-budget-csv"])
def test_outputs_without_the_gpu_flags_are_unchanged(capsys, args, name):
    """FAILS if an output without --gpu-layer-ms / --gpu-expert-ms differs by one byte from what
    ``pallas-cache replay`` printed before the GPU-time model existed (tests/data, captured from
    the commit before it; regenerated when the records gained ``cpu_fixed_seconds``)."""
    assert cli.main(["replay", "-q"] + args) == 0
    with open(os.path.join(DATA, name), encoding="utf-8") as handle:
        assert capsys.readouterr().out == handle.read()
