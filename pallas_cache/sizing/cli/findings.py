"""What a replay's results and its trace tell beyond the rows, computed once, before anything is
printed (:func:`findings`): the cliffs (per-layer LRU replayed at each thin size), what the trace
covers (its distinct experts, the sizes it is too short for), the fraction splits that copy
nothing, the GPU-time model's prefetch and eviction bounds, route_knn's changes, the fastest
size within common budgets, and each row's hit rates per layer.
:mod:`~pallas_cache.sizing.cli.output` turns a :class:`Findings` into text."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from pallas_cache.evictions import Eviction
from pallas_cache.sizing.report import CONFIG_KEYS, merged_configs
from pallas_cache.sizing.sweep.cost import ranking_figure
from pallas_cache.sizing.sweep.records import parse_policy
from pallas_cache.sizing.trace_stats import per_layer_lru_hit_rate

__all__ = ["COLD_SHARE", "COMMON_BUDGETS", "Cliffs", "Coverage", "EvictionBounds", "Findings",
           "Frontier", "FrontierGroup", "KnnChanges", "Prefetch", "cliffs", "coverage",
           "eviction_bounds", "findings", "frontier", "knn_changes", "layer_hit_rates",
           "prefetch", "stops_copying"]

#: A size is too short a trace's when more than this share of a ``full`` row's misses are cold
#: (the first use of an expert, which every cache pays once).
COLD_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class Cliffs:
    """The sizes past a cliff (docs/semantics.md §11.3).

    Attributes:
      working_set: ``L*k``, one token's experts (``k = min(top_k, E)``).
      below: ``(size, the best row's hit rate)`` of each size below ``working_set``.
      per_layer_floor: ``3*k`` slots per layer, below which per-layer LRU falls off.
      thin: ``(size, round(S/L), per-layer LRU's hit rate)`` of each size below that floor
        (the rate ``None`` where ``round(S/L)`` is below the trace's top-k).
    """

    working_set: int
    below: tuple[tuple[int, float], ...]
    per_layer_floor: int
    thin: tuple[tuple[int, int, float | None], ...]


@dataclasses.dataclass(frozen=True)
class Coverage:
    """What the trace can tell: its geometry, whether it is synthetic, the distinct experts it
    routes, and the cache sizes where more than :data:`COLD_SHARE` of a ``full`` row's misses
    are cold."""

    num_layers: int
    num_experts: int
    top_k: int
    num_tokens: int
    synthetic_preset: str | None
    distinct_experts: int
    short_sizes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """The GPU-time model's prefetch line: ``(size, prefetch_bound)`` of the fastest row whose
    CPU computes no expert at each size; one expert's copy time ``tau`` and one layer's GPU
    work ``A + k*C``, in seconds."""

    bounds: tuple[tuple[int, float], ...]
    tau: float
    layer: float


@dataclasses.dataclass(frozen=True)
class EvictionBounds:
    """What better eviction could save the ``full`` rows (the GPU-time model): ``(size, the
    most any eviction with demand copies could save)``, the sizes whose ``full`` row already
    misses no more than Belady's optimum, and whether the sweep had timed ``full`` rows at
    all (``timed``: any timed row)."""

    bounds: tuple[tuple[int, float], ...]
    reached: tuple[int, ...]
    has_full: bool
    timed: bool


@dataclasses.dataclass(frozen=True)
class KnnChanges:
    """route_knn's hit rate minus LRU's at each size of one series (``policy``)."""

    policy: str
    changes: tuple[tuple[int, float], ...]


#: The expert-pool budgets a table without ``--device-budget`` names a size for (frontier).
COMMON_BUDGETS = tuple(gib * 2 ** 30 for gib in (16, 24, 48, 72))


@dataclasses.dataclass(frozen=True)
class FrontierGroup:
    """One batch's (``None``: a one-token table's) frontier: the common budget below its
    smallest pool (``None``: none, or the grid's own sizes are the budgets), that pool's bytes,
    and ``(budget, the fastest record that fits)`` per budget."""

    batch: int | None
    below: int | None
    smallest: int
    picks: tuple[tuple[int, dict], ...]


@dataclasses.dataclass(frozen=True)
class Frontier:
    """The fastest size within each expert-pool budget (:func:`frontier`): the figure ranked
    by, the configuration keys that vary among the shown rows, a group per batch."""

    key: str
    varying: tuple[str, ...]
    groups: tuple[FrontierGroup, ...]


@dataclasses.dataclass(frozen=True)
class Findings:
    """Everything the printer shows beyond the rows, computed for the asked format (``None``
    where the format shows none of it). ``ranking``: the figure the results' verdicts rank by
    (:func:`~pallas_cache.sizing.sweep.cost.ranking_figure`)."""

    coverage: Coverage
    layer_hit_rates: tuple[list, ...] | None = None
    ranking: str | None = None
    cliffs: Cliffs | None = None
    stops_copying: tuple[tuple[str, int], ...] = ()
    prefetch: Prefetch | None = None
    eviction: EvictionBounds | None = None
    knn: KnnChanges | None = None
    frontier: Frontier | None = None


def findings(request, trace, results, rows, companions=(), knn_results=()) -> Findings:
    """The :class:`Findings` of one replay for ``request``'s format: what the trace covers and
    the hit rates per layer (``--per-layer``) for every format; the rest for a table only."""
    output = request.output
    per_layer = (tuple(layer_hit_rates(result) for result in results) if output.per_layer
                 else None)
    covered = coverage(rows, trace, getattr(request.source, "preset", None))
    if output.format != "table":
        return Findings(covered, per_layer)
    cost = request.cost
    return Findings(covered, per_layer, ranking_figure(results), cliffs(results, trace),
                    stops_copying(rows, trace),
                    prefetch(results, trace, cost) if cost.gpu else None,
                    eviction_bounds(results, cost) if cost.gpu else None,
                    knn_changes(results, companions, knn_results), frontier(rows))


def frontier(rows) -> Frontier | None:
    """For each common expert-pool budget (:data:`COMMON_BUDGETS`; the grid's own pool sizes
    when fewer than two of them fall in its range), the record that fits with the lowest
    ms/token by :func:`ranking_figure` (the smallest pool of equally fast ones); per batch in a
    batched table. In this model a bigger cache is never slower, so the fastest row alone names
    the largest size: a budget is what picks one. ``None`` without bytes or a figure."""
    key = ranking_figure(rows)
    if key is None or any(r["cache_bytes"] is None for r in rows):
        return None
    merged = merged_configs(rows)
    shown = [r for r in rows if tuple(r[k] for k in CONFIG_KEYS) not in merged]
    varying = tuple(k for k in CONFIG_KEYS if k == "policy" or len({r[k] for r in shown}) > 1)
    groups = []
    for batch in dict.fromkeys(r.get("batch") for r in shown):
        group = [r for r in shown if r.get("batch") == batch]
        pools = sorted({r["cache_bytes"] for r in group})
        budgets = [b for b in COMMON_BUDGETS if b >= pools[0]]
        past = next((i for i, b in enumerate(budgets) if b >= pools[-1]), len(budgets) - 1)
        budgets = budgets[:past + 1]
        if budgets and pools[-1] > budgets[-1]:  # the grid's largest pool, past every budget
            budgets.append(pools[-1])
        below = [b for b in COMMON_BUDGETS if b < pools[0]]
        if len(budgets) < 2:
            budgets, below = pools, []
        picks = tuple((budget, min((r for r in group if r["cache_bytes"] <= budget),
                                   key=lambda r: (r[key], r["cache_bytes"])))
                      for budget in budgets)
        groups.append(FrontierGroup(batch, below[-1] if below else None, pools[0], picks))
    return Frontier(key, varying, tuple(groups))


def cliffs(results, trace) -> Cliffs:
    """:class:`Cliffs` of a sweep: each size's best hit rate below one token's working set, and
    per-layer LRU replayed on this trace at ``round(S/L)`` slots per layer where that is below
    ``3 * top_k``."""
    num_layers, top_k = trace.num_layers, min(trace.top_k, trace.num_experts)
    sizes = sorted({r.cache_size for r in results})
    below = tuple((size, max(r.hit_rate for r in results if r.cache_size == size))
                  for size in sizes if size < num_layers * top_k)
    thin = []
    for size in sizes:
        per_layer = round(size / num_layers)
        if per_layer >= 3 * top_k:
            continue
        rate = (None if per_layer < trace.top_k
                else per_layer_lru_hit_rate(trace, per_layer * num_layers))
        thin.append((size, per_layer, rate))
    return Cliffs(num_layers * top_k, below, 3 * top_k, tuple(thin))


def coverage(rows, trace, synthetic_preset: str | None) -> Coverage:
    """:class:`Coverage` of a trace and the records replayed on it: the ``D`` distinct experts
    it routes, and the sizes short of a pool of every expert where more than
    :data:`COLD_SHARE` of a ``full`` row's misses are their first use."""
    routes = trace.routes
    valid = routes >= 0
    flat = (np.broadcast_to(trace.layers[:, None], routes.shape).astype(np.int64)
            * trace.num_experts + routes)[valid]
    distinct = int(np.unique(flat).size)
    # (a pool of every expert, S >= L*E, misses nothing but cold: its steady state is plain)
    short = sorted({r["cache_size"] for r in rows if r["policy"] == "full" and r["missing"]
                    and distinct > COLD_SHARE * r["missing"]
                    and r["cache_size"] < trace.num_layers * trace.num_experts})
    return Coverage(trace.num_layers, trace.num_experts, trace.top_k, trace.num_tokens,
                    synthetic_preset, distinct, tuple(short))


def stops_copying(rows, trace) -> tuple[tuple[str, int], ...]:
    """``(policy, k)`` for each ``fraction:Q`` marked best whose split, at ``k`` routes per call
    of this trace (the first such ``k``), rounds every call's misses down to 0
    (docs/semantics.md §5.3): once the pool is full it copies no miss."""
    found = []
    for policy in dict.fromkeys(r["policy"] for r in rows if r["best"] or r["budget_best"]):
        kind, _, _ = policy.partition(":")
        if kind != "fraction":
            continue
        widths = {min(trace.top_k, trace.num_experts) * r.get("batch", 1) for r in rows
                  if r["policy"] == policy}
        split = parse_policy(policy).split  # the library's own rule
        for k in sorted(widths):
            if int(jnp.max(split(jnp.arange(1, k + 1, dtype=jnp.int32)))) == 0:
                found.append((policy, k))
                break
    return tuple(found)


def prefetch(results, trace, cost) -> Prefetch | None:
    """:class:`Prefetch` of a sweep with the GPU's time (docs/semantics.md §11.6); ``None``
    without timed rows."""
    timed = [r for r in results if r.overlap_ms_per_token is not None]
    if not timed:
        return None
    fastest = {}
    for r in timed:  # the first of equally fast rows
        if r.prefetch_bound is None:
            continue
        best = fastest.get(r.cache_size)
        if best is None or r.overlap_ms_per_token < best.overlap_ms_per_token:
            fastest[r.cache_size] = r
    bounds = tuple((size, fastest[size].prefetch_bound) for size in sorted(fastest))
    A = cost.gpu_layer_seconds or 0.0
    C = cost.gpu_expert_seconds or 0.0
    k = min(trace.top_k, trace.num_experts)
    return Prefetch(bounds, cost.expert_bytes / cost.link_bandwidth, A + k * C)


def eviction_bounds(results, cost) -> EvictionBounds:
    """:class:`EvictionBounds` per cache size, from that size's ``full`` row with the fewest
    misses (Belady's optimum bounds the ``full`` rows, whichever row is fastest)."""
    full = {}
    for r in results:
        if (r.policy in ("full", "fraction:1") and r.belady_hit_rate is not None
                and r.overlap_ms_per_token):
            kept = full.get(r.cache_size)
            if kept is None or r.missing < kept.missing:
                full[r.cache_size] = r
    bounds, reached = [], []
    for size in sorted(full):
        r = full[size]
        if r.missing <= round(r.active * (1.0 - r.belady_hit_rate)):
            reached.append(size)
        else:
            bounds.append((size, _eviction_bound(r, cost)))
    return EvictionBounds(tuple(bounds), tuple(reached), bool(full),
                          any(r.overlap_ms_per_token for r in results))


def _eviction_bound(result, cost) -> float:
    """For a ``full`` row with its Belady hit rate: ``1 - (A * calls + max(C * active,
    tau * Belady's misses)) / overlap``, the most any eviction with demand copies could save
    (each call takes at least ``A`` plus the larger of its device work and its copies, and no
    eviction misses less than Belady)."""
    A = cost.gpu_layer_seconds or 0.0
    C = cost.gpu_expert_seconds or 0.0
    tau = cost.expert_bytes / cost.link_bandwidth
    misses = result.active * (1.0 - result.belady_hit_rate)
    floor = A * result.calls + max(C * result.active, tau * misses)
    total = result.overlap_ms_per_token * max(result.tokens, 1) / 1e3
    return max(0.0, 1.0 - floor / total)


def knn_changes(results, companions, knn_results) -> KnnChanges | None:
    """route_knn's hit rate minus LRU's at each size of the companions' series
    (``knn_results``: the companions' replay results); ``None`` without companions."""
    if not companions or len(knn_results) != len(companions):
        return None
    first = companions[0]
    series = _config(dataclasses.replace(first, eviction=Eviction.LRU))
    lru = {r.cache_size: r.hit_rate for r in results if _config(r) == series}
    return KnnChanges(first.policy, tuple(
        (knn.cache_size, result.hit_rate - lru[knn.cache_size])
        for knn, result in zip(companions, knn_results) if knn.cache_size in lru))


def _config(row) -> tuple:
    """A configuration's or a result's :data:`~pallas_cache.sizing.report.CONFIG_KEYS`, as the
    names a result holds."""
    return tuple(getattr(getattr(row, key), "value", getattr(row, key)) for key in CONFIG_KEYS)


def layer_hit_rates(result) -> list[float | None]:
    """A replay result's hit rate per layer, ``1 - missing/active`` of each layer's counters
    (``ReplayResult.layer_stats``); ``None`` for a layer no call routed."""
    return [None if not stats.active else 1.0 - stats.missing / stats.active
            for stats in result.layer_stats]
