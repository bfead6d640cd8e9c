"""Replay a routing trace through many cache configurations at once, to size a cache.

The question every user of an offloaded MoE asks first is "how big must the cache be, and which
policy, for my model and my traffic?". The answer is a replay: feed the trace's layer-calls, in
order, to the cache and count what it would have fetched. This module runs that replay as
compiled JAX, for a whole grid of configurations:

- **One compiled, vmapped program per bucket of cache sizes and eviction policy**
  (:func:`capacity_buckets`; one bucket for a usual grid; the policy is static metadata of the
  state, docs/semantics.md §5.16). The states are allocated at the bucket's largest size and each lane
  carries its own usable size as data (docs/semantics.md §5.15), so sizes x policies x orders x
  admissions are the lanes of a single ``jax.vmap``: the
  :class:`~pallas_cache.policy.FetchPolicy` is a traced pytree, and the fetch order and
  admission rule enter the cache's core as data (:class:`pallas_cache.ops.Rules` through
  :func:`pallas_cache.ops.ensure_with_rules`; the public ops take them as static options, which
  is what a decode loop wants). Configurations whose options cannot change the result share a
  lane. The scan walks the trace in
  fixed-length chunks (the host loop over chunks only drives the progress report), so a long
  trace compiles once.
- **Several devices**: the configuration axis is sharded across them with ``jax.sharding`` (a
  1-D mesh named ``"configs"``, padded to a multiple of the device count).
- **Several cores** of one CPU device: a group's lanes are dealt into equal shares, one host
  thread each, all running the same compiled program (XLA releases the GIL while it runs), and
  rules every lane shares are compiled in rather than traced.
- **The bounds** next to each result: Belady's offline optimum for the same pool (a bound for
  ``full`` rows), the bypass optimum (a miss may be served without being admitted: a bound for
  every row) and the stationary per-layer oracle of docs/semantics.md §5.10 (all from
  :mod:`pallas_cache.sizing.bounds`), computed on a second thread while the compiled scan runs.
- **The cost model** of docs/semantics.md §11: the scan counts how many calls had each
  ``(fetched, cpu_experts)`` pair (exact integers, inside the compiled loop), from which
  :mod:`pallas_cache.sizing.cost` derives bytes and modeled milliseconds per token.

``hit_rate`` is ``1 - missing / active``, counted per layer-call over distinct experts, exactly as
the cache's own stats (docs/semantics.md §5.9). The padding calls of the last chunk are layer ``-1`` calls,
which the cache refuses with ``ERR_LAYER`` and which therefore change nothing and count nothing.

(Why one module of ~400 lines: the configuration grid, the compiled chunk program, the device
sharding and the per-configuration results are one pipeline; about half is docstrings.)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
import queue
import threading
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_cache.sizing import bounds as belady_lib
from pallas_cache.sizing.bounds import bypass_optimum
from pallas_cache.sizing.cost import CostModel
from pallas_cache.sizing.progress import Progress, as_progress
from pallas_cache.evictions import Eviction, check_admission
from pallas_cache.ops import Rules, ensure_with_rules  # the core, with order/admission as data
from pallas_cache.policy import ONE, Admission, FetchOrder, FetchPolicy
from pallas_cache.state import init
from pallas_cache.sizing.traces import Trace
from pallas_cache.validate import is_int

__all__ = ["ReplayConfig", "ReplayResult", "parse_policy", "replay", "config_grid",
           "auto_cache_sizes", "capacity_buckets", "precompile"]

#: Layer-calls per compiled chunk: long enough that dispatch is noise, short enough for progress.
DEFAULT_CHUNK_CALLS = 2048
#: A bucket's largest size is at most this factor above its smallest (see capacity_buckets).
DEFAULT_BUCKET_RATIO = 8.0


def parse_policy(text: str) -> FetchPolicy:
    """``"full"``, ``"fraction:Q"`` or ``"cap:N"`` -> :class:`FetchPolicy` (raises ValueError)."""
    kind, _, value = str(text).partition(":")
    try:
        if kind == "full" and not value:
            return FetchPolicy.full()
        if kind == "fraction" and value:
            return FetchPolicy.fraction(float(value))
        if kind == "cap" and value:
            return FetchPolicy.fixed_cap(int(value))
    except (TypeError, ValueError) as error:
        raise ValueError(f"bad policy {text!r}: {error}") from None
    raise ValueError(f"bad policy {text!r}: expected full, fraction:Q (0 <= Q <= 1) or cap:N")


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """One cache configuration of a sweep.

    Attributes:
      cache_size: ``S``, device slots shared by all layers (``>= E``).
      policy: ``"full"``, ``"fraction:Q"`` or ``"cap:N"`` (see :func:`parse_policy`).
      order: ``"recency"`` or ``"lowest_id"``.
      admission: ``"promote_one"``, ``"none"`` or ``"reuse"``.
      eviction: ``"lru"``, ``"pair_lfu"``, ``"route_knn"`` or ``"route_lfu"`` (docs/semantics.md
        §5.16, the default ring of 128 tokens); ``reuse`` needs ``lru``.
    """

    cache_size: int
    policy: str = "fraction:0.4"
    order: str = "recency"
    admission: str = "promote_one"
    eviction: str = "lru"

    def __post_init__(self):
        parse_policy(self.policy)
        FetchOrder.coerce(self.order)
        check_admission(Eviction.coerce(self.eviction),
                        Admission.coerce(self.admission) is Admission.REUSE)
        if not is_int(self.cache_size):
            raise TypeError(f"cache_size must be an int, got {self.cache_size!r}")


def config_grid(cache_sizes: Iterable[int], policies: Iterable[str], orders: Iterable[str] = ("recency",),
                admissions: Iterable[str] = ("promote_one",),
                evictions: Iterable[str] = ("lru",)) -> list[ReplayConfig]:
    """The cartesian product, cache size slowest, as a list of configurations. A non-LRU
    eviction is not combined with ``reuse`` (which it refuses, docs/semantics.md §5.16)."""
    return [
        ReplayConfig(int(size), policy, order, admission, eviction)
        for size in cache_sizes for eviction in evictions for policy in policies
        for order in orders for admission in admissions
        if Eviction.coerce(eviction) is Eviction.LRU
        or Admission.coerce(admission) is not Admission.REUSE
    ]


def auto_cache_sizes(num_layers: int, num_experts: int, top_k: int) -> list[int]:
    """The ``--cache-size auto`` grid (docs/semantics.md §11.3): from ``max(E, L*k)`` up to ``L*E``
    in steps of x sqrt(2), each rounded half up to whole slots, plus ``L*E`` itself.

    ``L*k`` bounds one token's working set (``k = min(top_k, E)``); below it global LRU thrashes
    on the cyclic layer sweep, so the grid starts there.
    """
    total = num_layers * num_experts
    start = max(num_experts, num_layers * min(top_k, num_experts))
    sizes, step = [], 0
    while True:
        size = math.floor(start * math.sqrt(2) ** step + 0.5)
        if size >= total:
            break
        if not sizes or size > sizes[-1]:
            sizes.append(size)
        step += 1
    return sizes + [total]


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    """What one configuration did over the whole trace.

    Attributes:
      calls: layer-calls replayed. routes: non-padding routes (duplicates counted).
      active / missing / fetched: the cache's counters (distinct experts per call).
      cpu_routes: routes the CPU computed (hybrid misses not fetched; duplicates counted).
      empty_slots: slots never filled (or emptied) at the end of the trace.
      hit_rate: ``1 - missing / active``. belady_hit_rate: the offline optimum at this size when
        every miss is admitted (bounds ``full`` rows only: a hybrid row may beat it).
      bypass_optimum_hit_rate: the offline optimum when a miss may be served without being
        admitted (bounds every row).
      oracle_hit_rate: the stationary per-layer oracle at this size (mean over routed layers; it
        grants every layer at least one slot, so below ``S = L`` it uses more than ``S``).
      tokens: decode tokens of the trace (distinct (sequence, token) pairs).
      cpu_experts: distinct experts the CPU computed, summed over calls (``missing - fetched``).
      fetched_per_token / cpu_experts_per_token: ``fetched / tokens``, ``cpu_experts / tokens``.
      pair_counts: ``(fetched, cpu_experts, calls)`` for every per-call pair that occurred:
        exact, and enough to model any bandwidths (docs/semantics.md §11.2).
      cache_bytes: ``S * W`` (``None`` without ``W``; likewise the per-token bytes).
      fetched_bytes_per_token / cpu_bytes_per_token: ``fetched * W / tokens``,
        ``cpu_experts * W / tokens``.
      modeled_ms_per_token: docs/semantics.md §11.2's time (``None`` without both bandwidths).
      best: the lowest modeled ms/token among the rows of its cache size (ties all true; ``None``
        when untimed).
      budget_best: the lowest modeled ms/token among all rows whose ``cache_bytes`` fits the
        device budget (``None`` without a budget).
      note: why the row is flagged (semicolon-separated), else empty.
    """

    cache_size: int
    policy: str
    order: str
    admission: str
    calls: int
    routes: int
    active: int
    missing: int
    fetched: int
    cpu_routes: int
    empty_slots: int
    hit_rate: float
    belady_hit_rate: float | None
    bypass_optimum_hit_rate: float | None
    oracle_hit_rate: float | None
    tokens: int = 0
    cpu_experts: int = 0
    fetched_per_token: float = 0.0
    cpu_experts_per_token: float = 0.0
    pair_counts: tuple = ()
    cache_bytes: int | None = None
    fetched_bytes_per_token: float | None = None
    cpu_bytes_per_token: float | None = None
    modeled_ms_per_token: float | None = None
    best: bool | None = None
    budget_best: bool | None = None
    note: str = ""
    eviction: str = "lru"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def capacity_buckets(sizes: Sequence[int], ratio: float = DEFAULT_BUCKET_RATIO) -> list[list[int]]:
    """The ascending ``sizes`` cut into buckets that each run as one compiled program at the
    capacity of their largest size: a bucket starts at its smallest size and takes every next
    size up to ``ratio`` times it. A lane pays for the whole capacity (the victim search reads
    every slot, masked), but that part of its step grows slowly (the two-level search) beside
    the step's fixed per-call costs: measured on the 48 x 128 geometry, a 256-slot lane costs
    about the same in a 2048-slot program as in its own, so the default ratio 8 runs a
    256/1024/2048 sweep as one program and saves a compile (benchmarks/RESULTS.md, sweep_2m);
    past it a bucket still bounds the waste at the cost of one compile (docs/design.md)."""
    buckets: list[list[int]] = []
    for size in sorted(set(sizes)):
        if buckets and size <= ratio * buckets[-1][0]:
            buckets[-1].append(size)
        else:
            buckets.append([size])
    return buckets


@dataclasses.dataclass(frozen=True)
class _LaneKey:
    """What a configuration's lane computes: configurations with equal keys give equal results."""

    cache_size: int
    fraction16: int
    cap: int
    order: str
    admission: str
    eviction: str = Eviction.LRU.value


def _lane_key(config: ReplayConfig) -> _LaneKey:
    """The configuration with every option that cannot change its result normalised away.

    The policy as its fixed-point values (``fraction:1`` is ``full``; the cap is ignored beside a
    fraction). The admission rule acts only with RECENCY and a fraction strictly between 0 and 1
    (docs/semantics.md §5.5): with ``f == 0`` it never acts, and with ``full`` (``F = M``)
    PROMOTE_ONE needs ``F == 0 < M`` and REUSE only looks past ``F = M``. The order is kept even
    with ``full``: it decides which of a step's installs takes which slot, so which of them a
    later tie on usage evicts (tests/test_replay_compiles.py has a trace where it matters).
    """
    policy = parse_policy(config.policy)
    fraction16, cap = int(policy.fraction16), int(policy.cap)
    order = FetchOrder.coerce(config.order)
    admission = Admission.coerce(config.admission)
    if fraction16 > 0:
        cap = 0
    if order is not FetchOrder.RECENCY or fraction16 in (0, ONE):
        admission = Admission.NONE
    return _LaneKey(config.cache_size, fraction16, cap, order.value, admission.value,
                    Eviction.coerce(config.eviction).value)


def _stack(trees):
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


@functools.lru_cache(maxsize=None)
def _program(lru: bool = True, platform: str = "cpu", fixed: tuple = ()):
    """The jitted chunk program: every lane of one bucket (and eviction policy, a static part of
    the state) over one chunk of calls. ``lru=False``: the REUSE path, which a non-LRU eviction
    refuses, is left out (no lane of such a group runs it). ``platform``: the devices' platform
    (``"cpu"`` adds XLA:CPU options). ``fixed``: ``(field, bool)`` pairs of the :class:`Rules`
    fields every lane shares (:func:`_fixed_rules`), compiled in as Python bools so the paths no
    lane takes are not even traced (a sweep of RECENCY lanes without REUSE runs no REUSE code);
    the lanes' traced values of those fields are ignored.

    Args (of the returned function): ``(states, cpu_routes, pairs, policies, rules)`` batched
    over the configurations, and the chunk's ``layers [C]`` and ``routes [C, K]``. ``pairs``
    is int32 ``[K'+1, K'+1]`` per configuration: accepted calls by ``(fetched, cpu_experts)``.
    """

    def one_cache(state, cpu_routes, pairs, policy, rules, layers, routes):
        def call(carry, layer_routes):
            state, cpu_routes, pairs = carry
            layer, route = layer_routes
            lane_rules = rules.replace(**dict(fixed))
            if not lru:
                lane_rules = lane_rules.replace(reuse=False)
            state, plan = ensure_with_rules(state, layer, route, policy, lane_rules, backend="xla")
            # The cost model's per-call pair (docs/semantics.md §11.2); refused calls add nothing.
            pairs = pairs.at[plan.fetched, plan.missing - plan.fetched].add(
                (plan.error == 0).astype(jnp.int32))
            return (state, cpu_routes + jnp.sum(plan.cpu, dtype=jnp.int32), pairs), None

        # Unrolling amortises XLA:CPU's per-iteration loop overhead (measured: ~1.4x at unroll 4).
        (state, cpu_routes, pairs), _ = lax.scan(
            call, (state, cpu_routes, pairs), (layers, routes), unroll=4)
        return state, cpu_routes, pairs

    def _replay_chunk(configs, layers, routes):
        states, cpu_routes, pairs, policies, rules = configs
        states, cpu_routes, pairs = jax.vmap(one_cache, in_axes=(0, 0, 0, 0, 0, None, None))(
            states, cpu_routes, pairs, policies, rules, layers, routes)
        return states, cpu_routes, pairs, policies, rules

    # XLA:CPU's default copy insertion keeps about five full copies of the state's [lanes, L*E]
    # and [lanes, C] arrays per scanned call (each in-place update of a buffer another op of the
    # step still reads); its region analysis proves them unnecessary and removes them all, a
    # quarter to a third of the step (benchmarks/RESULTS.md, sweep_2m). Same program, same
    # results; a CPU-only option, so other backends compile as before.
    options = _CPU_OPTIONS if platform == "cpu" else None
    return jax.jit(_replay_chunk, donate_argnums=0, compiler_options=options)


def _fixed_rules(rules: Sequence[Rules]) -> tuple:
    """The ``(field, bool)`` pairs of the :class:`Rules` fields on which every lane agrees."""
    fields = [field.name for field in dataclasses.fields(Rules)]
    return tuple((name, getattr(rules[0], name)) for name in fields
                 if len({getattr(lane, name) for lane in rules}) == 1)


#: XLA options of the CPU chunk program (see :func:`_program`).
_CPU_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


def _usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _shard(tree, mesh):
    if mesh is None:
        return tree
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec("configs")))


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
    devices, mesh, width, threads = _placement(devices, threads)
    report = as_progress(progress)

    layers, routes = trace.to_array()
    num_calls = layers.shape[0]
    num_chunks = -(-num_calls // chunk_calls)
    padded = num_chunks * chunk_calls
    layers = np.concatenate([layers.astype(np.int32), np.full(padded - num_calls, -1, np.int32)])
    routes = np.concatenate(
        [routes.astype(np.int32), np.full((padded - num_calls, routes.shape[1]), -1, np.int32)])
    num_routes = int((routes >= 0).sum())
    pair_side = min(trace.top_k, trace.num_experts) + 1  # fetched, cpu_experts in [0, K']

    keys = [_lane_key(config) for config in configs]
    sizes = sorted({c.cache_size for c in configs})
    groups = _groups(keys, bucket_ratio)
    programs = len(groups)
    report.phase(f"compiling {programs} program{'s' if programs != 1 else ''} for "
                 f"{len(configs)} configuration{'s' if len(configs) != 1 else ''} "
                 f"({num_calls} layer-calls)...", num_chunks * programs)
    # The offline optima need only the trace: they run on a second thread while the scan runs
    # (pure Python holding the GIL, against compiled XLA code that releases it), so on two cores
    # they cost no wall time; their progress is replayed as its own phase after the scan. The
    # thread starts once every program is compiled: tracing is Python too, and would share the
    # GIL with it (measured: the first compile took twice as long).
    optima: list = []

    def start_optima():
        if bounds:
            optima.append(_OptimaThread(trace, sizes))

    try:
        results = _replay_groups(trace, configs, keys, groups, layers, routes, num_calls,
                                 num_chunks, chunk_calls, num_routes, pair_side, mesh, width,
                                 report, devices[0].platform, start_optima, threads)
    except BaseException:
        for thread in optima:
            thread.cancel()
        raise
    ordered = [results[i] for i in range(len(configs))]
    for thread in optima:
        # The bounds depend on the size only: computed once per size, whatever the evictions.
        bound_rows = thread.report_to(report)
        ordered = [dataclasses.replace(r, **bound_rows[r.cache_size]) for r in ordered]
    report.close()
    return _with_costs(ordered, cost)


def _replay_groups(trace, configs, keys, groups, layers, routes, num_calls, num_chunks,
                   chunk_calls, num_routes, pair_side, mesh, width, report, platform, compiled,
                   threads):
    """The scan of :func:`replay`: ``{config index: ReplayResult}`` without the bounds.

    Every group's first chunk runs first (each compiles its program), then ``compiled()`` is
    called, then the groups' other chunks run, one group after the other. With ``threads > 1``
    a group's lanes are dealt into that many equal parts, each run by its own host thread
    through the same compiled program (:func:`_run_parts`).
    """
    num_tokens = trace.num_tokens
    results: dict[int, ReplayResult] = {}
    done = 0

    def run(program, batch, chunk, status=None):
        """One chunk of one part; ``status``: report it (the main thread's part only)."""
        nonlocal done
        window = slice(chunk * chunk_calls, (chunk + 1) * chunk_calls)
        chunk_layers, chunk_routes = jnp.asarray(layers[window]), jnp.asarray(routes[window])
        batch = _executable(program, batch, chunk_layers, chunk_routes)(
            batch, chunk_layers, chunk_routes)
        if status is not None:
            done += 1
            report.update(done, f"{status} calls {min((chunk + 1) * chunk_calls, num_calls)}"
                                f"/{num_calls}")
        return batch

    started = []
    for bucket, eviction in groups:
        unique, batches, program = _group(trace.num_layers, trace.num_experts, pair_side, bucket,
                                          eviction, keys, width, threads, mesh, platform)
        status = "cache_size=" + ",".join(str(size) for size in bucket) + (
            "" if eviction == Eviction.LRU.value else f" eviction={eviction}")
        batches[0] = run(program, batches[0], 0, status)  # compiles the group's program
        started.append([bucket, eviction, unique, program, batches, status])
    compiled()
    for entry in started:
        bucket, eviction, unique, program, batches, status = entry
        entry[4] = None  # the group's state lives in `batches` only (donated chunk by chunk)
        batches = _run_parts(run, program, batches, num_chunks, status)
        states, cpu_routes, pairs = jax.tree.map(
            lambda *parts: np.concatenate(parts), *(jax.device_get(b[:3]) for b in batches))
        for index, config in enumerate(configs):
            key = keys[index]
            if key.cache_size not in bucket or key.eviction != eviction:
                continue
            row = unique.index(key)
            size = key.cache_size
            calls, active, missing, fetched = (int(v) for v in states.stats[row].sum(axis=0))
            fetched_of, cpu_of = np.nonzero(pairs[row])
            results[index] = ReplayResult(
                cache_size=size,
                policy=config.policy,
                order=FetchOrder.coerce(config.order).value,
                admission=Admission.coerce(config.admission).value,
                calls=calls,
                routes=num_routes,
                active=active,
                missing=missing,
                fetched=fetched,
                cpu_routes=int(cpu_routes[row]),
                # Usable slots only: those past the lane's size are neither empty nor full.
                empty_slots=int((states.id_of_slot[row][:size] < 0).sum()),
                hit_rate=1.0 - missing / active if active else 1.0,
                belady_hit_rate=None,
                bypass_optimum_hit_rate=None,
                oracle_hit_rate=None,
                tokens=num_tokens,
                cpu_experts=missing - fetched,
                fetched_per_token=fetched / max(num_tokens, 1),
                cpu_experts_per_token=(missing - fetched) / max(num_tokens, 1),
                pair_counts=tuple((int(f), int(c), int(pairs[row][f, c]))
                                  for f, c in zip(fetched_of, cpu_of)),
                note=_note(size, trace),
                eviction=eviction,
            )
    return results


def _placement(devices, threads):
    """``(devices, mesh, width, threads)`` of a replay: the mesh over several devices (``None``
    for one), the lane multiple it needs, and the host threads (see :func:`replay`)."""
    devices = list(devices) if devices is not None else jax.devices()
    mesh = Mesh(np.array(devices), ("configs",)) if len(devices) > 1 else None
    width = len(devices) if mesh is not None else 1
    if threads is None:
        threads = _usable_cores() if mesh is None and devices[0].platform == "cpu" else 1
    elif not is_int(threads) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    return devices, mesh, width, threads


def _groups(keys, bucket_ratio):
    """One compiled program per (bucket of sizes, eviction): the capacity is a shape and the
    eviction policy static metadata of the state (docs/semantics.md §5.16), so each pair is its
    own program; sizes, policies, orders and admissions are lanes."""
    buckets = capacity_buckets(sorted({key.cache_size for key in keys}), bucket_ratio)
    return [(bucket, eviction) for bucket in buckets for eviction in
            sorted({key.eviction for key in keys if key.cache_size in bucket})]


def _group(num_layers, num_experts, pair_side, bucket, eviction, keys, width, threads, mesh,
           platform):
    """``(unique lanes, batches, program)`` of one group: its initial batches, one per host
    thread's share of the lanes, and the compiled program they all run.

    One program for every size of the bucket: the capacity is its largest size, each lane has
    its own traced usable size (docs/semantics.md §5.15), and configurations that cannot differ
    share a lane.
    """
    capacity = bucket[-1]
    unique = list(dict.fromkeys(key for key in keys
                                if key.cache_size in bucket and key.eviction == eviction))
    parts = min(threads, len(unique))
    # Pad to equal parts, each a multiple of the devices (one program for all the parts).
    count = -(-len(unique) // (width * parts)) * width * parts
    lanes = unique + [unique[-1]] * (count - len(unique))
    rules = [Rules.of(True, key.order, key.admission) for key in lanes]
    per_part = count // parts
    batches = [_shard((
        _stack([init(num_layers, num_experts, key.cache_size, capacity=capacity,
                     eviction=eviction) for key in part]),
        jnp.zeros(per_part, jnp.int32),
        jnp.zeros((per_part, pair_side, pair_side), jnp.int32),
        _stack([FetchPolicy(jnp.int32(key.fraction16), jnp.int32(key.cap)) for key in part]),
        _stack(rules[start:start + per_part]),
    ), mesh) for start in range(0, count, per_part) for part in [lanes[start:start + per_part]]]
    program = _program(eviction == Eviction.LRU.value, platform, _fixed_rules(rules))
    return unique, batches, program


def precompile(num_layers: int, num_experts: int, top_k: int, configs: Sequence[ReplayConfig],
               *, chunk_calls: int = DEFAULT_CHUNK_CALLS,
               devices: Sequence[jax.Device] | None = None,
               bucket_ratio: float = DEFAULT_BUCKET_RATIO, threads: int | None = None) -> None:
    """Compile the programs :func:`replay` runs for ``configs`` on a trace of this geometry
    (``top_k`` route columns), with the same options, so that the replay compiles nothing.

    Meant for a second thread while the trace is read or generated: XLA compiles without the
    GIL, so the compile and the trace overlap (the CLI does this for a synthetic trace). Join
    the thread before calling :func:`replay`: a replay started while its program is still
    compiling compiles it again.
    """
    keys = [_lane_key(config) for config in configs]
    devices, mesh, width, threads = _placement(devices, threads)
    layers = jnp.zeros((chunk_calls,), jnp.int32)
    routes = jnp.zeros((chunk_calls, top_k), jnp.int32)
    for bucket, eviction in _groups(keys, bucket_ratio):
        _, batches, program = _group(num_layers, num_experts, min(top_k, num_experts) + 1,
                                     bucket, eviction, keys, width, threads, mesh,
                                     devices[0].platform)
        _executable(program, batches[0], layers, routes)


#: Compiled chunk programs by (program, argument signature), the most recent few: what
#: :func:`precompile` compiles and the replay runs. (A jitted function's own cache is not
#: filled by an ahead-of-time compile on every JAX version, nor under every context.)
_EXECUTABLES: collections.OrderedDict = collections.OrderedDict()
_EXECUTABLES_KEPT = 4
_EXECUTABLES_LOCK = threading.Lock()


def _executable(program, batch, layers, routes):
    """The compiled ``program`` for these arguments' shapes, dtypes and shardings."""
    leaves, tree = jax.tree.flatten((batch, layers, routes))
    key = (program, tree, tuple((leaf.shape, leaf.dtype, leaf.sharding) for leaf in leaves))
    with _EXECUTABLES_LOCK:
        found = _EXECUTABLES.get(key)
        if found is not None:
            _EXECUTABLES.move_to_end(key)
            return found
    found = program.trace(batch, layers, routes).lower().compile()
    with _EXECUTABLES_LOCK:
        _EXECUTABLES[key] = found
        while len(_EXECUTABLES) > _EXECUTABLES_KEPT:
            _EXECUTABLES.popitem(last=False)
    return found


def _run_parts(run, program, batches, num_chunks, status):
    """Run the parts of one group to the end of the trace: part 0 on this thread (from its
    second chunk, reporting), every other part on a host thread of its own (from its first).

    The parts share the compiled ``program``; XLA releases the GIL while a chunk runs, so on a
    multi-core CPU the parts' scans run side by side. Lanes never interact, so the results are
    those of one program over all the lanes. An error in any part is raised here, after every
    part has stopped.
    """
    errors: list = []
    stop = threading.Event()

    def work(index):
        try:
            batch = batches[index]
            for chunk in range(num_chunks):
                if stop.is_set():
                    return
                # Waiting for each chunk keeps the thread from queueing the whole trace ahead,
                # so a failure or Ctrl-C on the main thread stops it within a chunk.
                batch = jax.block_until_ready(run(program, batch, chunk))
            batches[index] = batch
        except BaseException as error:  # noqa: BLE001 - raised on the calling thread
            errors.append(error)

    workers = [threading.Thread(target=work, args=(index,), daemon=True,
                                name=f"pallas-cache-lanes-{index}")
               for index in range(1, len(batches))]
    for worker in workers:
        worker.start()
    try:
        batch = batches[0]
        for chunk in range(1, num_chunks):
            if errors:  # a part failed: stop this one too, and raise its error below
                break
            batch = run(program, batch, chunk, status)
        batches[0] = batch
    except BaseException:
        stop.set()
        raise
    finally:
        for worker in workers:
            worker.join()
    if errors:
        raise errors[0]
    return batches


class _Cancelled(Exception):
    """Raised inside the optima thread when the replay failed and no one will read them."""


class _OptimaThread:
    """The three bounds of every size, computed on a background thread.

    The thread queues each progress event; :meth:`report_to` replays them, in order, as one
    phase of ``report`` (the same events a sequential pass would report, so a terminal bar and a
    log read the same), then returns ``{size: {bound field: hit rate}}`` or raises what the
    thread raised.
    """

    def __init__(self, trace: Trace, sizes: list[int]):
        self.sizes = sizes
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False
        self.thread = threading.Thread(target=self._run, args=(trace,), daemon=True,
                                       name="pallas-cache-optima")
        self.thread.start()

    def cancel(self) -> None:
        self.cancelled = True

    def _update(self, done: int, status: str) -> None:
        if self.cancelled:
            raise _Cancelled
        self.events.put(("update", done, status))

    def _run(self, trace: Trace) -> None:
        try:
            optima = {}
            for index, size in enumerate(self.sizes):
                hit_rates = []
                for step, (name, bound) in enumerate((("belady", belady_lib.belady),
                                                      ("bypass optimum", bypass_optimum))):
                    base = 1000 * (2 * index + step)
                    status = f"{name} cache_size={size}"
                    hit_rates.append(bound(trace, size, progress=lambda done, total: self._update(
                        base + 1000 * done // max(total, 1), status)).hit_rate)
                optima[size] = dict(
                    belady_hit_rate=hit_rates[0], bypass_optimum_hit_rate=hit_rates[1],
                    oracle_hit_rate=belady_lib.stationary_oracle(trace, size).mean_hit_rate)
            self.events.put(("done", optima, None))
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            self.events.put(("error", error, None))

    def report_to(self, report: Progress) -> dict:
        """Wait for the bounds, reporting their progress as one phase of ``report``."""
        passes = 2 * len(self.sizes)  # two optima per size (the oracle is a histogram: no time)
        report.phase(f"offline optima (Belady, bypass) for {len(self.sizes)} cache "
                     f"size{'s' if len(self.sizes) != 1 else ''}...", 1000 * passes)
        while True:
            kind, value, status = self.events.get()
            if kind == "update":
                report.update(value, status)
            elif kind == "error":
                raise value
            else:
                return value


def _note(size: int, trace: Trace) -> str:
    """Why a row of this size deserves a second look (docs/semantics.md §11.3), else ``""``."""
    num_layers, top_k = trace.num_layers, min(trace.top_k, trace.num_experts)
    notes = []
    if size < num_layers * top_k:
        notes.append(f"S < L*k = {num_layers * top_k}: LRU thrashes on the cyclic layer sweep")
    if size < num_layers:
        notes.append(f"oracle assumes 1 slot/layer = {num_layers} > S")
    return "; ".join(notes)


def _with_costs(results: list[ReplayResult], cost: CostModel | None) -> list[ReplayResult]:
    """Fill the cost model's fields (docs/semantics.md §11): bytes, modeled ms, best, budget."""
    if cost is None or cost.expert_bytes is None:
        return results
    width = cost.expert_bytes
    out = []
    for r in results:
        tokens = max(r.tokens, 1)
        ms = 1e3 * cost.seconds(r.pair_counts) / tokens if cost.timed else None
        out.append(dataclasses.replace(
            r, cache_bytes=r.cache_size * width,
            fetched_bytes_per_token=r.fetched * width / tokens,
            cpu_bytes_per_token=r.cpu_experts * width / tokens,
            modeled_ms_per_token=ms))
    if not cost.timed:
        return out
    fastest = {}
    for r in out:
        fastest[r.cache_size] = min(fastest.get(r.cache_size, math.inf), r.modeled_ms_per_token)
    out = [dataclasses.replace(r, best=r.modeled_ms_per_token == fastest[r.cache_size])
           for r in out]
    if cost.device_budget is not None:
        fits = [r.modeled_ms_per_token for r in out if r.cache_bytes <= cost.device_budget]
        floor = min(fits, default=None)
        out = [dataclasses.replace(r, budget_best=(r.cache_bytes <= cost.device_budget
                                                   and r.modeled_ms_per_token == floor))
               for r in out]
    return out
