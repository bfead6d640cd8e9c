"""lru: the evictable slots ascend by ``(usage, slot)``; no bookkeeping."""

from __future__ import annotations

from .base import EvictionPolicy

POLICY = EvictionPolicy(
    name="lru",
    init=lambda num_layers, num_experts, history: None,
    observe=lambda cache, layer, distinct: None,
    rank=lambda cache, evictable, layer: sorted(evictable, key=lambda s: (cache.residency.usage[s], s)),
    allows_reuse=True,
)
