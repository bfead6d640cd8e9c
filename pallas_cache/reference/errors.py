"""The error bits of the reference (docs/semantics.md §6; the values of ``pallas_cache.errors``)
and its one static check of an integer argument."""

from __future__ import annotations

import numbers

ERR_EXPERT_ID = 1  # a route outside [-1, E)
ERR_LAYER = 2  # a layer outside [0, L)
ERR_SLOT = 4  # a slot outside [0, S)
ERR_PREFILL_NOT_BEGUN = 8  # staging a layer before begin_prefill
ERR_PREFILL_BUSY = 16  # staging into a buffer whose layer was not released
ERR_CACHE_SIZE = 64  # resize outside [E, capacity] or under a busy buffer; prefill below 2E


def int_arg(value, what) -> int:
    """``value`` as an ``int``; a non-integer (a bool included) raises TypeError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)
