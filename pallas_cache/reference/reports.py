"""Counters and routing reports of the reference (docs/semantics.md §5.9, §5.10)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

#: The routing mass ``experts_for_90pct`` covers.
COVERAGE_FRACTION = 0.9


@dataclass
class ReferenceStats:
    """The four counters of a stats window and the rates derived from them (docs/semantics.md §5.9)."""

    calls: int = 0
    active: int = 0
    missing: int = 0
    fetched: int = 0

    @staticmethod
    def _ratio(num: int, den: int) -> float:
        return num / den if den else 0.0

    @property
    def miss_rate(self) -> float:
        return self._ratio(self.missing, self.active)

    @property
    def fetch_rate(self) -> float:
        return self._ratio(self.fetched, self.missing)

    @property
    def active_per_call(self) -> float:
        return self._ratio(self.active, self.calls)

    @property
    def missing_per_call(self) -> float:
        return self._ratio(self.missing, self.calls)

    @property
    def fetched_per_call(self) -> float:
        return self._ratio(self.fetched, self.calls)


@dataclass
class LayerSkew:
    """One layer's routing concentration (docs/semantics.md §5.10)."""

    layer: int
    routed: int  # routes observed, duplicates counted
    working_set: int  # experts routed at least once
    experts_for_90pct: int  # hottest experts needed to cover 90% of the mass
    norm_entropy: float  # -sum p ln p / ln E; 0.0 when E == 1
    oracle_hit_at_slots: float  # share of the oracle_slots hottest experts


@dataclass
class SkewReport:
    """Routing skew over the layers that were routed to; means exclude un-routed layers."""

    slots_per_layer: float
    oracle_slots: int
    working_set_mean: float
    working_set_max: int
    experts_for_90pct: float
    oracle_hit_at_slots: float
    norm_entropy: float
    per_layer: list = field(default_factory=list)


def _stats_of(row) -> ReferenceStats:
    return ReferenceStats(*(int(v) for v in row))


def stats(cache) -> ReferenceStats:
    """Global counters: the column sums of the per-layer ones, so the two always agree."""
    return _stats_of(cache.stats.sum(axis=0))


def layer_stats(cache, layer) -> ReferenceStats:
    """One layer's counters: the only view that tells one thrashing layer (rebalance) from a
    uniformly tight cache (grow), which have the same global miss rate."""
    return _stats_of(cache.stats[layer])


def per_layer_stats(cache) -> list[ReferenceStats]:
    return [_stats_of(row) for row in cache.stats]


def routing_histogram(cache, layer) -> np.ndarray:
    return cache.routing.freq[layer].copy()


class Reports:
    """The operations that reset counters or switch the histogram, mixed into ``ReferenceCache``."""

    def reset_stats(self):
        """Open a new window: counters and prefill row counters zeroed; residency and the
        histogram kept (a metrics scrape must not destroy a slowly built distribution)."""
        self.stats[:] = 0
        self.prefill.hit_rows = 0
        self.prefill.rows = 0

    def set_collect_routing(self, on: bool):
        if not isinstance(on, (bool, np.bool_)):
            raise TypeError(f"collect_routing must be a bool, got {on!r}")
        self.settings.collect_routing = bool(on)

    def reset_routing(self):
        self.routing.freq[:] = 0


def routing_skew(cache) -> SkewReport | None:
    """How concentrated the observed routing is, per routed layer; None if nothing was seen.

    This describes the traffic, not the cache: ``oracle_hit_at_slots`` is the best hit rate
    any per-layer policy could reach with a fair share of the pool. Un-routed layers are
    absent (zeros would read as "unservable" when the truth is "no data").
    """
    E = cache.num_experts
    slots_per_layer = cache.cache_size / cache.num_layers
    oracle_slots = max(1, math.floor(slots_per_layer + 0.5))  # half away from zero
    per_layer = []
    for layer in range(cache.num_layers):
        freq = cache.routing.freq[layer]
        routed = int(freq.sum())
        if routed == 0:
            continue
        descending = sorted((int(c) for c in freq), reverse=True)
        cumulative, below = 0, 0
        for count in descending:
            cumulative += count
            if cumulative / routed >= COVERAGE_FRACTION:
                break
            below += 1
        entropy = -sum((c / routed) * math.log(c / routed) for c in freq if c > 0)
        per_layer.append(
            LayerSkew(
                layer=layer,
                routed=routed,
                working_set=int((freq > 0).sum()),
                experts_for_90pct=below + 1,
                norm_entropy=entropy / math.log(E) if E > 1 else 0.0,
                oracle_hit_at_slots=sum(descending[:oracle_slots]) / routed,
            )
        )
    if not per_layer:
        return None
    mean = lambda name: sum(getattr(s, name) for s in per_layer) / len(per_layer)  # noqa: E731
    return SkewReport(
        slots_per_layer=slots_per_layer,
        oracle_slots=oracle_slots,
        working_set_mean=mean("working_set"),
        working_set_max=max(s.working_set for s in per_layer),
        experts_for_90pct=mean("experts_for_90pct"),
        oracle_hit_at_slots=mean("oracle_hit_at_slots"),
        norm_entropy=mean("norm_entropy"),
        per_layer=per_layer,
    )
