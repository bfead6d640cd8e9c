"""Reading the cache's counters back on the host: the window's stats globally and per layer
(:func:`stats`, :func:`layer_stats`, :func:`per_layer_stats`), and the routing-skew report of
the opt-in histogram (:func:`routing_skew`; docs/semantics.md §5.9, 5.10)."""

from __future__ import annotations

import dataclasses
from typing import Union

import jax
import numpy as np

from pallas_cache.counters import checked_layer
from pallas_cache.host.metrics import COVERAGE_FRACTION, histogram_metrics, oracle_slots_for
from pallas_cache.state import CacheState, check_state

__all__ = [
    "COVERAGE_FRACTION",
    "CacheStats",
    "LayerRoutingSkew",
    "RoutingSkewReport",
    "layer_stats",
    "per_layer_stats",
    "routing_skew",
    "stats",
]


Count = Union[int, np.ndarray]
"""A counter: an ``int`` for one cache, an int64 array of the batch shape for a batch."""
Rate = Union[float, np.ndarray]
"""A rate: a ``float`` for one cache, a float64 array of the batch shape for a batch."""


def _ratio(numerator: Count, denominator: Count) -> Rate:
    if np.ndim(denominator) == 0:
        return numerator / denominator if denominator else 0.0
    num, den = np.asarray(numerator, np.float64), np.asarray(denominator, np.float64)
    return np.divide(num, den, out=np.zeros_like(num), where=den != 0)


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """Counters of one stats window (global, or one layer's), per layer-call over distinct
    experts (docs/semantics.md §5.9).

    Attributes:
      calls: accepted ensure / ensure_hybrid calls.
      active: distinct experts routed, summed over calls.
      missing: distinct routed experts that were not resident, summed over calls, before any
        cap.
      fetched: misses copied in, summed over calls.

    ``cpu_experts = missing - fetched`` are the misses the CPU computed (distinct experts per
    call; a route count, duplicates and tokens included, is ``plan.cpu.sum()``); ``active =
    (active - missing) hits + fetched + cpu_experts``. For a batch of caches (a stacked state)
    every counter is an int64 array of the batch shape and every rate a float64 array, one
    entry per cache. The rates are 0.0 when their denominator is 0.
    """

    calls: Count
    active: Count
    missing: Count
    fetched: Count

    @property
    def hits(self) -> Count:
        """active - missing: routed experts that were resident."""
        return self.active - self.missing

    @property
    def cpu_experts(self) -> Count:
        """missing - fetched: the misses computed on the CPU (ensure_hybrid), summed over calls;
        0 under plain ensure, which fetches every miss."""
        return self.missing - self.fetched

    @property
    def miss_rate(self) -> Rate:
        """missing / active: whether the cache is big enough."""
        return _ratio(self.missing, self.active)

    @property
    def fetch_rate(self) -> Rate:
        """fetched / missing: what the hybrid split actually did."""
        return _ratio(self.fetched, self.missing)

    @property
    def active_per_call(self) -> Rate:
        return _ratio(self.active, self.calls)

    @property
    def missing_per_call(self) -> Rate:
        """What one step wants to move (times bytes per expert: the link budget)."""
        return _ratio(self.missing, self.calls)

    @property
    def fetched_per_call(self) -> Rate:
        """What one step did move; missing_per_call minus this is what the CPU absorbed."""
        return _ratio(self.fetched, self.calls)

    @property
    def cpu_experts_per_call(self) -> Rate:
        """cpu_experts / calls: the misses the CPU computed per call."""
        return _ratio(self.cpu_experts, self.calls)


def _counters(state: CacheState) -> np.ndarray:
    """The per-layer counters as int64[..., L, 4] on the host (leading axes: a batch)."""
    check_state(state, batched=True)
    if isinstance(state.stats, jax.core.Tracer):
        raise TypeError(
            "stats reads the counters on the host and cannot run under jit/vmap; call it on the "
            "state the compiled function returns, or read state.stats there (int32[L, 4]: "
            "calls, active, missing, fetched)")
    return np.asarray(jax.device_get(state.stats)).astype(np.int64)


def _from_row(row: np.ndarray) -> CacheStats:
    """``row [..., 4]``: ints for one cache, arrays of the batch shape for a batch."""
    if row.ndim == 1:
        return CacheStats(*(int(v) for v in row))
    return CacheStats(*(row[..., i] for i in range(4)))


def stats(state: CacheState) -> CacheStats:
    """The global counters of the current window: the column sums of the per-layer ones.

    Host-side: call it outside ``jit`` (under ``jit`` it raises ``TypeError`` saying so). A
    batched state (:func:`~pallas_cache.stack_states`, or a vmapped loop's result) gives one
    entry per cache in every field."""
    return _from_row(_counters(state).sum(axis=-2))


def layer_stats(state: CacheState, layer: int) -> CacheStats:
    """One layer's counters over the current window. Host-side; ``layer`` a Python int; per
    cache for a batch, as :func:`stats`."""
    return _from_row(_counters(state)[..., checked_layer(state, layer), :])


def per_layer_stats(state: CacheState) -> list[CacheStats]:
    """Every layer's counters, indexed by layer; they sum exactly to :func:`stats` (per cache
    for a batch)."""
    table = _counters(state)
    return [_from_row(table[..., layer, :]) for layer in range(table.shape[-2])]


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


def routing_skew(state: CacheState) -> RoutingSkewReport | None:
    """The :class:`RoutingSkewReport` of the observed histogram, or None if nothing was observed.

    One cache: a batch raises ``ValueError`` (take one with :func:`~pallas_cache.take_state`)."""
    check_state(state, batched=True)
    if np.ndim(state.routing.freq) != 2:
        raise ValueError(f"routing_skew reads one cache, got a batch of shape "
                         f"{np.shape(state.routing.freq)[:-2]}; take one with "
                         f"pc.take_state(batch, i)")
    freq = np.asarray(jax.device_get(state.routing.freq)).astype(np.int64)
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
