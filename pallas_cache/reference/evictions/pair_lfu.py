"""pair_lfu: per expert a Q16 frequency, decayed as ``freq = (freq * 64132) >> 16`` (half-life 32
visits of the layer) at every call of its layer, then ``+65536`` for each distinct routed expert,
and a protection bit (routed by its layer's last call); residents ascend by ``(prot, freq,
last_use, slot)``. The JAX core forms the decay in 32-bit halves; here it is one int64 product."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import EvictionPolicy, free_first

#: ``2**(-1/32)`` in Q16: PAIR_LFU's decay per visit of the layer.
DECAY_Q16 = 64132
#: One routed call in Q16.
ONE_Q16 = 65536


@dataclass
class PairLfuState:
    """PAIR_LFU's bookkeeping, the fields of ``pallas_cache.evictions.PairLfuState``."""

    freq: np.ndarray  # [L, E] Q16 routing frequency
    prot: np.ndarray  # [L, E] bool: routed by the last accepted call of its layer


def _init(num_layers, num_experts, history) -> PairLfuState:
    return PairLfuState(freq=np.zeros((num_layers, num_experts), np.int64),
                        prot=np.zeros((num_layers, num_experts), bool))


def _observe(cache, layer: int, distinct: list[int]) -> None:
    lfu = cache.eviction_state
    for expert in range(cache.num_experts):
        # Every expert of the layer decays (exactly: the product fits int64)...
        lfu.freq[layer, expert] = (int(lfu.freq[layer, expert]) * DECAY_Q16) >> 16
        # ...and the protection bit says "routed by this, the layer's latest call".
        lfu.prot[layer, expert] = expert in distinct
    for expert in distinct:
        lfu.freq[layer, expert] += ONE_Q16


def _rank(cache, evictable, layer) -> list[int]:
    E, lfu = cache.num_experts, cache.eviction_state

    def key(slot):
        m, e = divmod(int(cache.residency.id_of_slot[slot]), E)
        return bool(lfu.prot[m, e]), int(lfu.freq[m, e]), int(cache.residency.usage[slot]), slot

    return free_first(cache, evictable, key)


POLICY = EvictionPolicy(name="pair_lfu", init=_init, observe=_observe, rank=_rank)
