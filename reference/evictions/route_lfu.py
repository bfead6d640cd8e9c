"""route_lfu: route_knn's ring and similarities; residents ascend by ``(prot, L * F - NU, usage,
slot)`` with ``prot`` "routed by its layer's latest call in the ring", ``F`` the ring tokens that
routed it and ``NU`` route_knn's prediction (:func:`ring_frequency_key`)."""

from __future__ import annotations

import numpy as np

from . import ring
from .base import EvictionPolicy, free_first
from .route_knn import next_use


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
        prot = ring.in_ring(cache, latest) and bool(cache.ring[latest % W, m, e])
        freq = sum(int(cache.ring[t % W, m, e]) for t in range(T - W + 1, T + 1)
                   if ring.in_ring(cache, t))
        out[flat] = (int(prot), L * freq - predicted[flat])
    return out


def _rank(cache, evictable, layer) -> list[int]:
    keys = ring_frequency_key(cache, layer)
    # Unprotected first, then the smallest L * F - NU, the oldest last use, the lowest slot.
    return free_first(cache, evictable, lambda s: keys[int(cache.id_of_slot[s])]
                      + (cache.usage[s], s))


def _fields(cache) -> dict:
    # The JAX core keeps F incrementally; the reference recounts its ring.
    return {**ring.fields(cache), "counts": cache.ring.sum(axis=0).astype(np.int64)}


POLICY = EvictionPolicy(name="route_lfu", cold=ring.cold, observe=ring.observe, rank=_rank,
                        start_token=ring.start_token, fields=_fields)
