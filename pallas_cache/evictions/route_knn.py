"""``Eviction.ROUTE_KNN``: the token ring (:mod:`~pallas_cache.evictions.ring`), and residents
ranked by the next use the three most similar past tokens predict, furthest first
(docs/semantics.md §5.16)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from pallas_cache import selection
from pallas_cache.evictions import ring as ring_module
from pallas_cache.evictions.base import (EvictionPolicy, KernelRanking, PerCall,
                                         from_no_tables, no_rows, no_tables)
from pallas_cache.evictions.ring import NEIGHBOURS
from pallas_cache.validate import INT32_MAX


def _victim_keys(state, id_of_slot, usage, layer, num_experts, cache_size):
    # Largest predicted next use first: free slots below every -NU.
    return (jnp.where(id_of_slot < 0, -(1 << 30),
                      -next_use(state, id_of_slot, layer, num_experts, cache_size)), usage)


def _kernel_key(tables, occupant, usage, own, computed):
    """:func:`_victim_keys` in the fused kernel, from the next use it computes per call."""
    return jnp.where(occupant < 0, -(1 << 30), -computed.next_use), usage


def next_use(ring, id_of_slot, layer, num_experts, cache_size=None, per_slot=None):
    """ROUTE_KNN's predicted next use ``NU`` of every slot's occupant (docs/semantics.md
    §5.16), int32[C]: the ``K`` past tokens with the largest ``(sim, token)`` are the neighbours;
    for each, the first of the next ``H = ceil(S / L)`` tokens (shifted by one for layers at or
    before this one) that routed the occupant, counting seen routes only. ``S`` is the usable
    size, traced: the token axis has the static length ``ceil(C / L)`` and ``k >= H`` is masked
    (with ``S == C`` the mask is all true).

    ``per_slot`` (static; ``None``: :func:`_reads_per_slot`) picks one of two exact
    formulations: per (layer, expert) by bit-sliced counters over the neighbours' mask words, or
    per slot over one gathered row of words each."""
    history, num_layers, words = ring.masks.shape
    num_slots = id_of_slot.shape[0]
    bound = -(-num_slots // num_layers)  # static: H for the whole capacity
    usable = num_slots if cache_size is None else cache_size
    horizon = (usable + num_layers - 1) // num_layers  # traced H = ceil(S / L)
    neighbour = _neighbours(ring, num_experts)
    found = jnp.sum(neighbour >= 0, dtype=jnp.int32)
    if per_slot is None:
        per_slot = _reads_per_slot(num_slots, num_layers)
    if per_slot:
        return _next_use_per_slot(ring, id_of_slot, layer, num_experts, neighbour, found, bound,
                                  horizon)
    table = functools.partial(_predicted_table, num_experts=num_experts, bound=bound)
    if ring_module.branches_on_cpu(ring):
        # With no neighbour the table is all zero; the branch also makes XLA:CPU compute it
        # once, where fused into the victim search it would be recomputed per slot.
        zeros = lambda *_: jnp.zeros((num_layers, num_experts), jnp.int32)  # noqa: E731
        predicted = ring_module.cpu_branch(found > 0, table, zeros, ring, layer, neighbour,
                                           found, horizon)
    else:
        predicted = table(ring, layer, neighbour, found, horizon)
    return predicted.reshape(-1)[jnp.maximum(id_of_slot, 0)]


def _predicted_table(ring, layer, neighbour, found, horizon, *, num_experts, bound):
    """:func:`next_use` per (layer, expert), int32[L, E]."""
    num_layers = ring.masks.shape[1]
    layers = lax.iota(jnp.int32, num_layers)
    steps = found * horizon - _first_use_misses(ring, layer, num_experts, neighbour, bound,
                                                horizon)
    distance = (layers - layer - 1 + num_layers) % num_layers + 1
    return found * distance[:, None] + num_layers * steps


def _neighbours(ring, num_experts):
    """The ages of the ``K`` past tokens with the largest ``(sim, token)`` (ties to the latest
    token), most similar first, int32[K]; -1 = none."""
    history, num_layers, _ = ring.masks.shape
    ages = lax.iota(jnp.int32, history)
    by_age = ring.sim[(ring.head - ages) % history]
    past = (ages >= 1) & (ages <= ring.count - 1)
    num = min(NEIGHBOURS, history)
    # sim <= 3 * L * E: the aligned part counts one call per layer, each call adds twice its own.
    top = 3 * num_layers * num_experts
    if (top + 1) * history > INT32_MAX:
        # Ascending (-sim, age) = descending (sim, token).
        return selection.first_in_order(-by_age, past, num)
    # The same order as one distinct key that holds its own age.
    picks = selection.smallest_values((top - by_age) * history + ages, past, num)
    return jnp.where(picks >= 0, picks % history, -1)


def _first_use_misses(ring, layer, num_experts, neighbour, bound, horizon):
    """``found * H - sum_j first_j``, int32[L, E], where ``first_j`` is the first ``k < H`` whose
    token routed (m, e) (``H`` if none), over the neighbours ``j`` found.

    ``first_j = #{k < H : (m, e) not in P_jk}`` with ``P_jk`` the OR of the neighbour's seen mask
    words up to ``k``, so the result is a count of set bits over the ``K * B`` words ``P_jk``,
    which bit-sliced counters (one word per bit of the count) add word-wide; only the count's
    planes are unpacked to ``[L, E]``."""
    history, num_layers, words = ring.masks.shape
    shifted = (lax.iota(jnp.int32, num_layers) <= layer)[:, None]  # layer m called in this token
    # Token j + k + shift has age a_j - k - shift: rows of ages a_j - k', k' = 0..B.
    offset = lax.iota(jnp.int32, bound + 1)
    rows = ring.masks[(ring.head - neighbour[:, None] + offset[None, :]) % history]  # [K, B+1, L, w]
    zero = jnp.uint32(0)
    planes = [jnp.zeros((num_layers, words), jnp.uint32)
              for _ in range((neighbour.shape[0] * bound).bit_length())]
    for j in range(neighbour.shape[0]):
        age = neighbour[j]
        prefix = jnp.zeros((num_layers, words), jnp.uint32)
        for k in range(bound):
            word = jnp.where(shifted, rows[j, k + 1], rows[j, k])
            prefix = prefix | jnp.where(k <= age - 1, word, zero)  # seen iff k <= a_j - 1
            carry = jnp.where((age >= 0) & (k < horizon), prefix, zero)
            for b, plane in enumerate(planes):
                planes[b], carry = plane ^ carry, plane & carry
    experts = lax.iota(jnp.int32, num_experts)
    count = jnp.zeros((num_layers, num_experts), jnp.int32)
    for b, plane in enumerate(planes):
        bit = (plane[:, experts // 32] >> (experts % 32).astype(jnp.uint32)) & 1
        count = count + (bit.astype(jnp.int32) << b)
    return count


#: Above this many words ``P_jk`` per layer (``K * ceil(C / L)``), :func:`next_use` reads per
#: slot: the counters' unrolled adds grow with it, the per-slot gather does not.
_COUNTED_WORDS_MAX = 64


def _reads_per_slot(num_slots: int, num_layers: int) -> bool:
    """Whether :func:`next_use` reads per slot (measured on XLA:CPU: the counters are faster at
    Mixtral's L=32 S=128 and the fine-grained L=48 S=768, 12 and 48 words)."""
    return NEIGHBOURS * -(-num_slots // num_layers) > _COUNTED_WORDS_MAX


def _next_use_per_slot(ring, id_of_slot, layer, num_experts, neighbour, found, bound, horizon):
    """:func:`next_use` per slot: the rows of the neighbours' next ``bound + 1`` tokens laid
    out ``[L, w, K, bound + 1]``, so each slot gathers one contiguous row of words and tests its
    own bit (``K * (bound + 1) * C`` words instead of ``K * bound * L * 32w`` bits)."""
    history, num_layers, _ = ring.masks.shape
    occupant = jnp.maximum(id_of_slot, 0)
    m, e = occupant // num_experts, occupant % num_experts  # [C]
    shift = (m <= layer).astype(jnp.int32)  # layer m was already called in this token
    # Token j + k' (k' = k + shift) has age a_j - k'.
    offset = lax.iota(jnp.int32, bound + 1)
    position = (ring.head - neighbour[:, None] + offset[None, :]) % history  # [K, B+1]
    rows = ring.masks[position]  # [K, B+1, L, w]
    words = jnp.transpose(rows, (2, 3, 0, 1))[m, e // 32]  # [C, K, B+1]
    routed = ((words >> (e % 32).astype(jnp.uint32)[:, None, None]) & 1) == 1
    k = offset[None, None, :] - shift[:, None, None]  # [C, 1, B+1]
    # Seen iff k <= a_j - 1; only the first H tokens count (H <= bound).
    counted = (k >= 0) & (k < horizon) & (k <= neighbour[None, :, None] - 1)
    first = jnp.min(jnp.where(routed & counted, k, horizon), axis=2)  # [C, K]
    steps = jnp.sum(jnp.where((neighbour >= 0)[None, :], first, 0), axis=1)  # [C]
    distance = (m - layer - 1 + num_layers) % num_layers + 1
    return found * distance + num_layers * steps


POLICY = EvictionPolicy(
    name="route_knn",
    init=functools.partial(ring_module.init, counts=False),
    observe=ring_module.observe,
    victim_keys=_victim_keys,
    start_token=ring_module.start_token,
    history_of=ring_module.history_of,
    kernel=KernelRanking(tables=no_tables, from_tables=from_no_tables, width=2,
                         key=_kernel_key, observe_row=no_rows,
                         per_call=(PerCall.NEXT_USE,)),
)
