"""The replay's sweep: exact against the reference, sharded equals unsharded, one compiled
program per bucket of sizes and eviction, no configuration replayed twice, errors of its
threads raised to the caller.

Compilations are counted from ``jax.log_compiles`` (the chunk program is named
``_replay_chunk``), after :func:`~pallas_cache.sizing.sweep.program.clear_compiled` so that
earlier tests do not hide one.
"""

import json
import logging
import math
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from benchmarks.lowering import count_ops
from pallas_cache.sizing import bounds
from pallas_cache.sizing.sweep import program as sweep_program
from pallas_cache.sizing.sweep import runner as sweep_runner
from pallas_cache.sizing.sweep import (ReplayConfig, capacity_buckets, config_grid, parse_policy,
                                       replay)
from pallas_cache.sizing.traces import Trace
from pallas_cache import reference
from pallas_cache.reference import ReferenceCache, ReferencePolicy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def small_trace():
    rng = np.random.default_rng(3)
    tokens, layers, top_k, experts = 40, 3, 3, 6
    routes = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens * layers)])
    routes[rng.random(routes.shape) < 0.1] = -1  # some padding routes
    routes[::5, 1] = routes[::5, 0]  # calls with duplicate routes (CPU routes count each one)
    return Trace.from_dense(routes.reshape(tokens, layers, top_k), num_layers=layers,
                            num_experts=experts)


def reference_replay(trace, config):
    """The same replay, one call at a time, through the NumPy reference."""
    cache = ReferenceCache(trace.num_layers, trace.num_experts, config.cache_size)
    kind, _, value = config.policy.partition(":")
    policy = {"full": ReferencePolicy.full,
              "fraction": lambda: ReferencePolicy.fraction(float(value)),
              "cap": lambda: ReferencePolicy.fixed_cap(int(value))}[kind]()
    cpu = 0
    pairs = {}
    layers, routes = trace.to_array()
    for layer, route in zip(layers, routes):
        plan = cache.ensure_hybrid(int(layer), route, policy, order=config.order,
                                   admission=config.admission)
        cpu += int(plan.cpu.sum())
        # The cost model's per-call pair: copies made, distinct experts the CPU computes.
        pair = (int(plan.copy.count), len(set(np.asarray(route)[np.asarray(plan.cpu)].tolist())))
        pairs[pair] = pairs.get(pair, 0) + 1
    stats = reference.stats(cache)
    return dict(calls=stats.calls, active=stats.active, missing=stats.missing,
                fetched=stats.fetched, cpu_routes=cpu, empty_slots=int((cache.residency.id_of_slot < 0).sum()),
                pair_counts=sorted((f, c, n) for (f, c), n in pairs.items()))


@pytest.mark.parametrize("threads", [1, 3])
def test_a_compiled_replay_counts_exactly_what_the_reference_counts(threads):
    """FAILS if configurations sharing a program leak into each other, if padding calls of the
    last chunk count, if cpu routes are counted per distinct expert instead of per route, if
    the per-call (fetched, cpu_experts) pairs of the cost model count CPU routes instead of
    distinct CPU experts, if a rule the lanes do not all share is compiled in as if they did,
    or if a part of the lanes run on another host thread is lost or mixed up with another
    (three parts: the lanes do not divide evenly, so the last part is padded)."""
    trace = small_trace()
    configs = config_grid([6, 9], ["full", "fraction:0.4", "cap:1"], ["recency", "lowest_id"],
                          ["promote_one", "reuse"])
    results = replay(trace, configs, chunk_calls=64, progress=lambda s: None, threads=threads)
    for config, result in zip(configs, results):
        expected = reference_replay(trace, config)
        got = {k: getattr(result, k) for k in expected}
        got["pair_counts"] = sorted(got["pair_counts"])
        assert got == expected, config
        assert result.routes == int((trace.routes >= 0).sum())
        assert result.hit_rate == pytest.approx(1 - expected["missing"] / expected["active"])
        assert result.hit_rate <= result.belady_hit_rate + 1e-12, "nothing beats the optimum"


def test_parse_policy_names_the_bad_policy():
    assert int(parse_policy("cap:3").cap) == 3
    with pytest.raises(ValueError, match="'fraction:x'"):
        parse_policy("fraction:x")
    with pytest.raises(ValueError, match="'sometimes'"):
        ReplayConfig(8, policy="sometimes")


SHARDED = textwrap.dedent("""
    import json, jax
    from pallas_cache.sizing.sweep import config_grid, replay
    from pallas_cache.sizing.synthetic import synthetic_trace
    assert len(jax.devices()) == 4, jax.devices()
    trace = synthetic_trace("mixtral-like", num_tokens=24)
    configs = config_grid([8, 32], ["fraction:0.25", "fraction:0.5", "cap:1"], ["recency"],
                          ["promote_one", "none"])
    sharded = replay(trace, configs, progress=lambda s: None)
    single = replay(trace, configs, devices=jax.devices()[:1], progress=lambda s: None)
    print(json.dumps([[r.as_dict() for r in sharded], [r.as_dict() for r in single]]))
""")


def test_a_replay_sharded_over_four_devices_equals_the_single_device_one():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", SHARDED], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    sharded, single = json.loads(done.stdout.strip().splitlines()[-1])
    assert sharded == single
    assert len(sharded) == 12


def tiny_trace():
    rng = np.random.default_rng(5)
    tokens, layers, top_k, experts = 12, 3, 2, 4
    routes = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens * layers)])
    return Trace.from_dense(routes.reshape(tokens, layers, top_k), num_layers=layers,
                            num_experts=experts)


def compiles_of(caplog, fn):
    """``fn()``'s result and how many times it compiled the replay's chunk program."""
    sweep_program.clear_compiled()
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


def test_configurations_that_cannot_differ_share_a_lane():
    """FAILS if a sweep replays the admission variants of ``full``, ``cap:N`` or LOWEST_ID (which
    docs/semantics.md §5.5 makes inert) in lanes of their own, or merges what may differ."""
    configs = config_grid([4], ["full", "fraction:1.0", "fraction:0.4", "cap:2", "fraction:0"],
                          ["recency", "lowest_id"], ["promote_one", "none", "reuse"])
    keys = [sweep_program.lane_key(config) for config in configs]
    where = sweep_program.placement(jax.devices()[:1], threads=1)  # one part: one batch
    unique, batches, _ = sweep_program.group_batches(3, 4, 3, [4], "lru", keys, where)
    # full == fraction:1.0: one lane per order (2); fraction:0.4: 3 admissions with RECENCY + 1;
    # cap:2 and fraction:0 (fetch nothing): one lane per order each.
    assert len(unique) == 2 + 4 + 2 + 2
    assert [int(batch[0].cache_size.shape[0]) for batch in batches] == [len(unique)]
    rows = replay(tiny_trace(), configs, bounds=False, progress=lambda s: None,
                  devices=jax.devices()[:1], threads=1)
    assert len(rows) == len(configs)
    assert [(r.policy, r.order, r.admission) for r in rows] == [
        (c.policy, c.order, c.admission) for c in configs]


def reference_missing(routes, num_layers, num_experts, cache_size, order):
    cache = ReferenceCache(num_layers, num_experts, cache_size)
    for token in routes:
        for layer, route in enumerate(token):
            cache.ensure_hybrid(layer, route.tolist(), ReferencePolicy.full(), order=order,
                                admission="none")
    return reference.stats(cache).missing


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
    return reference.stats(cache).missing, int((cache.residency.id_of_slot < 0).sum())


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

    monkeypatch.setattr(bounds, "bypass_optimum", broken)
    with pytest.raises(ValueError, match="bypass optimum broke at 4"):
        replay(tiny_trace(), config_grid([4], ["full"]), progress=lambda s: None)


def test_rules_every_lane_shares_are_compiled_in():
    """FAILS if the chunk program still traces the paths no lane takes (a sweep without a REUSE
    lane compiling the REUSE code, as when every rule is a traced lane value), or if a rule the
    lanes do not share is fixed (the exact test above catches its wrong counts)."""
    from pallas_cache.ops import Rules

    lanes = [Rules.of(hybrid=True, order="recency", admission="promote_one"),
             Rules.of(hybrid=True, order="recency", admission="none")]
    fixed = sweep_program.fixed_rules(lanes)
    assert dict(fixed) == {"hybrid": True, "by_recency": True, "reuse": False}
    assert sweep_program.fixed_rules(lanes + [Rules.of(hybrid=True, order="recency", admission="reuse")]) == (
        ("hybrid", True), ("by_recency", True))
    configs = config_grid([6], ["fraction:0.4"], ["recency"], ["promote_one", "none"])
    keys = [sweep_program.lane_key(config) for config in configs]
    where = sweep_program.placement(jax.devices()[:1], threads=1)
    _, batches, program = sweep_program.group_batches(3, 4, 3, [6], "lru", keys, where)
    layers, routes = np.zeros(8, np.int32), np.zeros((8, 2), np.int32)

    def size(program):  # the one op counter (docs/semantics.md §7's rule)
        return count_ops(program.lower(batches[0], layers, routes).as_text())[1]

    assert program is sweep_program.chunk_program(True, "cpu", fixed)
    assert size(program) < size(sweep_program.chunk_program(True, "cpu", ()))


def test_an_error_in_a_part_run_on_another_thread_reaches_the_caller(monkeypatch):
    """FAILS if a failure of a host thread running a share of the lanes is swallowed (the
    replay would return that share's initial, empty counts as results), or if ``threads`` is
    not checked."""
    executable = sweep_runner.executable
    calls = []

    def spy(program, *args):
        run = executable(program, *args)

        def failing(batch, layers, routes):
            calls.append(int(batch[0].cache_size[0]))
            if int(batch[0].cache_size[0]) == 8 and len(calls) > 2:
                raise RuntimeError("lane share failed")
            return run(batch, layers, routes)
        return failing

    monkeypatch.setattr(sweep_runner, "executable", spy)
    with pytest.raises(RuntimeError, match="lane share failed"):
        replay(tiny_trace(), config_grid([4, 8], ["full"]), bounds=False, chunk_calls=8,
               progress=lambda s: None, devices=jax.devices()[:1], threads=2)
    assert set(calls) == {4, 8}  # the two sizes ran as two parts
    for bad in (0, 1.5, "2"):
        with pytest.raises(ValueError, match="threads must be a positive integer"):
            replay(tiny_trace(), config_grid([4], ["full"]), threads=bad,
                   progress=lambda s: None)
