"""pair_lfu: per expert a Q16 frequency, decayed as ``freq = (freq * 64132) >> 16`` (half-life 32
visits of the layer) at every call of its layer, then ``+65536`` for each distinct routed expert,
and a protection bit (routed by its layer's last call); residents ascend by ``(prot, freq,
last_use, slot)``. The JAX core forms the decay in 32-bit halves; here it is one int64 product."""

from __future__ import annotations

import numpy as np

from .base import EvictionPolicy, free_first

#: ``2**(-1/32)`` in Q16: PAIR_LFU's decay per visit of the layer.
DECAY_Q16 = 64132
#: One routed call in Q16.
ONE_Q16 = 65536


def _cold(cache) -> None:
    cache.freq = np.zeros((cache.num_layers, cache.num_experts), np.int64)
    cache.prot = np.zeros((cache.num_layers, cache.num_experts), bool)


def _observe(cache, layer: int, distinct: list[int]) -> None:
    for expert in range(cache.num_experts):
        # Every expert of the layer decays (exactly: the product fits int64)...
        cache.freq[layer, expert] = (int(cache.freq[layer, expert]) * DECAY_Q16) >> 16
        # ...and the protection bit says "routed by this, the layer's latest call".
        cache.prot[layer, expert] = expert in distinct
    for expert in distinct:
        cache.freq[layer, expert] += ONE_Q16


def _rank(cache, evictable, layer) -> list[int]:
    E = cache.num_experts

    def key(slot):
        m, e = divmod(int(cache.id_of_slot[slot]), E)
        return bool(cache.prot[m, e]), int(cache.freq[m, e]), int(cache.usage[slot]), slot

    return free_first(cache, evictable, key)


POLICY = EvictionPolicy(
    name="pair_lfu", cold=_cold, observe=_observe, rank=_rank,
    fields=lambda cache: {"freq": np.array(cache.freq, copy=True),
                          "prot": np.array(cache.prot, copy=True)},
)
