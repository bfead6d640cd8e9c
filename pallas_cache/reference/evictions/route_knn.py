"""route_knn: the token ring, and residents ranked by a predicted next use read off the three most
similar past tokens (:func:`next_use`), largest first."""

from __future__ import annotations

from . import ring
from .base import EvictionPolicy, free_first

#: route_knn's neighbours per call (K).
NEIGHBOURS = 3


def next_use(cache, layer: int) -> dict[int, int]:
    """route_knn's predicted next use ``NU`` of every resident, ``{flat id: NU}``."""
    rs, L, E = cache.eviction_state, cache.num_layers, cache.num_experts
    # The K most similar past tokens (d tokens back), ties to the latest.
    neighbours = sorted(range(1, rs.count), key=lambda d: (int(rs.sim[ring.position(rs, d)]), -d),
                        reverse=True)[:NEIGHBOURS]
    horizon = -(-cache.cache_size // L)
    out = {}
    for flat in cache.residency.id_of_slot:
        if flat < 0:
            continue
        m, e = divmod(int(flat), E)
        shift = 1 if m <= layer else 0  # layer m of token T is already behind us
        total = len(neighbours) * (((m - layer - 1) % L) + 1)
        for d in neighbours:
            k = horizon
            for kk in range(horizon):
                back = d - kk - shift  # the token kk (+ shift) after the neighbour, d back
                seen = back > 0 or (back == 0 and m <= layer)
                if seen and rs.ring[ring.position(rs, back), m, e]:
                    k = kk
                    break
            total += L * k
        out[int(flat)] = total
    return out


def _rank(cache, evictable, layer) -> list[int]:
    predicted = next_use(cache, layer)
    # The largest predicted next use first, ties to the oldest last use, then lowest slot.
    return free_first(cache, evictable, lambda s: (-predicted[int(cache.residency.id_of_slot[s])],
                                                   cache.residency.usage[s], s))


POLICY = EvictionPolicy(name="route_knn", init=ring.init, observe=ring.observe, rank=_rank,
                        start_token=ring.start_token)
