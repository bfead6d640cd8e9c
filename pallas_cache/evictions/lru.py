"""``Eviction.LRU``: evictable slots ascend by ``(usage, slot)``, the global least recently used
first; no bookkeeping (docs/semantics.md §5.2)."""

from __future__ import annotations

from pallas_cache.evictions.base import EvictionPolicy, KernelRanking


def _observe(state, layer, routed, accepted):
    return state


def _victim_keys(state, id_of_slot, usage, layer, num_experts, cache_size):
    return (usage,)


POLICY = EvictionPolicy(
    name="lru",
    init=lambda num_layers, num_experts, history: None,
    observe=_observe,
    victim_keys=_victim_keys,
    allows_reuse=True,
    kernel=KernelRanking(tables=lambda state: (), from_tables=lambda tables: None, width=1,
                         key=lambda tables, occupant, usage, own, computed: (usage,),
                         observe_row=lambda rows, routed: ()),
)
