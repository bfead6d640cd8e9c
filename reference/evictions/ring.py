"""The token ring route_knn and route_lfu keep: ``ring[t % W, m]`` the experts token ``t``'s call
to layer ``m`` routed, each past token's similarity to the current one, the current token ``T``."""

from __future__ import annotations

import numpy as np


def cold(cache) -> None:
    """The ring of a cold cache."""
    # R: the routed experts of token t's call to layer m live at ring[t % W, m].
    cache.ring = np.zeros((cache.history, cache.num_layers, cache.num_experts), bool)
    cache.sim = np.zeros(cache.history, np.int64)  # by ring position, like R
    cache.token = 0  # T, the current token (absolute); the first call continues token 0
    cache.last_layer = -1  # a call to a layer <= this starts a token


def start_token(cache) -> None:
    """The next accepted call starts a token, whatever its layer."""
    cache.last_layer = cache.num_layers


def fields(cache) -> dict:
    """The ring under the JAX core's names (``head``, ``count`` from the absolute token)."""
    return {"ring": np.array(cache.ring, copy=True), "sim": np.array(cache.sim, copy=True),
            "last_layer": np.array(cache.last_layer),
            "head": np.array(cache.token % cache.history),
            "count": np.array(min(cache.token + 1, cache.history))}


def in_ring(cache, t: int) -> bool:
    """Whether token ``t`` is held by the ring of the current token ``T``: ``T - W < t <= T``."""
    return 0 <= t and cache.token - cache.history < t <= cache.token


def observe(cache, layer: int, distinct: list[int]) -> None:
    W = cache.history
    if layer <= cache.last_layer:
        # A token starts: the layer did not increase (or start_token asked for it).
        cache.token += 1
        T = cache.token
        cache.ring[T % W] = False  # the oldest token leaves the ring
        cache.sim[:] = 0
        for j in range(T - W + 1, T):
            # Previous tokens aligned: how much j's predecessor resembles T's predecessor.
            if in_ring(cache, j) and in_ring(cache, j - 1):
                cache.sim[j % W] = int(np.sum(cache.ring[(j - 1) % W] & cache.ring[(T - 1) % W]))
    cache.last_layer = layer
    T = cache.token
    routed = np.zeros(cache.num_experts, bool)
    routed[distinct] = True
    cache.ring[T % W, layer] = routed
    for j in range(T - W + 1, T):
        if in_ring(cache, j):
            cache.sim[j % W] += 2 * int(np.sum(cache.ring[j % W, layer] & routed))
