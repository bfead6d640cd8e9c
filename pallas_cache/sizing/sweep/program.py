"""The replay's compiled chunk program: lane keys (configurations that cannot differ share a
lane), where the lanes run, the jitted, vmapped scan of one group of lanes over one chunk of
calls, the initial batches of a group, and the compiled executables kept for reuse."""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_cache.evictions import Eviction
from pallas_cache.ops import Rules, ensure_with_rules  # the core, with order/admission as data
from pallas_cache.policy import ONE, Admission, FetchOrder, FetchPolicy
from pallas_cache.sizing.sweep.records import ReplayConfig, capacity_buckets, parse_policy
from pallas_cache.state import init
from pallas_cache.validate import is_int

__all__ = ["LaneKey", "Placement", "chunk_program", "clear_compiled", "executable",
           "fixed_rules", "group_batches", "groups", "hit_index", "hit_table_size", "hit_triples",
           "lane_key", "placement"]


@dataclasses.dataclass(frozen=True)
class LaneKey:
    """What a configuration's lane computes: configurations with equal keys give equal results."""

    cache_size: int
    fraction16: int
    cap: int
    order: str
    admission: str
    eviction: str = Eviction.LRU.value


def lane_key(config: ReplayConfig) -> LaneKey:
    """The configuration with every option that cannot change its result normalised away.

    The policy as its fixed-point values (``fraction:1`` is ``full``; the cap is ignored beside a
    fraction). The admission rule acts only with RECENCY and a fraction strictly between 0 and 1
    (docs/semantics.md §5.5): with ``f == 0`` it never acts, and with ``full`` (``F = M``)
    PROMOTE_ONE needs ``F == 0 < M`` and REUSE only looks past ``F = M``. The order is kept even
    with ``full``: it decides which of a step's installs takes which slot, so which of them a
    later tie on usage evicts (tests/sizing/sweep/test_replay.py has a trace where it matters).
    """
    policy = parse_policy(config.policy)
    fraction16, cap = int(policy.fraction16), int(policy.cap)
    order = FetchOrder.coerce(config.order)
    admission = Admission.coerce(config.admission)
    if fraction16 > 0:
        cap = 0
    if order is not FetchOrder.RECENCY or fraction16 in (0, ONE):
        admission = Admission.NONE
    return LaneKey(config.cache_size, fraction16, cap, order.value, admission.value,
                   Eviction.coerce(config.eviction).value)


def _stack(trees):
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


@functools.lru_cache(maxsize=None)
def chunk_program(reuse: bool = True, platform: str = "cpu", fixed: tuple = ()):
    """The jitted chunk program: every lane of one bucket (and eviction policy, a static part of
    the state) over one chunk of calls. ``reuse=False``: the REUSE path, which the group's
    eviction refuses (its record's ``allows_reuse``), is left out. ``platform``: the devices'
    platform (``"cpu"`` adds XLA:CPU options). ``fixed``: ``(field, bool)`` pairs of the
    :class:`Rules` fields every lane shares (:func:`fixed_rules`), compiled in as Python bools so
    the paths no lane takes are not even traced (a sweep of RECENCY lanes without REUSE runs no
    REUSE code); the lanes' traced values of those fields are ignored.

    Args (of the returned function): ``(states, cpu_routes, pairs, policies, rules)`` batched
    over the configurations, and the chunk's ``layers [C]`` and ``routes [C, K]``. ``pairs``
    is int32 ``[K'+1, K'+1]`` per configuration: accepted calls by ``(fetched, cpu_experts)``;
    or int32 ``[hit_table_size(K')]``: by ``(hits, fetched, cpu_experts)`` at
    :func:`hit_index` (what the GPU-time model needs; its shape makes it another executable).
    """

    def one_cache(state, cpu_routes, pairs, policy, rules, layers, routes):
        def call(carry, layer_routes):
            state, cpu_routes, pairs = carry
            layer, route = layer_routes
            lane_rules = rules.replace(**dict(fixed))
            if not reuse:
                lane_rules = lane_rules.replace(reuse=False)
            state, plan = ensure_with_rules(state, layer, route, policy, lane_rules, backend="xla")
            # The cost model's per-call pair (docs/semantics.md §11.2); refused calls add nothing.
            # A packed table of (hits, fetched, cpu_experts) triples instead (§11.6).
            index = (plan.fetched, plan.missing - plan.fetched)
            if pairs.ndim == 1:
                index = hit_index(plan.active - plan.missing, *index)
            pairs = pairs.at[index].add((plan.error == 0).astype(jnp.int32))
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


#: The most distinct experts per call the packed table indexes in int32 (``n^3`` stays below
#: ``2^31``); its ``C(K'+3, 3)`` entries per lane are far past any memory limit before that.
MAX_HIT_DISTINCT = 1200


def hit_table_size(distinct: int) -> int:
    """Entries of the packed ``(hits, fetched, cpu_experts)`` table of calls that route at most
    ``distinct`` experts: the triples of sum at most ``K'``, ``C(K'+3, 3)`` (a sixth of a cube)."""
    return (distinct + 1) * (distinct + 2) * (distinct + 3) // 6


def hit_index(hits, fetched, cpu):
    """The packed table's entry of a triple (jnp or Python ints): the triples ordered by their
    sum ``n``, then ``hits``, then ``fetched``: ``C(n+2, 3) + hits*(n+1) - hits*(hits-1)/2 +
    fetched``. :func:`hit_triples` inverts it."""
    n = hits + fetched + cpu
    return n * (n + 1) * (n + 2) // 6 + hits * (n + 1) - hits * (hits - 1) // 2 + fetched


def hit_triples(indices) -> list[tuple[int, int, int]]:
    """The ``(hits, fetched, cpu_experts)`` triples of packed entries (see :func:`hit_index`)."""
    out = []
    for index in (int(i) for i in indices):
        n = 0
        while (n + 1) * (n + 2) * (n + 3) // 6 <= index:
            n += 1
        rest = index - n * (n + 1) * (n + 2) // 6
        hits = 0
        while rest >= n + 1 - hits:  # n + 1 - hits triples start with this many hits
            rest -= n + 1 - hits
            hits += 1
        out.append((hits, rest, n - hits - rest))
    return out


def fixed_rules(rules: Sequence[Rules]) -> tuple:
    """The ``(field, bool)`` pairs of the :class:`Rules` fields on which every lane agrees."""
    fields = [field.name for field in dataclasses.fields(Rules)]
    return tuple((name, getattr(rules[0], name)) for name in fields
                 if len({getattr(lane, name) for lane in rules}) == 1)


#: XLA options of the CPU chunk program (see :func:`chunk_program`).
_CPU_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a sweep's lanes run: the devices, the 1-D ``"configs"`` mesh over them (``None``
    for one device), the lane multiple the mesh needs, the host threads that share a group's
    lanes, and the devices' platform."""

    devices: tuple
    mesh: Mesh | None
    width: int
    threads: int

    @property
    def platform(self) -> str:
        return self.devices[0].platform


def placement(devices=None, threads=None) -> Placement:
    """The :class:`Placement` of a replay on ``devices`` (default: all local devices of the
    default backend) with ``threads`` host threads (``None``: the CPU cores this process may
    use, when the sweep runs on one CPU device, else one)."""
    devices = list(devices) if devices is not None else jax.devices()
    mesh = Mesh(np.array(devices), ("configs",)) if len(devices) > 1 else None
    width = len(devices) if mesh is not None else 1
    if threads is None:
        threads = _usable_cores() if mesh is None and devices[0].platform == "cpu" else 1
    elif not is_int(threads) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    return Placement(tuple(devices), mesh, width, threads)


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


def groups(keys, bucket_ratio):
    """One compiled program per (bucket of sizes, eviction): the capacity is a shape and the
    eviction policy static metadata of the state (docs/semantics.md §5.16), so each pair is its
    own program; sizes, policies, orders and admissions are lanes."""
    buckets = capacity_buckets(sorted({key.cache_size for key in keys}), bucket_ratio)
    return [(bucket, eviction) for bucket in buckets for eviction in
            sorted({key.eviction for key in keys if key.cache_size in bucket})]


def group_batches(num_layers, num_experts, pair_side, bucket, eviction, keys,
                  where: Placement, hit_counts: bool = False):
    """``(unique lanes, batches, program)`` of one group: its initial batches, one per host
    thread's share of the lanes, and the compiled program they all run. ``hit_counts``: count
    the calls by ``(hits, fetched, cpu_experts)`` (the packed table of :func:`hit_index`)
    instead of by ``(fetched, cpu_experts)``.

    One program for every size of the bucket: the capacity is its largest size, each lane has
    its own traced usable size (docs/semantics.md §5.15), and configurations that cannot differ
    share a lane.
    """
    capacity = bucket[-1]
    if hit_counts and pair_side - 1 > MAX_HIT_DISTINCT:
        raise ValueError(f"the GPU-time model counts calls of at most {MAX_HIT_DISTINCT} "
                         f"distinct experts; these calls route up to {pair_side - 1}")
    unique = list(dict.fromkeys(key for key in keys
                                if key.cache_size in bucket and key.eviction == eviction))
    parts = min(where.threads, len(unique))
    # Pad to equal parts, each a multiple of the devices (one program for all the parts).
    count = -(-len(unique) // (where.width * parts)) * where.width * parts
    lanes = unique + [unique[-1]] * (count - len(unique))
    rules = [Rules.of(hybrid=True, order=key.order, admission=key.admission) for key in lanes]
    per_part = count // parts
    batches = [_shard((
        _stack([init(num_layers, num_experts, key.cache_size, capacity=capacity,
                     eviction=eviction) for key in part]),
        jnp.zeros(per_part, jnp.int32),
        jnp.zeros((per_part,) + ((hit_table_size(pair_side - 1),) if hit_counts
                                 else (pair_side, pair_side)), jnp.int32),
        _stack([FetchPolicy(jnp.int32(key.fraction16), jnp.int32(key.cap)) for key in part]),
        _stack(rules[start:start + per_part]),
    ), where.mesh) for start in range(0, count, per_part)
        for part in [lanes[start:start + per_part]]]
    program = chunk_program(Eviction.coerce(eviction).policy.allows_reuse, where.platform,
                            fixed_rules(rules))
    return unique, batches, program


#: Compiled chunk programs by (program, argument signature), the most recent few: what
#: :func:`~pallas_cache.sizing.sweep.precompile` compiles and the replay runs. (A jitted
#: function's own cache is not filled by an ahead-of-time compile on every JAX version, nor
#: under every context.)
_EXECUTABLES: collections.OrderedDict = collections.OrderedDict()
_EXECUTABLES_KEPT = 4
_EXECUTABLES_LOCK = threading.Lock()


def executable(program, batch, layers, routes):
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


def clear_compiled() -> None:
    """Forget every chunk program and kept executable: the next replay compiles afresh."""
    chunk_program.cache_clear()
    with _EXECUTABLES_LOCK:
        _EXECUTABLES.clear()
