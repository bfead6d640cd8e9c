"""A toy eviction policy outside the registry, for the tests that show a policy needs only its
record and its NumPy twin (tests/core/test_eviction.py) and that every eviction-parametrised test
picks it up (tests/lockstep/test_harness.py's plugin imports this module before collection)."""

from __future__ import annotations

import jax.numpy as jnp

import pallas_cache as pc
from pallas_cache import reference


def _mru_keys(state, id_of_slot, usage, layer, num_experts, cache_size):
    """Free slots first by (usage, slot), then the most recently used resident."""
    free = id_of_slot < 0
    return jnp.where(free, 0, 1), jnp.where(free, usage, -usage)


#: MRU: one record and its NumPy twin, nothing else.
MRU = pc.evictions.EvictionPolicy(name="mru", init=lambda num_layers, num_experts, history: None,
                                  observe=lambda state, layer, routed, accepted: state,
                                  victim_keys=_mru_keys)
REFERENCE_MRU = reference.EvictionPolicy(
    name="mru", init=lambda num_layers, num_experts, history: None,
    observe=lambda cache, layer, distinct: None,
    rank=lambda cache, evictable, layer: reference.evictions.free_first(
        cache, evictable, lambda s: (-cache.residency.usage[s], s)))
