"""The reference's eviction policies (docs/semantics.md §5.15), stated plainly over Python ints.

A policy only ranks victims: free slots first in ``(usage, slot)`` order, then the evictable
residents in the policy's order. ``lru``: ascending ``(usage, slot)``. ``pair_lfu``: per expert a
Q16 frequency, decayed as ``freq = (freq * 64132) >> 16`` (half-life 32 visits of the layer) at
every call of its layer, then ``+65536`` for each distinct routed expert, and a protection bit
(routed by its layer's last call); residents ascend by ``(prot, freq, last_use, slot)`` with
``last_use`` the slot's ``usage``. The JAX core forms the same decay in 32-bit halves; here it is
one exact int64 product.
"""

from __future__ import annotations

import numpy as np

EVICTIONS = ("lru", "pair_lfu", "route_knn")
#: ``2**(-1/32)`` in Q16: PAIR_LFU's decay per visit of the layer.
DECAY_Q16 = 64132
#: One routed call in Q16.
ONE_Q16 = 65536


def check_eviction(eviction) -> str:
    """The eviction's name; an unknown one raises ValueError naming it."""
    name = eviction.lower() if isinstance(eviction, str) else eviction
    if name not in EVICTIONS:
        raise ValueError(f"unknown eviction {eviction!r}; expected one of {EVICTIONS}")
    if name == "route_knn":
        raise NotImplementedError("eviction route_knn is not implemented yet")
    return name


def cold_bookkeeping(cache) -> None:
    """The policy's per-expert fields of a cold cache (none for LRU)."""
    if cache.eviction == "pair_lfu":
        cache.freq = np.zeros((cache.num_layers, cache.num_experts), np.int64)
        cache.prot = np.zeros((cache.num_layers, cache.num_experts), bool)


def observe_call(cache, layer: int, distinct: list[int]) -> None:
    """An accepted call of ``layer`` routed the experts ``distinct``: update the bookkeeping."""
    if cache.eviction != "pair_lfu":
        return
    for expert in range(cache.num_experts):
        # Every expert of the layer decays (exactly: the product fits int64)...
        cache.freq[layer, expert] = (int(cache.freq[layer, expert]) * DECAY_Q16) >> 16
        # ...and the protection bit says "routed by this, the layer's latest call".
        cache.prot[layer, expert] = expert in distinct
    for expert in distinct:
        cache.freq[layer, expert] += ONE_Q16


def ranked_victims(cache, step: int) -> list[int]:
    """Evictable slots (usage != step) in victim order under a non-LRU policy: free slots first
    by ``(usage, slot)``, then the residents by the policy's key. (LRU is ``DecodeOps``' own
    ``(usage, slot)`` sort, which puts free slots first too: their usage is 0 or FORGOTTEN.)"""
    evictable = [slot for slot in range(cache.cache_size) if cache.usage[slot] != step]
    free = sorted((s for s in evictable if cache.id_of_slot[s] < 0),
                  key=lambda s: (cache.usage[s], s))
    residents = [s for s in evictable if cache.id_of_slot[s] >= 0]
    E = cache.num_experts

    def pair_lfu_key(slot):
        layer, expert = divmod(int(cache.id_of_slot[slot]), E)
        return (bool(cache.prot[layer, expert]), int(cache.freq[layer, expert]),
                int(cache.usage[slot]), slot)

    return free + sorted(residents, key=pair_lfu_key)
