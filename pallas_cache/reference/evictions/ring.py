"""The token ring route_knn and route_lfu keep, under the field names of
``pallas_cache.evictions.TokenRingState``: ``ring[p, m]`` the experts routed by the call to layer
``m`` of the token at ring position ``p`` (bools here, bitmask words ``masks`` in the library),
each past token's similarity ``sim`` to the current one, the current token's position ``head`` and
the tokens held ``count``. A token ``d`` tokens before the current one (``0 <= d < count``) lives
at :func:`position` ``(head - d) % W``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TokenRingState:
    """The ring's bookkeeping (the library's ``match`` is its incremental form of ``sim`` and has
    no twin here; ``counts`` only under route_lfu)."""

    ring: np.ndarray  # [W, L, E] bool
    sim: np.ndarray  # [W] similarity of each ring position's token to the current one
    head: int  # ring position of the current token T
    count: int  # tokens in the ring, the current one included: min(T + 1, W)
    last_layer: int  # a call to a layer <= this starts a token (-1 before any call)
    counts: np.ndarray | None = None  # [L, E] route_lfu: ring tokens that routed each expert


def init(num_layers, num_experts, history, *, counts=False) -> TokenRingState:
    """The ring of a cold cache; the first call continues token 0."""
    return TokenRingState(
        ring=np.zeros((history, num_layers, num_experts), bool), sim=np.zeros(history, np.int64),
        head=0, count=1, last_layer=-1,
        counts=np.zeros((num_layers, num_experts), np.int64) if counts else None)


def position(rs: TokenRingState, d: int) -> int:
    """The ring position of the token ``d`` tokens before the current one."""
    return (rs.head - d) % rs.ring.shape[0]


def start_token(cache) -> None:
    """The next accepted call starts a token, whatever its layer."""
    cache.eviction_state.last_layer = cache.num_layers


def observe(cache, layer: int, distinct: list[int]) -> None:
    rs = cache.eviction_state
    W = rs.ring.shape[0]
    if layer <= rs.last_layer:
        # A token starts: the layer did not increase (or start_token asked for it).
        rs.head, rs.count = (rs.head + 1) % W, min(rs.count + 1, W)
        rs.ring[rs.head] = False  # the oldest token leaves the ring
        rs.sim[:] = 0
        for d in range(1, rs.count - 1):
            # Previous tokens aligned: how much d's predecessor resembles T's predecessor.
            rs.sim[position(rs, d)] = int(np.sum(rs.ring[position(rs, d + 1)]
                                                 & rs.ring[position(rs, 1)]))
    rs.last_layer = layer
    routed = np.zeros(cache.num_experts, bool)
    routed[distinct] = True
    rs.ring[rs.head, layer] = routed
    for d in range(1, rs.count):
        rs.sim[position(rs, d)] += 2 * int(np.sum(rs.ring[position(rs, d), layer] & routed))
    if rs.counts is not None:
        rs.counts = rs.ring.sum(axis=0).astype(np.int64)  # the library keeps F incrementally
