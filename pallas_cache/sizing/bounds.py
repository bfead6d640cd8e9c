"""Offline bounds for a routing trace: Belady's optimum and the per-layer stationary oracle.

A replay says what hit rate a policy *gets* at a cache size; these say what is *possible*, so a
user can tell "the policy loses residency it could keep" from "the trace leaves nothing to keep":

* :func:`belady` -- the fewest misses any eviction policy could have on this trace under the
  cache's own constraints (docs/semantics.md §2, 5.2): one pool of ``S`` slots shared by all layers (flat id
  ``layer * E + expert``); each call must have all its distinct routed experts resident; every
  miss is fetched (pure-offload ``ensure``); an expert the current call needs is never evicted.
  On a miss with a full pool it evicts the resident whose next use (the next call routing it) is
  furthest away -- never used again counts as infinitely far. With requests grouped per call this
  greedy rule stays optimal (the usual exchange argument: swapping a furthest-use victim for any
  other choice never saves a miss); ``tests/test_belady.py`` checks it against an exhaustive
  search on small traces.
* :func:`stationary_oracle` -- docs/semantics.md §5.10's ``oracle_hit_at_slots``: with a fair share of
  ``S / L`` slots per layer and a fixed set of residents, the best hit share is the routing mass
  of each layer's hottest experts. It ignores time (no warm-up, no phases), so it is a different
  bound from Belady's, quoted the same way as the cache's skew report.

Counting matches the cache's stats exactly (docs/semantics.md §5.2 step 8): per layer-call over *distinct*
experts, ``-1`` padding ignored; ``active`` = distinct experts of the call, ``missing`` = those
not resident when the call starts. So ``belady(...).miss_rate`` is directly comparable with a
replayed cache's ``stats(state).miss_rate``.

Complexity: next uses are precomputed with one sort; the simulation keeps a max-heap keyed by
next use with lazy deletion (a stale entry is skipped when popped, and the heap is rebuilt from
the live entries whenever stale ones outnumber them, so it never exceeds ``O(L*E)`` entries): a
trace of ``N`` distinct routes costs ``O(N log(L*E))`` -- about 1-2 s on one CPU core for 48
layers x 128 experts x 2000 tokens x top-8 (768k routes).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import numpy as np

from pallas_cache.sizing.trace import Trace

__all__ = [
    "BeladyResult",
    "belady",
    "StationaryOracle",
    "stationary_oracle",
    "oracle_slots_for",
]


@dataclass(frozen=True, eq=False)
class BeladyResult:
    """Counters of Belady's optimal schedule, in the cache's stats vocabulary (docs/semantics.md §5.9).

    Rates with a zero denominator are ``0.0`` for ``miss_rate`` (as the cache's stats define it),
    hence ``1.0`` for ``hit_rate = 1 - miss_rate``.

    Attributes:
        cache_size: ``S``, the pool size simulated.
        num_layers: ``L``.
        num_experts: ``E``.
        calls: layer-calls replayed (padding-only calls included, as the cache counts them).
        active: distinct non-padding experts summed over calls.
        missing: distinct experts not resident at the start of their call (= fetched).
        layer_calls: int64 ``[L]``, calls per layer.
        layer_active: int64 ``[L]``, ``active`` per layer.
        layer_missing: int64 ``[L]``, ``missing`` per layer; sums to ``missing``.
    """

    cache_size: int
    num_layers: int
    num_experts: int
    calls: int
    active: int
    missing: int
    layer_calls: np.ndarray
    layer_active: np.ndarray
    layer_missing: np.ndarray

    @property
    def miss_rate(self) -> float:
        """``missing / active`` (0.0 when nothing was active)."""
        return self.missing / self.active if self.active else 0.0

    @property
    def hit_rate(self) -> float:
        """``1 - missing / active``: the best hit rate any policy could reach at this size."""
        return 1.0 - self.miss_rate

    @property
    def layer_miss_rate(self) -> np.ndarray:
        """float64 ``[L]``, per-layer ``missing / active`` (0.0 for a layer never active)."""
        active = self.layer_active.astype(np.float64)
        return np.divide(self.layer_missing, active, out=np.zeros_like(active),
                         where=active > 0)

    @property
    def layer_hit_rate(self) -> np.ndarray:
        """float64 ``[L]``, ``1 - layer_miss_rate``."""
        return 1.0 - self.layer_miss_rate

    def __repr__(self) -> str:
        return (f"BeladyResult(cache_size={self.cache_size}, calls={self.calls}, "
                f"active={self.active}, missing={self.missing}, "
                f"hit_rate={self.hit_rate:.4f})")


def belady(trace: Trace | tuple[Any, Any], cache_size: int, *,
           num_experts: int | None = None, num_layers: int | None = None) -> BeladyResult:
    """Replay a trace under Belady's furthest-next-use eviction: the fewest possible misses.

    Args:
        trace: a :class:`~pallas_cache.sizing.trace.Trace`, or a pair ``(layers, routes)`` of integer
            arrays ``[C]`` and ``[C, K]`` (``-1`` = padding), e.g. ``trace.to_array()``.
        cache_size: ``S``, slots in the shared pool; must be ``>= num_experts`` (the cache's own
            rule, docs/semantics.md §5.1, which also guarantees one call's experts always fit).
        num_experts: ``E`` for the array form (default: ``max route + 1``); must match the
            trace's when a trace is given.
        num_layers: ``L`` for the array form (default: ``max layer + 1``); likewise.

    Returns:
        The counters of the optimal schedule.

    Raises:
        ValueError: a cache size below ``E``, inconsistent geometry, or malformed arrays.
    """
    layers, routes, num_layers, num_experts = _coerce_trace(trace, num_layers, num_experts)
    if (not isinstance(cache_size, (int, np.integer)) or isinstance(cache_size, bool)
            or cache_size < num_experts):
        raise ValueError(f"cache_size must be an integer >= num_experts={num_experts} (the cache "
                         f"cannot hold one layer otherwise), got {cache_size!r}")
    slots = int(cache_size)
    calls = routes.shape[0]
    id_space = num_layers * num_experts

    # Distinct non-padding routes per call, in call order: (call, flat id) pairs.
    sorted_routes = np.sort(routes, axis=1)
    distinct = sorted_routes >= 0
    distinct[:, 1:] &= sorted_routes[:, 1:] != sorted_routes[:, :-1]
    call_of = np.nonzero(distinct)[0]
    flat_of = layers[call_of] * num_experts + sorted_routes[distinct]

    # Next use of each (call, flat) occurrence: the call of the next occurrence of the same id,
    # or `calls` (= never again, the furthest possible) for the last one.
    by_id = np.lexsort((call_of, flat_of))
    next_use = np.full(call_of.size, calls, dtype=np.int64)
    repeats = flat_of[by_id[1:]] == flat_of[by_id[:-1]]
    next_use[by_id[:-1][repeats]] = call_of[by_id[1:][repeats]]

    missed = _simulate(call_of, flat_of, next_use, calls, slots, id_space)

    layer_of = layers[call_of]
    layer_active = np.bincount(layer_of, minlength=num_layers).astype(np.int64)
    layer_missing = np.bincount(layer_of, weights=missed, minlength=num_layers).astype(np.int64)
    return BeladyResult(
        cache_size=slots, num_layers=num_layers, num_experts=num_experts, calls=int(calls),
        active=int(layer_active.sum()), missing=int(layer_missing.sum()),
        layer_calls=np.bincount(layers, minlength=num_layers).astype(np.int64),
        layer_active=layer_active, layer_missing=layer_missing)


def _simulate(call_of: np.ndarray, flat_of: np.ndarray, next_use: np.ndarray, calls: int,
              slots: int, id_space: int) -> np.ndarray:
    """The eviction loop; returns a 0/1 miss flag per (call, flat) occurrence.

    Heap entries are ints ``-(next_use * id_space + flat)``: a max-heap on next use (ties to the
    higher flat id -- any tie-break is optimal). An entry is live iff its flat id is resident with
    exactly that next use; any other entry is stale and skipped when popped.

    A call's evictions run *before* its own entries are refreshed, which is what keeps the call's
    experts safe without a check: a resident the call hits still carries next use == this call,
    smaller than that of every resident the call does not route (whose next use lies beyond
    this call), so the max-heap reaches all of those first -- and there are enough of them,
    because the call's distinct experts fit in the pool (``S >= E``).
    """
    flat_list = flat_of.tolist()
    next_list = next_use.tolist()
    bounds = np.searchsorted(call_of, np.arange(calls + 1)).tolist()
    resident_next = [-1] * id_space   # next use of a resident id; -1 = not resident
    missed = np.zeros(len(flat_list), dtype=np.float64)
    heap: list[int] = []
    push, pop = heapq.heappush, heapq.heappop
    resident = 0
    # Each compaction costs O(L*E) and removes at least `compact_above - S` stale entries.
    compact_above = 2 * max(slots, id_space) + 64
    for call in range(calls):
        start, stop = bounds[call], bounds[call + 1]
        misses = 0
        for i in range(start, stop):
            if resident_next[flat_list[i]] < 0:
                missed[i] = 1.0
                misses += 1
        evictions = resident + misses - slots
        for _ in range(evictions):  # no-op while the pool has room
            while True:
                victim_next, victim = divmod(-pop(heap), id_space)
                if resident_next[victim] == victim_next:
                    break  # live (stale entries fall through and are dropped)
            resident_next[victim] = -1
        resident += misses - max(0, evictions)
        for i in range(start, stop):  # install misses, refresh hits: both now used at `call`
            flat, upcoming = flat_list[i], next_list[i]
            resident_next[flat] = upcoming
            push(heap, -(upcoming * id_space + flat))
        if len(heap) > compact_above:  # drop stale entries: the heap stays O(L*E)
            heap = [-(upcoming * id_space + flat) for flat, upcoming in enumerate(resident_next)
                    if upcoming >= 0]
            heapq.heapify(heap)
    return missed


# ---- the stationary oracle ------------------------------------------------------------------


def oracle_slots_for(cache_size: int, num_layers: int) -> int:
    """``max(1, round_half_away_from_zero(S / L))`` in exact integer arithmetic (docs/semantics.md §5.10, 10).

    Args:
        cache_size: ``S >= 1``.
        num_layers: ``L >= 1``.

    Returns:
        Slots the oracle grants each layer (``S=5, L=2`` gives 3, where half-to-even gives 2).
    """
    return max(1, (2 * int(cache_size) + int(num_layers)) // (2 * int(num_layers)))


@dataclass(frozen=True, eq=False)
class StationaryOracle:
    """The per-layer stationary oracle of docs/semantics.md §5.10, for one cache size.

    Attributes:
        cache_size: ``S``.
        slots_per_layer: ``S / L``, unrounded.
        oracle_slots: ``max(1, round_half_away_from_zero(S / L))``.
        routed_layers: int ``[R]``, layers with at least one route (others are absent, not 0).
        hit_rate: float64 ``[R]``, each routed layer's share of routing mass (duplicates
            counted, padding ignored) held by its ``oracle_slots`` hottest experts.
        mean_hit_rate: mean of ``hit_rate`` over routed layers.
    """

    cache_size: int
    slots_per_layer: float
    oracle_slots: int
    routed_layers: np.ndarray
    hit_rate: np.ndarray
    mean_hit_rate: float


def stationary_oracle(trace: Trace, cache_size: int) -> StationaryOracle:
    """The best hit share of a fixed per-layer resident set of ``S / L`` slots (docs/semantics.md §5.10).

    Args:
        trace: the trace; its ``num_layers`` sets ``L``.
        cache_size: ``S >= 1``.

    Returns:
        The oracle report (float64).

    Raises:
        ValueError: a cache size below 1, or a trace with no non-padding route.
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"stationary_oracle needs a Trace, got {type(trace).__name__}")
    if (not isinstance(cache_size, (int, np.integer)) or isinstance(cache_size, bool)
            or cache_size < 1):
        raise ValueError(f"cache_size must be a positive integer, got {cache_size!r}")
    num_layers = trace.num_layers
    oracle_slots = oracle_slots_for(cache_size, num_layers)
    histogram = trace.routing_histogram()
    routed_per_layer = histogram.sum(axis=1)
    routed_layers = np.flatnonzero(routed_per_layer)
    if routed_layers.size == 0:
        raise ValueError(f"{trace.source}: no non-padding route, no oracle to compute")
    hottest_first = -np.sort(-histogram[routed_layers], axis=1)
    head = hottest_first[:, :oracle_slots].sum(axis=1)
    hit_rate = head.astype(np.float64) / routed_per_layer[routed_layers].astype(np.float64)
    return StationaryOracle(cache_size=int(cache_size),
                            slots_per_layer=int(cache_size) / num_layers,
                            oracle_slots=oracle_slots, routed_layers=routed_layers,
                            hit_rate=hit_rate, mean_hit_rate=float(hit_rate.mean()))


# ---- input handling -------------------------------------------------------------------------


def _coerce_trace(trace: Trace | tuple[Any, Any], num_layers: int | None,
                  num_experts: int | None) -> tuple[np.ndarray, np.ndarray, int, int]:
    """``(layers int64 [C], routes int64 [C, K], L, E)`` from a Trace or a (layers, routes) pair."""
    if isinstance(trace, Trace):
        for name, given, own in (("num_layers", num_layers, trace.num_layers),
                                 ("num_experts", num_experts, trace.num_experts)):
            if given is not None and given != own:
                raise ValueError(f"{name}={given} contradicts the trace's {name}={own}")
        return (trace.layers.astype(np.int64), trace.routes.astype(np.int64),
                trace.num_layers, trace.num_experts)
    try:
        layers_in, routes_in = trace
    except (TypeError, ValueError):
        raise TypeError(f"expected a Trace or a (layers, routes) pair, got "
                        f"{type(trace).__name__}") from None
    layers, routes = np.asarray(layers_in), np.asarray(routes_in)
    if routes.ndim != 2 or layers.shape != routes.shape[:1] or routes.shape[0] == 0 \
            or routes.shape[1] == 0:
        raise ValueError(f"expected layers [C] and routes [C, K] with C, K >= 1, got shapes "
                         f"{layers.shape} and {routes.shape}")
    for name, array in (("layers", layers), ("routes", routes)):
        if not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {array.dtype}")
    layers, routes = layers.astype(np.int64), routes.astype(np.int64)
    if layers.min() < 0:
        raise ValueError(f"layers must be >= 0, got {int(layers.min())}")
    if routes.min() < -1:
        raise ValueError(f"routes must be >= -1 (-1 = padding), got {int(routes.min())}")
    inferred_layers, inferred_experts = int(layers.max()) + 1, int(routes.max()) + 1
    num_layers = inferred_layers if num_layers is None else int(num_layers)
    num_experts = max(inferred_experts, 1) if num_experts is None else int(num_experts)
    if inferred_layers > num_layers:
        raise ValueError(f"layer {inferred_layers - 1} is outside [0, {num_layers})")
    if inferred_experts > num_experts:
        raise ValueError(f"expert {inferred_experts - 1} is outside [-1, {num_experts})")
    return layers, routes, num_layers, num_experts


# ---- TEMPORARY STUB (branch `sizing`): the `bounds` helper implements the real bypass_optimum;
# ---- the lead replaces this block with it when merging. Returns no hit rate.


@dataclass(frozen=True, eq=False)
class _BypassOptimumStub:
    """Placeholder result: ``hit_rate`` is ``None`` until the real bypass optimum lands."""

    cache_size: int
    hit_rate: float | None = None


def bypass_optimum(trace: Trace, cache_size: int) -> _BypassOptimumStub:
    """TEMPORARY STUB: the bypass optimum's hit rate is not computed yet (``None``)."""
    return _BypassOptimumStub(cache_size=int(cache_size))
