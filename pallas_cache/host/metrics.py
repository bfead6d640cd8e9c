"""The metrics of a routing histogram row (docs/semantics.md §5.10): routes, working set,
experts covering 90%, normalised entropy and the share of the ``k`` hottest experts.

:func:`histogram_metrics` serves the skew report, the stationary oracle and a trace's statistics
(host-side NumPy, float64, vectorised over rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["COVERAGE_FRACTION", "HistogramMetrics", "histogram_metrics", "oracle_slots_for"]

# The share of routing mass ``experts_for_90pct`` covers.
COVERAGE_FRACTION = 0.9


def oracle_slots_for(cache_size: int, num_layers: int) -> int:
    """``max(1, round_half_away_from_zero(S / L))`` in exact integer arithmetic (docs/semantics.md
    §5.10): the slots the stationary oracle grants each layer (``S=5, L=2`` gives 3, where
    half-to-even would give 2)."""
    return max(1, (2 * int(cache_size) + int(num_layers)) // (2 * int(num_layers)))


@dataclass(frozen=True, eq=False)
class HistogramMetrics:
    """Per-row metrics of routing histograms (one row per routed layer).

    Attributes:
      routed: int64[R]. Routes per row.
      working_set: int64[R]. Experts routed at least once.
      experts_for_90pct: int64[R]. The fewest hottest experts covering 90% of the routes.
      norm_entropy: float64[R]. ``-sum p ln p / ln E``; 0.0 when ``E == 1``.
      hottest_share: float64[R]. Share of the routes held by the ``top`` hottest experts (the
        stationary oracle's hit rate); None when no ``top`` was given.
    """

    routed: np.ndarray
    working_set: np.ndarray
    experts_for_90pct: np.ndarray
    norm_entropy: np.ndarray
    hottest_share: np.ndarray | None


def histogram_metrics(counts, top: int | None = None) -> HistogramMetrics:
    """The metrics of each row of ``counts``.

    Args:
      counts: integer ``[R, E]`` histogram rows, each with at least one route.
      top: the number of hottest experts whose share ``hottest_share`` reports, or None.

    Returns:
      A :class:`HistogramMetrics` with ``[R]`` arrays.

    Raises:
      ValueError: ``counts`` is not 2-D, or a row has no route.
    """
    counts = np.asarray(counts).astype(np.int64)
    if counts.ndim != 2:
        raise ValueError(f"histogram rows must be [R, E], got shape {counts.shape}")
    num_experts = counts.shape[1]
    routed = counts.sum(axis=1)
    if (routed <= 0).any():
        raise ValueError("every histogram row needs at least one route")
    total = routed.astype(np.float64)[:, None]
    hottest_first = -np.sort(-counts, axis=1)
    # The cdf is non-decreasing: the entries below the coverage line are a prefix, +1 crosses it.
    below = np.count_nonzero(np.cumsum(hottest_first, axis=1) / total < COVERAGE_FRACTION, axis=1)
    share = counts.astype(np.float64) / total
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(share > 0, share * np.log(share), 0.0)
    entropy = -plogp.sum(axis=1)
    norm_entropy = entropy / math.log(num_experts) if num_experts > 1 else np.zeros_like(entropy)
    hottest_share = None
    if top is not None:
        hottest_share = hottest_first[:, :top].sum(axis=1).astype(np.float64) / total[:, 0]
    return HistogramMetrics(
        routed=routed,
        working_set=np.count_nonzero(counts, axis=1).astype(np.int64),
        experts_for_90pct=np.minimum(below + 1, num_experts).astype(np.int64),
        norm_entropy=norm_entropy,
        hottest_share=hottest_share,
    )
