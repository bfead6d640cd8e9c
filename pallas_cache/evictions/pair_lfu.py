"""``Eviction.PAIR_LFU``: per expert a Q16 frequency decayed at every call of its layer
(half-life 32 visits) and a protection bit (routed by the layer's last call); residents ascend by
``(prot, freq, last_use, slot)`` (docs/semantics.md §5.16). Ranked in the fused kernel too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_cache.evictions.base import EvictionPolicy, KernelRanking
from pallas_cache.tree import Record, pytree_dataclass

#: The per-visit decay of PAIR_LFU's frequency, ``2**(-1/32)`` in Q16 (half-life 32 visits).
DECAY_Q16 = 64132
#: What one routed call adds to an expert's frequency: 1.0 in Q16.
ONE_Q16 = 65536
# Residents' frequencies stay below 2**22 (the fixed point of f -> f*DECAY/2**16 + 2**16 is about
# 3.06M), so (class, freq) packs into one int32 key: class * 2**23 + freq.
_CLASS_SHIFT = 23


@pytree_dataclass
class PairLfuState(Record):
    """PAIR_LFU's per-expert bookkeeping (docs/semantics.md §5.16).

    Attributes:
      freq: int32[L, E]. Q16 routing frequency, decayed by ``DECAY_Q16 / 2**16`` at every
        accepted call of the layer, +``ONE_Q16`` for each distinct routed expert.
      prot: bool[L, E]. Whether the expert was routed by the last accepted call of its layer.
    """

    freq: jax.Array
    prot: jax.Array


def decay_q16(freq):
    """``(freq * DECAY_Q16) >> 16`` exactly, for ``0 <= freq < 2**31``, in 32-bit arithmetic.

    The product needs 47 bits; with ``freq = hi * 2**16 + lo`` it is
    ``hi * DECAY_Q16 + ((lo * DECAY_Q16) >> 16)``, where ``lo * DECAY_Q16 < 2**32`` is formed in
    uint32 and ``hi * DECAY_Q16 < 2**31`` for every frequency PAIR_LFU reaches.
    """
    hi = freq >> 16
    lo = (freq & 0xFFFF).astype(jnp.uint32)
    low_part = ((lo * jnp.uint32(DECAY_Q16)) >> 16).astype(jnp.int32)
    return hi * DECAY_Q16 + low_part


def _init(num_layers, num_experts, history):
    return PairLfuState(freq=jnp.zeros((num_layers, num_experts), jnp.int32),
                        prot=jnp.zeros((num_layers, num_experts), jnp.bool_))


def _observe_row(rows, routed):
    freq, _ = rows
    return decay_q16(freq) + jnp.where(routed, ONE_Q16, 0), routed


def _observe(state, layer, routed, accepted):
    freq, prot = _observe_row((state.freq[layer], state.prot[layer]), routed)
    freq = lax.dynamic_update_slice(
        state.freq, jnp.where(accepted, freq, state.freq[layer])[None], (layer, jnp.int32(0)))
    prot = lax.dynamic_update_slice(
        state.prot, jnp.where(accepted, prot, state.prot[layer])[None], (layer, jnp.int32(0)))
    return PairLfuState(freq=freq, prot=prot)


def _key(freq, prot, free, usage):
    """The victim key from the occupant's frequency and protection (int32): class 0 = free
    (ranked by usage alone), 1 = unprotected, 2 = protected resident, packed with ``freq``."""
    return jnp.where(free, 0, ((1 + prot) << _CLASS_SHIFT) + freq), usage


def _victim_keys(state, id_of_slot, usage, layer, num_experts, cache_size):
    occupant = jnp.maximum(id_of_slot, 0)
    freq = state.freq.reshape(-1)[occupant]
    prot = state.prot.reshape(-1)[occupant].astype(jnp.int32)
    return _key(freq, prot, id_of_slot < 0, usage)


def _kernel_key(tables, occupant, usage, own, computed):
    """:func:`_key` in the kernel, from the tables before the call: this layer's evictable
    residents were not routed (a routed resident is a hit), so this call's bookkeeping decays
    their frequency and clears their protection."""
    freq, prot = tables
    prot = prot.astype(jnp.int32)
    freq = jnp.where(own, decay_q16(freq), freq)
    prot = jnp.where(own, 0, prot)
    return _key(freq, prot, occupant < 0, usage)


def _tables(state):
    return state.freq, state.prot


def _from_tables(tables):
    return PairLfuState(*tables)


POLICY = EvictionPolicy(
    name="pair_lfu",
    init=_init,
    observe=_observe,
    victim_keys=_victim_keys,
    kernel=KernelRanking(tables=_tables, from_tables=_from_tables, width=2,
                         key=_kernel_key, observe_row=_observe_row),
    view_columns=("prot", "freq"),
)
