"""The reference's eviction policies (docs/semantics.md §5.16), stated plainly over Python ints:
one record per policy, one module each, registered in :data:`POLICIES`."""

from __future__ import annotations

from . import lru, pair_lfu, route_knn, route_lfu
from .base import EvictionPolicy, free_first  # noqa: F401

#: The registry: name -> record.
POLICIES = {policy.name: policy for policy in
            (lru.POLICY, pair_lfu.POLICY, route_knn.POLICY, route_lfu.POLICY)}


def check_eviction(eviction) -> str:
    """The eviction's name (of a name, or of a record with a ``name``, a JAX one included); an
    unknown one raises ValueError naming it."""
    name = getattr(eviction, "name", eviction)
    name = name.lower() if isinstance(name, str) else name
    if name not in POLICIES:
        raise ValueError(f"unknown eviction {eviction!r}; expected one of {tuple(POLICIES)}")
    return name


def policy_of(cache) -> EvictionPolicy:
    """The record of a cache's eviction."""
    return POLICIES[cache.eviction]


def ranked_victims(cache, step: int, layer: int) -> list[int]:
    """The evictable slots (``usage != step``, usable) in victim order under the cache's policy
    (free slots first by ``(usage, slot)``, then the residents by the policy's key)."""
    evictable = [slot for slot in range(cache.cache_size) if cache.usage[slot] != step]
    return policy_of(cache).rank(cache, evictable, layer)
