"""The int32 clock's renumbering (docs/semantics.md §5.12), on the reference's int64 arrays."""

from __future__ import annotations

import numpy as np


def dense_rank_stamps(usage: np.ndarray, recency: np.ndarray, step: int):
    """Replace every live stamp by its dense rank among all live stamps; returns the new
    ``(usage, recency, step)`` (the arrays are new copies).

    Live: ``usage >= 1`` (0 is "empty", FORGOTTEN is "forgotten"), ``recency >= 0`` (-1 is
    "never routed") and ``step``. Ranks start at 1, so sentinels survive, occupied slots keep
    ``usage >= 1``, and every comparison between two live stamps -- usage against usage,
    recency against recency, recency against usage -- gives the same answer as before.
    """
    usage, recency = usage.copy(), recency.copy()
    live_usage = usage >= 1
    live_recency = recency >= 0
    stamps = np.unique(np.concatenate([usage[live_usage], recency[live_recency], [step]]))
    rank = lambda values: np.searchsorted(stamps, values) + 1  # noqa: E731
    usage[live_usage] = rank(usage[live_usage])
    recency[live_recency] = rank(recency[live_recency])
    return usage, recency, int(rank(step))
