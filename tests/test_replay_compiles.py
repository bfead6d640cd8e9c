"""The replay compiles one program per bucket of cache sizes, and replays no configuration twice.

Sizes are data since the usable size became a traced leaf (docs/semantics.md §5.15): every size,
policy, order and admission of a bucket is a lane of one vmapped program at the bucket's
capacity. Compilations are counted from ``jax.log_compiles`` (the chunk program is named
``_replay_chunk``), after clearing the program cache so that earlier tests do not hide one.
"""

from __future__ import annotations

import logging
import math

import jax
import numpy as np
import pytest

from pallas_cache.sizing import sweep
from pallas_cache.sizing.sweep import capacity_buckets, config_grid, replay
from pallas_cache.sizing.traces import Trace
from reference import ReferenceCache, ReferencePolicy


def tiny_trace():
    rng = np.random.default_rng(5)
    tokens, layers, top_k, experts = 12, 3, 2, 4
    routes = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens * layers)])
    return Trace.from_dense(routes.reshape(tokens, layers, top_k), num_layers=layers,
                            num_experts=experts)


def compiles_of(caplog, fn):
    """``fn()``'s result and how many times it compiled the replay's chunk program."""
    sweep._program.cache_clear()
    sweep._EXECUTABLES.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING), jax.log_compiles(True):
        result = fn()
    return result, sum("Compiling jit(_replay_chunk)" in r.getMessage() for r in caplog.records)


def test_a_sweep_compiles_one_program_per_bucket(caplog):
    """FAILS if each cache size compiles its own program (the pool size as a shape), or if the
    bucket rule is not what decides the number of programs."""
    trace = tiny_trace()
    configs = config_grid([4, 6, 9, 12], ["full", "fraction:0.4", "cap:1"],
                          ["recency", "lowest_id"], ["promote_one", "none", "reuse"])
    assert capacity_buckets([4, 6, 9, 12], 4.0) == [[4, 6, 9, 12]]
    one, compiles = compiles_of(caplog, lambda: replay(trace, configs, bounds=False,
                                                      progress=lambda s: None))
    assert compiles == 1
    assert capacity_buckets([4, 6, 9, 12], 2.0) == [[4, 6], [9, 12]]
    two, compiles = compiles_of(caplog, lambda: replay(trace, configs, bounds=False,
                                                      progress=lambda s: None, bucket_ratio=2.0))
    assert compiles == 2
    assert one == two, "the bucket a size lands in changes nothing it counts"


def test_bucket_rule():
    assert capacity_buckets([64, 91, 128, 181, 256]) == [[64, 91, 128, 181, 256]]
    assert capacity_buckets([256, 1024, 2048]) == [[256, 1024, 2048]]
    assert capacity_buckets([256, 1024, 2048, 4096]) == [[256, 1024, 2048], [4096]]
    assert capacity_buckets([256, 1024, 2048], 4.0) == [[256, 1024], [2048]]
    assert capacity_buckets([2048, 256, 256], math.inf) == [[256, 2048]]


def test_configurations_that_cannot_differ_share_a_lane(monkeypatch):
    """FAILS if a sweep replays the admission variants of ``full``, ``cap:N`` or LOWEST_ID (which
    docs/semantics.md §5.5 makes inert) in lanes of their own, or merges what may differ."""
    lanes = []
    executable = sweep._executable

    def spy(program, *args):
        run = executable(program, *args)

        def counted(batch, layers, routes):
            lanes.append(int(batch[0].cache_size.shape[0]))
            return run(batch, layers, routes)
        return counted

    monkeypatch.setattr(sweep, "_executable", spy)
    configs = config_grid([4], ["full", "fraction:1.0", "fraction:0.4", "cap:2", "fraction:0"],
                          ["recency", "lowest_id"], ["promote_one", "none", "reuse"])
    rows = replay(tiny_trace(), configs, bounds=False, progress=lambda s: None,
                  devices=jax.devices()[:1], threads=1)  # one part: every lane in one batch
    # full == fraction:1.0: one lane per order (2); fraction:0.4: 3 admissions with RECENCY + 1;
    # cap:2 and fraction:0 (fetch nothing): one lane per order each.
    assert set(lanes) == {2 + 4 + 2 + 2}
    assert len(rows) == len(configs)
    assert [(r.policy, r.order, r.admission) for r in rows] == [
        (c.policy, c.order, c.admission) for c in configs]


def reference_missing(routes, num_layers, num_experts, cache_size, order):
    cache = ReferenceCache(num_layers, num_experts, cache_size)
    for token in routes:
        for layer, route in enumerate(token):
            cache.ensure_hybrid(layer, route.tolist(), ReferencePolicy.full(), order=order,
                                admission="none")
    return cache.stats().missing


def test_the_fetch_order_is_not_deduplicated_under_full():
    """FAILS if ``full`` rows of both orders share a lane: the order decides which of a step's
    installs takes which slot, so which one a later tie on usage evicts. On this trace (found by
    a search over the reference) RECENCY misses 6 and LOWEST_ID 7."""
    routes = np.asarray([[[1, -1], [0, 1]], [[0, 1], [0, 0]], [[0, 0], [0, 0]]])
    trace = Trace.from_dense(routes, num_layers=2, num_experts=2)
    expected = [reference_missing(routes, 2, 2, 2, order) for order in ("recency", "lowest_id")]
    assert expected == [6, 7]
    rows = replay(trace, config_grid([2], ["full"], ["recency", "lowest_id"], ["none"]),
                  bounds=False, progress=lambda s: None)
    assert [r.missing for r in rows] == expected


@pytest.mark.parametrize("ratio", [math.inf, 1.0])
def test_lanes_of_every_size_in_one_program_count_what_their_own_pool_counts(ratio):
    """FAILS if a lane's usable size leaks (a small lane using the bucket's capacity) or if
    empty_slots counts the unusable slots: one program and one program per size agree."""
    trace = tiny_trace()
    configs = config_grid([4, 5, 12], ["full", "fraction:0.4"], ["recency"], ["promote_one"])
    rows = replay(trace, configs, bounds=False, progress=lambda s: None, bucket_ratio=ratio)
    for row in rows:
        missing = reference_missing_hybrid(trace, row)
        assert (row.missing, row.empty_slots) == missing, row


def reference_missing_hybrid(trace, row):
    cache = ReferenceCache(trace.num_layers, trace.num_experts, row.cache_size,
                           eviction=row.eviction)
    policy = (ReferencePolicy.full() if row.policy == "full"
              else ReferencePolicy.fraction(float(row.policy.split(":")[1])))
    layers, routes = trace.to_array()
    for layer, route in zip(layers, routes):
        cache.ensure_hybrid(int(layer), route, policy, order=row.order, admission=row.admission)
    return cache.stats().missing, int((cache.id_of_slot < 0).sum())


def test_one_program_per_bucket_and_eviction_and_the_first_line_counts_them(caplog):
    """FAILS if the eviction policies share a program (they cannot: the policy is static state
    metadata, docs/semantics.md §5.16) or each (size, eviction) compiles its own, if the first
    progress line's count is not the number of compiles, if a row loses its eviction, or if a
    non-LRU lane of a bucket counts otherwise than a plain reference pool of its size."""
    trace = tiny_trace()
    evictions = ["lru", "pair_lfu", "route_knn"]
    configs = config_grid([4, 6, 9, 12], ["full", "fraction:0.4"], evictions=evictions)
    assert capacity_buckets([4, 6, 9, 12], 2.0) == [[4, 6], [9, 12]]
    lines = []
    rows, compiles = compiles_of(caplog, lambda: replay(trace, configs, bounds=False,
                                                       progress=lines.append, bucket_ratio=2.0))
    assert compiles == 2 * len(evictions)
    assert lines[0].startswith(f"compiling {compiles} programs for {len(configs)} configurations")
    assert [(r.cache_size, r.policy, r.eviction) for r in rows] == [
        (c.cache_size, c.policy, c.eviction) for c in configs]
    for row in rows:
        assert (row.missing, row.empty_slots) == reference_missing_hybrid(trace, row), row


def test_an_error_of_the_optima_thread_reaches_the_caller(monkeypatch):
    """FAILS if the offline optima, which run on a second thread beside the scan, lose an
    error: the replay must raise it, not return rows without (or with stale) bounds."""
    def broken(trace, size, progress=None):
        raise ValueError(f"bypass optimum broke at {size}")

    monkeypatch.setattr(sweep, "bypass_optimum", broken)
    with pytest.raises(ValueError, match="bypass optimum broke at 4"):
        replay(tiny_trace(), config_grid([4], ["full"]), progress=lambda s: None)


def test_rules_every_lane_shares_are_compiled_in():
    """FAILS if the chunk program still traces the paths no lane takes (a sweep without a REUSE
    lane compiling the REUSE code, as when every rule was a traced lane value), or if a rule the
    lanes do not share is fixed (``test_replay.py``'s exact test catches its wrong counts)."""
    from pallas_cache.ops import Rules
    from pallas_cache.policy import FetchPolicy
    from pallas_cache.state import init

    lanes = [Rules.of(hybrid=True, order="recency", admission="promote_one"),
             Rules.of(hybrid=True, order="recency", admission="none")]
    fixed = sweep._fixed_rules(lanes)
    assert dict(fixed) == {"hybrid": True, "by_recency": True, "reuse": False}
    reuse = Rules.of(hybrid=True, order="recency", admission="reuse")
    assert sweep._fixed_rules(lanes + [reuse]) == (("hybrid", True), ("by_recency", True))
    batch = (sweep._stack([init(3, 4, 6)] * 2), np.zeros(2, np.int32),
             np.zeros((2, 3, 3), np.int32),
             sweep._stack([FetchPolicy(np.int32(0), np.int32(1))] * 2), sweep._stack(lanes))
    layers, routes = np.zeros(8, np.int32), np.zeros((8, 2), np.int32)

    def size(program):
        return program.lower(batch, layers, routes).as_text().count("stablehlo.")

    assert size(sweep._program(True, "cpu", fixed)) < size(sweep._program(True, "cpu", ()))


def test_an_error_in_a_part_run_on_another_thread_reaches_the_caller(monkeypatch):
    """FAILS if a failure of a host thread running a share of the lanes is swallowed (the
    replay would return that share's initial, empty counts as results), or if ``threads`` is
    not checked."""
    executable = sweep._executable
    calls = []

    def spy(program, *args):
        run = executable(program, *args)

        def failing(batch, layers, routes):
            calls.append(int(batch[0].cache_size[0]))
            if int(batch[0].cache_size[0]) == 8 and len(calls) > 2:
                raise RuntimeError("lane share failed")
            return run(batch, layers, routes)
        return failing

    monkeypatch.setattr(sweep, "_executable", spy)
    with pytest.raises(RuntimeError, match="lane share failed"):
        replay(tiny_trace(), config_grid([4, 8], ["full"]), bounds=False, chunk_calls=8,
               progress=lambda s: None, devices=jax.devices()[:1], threads=2)
    assert set(calls) == {4, 8}  # the two sizes ran as two parts
    for bad in (0, 1.5, "2"):
        with pytest.raises(ValueError, match="threads must be a positive integer"):
            replay(tiny_trace(), config_grid([4], ["full"]), threads=bad,
                   progress=lambda s: None)


def test_the_cli_compiles_a_synthetic_sweep_while_it_generates_the_trace(caplog):
    """FAILS if the CLI compiles the replay's program only once the synthetic trace exists (on
    the main thread, after generating it), or if the program it compiles ahead is not the one
    the replay runs (the replay would compile a second one)."""
    from pallas_cache.sizing import cli

    sweep._program.cache_clear()
    sweep._EXECUTABLES.clear()
    caplog.clear()
    # Logged from every thread (the context manager would switch the log on for this one only).
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING):
            assert cli.main(["replay", "--synthetic", "mixtral-like", "--tokens", "3",
                             "--cache-size", "8", "16", "--policy", "full", "fraction:0.4",
                             "--quiet"]) == 0
    finally:
        jax.config.update("jax_log_compiles", False)
    compiles = [r for r in caplog.records if "Compiling jit(_replay_chunk)" in r.getMessage()]
    assert [r.threadName for r in compiles] == ["pallas-cache-precompile"]
