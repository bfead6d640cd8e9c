"""route_lfu: route_knn's ring and similarities; residents ascend by ``(prot, L * F - NU, usage,
slot)`` with ``prot`` "routed by its layer's latest call in the ring", ``F`` the ring tokens that
routed it and ``NU`` route_knn's prediction (:func:`ring_frequency_key`)."""

from __future__ import annotations

import functools

from . import ring
from .base import EvictionPolicy, free_first
from .route_knn import next_use


def ring_frequency_key(cache, layer: int) -> dict[int, tuple[int, int]]:
    """route_lfu's key ``(prot, L * F - NU)`` of every resident, ``{flat id: key}``: ``prot`` =
    routed by the latest call of its layer the ring holds (token ``T`` if ``m <= layer``, else
    ``T - 1``), ``F`` = how many ring tokens routed it, ``NU`` = :func:`next_use`."""
    rs, L, E = cache.eviction_state, cache.num_layers, cache.num_experts
    predicted = next_use(cache, layer)
    out = {}
    for flat in predicted:
        m, e = divmod(flat, E)
        latest = 0 if m <= layer else 1  # tokens back
        prot = latest < rs.count and bool(rs.ring[ring.position(rs, latest), m, e])
        freq = sum(int(rs.ring[ring.position(rs, d), m, e]) for d in range(rs.count))
        out[flat] = (int(prot), L * freq - predicted[flat])
    return out


def _rank(cache, evictable, layer) -> list[int]:
    keys = ring_frequency_key(cache, layer)
    # Unprotected first, then the smallest L * F - NU, the oldest last use, the lowest slot.
    return free_first(cache, evictable, lambda s: keys[int(cache.residency.id_of_slot[s])]
                      + (cache.residency.usage[s], s))


POLICY = EvictionPolicy(name="route_lfu", init=functools.partial(ring.init, counts=True),
                        observe=ring.observe, rank=_rank, start_token=ring.start_token)
