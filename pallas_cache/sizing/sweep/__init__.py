"""Replay a routing trace through many cache configurations at once, to size a cache: the
compiled, vmapped sweep of docs/semantics.md §11 (:func:`replay`), its ahead-of-time compile
(:func:`precompile`), and the records it takes and returns (from
:mod:`~pallas_cache.sizing.sweep.records`)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from pallas_cache.sizing.sweep.cost import CostModel, with_costs
from pallas_cache.sizing.progress import Progress, as_progress
from pallas_cache.sizing.sweep.program import (executable, group_batches, groups, lane_key,
                                               placement)
from pallas_cache.sizing.sweep.records import (DEFAULT_BUCKET_RATIO, ReplayConfig, ReplayResult,
                                               auto_cache_sizes, capacity_buckets, config_grid,
                                               parse_policy)
from pallas_cache.sizing.sweep.runner import OptimaThread, SweepPlan, run_groups
from pallas_cache.sizing.traces import Trace

__all__ = ["ReplayConfig", "ReplayResult", "parse_policy", "replay", "config_grid",
           "auto_cache_sizes", "capacity_buckets", "precompile"]

#: Layer-calls per compiled chunk: long enough that dispatch is noise, short enough for progress.
DEFAULT_CHUNK_CALLS = 2048


def replay(
    trace: Trace,
    configs: Sequence[ReplayConfig],
    *,
    chunk_calls: int = DEFAULT_CHUNK_CALLS,
    bounds: bool = True,
    cost: CostModel | None = None,
    devices: Sequence[jax.Device] | None = None,
    progress: Progress | Callable[[str], None] | None = None,
    bucket_ratio: float = DEFAULT_BUCKET_RATIO,
    threads: int | None = None,
    hit_counts: bool = False,
    per_layer: bool = False,
) -> list[ReplayResult]:
    """Replay ``trace`` through every configuration and return one result per configuration.

    Args:
      trace: the routing trace (see :mod:`pallas_cache.sizing.traces`, :mod:`pallas_cache.sizing.synthetic`).
      configs: the configurations, any mix of sizes and options; results come back in this order.
      chunk_calls: layer-calls per compiled scan chunk.
      bounds: also compute Belady's optimum, the bypass optimum and the stationary oracle per
        cache size.
      cost: the expert size, bandwidths and device budget that turn counts into bytes and
        modeled milliseconds (docs/semantics.md §11); ``None``: counts and hit rates only.
      devices: devices to shard the configuration axis over (default: all local devices of the
        default backend; one device means no sharding).
      progress: a :class:`~pallas_cache.sizing.progress.Progress` told each phase (the replay,
        whose line counts the programs it compiles, then the offline optima) and its progress;
        or a callable, called with each phase's line and each status; ``None``: a
        :class:`~pallas_cache.sizing.progress.Bar` on stderr (a bar only on a terminal). Pass
        ``lambda s: None`` to silence.
      bucket_ratio: sizes up to this factor above a bucket's smallest share its compiled program
        (:func:`capacity_buckets`); ``math.inf``: one program for the whole sweep.
      threads: host threads that run a group's lanes, each through the same compiled program
        over an equal share of them (XLA releases the GIL while a chunk runs, so on a multi-core
        CPU the shares run side by side; the results do not depend on it). ``None``: the CPU
        cores this process may use, when the sweep runs on one CPU device, else one.
      hit_counts: also count the calls by ``(hits, fetched, cpu_experts)``
        (``ReplayResult.call_counts``), what the GPU-time model of docs/semantics.md §11.6
        times; implied by a ``cost`` with the GPU's time. Another compiled program (a bigger
        table per lane); the other results are the same.
      per_layer: also keep each configuration's per-layer counters
        (``ReplayResult.layer_stats``: :func:`pallas_cache.per_layer_stats` of its final state);
        the same compiled programs, the other results the same.

    Returns:
      ``list[ReplayResult]``, aligned with ``configs``.
    """
    configs = list(configs)
    if not configs:
        raise ValueError("replay needs at least one configuration")
    for config in configs:
        if config.cache_size < trace.num_experts:
            raise ValueError(
                f"cache_size {config.cache_size} cannot hold one layer of {trace.num_experts} experts"
            )
    where = placement(devices, threads)
    report = as_progress(progress)
    hit_counts = bool(hit_counts) or (cost is not None and cost.gpu)
    plan = SweepPlan.of(trace, configs, chunk_calls=chunk_calls, bucket_ratio=bucket_ratio,
                        where=where, hit_counts=hit_counts, per_layer=per_layer)
    sizes = sorted({c.cache_size for c in configs})
    programs = len(plan.groups)
    report.phase(f"compiling {programs} program{'s' if programs != 1 else ''} for "
                 f"{len(configs)} configuration{'s' if len(configs) != 1 else ''} "
                 f"({plan.num_calls} layer-calls)...", plan.num_chunks * programs)
    # The optima start once every program is compiled (docs/design.md, the replay's sweep).
    optima: list = []

    def start_optima():
        if bounds:
            optima.append(OptimaThread(trace, sizes))

    try:
        results = run_groups(plan, report, start_optima)
    except BaseException:
        for thread in optima:
            thread.cancel()
        raise
    ordered = [results[i] for i in range(len(configs))]
    try:
        for thread in optima:
            # The bounds depend on the size only: computed once per size, whatever the evictions.
            bound_rows = thread.report_to(report)
            ordered = [dataclasses.replace(r, **bound_rows[r.cache_size]) for r in ordered]
    except BaseException:  # Ctrl-C while waiting: the optima stop at their next report
        for thread in optima:
            thread.cancel()
        raise
    report.close()
    return with_costs(ordered, cost)


def precompile(num_layers: int, num_experts: int, top_k: int, configs: Sequence[ReplayConfig],
               *, chunk_calls: int = DEFAULT_CHUNK_CALLS,
               devices: Sequence[jax.Device] | None = None,
               bucket_ratio: float = DEFAULT_BUCKET_RATIO, threads: int | None = None,
               hit_counts: bool = False) -> None:
    """Compile the programs :func:`replay` runs for ``configs`` on a trace of this geometry
    (``top_k`` route columns), with the same options, so that the replay compiles nothing.

    Meant for a second thread while the trace is read or generated: XLA compiles without the
    GIL, so the compile and the trace overlap (the CLI does this for a synthetic trace). Join
    the thread before calling :func:`replay`: a replay started while its program is still
    compiling compiles it again.
    """
    keys = [lane_key(config) for config in configs]
    where = placement(devices, threads)
    layers = jnp.zeros((chunk_calls,), jnp.int32)
    routes = jnp.zeros((chunk_calls, top_k), jnp.int32)
    for bucket, eviction in groups(keys, bucket_ratio):
        _, batches, program = group_batches(num_layers, num_experts, min(top_k, num_experts) + 1,
                                            bucket, eviction, keys, where, hit_counts)
        executable(program, batches[0], layers, routes)
