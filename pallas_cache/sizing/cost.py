"""The decode-time cost model of a replay: bytes and milliseconds per token (docs/semantics.md §11).

A layer-call costs ``max(fetched * W / B_link, cpu_experts * W / B_cpu + T_cpu)`` (``T_cpu``, the
CPU partial's fixed cost, only when ``cpu_experts > 0``; 0 unless given) and a token the sum
over its layer-calls; :func:`modeled_seconds` computes it from the replay's exact counts of
``(fetched, cpu_experts)`` pairs, for any bandwidths.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

__all__ = ["CostModel", "modeled_seconds", "with_costs"]


def modeled_seconds(pair_counts: Iterable[tuple[int, int, int]], expert_bytes: int,
                    link_bandwidth: float, cpu_bandwidth: float,
                    cpu_fixed_seconds: float = 0.0) -> float:
    """``sum(calls * max(fetched * W / B_link, cpu_experts * W / B_cpu + T_cpu))`` over the
    pairs, ``T_cpu`` charged once per call that has at least one CPU expert.

    Args:
      pair_counts: ``(fetched, cpu_experts, calls)`` triples, as a replay reports them.
      expert_bytes: ``W``.
      link_bandwidth: ``B_link`` in bytes per second.
      cpu_bandwidth: ``B_cpu`` in bytes per second.
      cpu_fixed_seconds: ``T_cpu``, the CPU partial's fixed cost per layer-call (its launch,
        the host round trip, the wait for the host threads); 0 leaves the two-bandwidth model.
    """
    return sum(calls * max(fetched * expert_bytes / link_bandwidth,
                           _cpu_seconds(cpu_experts, expert_bytes, cpu_bandwidth,
                                        cpu_fixed_seconds))
               for fetched, cpu_experts, calls in pair_counts)


def _cpu_seconds(cpu_experts: int, expert_bytes: int, cpu_bandwidth: float,
                 cpu_fixed_seconds: float) -> float:
    """One call's CPU partial: ``cpu_experts * W / B_cpu``, plus ``T_cpu`` when it runs at all."""
    seconds = cpu_experts * expert_bytes / cpu_bandwidth
    if cpu_fixed_seconds and cpu_experts > 0:
        seconds += cpu_fixed_seconds
    return seconds


@dataclasses.dataclass(frozen=True)
class CostModel:
    """What turns counts into bytes and milliseconds; every field optional.

    Attributes:
      expert_bytes: ``W``, bytes of one routed expert (``None``: hit rates only).
      link_bandwidth: ``B_link``, host-to-device bytes per second.
      cpu_bandwidth: ``B_cpu``, expert bytes per second the CPU MoE path processes.
      device_budget: device bytes the pool may take; names the best configuration that fits.
      cpu_fixed_seconds: ``T_cpu``, the CPU partial's fixed cost per layer-call with at least
        one CPU expert (``pallas-cache bench-bandwidth`` measures it); 0: none.
    """

    expert_bytes: int | None = None
    link_bandwidth: float | None = None
    cpu_bandwidth: float | None = None
    device_budget: int | None = None
    cpu_fixed_seconds: float = 0.0

    def __post_init__(self):
        for name in ("expert_bytes", "link_bandwidth", "cpu_bandwidth", "device_budget"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        fixed = self.cpu_fixed_seconds
        if not (isinstance(fixed, (int, float)) and math.isfinite(fixed) and fixed >= 0):
            raise ValueError(f"cpu_fixed_seconds must be a finite number >= 0, got {fixed!r}")

    @property
    def timed(self) -> bool:
        """Whether ``W`` and both bandwidths are known, so milliseconds can be modeled."""
        return None not in (self.expert_bytes, self.link_bandwidth, self.cpu_bandwidth)

    def auto_fraction(self, top_k: int | None = None) -> float:
        """The share of misses to copy so that, for a call's misses, the copy and the CPU work
        take the same time: ``B_link / (B_link + B_cpu)`` (the upstream engine's rule). With a
        fixed CPU cost ``T_cpu``, the balance of a call whose ``k = top_k`` routes all miss,
        ``f * k * W / B_link = (1 - f) * k * W / B_cpu + T_cpu``, clamped to ``[0, 1]``: the
        fixed cost moves copies off the CPU (docs/semantics.md §11.4)."""
        if self.link_bandwidth is None or self.cpu_bandwidth is None:
            raise ValueError("fraction:auto needs both --link-bandwidth and --cpu-bandwidth")
        balance = self.link_bandwidth / (self.link_bandwidth + self.cpu_bandwidth)
        if not self.cpu_fixed_seconds:
            return balance
        if self.expert_bytes is None or top_k is None or top_k < 1:
            raise ValueError("fraction:auto with a fixed CPU cost needs the expert size and "
                             "the routes per call")
        link = top_k * self.expert_bytes / self.link_bandwidth
        cpu = top_k * self.expert_bytes / self.cpu_bandwidth
        return min(1.0, (cpu + self.cpu_fixed_seconds) / (link + cpu))

    def auto_policy(self, top_k: int | None = None) -> str:
        """``fraction:auto`` resolved, to 4 significant digits: the row runs what it shows."""
        return f"fraction:{self.auto_fraction(top_k):.4g}"

    def seconds(self, pair_counts: Iterable[tuple[int, int, int]]) -> float:
        """Modeled seconds of the calls in ``pair_counts`` (see :func:`modeled_seconds`)."""
        if not self.timed:
            raise ValueError("modeled time needs the expert size and both bandwidths")
        return modeled_seconds(pair_counts, self.expert_bytes, self.link_bandwidth,
                               self.cpu_bandwidth, self.cpu_fixed_seconds)


def with_costs(results: list, cost: CostModel | None) -> list:
    """The replay's results with the cost model's fields filled (docs/semantics.md §11): bytes,
    modeled ms per token, ``best`` and ``budget_best``; unchanged without an expert size."""
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
