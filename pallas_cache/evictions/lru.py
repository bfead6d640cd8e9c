"""``Eviction.LRU``: evictable slots ascend by ``(usage, slot)``, the global least recently used
first; no bookkeeping (docs/semantics.md §5.2)."""

from __future__ import annotations

from pallas_cache.evictions.base import (EvictionPolicy, KernelRanking, from_no_tables,
                                         no_bookkeeping, no_rows, no_tables)


def _observe(state, layer, routed, accepted):
    return state


def _victim_keys(state, id_of_slot, usage, layer, num_experts, cache_size):
    return (usage,)


def _kernel_key(tables, occupant, usage, own, computed):
    return (usage,)


POLICY = EvictionPolicy(
    name="lru",
    init=no_bookkeeping,
    observe=_observe,
    victim_keys=_victim_keys,
    allows_reuse=True,
    kernel=KernelRanking(tables=no_tables, from_tables=from_no_tables, width=1, key=_kernel_key,
                         observe_row=no_rows),
)
