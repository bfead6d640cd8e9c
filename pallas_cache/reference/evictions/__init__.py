"""The reference's evictions (docs/semantics.md §5.16), stated plainly over Python ints:
one record per policy, one module each, registered in :data:`POLICIES`."""

from __future__ import annotations

from . import lru, pair_lfu, route_knn, route_lfu
from .base import EvictionPolicy, free_first  # noqa: F401
from .pair_lfu import PairLfuState  # noqa: F401
from .ring import TokenRingState  # noqa: F401

#: The registry: name -> record.
POLICIES = {eviction.name: eviction for eviction in
            (lru.POLICY, pair_lfu.POLICY, route_knn.POLICY, route_lfu.POLICY)}


def check_eviction(eviction) -> EvictionPolicy:
    """The record of an eviction: a reference record as is; a name, or a library record or
    ``Eviction`` member by its name, from :data:`POLICIES`. An unknown one raises ValueError
    naming it."""
    if isinstance(eviction, EvictionPolicy):
        return eviction
    name = getattr(eviction, "name", eviction)
    name = name.lower() if isinstance(name, str) else name
    if name not in POLICIES:
        raise ValueError(f"unknown eviction {eviction!r}; expected one of {tuple(POLICIES)}")
    return POLICIES[name]


def ranked_victims(cache, step: int, layer: int) -> list[int]:
    """The evictable slots (``usage != step``, usable) in victim order under the cache's eviction
    (free slots first by ``(usage, slot)``, then the residents by the eviction's key)."""
    evictable = [slot for slot in range(cache.cache_size) if cache.residency.usage[slot] != step]
    return cache.eviction.rank(cache, evictable, layer)
