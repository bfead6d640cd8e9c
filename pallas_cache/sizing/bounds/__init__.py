"""Offline bounds for a routing trace: Belady's optimum, the bypass optimum, the stationary oracle.

The rules are docs/semantics.md §5.14; their eviction loops are
:mod:`pallas_cache.sizing.bounds.loops`.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from pallas_cache.host.metrics import histogram_metrics, oracle_slots_for
from pallas_cache.sizing.bounds import loops as bounds_loops
from pallas_cache.sizing.traces import Trace
from pallas_cache.validate import is_int

__all__ = [
    "BeladyResult",
    "BypassOptimumResult",
    "belady",
    "bypass_optimum",
    "StationaryOracle",
    "stationary_oracle",
    "oracle_slots_for",
]

#: Visited accesses converted to Python ints at a time (bounds the loop's transient memory).
_CHUNK = 1 << 16


@dataclass(frozen=True, eq=False)
class BeladyResult:
    """Counters of an optimal schedule, in the cache's stats vocabulary (docs/semantics.md §5.9).

    Rates with a zero denominator are ``0.0`` for ``miss_rate`` (as the cache's stats define it),
    hence ``1.0`` for ``hit_rate = 1 - miss_rate``.

    Attributes:
        cache_size: ``S``, the pool size simulated.
        num_layers: ``L``.
        num_experts: ``E``.
        calls: layer-calls replayed (padding-only calls included, as the cache counts them).
        active: distinct non-padding experts summed over calls.
        missing: distinct experts not resident at the start of their call.
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
        """``1 - missing / active``: the best hit rate of the schedules this bound ranges over."""
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
        return (f"{type(self).__name__}(cache_size={self.cache_size}, calls={self.calls}, "
                f"active={self.active}, missing={self.missing}, "
                f"hit_rate={self.hit_rate:.4f})")


class BypassOptimumResult(BeladyResult):
    """Counters of the bypass optimum (misses may go unadmitted); fields as :class:`BeladyResult`.

    ``missing`` counts every miss, admitted or served without admission, as the cache's
    ``missing`` counter does; ``layer_missing`` is that of the schedule :func:`bypass_optimum`
    describes (another optimal schedule may spread its misses over layers differently).
    """


def belady(trace: Trace | tuple[Any, Any], cache_size: int, *,
           num_experts: int | None = None, num_layers: int | None = None,
           progress: Callable[[int, int], None] | None = None) -> BeladyResult:
    """Replay a trace under Belady's furthest-next-use eviction: the fewest pure-offload misses.

    Args:
        trace: a :class:`~pallas_cache.sizing.traces.Trace`, or a pair ``(layers, routes)`` of integer
            arrays ``[C]`` and ``[C, K]`` (``-1`` = padding), e.g. ``trace.to_array()``.
        cache_size: ``S``, slots in the shared pool; must be ``>= num_experts`` (the cache's own
            rule, docs/semantics.md §5.1, which also guarantees one call's experts always fit).
        num_experts: ``E`` for the array form (default: ``max route + 1``); must match the
            trace's when a trace is given.
        num_layers: ``L`` for the array form (default: ``max layer + 1``); likewise.
        progress: called as ``progress(done, total)`` with the accesses simulated so far, after
            each chunk of them and once at the end (``done == total``); draws nothing itself
            (:mod:`pallas_cache.sizing.progress` draws).

    Returns:
        The counters of the optimal schedule.

    Raises:
        ValueError: a cache size below ``E``, inconsistent geometry, or malformed arrays.
    """
    accesses = _Accesses.of(trace, num_layers, num_experts)
    slots = accesses.check_size(cache_size)
    layer_missing = _simulate(accesses, slots, bypass=False, progress=progress)
    return accesses.result(BeladyResult, slots, layer_missing)


def bypass_optimum(trace: Trace | tuple[Any, Any], cache_size: int, *,
                   num_experts: int | None = None,
                   num_layers: int | None = None,
                   progress: Callable[[int, int], None] | None = None) -> BypassOptimumResult:
    """The fewest misses when a miss may be served without being admitted (docs/semantics.md §5.14).

    The schedules it ranges over are those of the cache's hybrid path: a call's routed experts
    stay resident through the call (its hits are never evicted by it), and each miss is either
    admitted (into a free slot or over a resident the call does not route) or not. After each call
    the pool holds the call's hits plus the best ``S - |hits|`` of (residents not routed in the
    call and the call's misses), ranked by their sequences of later uses compared from the front
    (never again = infinitely far), then flat id, never keeping an item not used again. ``hit_rate`` is therefore an upper bound for every replay row, hybrid or
    not, and at least :func:`belady`'s.

    Args and Raises: as :func:`belady`.

    Returns:
        The counters of that schedule (:class:`BypassOptimumResult`).
    """
    accesses = _Accesses.of(trace, num_layers, num_experts)
    slots = accesses.check_size(cache_size)
    layer_missing = _simulate(accesses, slots, bypass=True, progress=progress)
    return accesses.result(BypassOptimumResult, slots, layer_missing)


@dataclass(frozen=True, eq=False)
class _Accesses:
    """The trace as accesses: one per distinct non-padding expert of a call, in call order.

    Within a call, accesses are in ascending expert id. Index arrays are int32 whenever the
    counts allow (int64 otherwise); nothing here depends on the cache size.
    """

    num_layers: int
    num_experts: int
    layers: np.ndarray      # int [C], the layer of each call
    before: np.ndarray      # int64 [C + 1], accesses in calls < c
    call_of: np.ndarray     # int [N], the call of each access
    flat: np.ndarray        # int [N], its flat id
    next_index: np.ndarray  # int [N], the next access of the same flat id, -1 if none
    next_call: np.ndarray   # int [N], the call of that next access, C if none
    between: np.ndarray     # int [N], accesses in calls c+1 .. next_call (0 if none)

    @classmethod
    def of(cls, trace, num_layers, num_experts) -> "_Accesses":
        if isinstance(trace, Trace) and num_layers is None and num_experts is None:
            cached = _LAST_ACCESSES[0]
            if cached is not None and cached[0]() is trace:
                return cached[1]
            accesses = cls._build(trace, None, None)
            _LAST_ACCESSES[0] = (weakref.ref(trace), accesses)
            return accesses
        return cls._build(trace, num_layers, num_experts)

    @classmethod
    def _build(cls, trace, num_layers, num_experts) -> "_Accesses":
        layers, routes, num_layers, num_experts = _coerce_trace(trace, num_layers, num_experts)
        calls = routes.shape[0]
        id_space = num_layers * num_experts
        flat_type = np.int32 if id_space < 2**31 else np.int64
        routes = np.sort(routes, axis=1)
        distinct = routes >= 0
        distinct[:, 1:] &= routes[:, 1:] != routes[:, :-1]
        per_call = distinct.sum(axis=1)
        before = np.zeros(calls + 1, dtype=np.int64)
        np.cumsum(per_call, out=before[1:])
        count = int(before[-1])
        index_type = np.int32 if max(count, calls) < 2**31 - 1 else np.int64
        base = (layers.astype(flat_type) * flat_type(num_experts))[:, None]
        flat = (routes.astype(flat_type, copy=False) + base)[distinct]
        del routes, distinct, base
        call_of = np.repeat(np.arange(calls, dtype=index_type), per_call)
        # Next access of the same id: a stable sort by id keeps call order within an id (a radix
        # sort when the ids fit 16 bits).
        key = flat.astype(np.uint16) if id_space <= 2**16 else flat
        order = np.argsort(key, kind="stable").astype(index_type, copy=False)
        del key
        next_index = np.full(count, -1, dtype=index_type)
        same = flat[order[1:]] == flat[order[:-1]]
        next_index[order[:-1][same]] = order[1:][same]
        del order, same
        has_next = next_index >= 0
        next_call = np.full(count, calls, dtype=index_type)
        next_call[has_next] = call_of[next_index[has_next]]
        between = np.zeros(count, dtype=index_type)
        between[has_next] = (before[next_call[has_next] + 1]
                             - before[call_of[has_next] + 1]).astype(index_type)
        return cls(num_layers, num_experts, layers, before, call_of, flat, next_index, next_call,
                   between)

    @property
    def calls(self) -> int:
        return int(self.before.size - 1)

    def check_size(self, cache_size: Any) -> int:
        if not is_int(cache_size) or cache_size < self.num_experts:
            raise ValueError(f"cache_size must be an integer >= num_experts={self.num_experts} "
                             f"(the cache cannot hold one layer otherwise), got {cache_size!r}")
        return int(cache_size)

    def result(self, kind: type, slots: int, layer_missing: np.ndarray) -> BeladyResult:
        layer_active = np.bincount(self.layers, weights=np.diff(self.before),
                                   minlength=self.num_layers)
        return kind(cache_size=slots, num_layers=self.num_layers, num_experts=self.num_experts,
                    calls=self.calls, active=int(layer_active.sum()),
                    missing=int(layer_missing.sum()),
                    layer_calls=np.bincount(self.layers,
                                            minlength=self.num_layers).astype(np.int64),
                    layer_active=layer_active.astype(np.int64),
                    layer_missing=layer_missing.astype(np.int64))


#: ``[(weakref to a Trace, its _Accesses)]`` or ``[None]``: the last trace's accesses, so the two
#: optima at several sizes share them (a Trace's arrays are read-only, so they cannot go stale).
_LAST_ACCESSES: list = [None]


def _simulate(accesses: _Accesses, slots: int, *, bypass: bool,
              progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """Belady's schedule (``bypass=False``) or the bypass optimum's; returns missing per layer
    (``progress(done, total)`` after each chunk of accesses, if given).

    Heap entries are negative ints ``-(n * unit + tag)``, a max-heap on the next use ``n``. For
    Belady ``tag`` is the flat id (ties to the higher one; any tie-break gives the same counts,
    per layer too: tied ids are routed by the same call). For the bypass optimum ``tag`` is the
    access index, and the bypass loop ranks ids tied on ``n`` by walking their later uses.
    An entry is live iff its next use lies beyond the current call; only a resident's latest
    access can have one, so a live entry names a resident.

    Settled accesses. For an access at call ``c`` with next use ``n``, let ``W`` be the accesses
    of calls ``c+1..n`` (Belady) or ``c..n`` (bypass) other than this id's own. Were the id
    dropped at a call ``e`` of that window, the pool after ``e`` would be full of ``S`` other ids,
    each routed at ``e`` or ranked no later (so used by call ``n``) -- all in ``W``. So ``|W| < S``
    settles it: the id stays resident until ``n`` (a certain hit there) and needs no heap entry.
    An access that is a certain hit and needs no entry is skipped entirely; the schedule is the
    same as with every entry present, because a settled id is never the one popped.

    ``resident[f]`` is 0 for an id not resident, else a stamp: ``c + 1`` for the latest call
    ``c`` that routed it while resident (a hit there, or a Belady miss, which is always
    admitted), ``-(c + 1)`` for a bypass miss admitted at ``c`` (still a candidate to drop in
    that call). A call pushes its entries as it goes, then evicts: a popped entry of an id the
    call routes (its positive stamp) is set aside and pushed back afterwards, so victims are
    the best-to-drop live entries among the other residents (and, for the bypass optimum, the
    call's own misses). They always number enough: the exact rule drops only ids that rank
    below ``S`` others, none of them settled, so no stale entry is ever popped.
    """
    calls = accesses.calls
    id_space = accesses.num_layers * accesses.num_experts
    call_of, flat, next_index = accesses.call_of, accesses.flat, accesses.next_index
    next_call, before = accesses.next_call, accesses.before
    if slots >= id_space:  # everything fits: only first uses miss
        first = np.ones(flat.size, dtype=bool)
        first[next_index[next_index >= 0]] = False
        if progress is not None:
            progress(flat.size, flat.size)
        return np.bincount(accesses.layers[call_of[first]],
                           minlength=accesses.num_layers).astype(np.int64)
    has_next = next_index >= 0
    # Entry keys: -(n * unit + tag), n the next use; tag = the flat id (Belady) or the access
    # index (bypass, whose ties on n are broken deeper, by walking the ids' later uses).
    unit = flat.size if bypass else id_space
    exact = (calls + 1) * unit < 2**62
    if bypass:
        own_call = np.diff(before).astype(accesses.between.dtype)[call_of]
        settled = has_next & (accesses.between + own_call - 2 < slots)
        del own_call
    else:
        settled = has_next & (accesses.between - 1 < slots)
    del has_next
    skip = np.zeros(flat.size, dtype=bool)
    skip[next_index[settled]] = True  # certain hits ...
    skip &= settled                   # ... that need no entry either

    compiled = compiled_loops(flat.size) if exact else None
    run = compiled if compiled is not None else bounds_loops.loops(compiled=False)
    most_per_call = int(np.diff(before).max()) if calls else 0
    state = run.new_state(id_space, accesses.num_layers, slots, most_per_call)
    if compiled is None:  # the interpreter reads the access arrays by index without copies
        flat_of, next_index_of, next_call_of = (memoryview(flat), memoryview(next_index),
                                                memoryview(next_call))
    else:
        flat_of, next_index_of, next_call_of = flat, next_index, next_call
    start = 0
    while start < flat.size:  # chunks of whole calls
        stop = min(start + _CHUNK, flat.size)
        if stop < flat.size:
            stop = int(before[call_of[stop]])
            if stop == start:  # one call longer than a chunk
                stop = int(before[call_of[start] + 1])
        visit = ~skip[start:stop]
        chunk_calls = call_of[start:stop][visit]
        if chunk_calls.size:
            rank = next_call[start:stop][visit].astype(np.int64)
            v_flat = flat[start:stop][visit]
            tag = np.flatnonzero(visit) + start if bypass else v_flat
            if not exact:  # Python ints: exact for any trace length
                rank = rank.astype(object)
            keys = -(rank * unit + tag)
            keys[settled[start:stop][visit]] = 0
            last = np.ones(chunk_calls.size, dtype=bool)
            last[:-1] = chunk_calls[1:] != chunk_calls[:-1]
            ends = np.where(last, accesses.layers[chunk_calls].astype(np.int64) + 1, 0)
            stamps = chunk_calls[last].astype(np.int64) + 1
            if compiled is None:
                v_flat, keys, stamps, ends = (v_flat.tolist(), keys.tolist(), stamps.tolist(),
                                              ends.tolist())
            resident, layer_missing, heap, scalars, own, tied = state
            if bypass:
                run.bypass_chunk(resident, layer_missing, heap, scalars, slots, unit, calls,
                                 v_flat, keys, stamps, ends, own, tied, flat_of, next_index_of,
                                 next_call_of)
            else:
                run.belady_chunk(resident, layer_missing, heap, scalars, slots, id_space,
                                 v_flat, keys, stamps, ends, own)
        start = stop
        if progress is not None:
            progress(stop, flat.size)
    if progress is not None and flat.size == 0:
        progress(0, 0)
    return np.asarray(state[1], dtype=np.int64)


#: ``"0"``: simulate the optima with the Python loop even where Numba is installed; ``"1"``: with
#: the compiled loop whatever the trace's size; unset (or anything else): by size.
COMPILED_BOUNDS_ENV = "PALLAS_CACHE_COMPILED_BOUNDS"
#: Accesses from which the compiled loop runs by default: importing Numba and loading the compiled
#: loops take about 0.8 s per process, what the Python loop spends on a few passes of this many.
_COMPILED_FROM = 500_000


def compiled_loops(accesses: int | None = None) -> bounds_loops.Loops | None:
    """The Numba-compiled loops (:func:`pallas_cache.sizing.bounds.loops.loops`) when Numba can
    be imported (the ``fast`` extra) and the loop is worth compiling (``accesses`` at least
    ``_COMPILED_FROM``, or ``PALLAS_CACHE_COMPILED_BOUNDS=1``; never with ``=0``); else ``None``
    (the Python loop)."""
    choice = os.environ.get(COMPILED_BOUNDS_ENV, "")
    if choice == "0":
        return None
    if choice != "1" and accesses is not None and accesses < _COMPILED_FROM:
        return None
    return bounds_loops.loops(compiled=True)


# ---- the stationary oracle ------------------------------------------------------------------


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
    if not is_int(cache_size) or cache_size < 1:
        raise ValueError(f"cache_size must be a positive integer, got {cache_size!r}")
    num_layers = trace.num_layers
    oracle_slots = oracle_slots_for(cache_size, num_layers)
    histogram = trace.routing_histogram()
    routed_per_layer = histogram.sum(axis=1)
    routed_layers = np.flatnonzero(routed_per_layer)
    if routed_layers.size == 0:
        raise ValueError(f"{trace.source}: no non-padding route, no oracle to compute")
    hit_rate = histogram_metrics(histogram[routed_layers], top=oracle_slots).hottest_share
    return StationaryOracle(cache_size=int(cache_size),
                            slots_per_layer=int(cache_size) / num_layers,
                            oracle_slots=oracle_slots, routed_layers=routed_layers,
                            hit_rate=hit_rate, mean_hit_rate=float(hit_rate.mean()))


# ---- input handling -------------------------------------------------------------------------


def _coerce_trace(trace: Trace | tuple[Any, Any], num_layers: int | None,
                  num_experts: int | None) -> tuple[np.ndarray, np.ndarray, int, int]:
    """``(layers [C], routes [C, K], L, E)``, integer arrays, from a Trace or a (layers, routes) pair."""
    if isinstance(trace, Trace):
        for name, given, own in (("num_layers", num_layers, trace.num_layers),
                                 ("num_experts", num_experts, trace.num_experts)):
            if given is not None and given != own:
                raise ValueError(f"{name}={given} contradicts the trace's {name}={own}")
        return trace.layers, trace.routes, trace.num_layers, trace.num_experts
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
