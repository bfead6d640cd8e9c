"""The record a reference eviction is, the NumPy twin of ``pallas_cache.evictions.base``."""

from __future__ import annotations

import dataclasses
from typing import Callable


def _nothing(cache) -> None:
    return None


def free_first(cache, evictable, resident_key) -> list[int]:
    """``evictable`` slots in victim order: free slots first by ``(usage, slot)``, then the
    residents ascending by ``resident_key(slot)``."""
    free = sorted((s for s in evictable if cache.residency.id_of_slot[s] < 0),
                  key=lambda s: (cache.residency.usage[s], s))
    return free + sorted((s for s in evictable if cache.residency.id_of_slot[s] >= 0), key=resident_key)


@dataclasses.dataclass(frozen=True)
class EvictionPolicy:
    """One reference eviction (docs/semantics.md §5.16).

    Attributes:
      name: the eviction's string value (the library record's ``name``).
      init: ``(num_layers, num_experts, history) -> record | None``: the bookkeeping of a cold
        cache, kept as ``cache.eviction_state`` under the library record's field names.
      observe: ``(cache, layer, distinct) -> None``: an accepted call of ``layer`` routed the
        experts ``distinct``; updates ``cache.eviction_state`` in place.
      rank: ``(cache, evictable, layer) -> list``: the ``evictable`` slots in victim order.
      start_token: ``cache -> None``: the next accepted call starts a token.
      allows_reuse: whether the REUSE admission may run with the eviction.
    """

    name: str
    init: Callable
    observe: Callable
    rank: Callable
    start_token: Callable = _nothing
    allows_reuse: bool = False
