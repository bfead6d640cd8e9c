"""``Eviction.ROUTE_LFU``: ROUTE_KNN's token ring with its per-expert ring frequency ``F``, and
residents ascending by ``(prot, L * F - NU, last_use, slot)``: protected if routed by their
layer's latest call, then the fewest ring tokens routing them against ROUTE_KNN's predicted next
use (docs/semantics.md §5.16)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from pallas_cache.evictions import ring
from pallas_cache.evictions.base import (EvictionPolicy, KernelRanking, PerCall,
                                         from_no_tables, no_rows, no_tables)
from pallas_cache.evictions.ring import unpacked
from pallas_cache.evictions.route_knn import next_use


def _victim_keys(state, id_of_slot, usage, layer, num_experts, cache_size):
    free = id_of_slot < 0
    prot, score = ring_frequency_key(state, id_of_slot, layer, num_experts, cache_size)
    # Class 0 = free (ranked by usage alone), 1 = unprotected, 2 = protected resident.
    return jnp.where(free, 0, 1 + prot), jnp.where(free, 0, score), usage


def _kernel_key(tables, occupant, usage, own, computed):
    """:func:`_victim_keys` in the fused kernel, from the protection, ring frequency and next use
    it computes per call."""
    free = occupant < 0
    score = computed.num_layers * computed.freq - computed.next_use
    return jnp.where(free, 0, 1 + computed.prot), jnp.where(free, 0, score), usage


def ring_frequency_key(ring, id_of_slot, layer, num_experts, cache_size=None):
    """ROUTE_LFU's key of every slot's occupant (docs/semantics.md §5.16): ``prot`` int32[C]
    (1 if routed by the latest call of its layer the ring holds: this token's for layers up to
    ``layer``, the previous token's after it) and ``L * F - NU`` int32[C], ``F`` the ring tokens
    that routed the occupant (the ``counts`` the bookkeeping keeps), ``NU``
    :func:`~pallas_cache.evictions.route_knn.next_use`."""
    history, num_layers, _ = ring.masks.shape
    layers = lax.iota(jnp.int32, num_layers)
    current = unpacked(ring.masks[ring.head], num_experts)  # [L, E]
    previous = unpacked(ring.masks[(ring.head - 1) % history], num_experts)
    prot = jnp.where((layers <= layer)[:, None], current,
                     jnp.where(ring.count >= 2, previous, 0))
    predicted = next_use(ring, id_of_slot, layer, num_experts, cache_size)
    occupant = jnp.maximum(id_of_slot, 0)
    score = num_layers * ring.counts.reshape(-1)[occupant] - predicted
    return prot.reshape(-1)[occupant], score


POLICY = EvictionPolicy(
    name="route_lfu",
    init=functools.partial(ring.init, counts=True),
    observe=ring.observe,
    victim_keys=_victim_keys,
    start_token=ring.start_token,
    history_of=ring.history_of,
    kernel=KernelRanking(tables=no_tables, from_tables=from_no_tables, width=3,
                         key=_kernel_key, observe_row=no_rows,
                         per_call=(PerCall.NEXT_USE, PerCall.PROT, PerCall.FREQ)),
)
