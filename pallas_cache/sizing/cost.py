"""The decode-time cost model of a replay: bytes and milliseconds per token (docs/semantics.md §11).

A layer-call costs ``max(fetched * W / B_link, cpu_experts * W / B_cpu)`` and a token the sum
over its layer-calls; :func:`modeled_seconds` computes it from the replay's exact counts of
``(fetched, cpu_experts)`` pairs, for any bandwidths.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

__all__ = ["CostModel", "modeled_seconds", "with_costs"]


def modeled_seconds(pair_counts: Iterable[tuple[int, int, int]], expert_bytes: int,
                    link_bandwidth: float, cpu_bandwidth: float) -> float:
    """``sum(calls * max(fetched * W / B_link, cpu_experts * W / B_cpu))`` over the pairs.

    Args:
      pair_counts: ``(fetched, cpu_experts, calls)`` triples, as a replay reports them.
      expert_bytes: ``W``.
      link_bandwidth: ``B_link`` in bytes per second.
      cpu_bandwidth: ``B_cpu`` in bytes per second.
    """
    return sum(calls * max(fetched * expert_bytes / link_bandwidth,
                           cpu_experts * expert_bytes / cpu_bandwidth)
               for fetched, cpu_experts, calls in pair_counts)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """What turns counts into bytes and milliseconds; every field optional.

    Attributes:
      expert_bytes: ``W``, bytes of one routed expert (``None``: hit rates only).
      link_bandwidth: ``B_link``, host-to-device bytes per second.
      cpu_bandwidth: ``B_cpu``, expert bytes per second the CPU MoE path processes.
      device_budget: device bytes the pool may take; names the best configuration that fits.
    """

    expert_bytes: int | None = None
    link_bandwidth: float | None = None
    cpu_bandwidth: float | None = None
    device_budget: int | None = None

    def __post_init__(self):
        for name in ("expert_bytes", "link_bandwidth", "cpu_bandwidth", "device_budget"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")

    @property
    def timed(self) -> bool:
        """Whether ``W`` and both bandwidths are known, so milliseconds can be modeled."""
        return None not in (self.expert_bytes, self.link_bandwidth, self.cpu_bandwidth)

    def auto_fraction(self) -> float:
        """``B_link / (B_link + B_cpu)``: the share of misses to copy so that, for a call's
        misses, the copy and the CPU work take the same time (the upstream engine's rule)."""
        if self.link_bandwidth is None or self.cpu_bandwidth is None:
            raise ValueError("fraction:auto needs both --link-bandwidth and --cpu-bandwidth")
        return self.link_bandwidth / (self.link_bandwidth + self.cpu_bandwidth)

    def auto_policy(self) -> str:
        """``fraction:auto`` resolved, to 4 significant digits: the row runs what it shows."""
        return f"fraction:{self.auto_fraction():.4g}"

    def seconds(self, pair_counts: Iterable[tuple[int, int, int]]) -> float:
        """Modeled seconds of the calls in ``pair_counts`` (see :func:`modeled_seconds`)."""
        if not self.timed:
            raise ValueError("modeled time needs the expert size and both bandwidths")
        return modeled_seconds(pair_counts, self.expert_bytes, self.link_bandwidth,
                               self.cpu_bandwidth)


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
