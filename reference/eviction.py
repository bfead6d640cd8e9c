"""The reference's eviction policies (docs/semantics.md §5.16), stated plainly over Python ints.

A policy only ranks victims: free slots first in ``(usage, slot)`` order, then the evictable
residents in the policy's order. ``lru``: ascending ``(usage, slot)``. ``pair_lfu``: per expert a
Q16 frequency, decayed as ``freq = (freq * 64132) >> 16`` (half-life 32 visits of the layer) at
every call of its layer, then ``+65536`` for each distinct routed expert, and a protection bit
(routed by its layer's last call); residents ascend by ``(prot, freq, last_use, slot)`` with
``last_use`` the slot's ``usage``. The JAX core forms the same decay in 32-bit halves; here it is
one exact int64 product. ``route_knn``: a ring of the last ``W`` tokens' routes per layer, a
similarity of each past token to the current one, and residents ranked by a predicted next use
read off the three most similar past tokens (:func:`next_use`), largest first. ``route_lfu``:
the same ring and similarities; residents ascend by ``(prot, L * F - NU, usage, slot)`` with
``prot`` "routed by its layer's latest call in the ring", ``F`` the ring tokens that routed it
and ``NU`` route_knn's prediction (:func:`ring_frequency_key`).
"""

from __future__ import annotations

import numpy as np

EVICTIONS = ("lru", "pair_lfu", "route_knn", "route_lfu")
#: The policies keeping the token ring.
RING_EVICTIONS = ("route_knn", "route_lfu")
#: ``2**(-1/32)`` in Q16: PAIR_LFU's decay per visit of the layer.
DECAY_Q16 = 64132
#: One routed call in Q16.
ONE_Q16 = 65536
#: route_knn's neighbours per call (K).
NEIGHBOURS = 3


def check_eviction(eviction) -> str:
    """The eviction's name; an unknown one raises ValueError naming it."""
    name = eviction.lower() if isinstance(eviction, str) else eviction
    if name not in EVICTIONS:
        raise ValueError(f"unknown eviction {eviction!r}; expected one of {EVICTIONS}")
    return name


def cold_bookkeeping(cache) -> None:
    """The policy's per-expert fields of a cold cache (none for LRU)."""
    if cache.eviction == "pair_lfu":
        cache.freq = np.zeros((cache.num_layers, cache.num_experts), np.int64)
        cache.prot = np.zeros((cache.num_layers, cache.num_experts), bool)
    if cache.eviction in RING_EVICTIONS:
        # R: the routed experts of token t's call to layer m live at ring[t % W, m].
        cache.ring = np.zeros((cache.history, cache.num_layers, cache.num_experts), bool)
        cache.sim = np.zeros(cache.history, np.int64)  # by ring position, like R
        cache.token = 0  # T, the current token (absolute); the first call continues token 0
        cache.last_layer = -1  # a call to a layer <= this starts a token


def start_token(cache) -> None:
    """route_knn, route_lfu: the next accepted call starts a token, whatever its layer."""
    if cache.eviction in RING_EVICTIONS:
        cache.last_layer = cache.num_layers


def observe_call(cache, layer: int, distinct: list[int]) -> None:
    """An accepted call of ``layer`` routed the experts ``distinct``: update the bookkeeping."""
    if cache.eviction in RING_EVICTIONS:
        _observe_token(cache, layer, distinct)
    if cache.eviction != "pair_lfu":
        return
    for expert in range(cache.num_experts):
        # Every expert of the layer decays (exactly: the product fits int64)...
        cache.freq[layer, expert] = (int(cache.freq[layer, expert]) * DECAY_Q16) >> 16
        # ...and the protection bit says "routed by this, the layer's latest call".
        cache.prot[layer, expert] = expert in distinct
    for expert in distinct:
        cache.freq[layer, expert] += ONE_Q16


def _in_ring(cache, t: int) -> bool:
    """Whether token ``t`` is held by the ring of the current token ``T``: ``T - W < t <= T``."""
    return 0 <= t and cache.token - cache.history < t <= cache.token


def _observe_token(cache, layer: int, distinct: list[int]) -> None:
    W = cache.history
    if layer <= cache.last_layer:
        # A token starts: the layer did not increase (or start_token asked for it).
        cache.token += 1
        T = cache.token
        cache.ring[T % W] = False  # the oldest token leaves the ring
        cache.sim[:] = 0
        for j in range(T - W + 1, T):
            # Previous tokens aligned: how much j's predecessor resembles T's predecessor.
            if _in_ring(cache, j) and _in_ring(cache, j - 1):
                cache.sim[j % W] = int(np.sum(cache.ring[(j - 1) % W] & cache.ring[(T - 1) % W]))
    cache.last_layer = layer
    T = cache.token
    routed = np.zeros(cache.num_experts, bool)
    routed[distinct] = True
    cache.ring[T % W, layer] = routed
    for j in range(T - W + 1, T):
        if _in_ring(cache, j):
            cache.sim[j % W] += 2 * int(np.sum(cache.ring[j % W, layer] & routed))


def next_use(cache, layer: int) -> dict[int, int]:
    """route_knn's predicted next use ``NU`` of every resident, ``{flat id: NU}``."""
    W, L, E, T = cache.history, cache.num_layers, cache.num_experts, cache.token
    past = [j for j in range(T - W + 1, T) if _in_ring(cache, j)]
    # The K most similar past tokens, ties to the latest.
    neighbours = sorted(past, key=lambda j: (int(cache.sim[j % W]), j), reverse=True)[:NEIGHBOURS]
    horizon = -(-cache.cache_size // L)
    out = {}
    for flat in cache.id_of_slot:
        if flat < 0:
            continue
        m, e = divmod(int(flat), E)
        shift = 1 if m <= layer else 0  # layer m of token T is already behind us
        total = len(neighbours) * (((m - layer - 1) % L) + 1)
        for j in neighbours:
            k = horizon
            for kk in range(horizon):
                t = j + kk + shift
                seen = t < T or (t == T and m <= layer)
                if seen and cache.ring[t % W, m, e]:
                    k = kk
                    break
            total += L * k
        out[int(flat)] = total
    return out


def ring_frequency_key(cache, layer: int) -> dict[int, tuple[int, int]]:
    """route_lfu's key ``(prot, L * F - NU)`` of every resident, ``{flat id: key}``: ``prot`` =
    routed by the latest call of its layer the ring holds (token ``T`` if ``m <= layer``, else
    ``T - 1``), ``F`` = how many ring tokens routed it, ``NU`` = :func:`next_use`."""
    W, L, E, T = cache.history, cache.num_layers, cache.num_experts, cache.token
    predicted = next_use(cache, layer)
    out = {}
    for flat in predicted:
        m, e = divmod(flat, E)
        latest = T if m <= layer else T - 1
        prot = _in_ring(cache, latest) and bool(cache.ring[latest % W, m, e])
        freq = sum(int(cache.ring[t % W, m, e]) for t in range(T - W + 1, T + 1)
                   if _in_ring(cache, t))
        out[flat] = (int(prot), L * freq - predicted[flat])
    return out


def ranked_victims(cache, step: int, layer: int) -> list[int]:
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

    if cache.eviction == "route_knn":
        predicted = next_use(cache, layer)
        # The largest predicted next use first, ties to the oldest last use, then lowest slot.
        return free + sorted(residents, key=lambda s: (-predicted[int(cache.id_of_slot[s])],
                                                       cache.usage[s], s))
    if cache.eviction == "route_lfu":
        keys = ring_frequency_key(cache, layer)
        # Unprotected first, then the smallest L * F - NU, the oldest last use, the lowest slot.
        return free + sorted(residents, key=lambda s: keys[int(cache.id_of_slot[s])]
                             + (cache.usage[s], s))
    return free + sorted(residents, key=pair_lfu_key)
