"""Reading the cache back: counters per window, per layer, and the routing histogram.

Two questions, two tools (docs/semantics.md §5.9, 5.10):

* "Is the cache big enough?" -- :func:`stats`, and per layer :func:`layer_stats` /
  :func:`per_layer_stats`. The per-layer form exists because one thrashing layer and a uniformly
  tight cache show the same global miss rate and want opposite fixes (rebalance vs grow). The
  per-layer counters are the state (``CacheState.stats``); the global ones are their sums, so the
  two always agree exactly.
* "What could any cache do on this traffic?" -- :func:`routing_skew`, computed from the opt-in
  routing histogram. It describes the router, not the policy.

The reports are host-side (float64 NumPy over ``device_get``'d arrays): they are read by people and
dashboards, not by the decode loop. The state transitions (:func:`reset_stats`,
:func:`set_collect_routing`, :func:`reset_routing`) are pure and jittable.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_cache import validate
from pallas_cache.host.metrics import COVERAGE_FRACTION, histogram_metrics, oracle_slots_for
from pallas_cache.state import CacheState

__all__ = [
    "COVERAGE_FRACTION",
    "CacheStats",
    "LayerRoutingSkew",
    "RoutingSkewReport",
    "layer_stats",
    "per_layer_stats",
    "reset_routing",
    "reset_stats",
    "routing_histogram",
    "routing_skew",
    "set_collect_routing",
    "stats",
]

def _ratio(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else 0.0


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """Counters of one stats window (global, or one layer's).

    Attributes:
      calls: ensure / ensure_hybrid calls.
      active: distinct experts routed, summed over calls.
      missing: distinct misses, summed over calls, before any cap.
      fetched: misses actually copied in, summed over calls.
    The rates are 0.0 when their denominator is 0.
    """

    calls: int
    active: int
    missing: int
    fetched: int

    @property
    def miss_rate(self) -> float:
        """missing / active: whether the cache is big enough."""
        return _ratio(self.missing, self.active)

    @property
    def fetch_rate(self) -> float:
        """fetched / missing: what the hybrid split actually did."""
        return _ratio(self.fetched, self.missing)

    @property
    def active_per_call(self) -> float:
        return _ratio(self.active, self.calls)

    @property
    def missing_per_call(self) -> float:
        """What one step wants to move (times bytes per expert: the link budget)."""
        return _ratio(self.missing, self.calls)

    @property
    def fetched_per_call(self) -> float:
        """What one step did move; missing_per_call minus this is what the CPU absorbed."""
        return _ratio(self.fetched, self.calls)


def _counters(state: CacheState) -> np.ndarray:
    """The per-layer counters as int64[L, 4] on the host."""
    table = np.asarray(jax.device_get(state.stats)).astype(np.int64)
    if table.ndim != 2:
        raise ValueError(
            f"stats reads one cache; got a batched state with stats of shape {table.shape} "
            f"(index the batch first, e.g. jax.tree.map(lambda x: x[i], state))"
        )
    return table


def _from_row(row) -> CacheStats:
    return CacheStats(*(int(v) for v in row))


def stats(state: CacheState) -> CacheStats:
    """The global counters of the current window: the column sums of the per-layer ones."""
    return _from_row(_counters(state).sum(axis=0))


def _host_layer(state: CacheState, layer) -> int:
    layer = validate.as_host_int("layer", layer)
    if not 0 <= layer < state.num_layers:
        raise ValueError(f"layer {layer} is outside a model of {state.num_layers} layers")
    return layer


def layer_stats(state: CacheState, layer: int) -> CacheStats:
    """One layer's counters over the current window. Host-side; ``layer`` a Python int."""
    return _from_row(_counters(state)[_host_layer(state, layer)])


def per_layer_stats(state: CacheState) -> list[CacheStats]:
    """Every layer's counters, indexed by layer; they sum exactly to :func:`stats`."""
    return [_from_row(row) for row in _counters(state)]


def reset_stats(state: CacheState) -> CacheState:
    """Open a new window: counters and prefill row counters zeroed; residency and the routing
    histogram kept (the histogram estimates a distribution; a scrape must not destroy it)."""
    return state.replace(
        stats=jnp.zeros_like(state.stats),
        prefill_hit_rows=jnp.zeros_like(state.prefill_hit_rows),
        prefill_rows=jnp.zeros_like(state.prefill_rows),
    )


def set_collect_routing(state: CacheState, on) -> CacheState:
    """Turn routing-histogram collection on or off (``on`` may be traced). Off by default: a
    histogram is only meaningful over a long stationary window."""
    if not isinstance(on, (bool, np.bool_)) and not (
        hasattr(on, "dtype") and np.shape(on) == () and jnp.issubdtype(on.dtype, jnp.bool_)
    ):
        raise TypeError(f"set_collect_routing takes a bool, got {on!r}")
    return state.replace(collect_routing=jnp.asarray(on, jnp.bool_))


def routing_histogram(state: CacheState, layer) -> jax.Array:
    """int32[E]: how often each expert of ``layer`` was routed to, duplicates counted.

    Jittable. A Python int layer is range-checked (ValueError); a traced one is clamped into
    range, since a report cannot carry an error bit."""
    if validate.is_int(layer):
        layer = _host_layer(state, layer)
    return state.routing_freq[jnp.clip(layer, 0, state.num_layers - 1)]


def reset_routing(state: CacheState) -> CacheState:
    """Throw the observed routing distribution away (collection setting unchanged)."""
    return state.replace(routing_freq=jnp.zeros_like(state.routing_freq))


@dataclasses.dataclass(frozen=True)
class LayerRoutingSkew:
    """One routed layer's concentration, from its histogram row alone (docs/semantics.md §5.10).

    Attributes:
      layer: the layer.
      routed: total routes observed, duplicates counted.
      working_set: experts routed to at least once.
      experts_for_90pct: the smallest number of hottest experts covering 90% of the routes.
      norm_entropy: ``-sum p ln p / ln E`` (1.0 flat, 0.0 one expert; 0.0 when ``E == 1``).
      oracle_hit_at_slots: the share of the ``oracle_slots`` hottest experts: the best hit rate
        any per-layer policy could reach on this traffic with a fair share of slots.
    """

    layer: int
    routed: int
    working_set: int
    experts_for_90pct: int
    norm_entropy: float
    oracle_hit_at_slots: float


@dataclasses.dataclass(frozen=True)
class RoutingSkewReport:
    """The routing-skew report: per routed layer, and means over routed layers only.

    Attributes:
      slots_per_layer: ``S / L`` unrounded, the fair per-layer share.
      oracle_slots: ``max(1, round_half_away(S / L))``, the slot count the oracle is quoted at.
      working_set_mean, working_set_max, experts_for_90pct, oracle_hit_at_slots, norm_entropy:
        means (and the max) over the routed layers; un-routed layers are absent, not zeros.
      per_layer: one entry per routed layer, in layer order.
    """

    slots_per_layer: float
    oracle_slots: int
    working_set_mean: float
    working_set_max: int
    experts_for_90pct: float
    oracle_hit_at_slots: float
    norm_entropy: float
    per_layer: list


def routing_skew(state: CacheState):
    """The :class:`RoutingSkewReport` of the observed histogram, or None if nothing was observed."""
    freq = np.asarray(jax.device_get(state.routing_freq)).astype(np.int64)
    num_layers, cache_size = state.num_layers, int(jax.device_get(state.cache_size))
    oracle_slots = oracle_slots_for(cache_size, num_layers)
    routed_layers = np.flatnonzero(freq.sum(axis=1))
    if routed_layers.size == 0:
        return None
    metrics = histogram_metrics(freq[routed_layers], top=oracle_slots)
    per_layer = [
        LayerRoutingSkew(
            layer=int(layer),
            routed=int(metrics.routed[row]),
            working_set=int(metrics.working_set[row]),
            experts_for_90pct=int(metrics.experts_for_90pct[row]),
            norm_entropy=float(metrics.norm_entropy[row]),
            oracle_hit_at_slots=float(metrics.hottest_share[row]),
        )
        for row, layer in enumerate(routed_layers)
    ]
    count = float(len(per_layer))
    return RoutingSkewReport(
        slots_per_layer=cache_size / num_layers,
        oracle_slots=oracle_slots,
        working_set_mean=sum(s.working_set for s in per_layer) / count,
        working_set_max=max(s.working_set for s in per_layer),
        experts_for_90pct=sum(s.experts_for_90pct for s in per_layer) / count,
        oracle_hit_at_slots=sum(s.oracle_hit_at_slots for s in per_layer) / count,
        norm_entropy=sum(s.norm_entropy for s in per_layer) / count,
        per_layer=per_layer,
    )
