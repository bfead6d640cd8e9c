"""Replay a routing trace through many cache configurations at once, to size a cache.

The question every user of an offloaded MoE asks first is "how big must the cache be, and which
policy, for my model and my traffic?". The answer is a replay: feed the trace's layer-calls, in
order, to the cache and count what it would have fetched. This module runs that replay as
compiled JAX, for a whole grid of configurations:

- **One compiled, vmapped program per cache size.** The pool size is a shape, so each size
  compiles on its own. Within a size every configuration is one lane of a single ``jax.vmap``:
  the :class:`~pallas_cache.policy.FetchPolicy` is a traced pytree, and the fetch order and
  admission rule enter the cache's core as data (:class:`pallas_cache.ops.Rules` through
  :func:`pallas_cache.ops.ensure_with_rules`; the public ops take
  them as static options, which is what a decode loop wants). The scan walks the trace in
  fixed-length chunks (the host loop over chunks only drives the progress bar), so a long trace
  compiles once.
- **Several devices**: the configuration axis is sharded across them with ``jax.sharding`` (a
  1-D mesh named ``"configs"``, padded to a multiple of the device count).
- **The bounds** next to each result: Belady's offline optimum for the same pool (a bound for
  ``full`` rows), the bypass optimum (a miss may be served without being admitted: a bound for
  every row) and the stationary per-layer oracle of docs/semantics.md §5.10 (all from
  :mod:`pallas_cache.sizing.bounds`).
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

import dataclasses
import functools
import math
import sys
import time
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_cache.sizing import bounds as belady_lib
from pallas_cache.sizing.bounds import bypass_optimum
from pallas_cache.sizing.cost import CostModel
from pallas_cache.eviction import Eviction, check_admission
from pallas_cache.ops import Rules, ensure_with_rules  # the core, with order/admission as data
from pallas_cache.policy import Admission, FetchOrder, FetchPolicy
from pallas_cache.state import init
from pallas_cache.sizing.traces import Trace
from pallas_cache.validate import is_int

__all__ = ["ReplayConfig", "ReplayResult", "parse_policy", "replay", "config_grid",
           "auto_cache_sizes"]

#: Layer-calls per compiled chunk: long enough that dispatch is noise, short enough for progress.
DEFAULT_CHUNK_CALLS = 2048


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
      eviction: ``"lru"``, ``"pair_lfu"`` or ``"route_knn"`` (docs/semantics.md §5.15, its default
        ring of 128 tokens); ``reuse`` needs ``lru``.
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
    eviction is not combined with ``reuse`` (which it refuses, docs/semantics.md §5.15)."""
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


def _stack(trees):
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


@functools.lru_cache(maxsize=None)
def _program(lru: bool = True):
    """The jitted chunk program: every configuration of one cache size (and eviction policy,
    a static part of the state) over one chunk of calls. ``lru=False``: the REUSE path, which a
    non-LRU eviction refuses, is left out (no lane of such a group runs it).

    Args (of the returned function): ``(states, cpu_routes, pairs, policies, rules)`` batched
    over the configurations, and the chunk's ``layers [C]`` and ``routes [C, K]``. ``pairs``
    is int32 ``[K'+1, K'+1]`` per configuration: accepted calls by ``(fetched, cpu_experts)``.
    """

    def one_cache(state, cpu_routes, pairs, policy, rules, layers, routes):
        def call(carry, layer_routes):
            state, cpu_routes, pairs = carry
            layer, route = layer_routes
            lane_rules = rules if lru else rules.replace(reuse=False)
            state, plan = ensure_with_rules(state, layer, route, policy, lane_rules, backend="xla")
            # The cost model's per-call pair (docs/semantics.md §11.2); refused calls add nothing.
            pairs = pairs.at[plan.fetched, plan.missing - plan.fetched].add(
                (plan.error == 0).astype(jnp.int32))
            return (state, cpu_routes + jnp.sum(plan.cpu, dtype=jnp.int32), pairs), None

        # Unrolling amortises XLA:CPU's per-iteration loop overhead (measured: ~1.4x at unroll 4).
        (state, cpu_routes, pairs), _ = lax.scan(
            call, (state, cpu_routes, pairs), (layers, routes), unroll=4)
        return state, cpu_routes, pairs

    def run(configs, layers, routes):
        states, cpu_routes, pairs, policies, rules = configs
        states, cpu_routes, pairs = jax.vmap(one_cache, in_axes=(0, 0, 0, 0, 0, None, None))(
            states, cpu_routes, pairs, policies, rules, layers, routes)
        return states, cpu_routes, pairs, policies, rules

    return jax.jit(run, donate_argnums=0)


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
    progress: Callable[[str], None] | None = None,
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
      progress: called with a one-line status after each chunk (``None``: a bar on stderr when
        the replay runs longer than about two seconds; pass ``lambda s: None`` to silence).

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
    devices = list(devices) if devices is not None else jax.devices()
    mesh = Mesh(np.array(devices), ("configs",)) if len(devices) > 1 else None
    width = len(devices) if mesh is not None else 1
    report = progress if progress is not None else _StderrBar()

    layers, routes = trace.to_array()
    num_calls = layers.shape[0]
    num_chunks = -(-num_calls // chunk_calls)
    padded = num_chunks * chunk_calls
    layers = np.concatenate([layers.astype(np.int32), np.full(padded - num_calls, -1, np.int32)])
    routes = np.concatenate(
        [routes.astype(np.int32), np.full((padded - num_calls, routes.shape[1]), -1, np.int32)])
    num_routes = int((routes >= 0).sum())
    num_tokens = trace.num_tokens
    pair_side = min(trace.top_k, trace.num_experts) + 1  # fetched, cpu_experts in [0, K']

    results: dict[int, ReplayResult] = {}
    # One compiled program per (size, eviction): both are part of the state's structure.
    groups = sorted({(c.cache_size, Eviction.coerce(c.eviction).value) for c in configs})
    total_work = num_chunks * len(groups)
    done = 0
    bound_cache: dict[int, tuple] = {}
    for size, eviction in groups:
        members = [i for i, config in enumerate(configs) if config.cache_size == size
                   and Eviction.coerce(config.eviction).value == eviction]
        count = -(-len(members) // width) * width  # pad to a multiple of the devices
        lanes = members + [members[-1]] * (count - len(members))
        batch = (
            _stack([init(trace.num_layers, trace.num_experts, size, eviction=eviction)] * count),
            jnp.zeros(count, jnp.int32),
            jnp.zeros((count, pair_side, pair_side), jnp.int32),
            _stack([parse_policy(configs[i].policy) for i in lanes]),
            _stack([Rules.of(True, configs[i].order, configs[i].admission) for i in lanes]),
        )
        batch = _shard(batch, mesh)
        for chunk in range(num_chunks):
            window = slice(chunk * chunk_calls, (chunk + 1) * chunk_calls)
            batch = _program(eviction == Eviction.LRU.value)(
                batch, jnp.asarray(layers[window]), jnp.asarray(routes[window]))
            done += 1
            report(f"cache_size={size} eviction={eviction} calls {min((chunk + 1) * chunk_calls, num_calls)}/{num_calls}"
                   f" [{done}/{total_work}]")

        if not bounds:
            optimum = bypass = oracle = None
        elif size in bound_cache:
            optimum, bypass, oracle = bound_cache[size]
        else:
            optimum = belady_lib.belady(trace, size).hit_rate
            bypass = bypass_optimum(trace, size).hit_rate
            oracle = belady_lib.stationary_oracle(trace, size).mean_hit_rate
            bound_cache[size] = optimum, bypass, oracle
        states, cpu_routes, pairs = jax.device_get(batch[:3])
        for row, index in enumerate(members):
            calls, active, missing, fetched = (int(v) for v in states.stats[row].sum(axis=0))
            config = configs[index]
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
                empty_slots=int((states.id_of_slot[row] < 0).sum()),
                hit_rate=1.0 - missing / active if active else 1.0,
                belady_hit_rate=optimum,
                bypass_optimum_hit_rate=bypass,
                oracle_hit_rate=oracle,
                tokens=num_tokens,
                cpu_experts=missing - fetched,
                fetched_per_token=fetched / max(num_tokens, 1),
                cpu_experts_per_token=(missing - fetched) / max(num_tokens, 1),
                pair_counts=tuple((int(f), int(c), int(pairs[row][f, c]))
                                  for f, c in zip(fetched_of, cpu_of)),
                note=_note(size, trace),
                eviction=eviction,
            )
    if hasattr(report, "close"):
        report.close()
    return _with_costs([results[i] for i in range(len(configs))], cost)


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


class _StderrBar:
    """A one-line progress bar on stderr that only appears once a replay has run ~2 seconds."""

    def __init__(self, after_seconds: float = 2.0):
        self.start = time.perf_counter()
        self.after = after_seconds
        self.shown = False

    def __call__(self, status: str):
        if time.perf_counter() - self.start < self.after:
            return
        done, total = (int(x) for x in status.rsplit("[", 1)[1].rstrip("]").split("/"))
        filled = int(30 * done / total)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {status}   ")
        sys.stderr.flush()
        self.shown = True

    def close(self):
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
