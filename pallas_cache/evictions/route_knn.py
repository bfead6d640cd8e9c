"""``Eviction.ROUTE_KNN``: the token ring (:mod:`~pallas_cache.evictions.ring`), and residents
ranked by the next use the three most similar past tokens predict, furthest first
(docs/semantics.md §5.16)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_cache import selection
from pallas_cache.evictions import ring
from pallas_cache.evictions.base import EvictionPolicy

#: ROUTE_KNN's neighbours per call (``K``).
NEIGHBOURS = 3


def _victim_keys(state, id_of_slot, usage, layer, num_experts, cache_size):
    # Largest predicted next use first: free slots below every -NU.
    return (jnp.where(id_of_slot < 0, -(1 << 30),
                      -next_use(state, id_of_slot, layer, num_experts, cache_size)), usage)


def next_use(ring, id_of_slot, layer, num_experts, cache_size=None, per_slot=None):
    """ROUTE_KNN's predicted next use ``NU`` of every slot's occupant (docs/semantics.md
    §5.16), int32[C]: the ``K`` past tokens with the largest ``(sim, token)`` are the neighbours;
    for each, the first of the next ``H = ceil(S / L)`` tokens (shifted by one for layers at or
    before this one) that routed the occupant, counting seen routes only. ``S`` is the usable
    size, traced: the token axis has the static length ``ceil(C / L)`` and ``k >= H`` is masked
    (with ``S == C`` the mask is all true).

    ``per_slot`` (static; ``None``: :func:`_reads_per_slot`) picks one of two exact
    formulations: per (layer, expert) over the unpacked rows of the neighbours' tokens, or per
    slot over one gathered row of words each."""
    history, num_layers, words = ring.masks.shape
    num_slots = id_of_slot.shape[0]
    bound = -(-num_slots // num_layers)  # static: H for the whole capacity
    usable = num_slots if cache_size is None else cache_size
    horizon = (usable + num_layers - 1) // num_layers  # traced H = ceil(S / L)
    ages = lax.iota(jnp.int32, history)
    by_age = ring.sim[(ring.head - ages) % history]
    past = (ages >= 1) & (ages <= ring.count - 1)
    # Ascending (-sim, age) = descending (sim, token): the most similar, ties to the latest token.
    # Ages, -1 = none.
    neighbour = selection.first_in_order(-by_age, past, min(NEIGHBOURS, history))
    found = jnp.sum(neighbour >= 0, dtype=jnp.int32)
    if per_slot is None:
        per_slot = _reads_per_slot(num_layers, words, num_slots)
    if per_slot:
        return _next_use_per_slot(ring, id_of_slot, layer, num_experts, neighbour, found, bound,
                                  horizon)
    # Per (layer m, expert e): whole mask rows of the neighbours' next tokens, unpacked.
    layers = lax.iota(jnp.int32, num_layers)
    shift = (layers <= layer).astype(jnp.int32)  # layer m was already called in this token
    k = lax.iota(jnp.int32, bound)
    # Token j + k + shift has age a_j - k - shift; it was seen iff k <= a_j - 1.
    token_age = neighbour[:, None, None] - k[None, :, None] - shift[None, None, :]  # [K, H, L]
    seen = (neighbour[:, None] >= 0) & (k[None, :] <= neighbour[:, None] - 1)  # [K, H]
    rows = ring.masks[(ring.head - token_age) % history, layers[None, None, :]]  # [K, H, L, w]
    bits = (rows[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    seen = seen & (k[None, :] < horizon)  # only the first H tokens count (H <= bound)
    routed = (bits.reshape(rows.shape[:3] + (-1,))[..., :num_experts] == 1) & seen[:, :, None, None]
    first = jnp.min(jnp.where(routed, k[None, :, None, None], horizon), axis=1)  # [K, L, E]
    steps = jnp.sum(jnp.where((neighbour >= 0)[:, None, None], first, 0), axis=0)  # [L, E]
    distance = (layers - layer - 1 + num_layers) % num_layers + 1
    predicted = found * distance[:, None] + num_layers * steps
    return predicted.reshape(-1)[jnp.maximum(id_of_slot, 0)]


def _reads_per_slot(num_layers: int, words: int, num_slots: int) -> bool:
    """Whether :func:`next_use` reads per slot: when the unpacked form's bits per call,
    ``K * ceil(C / L) * L * 32w``, pass ``2**15`` (fine-grained, L=48 E=128 S=768: 295k bits
    against 39k gathered words). Below, the unpacked form's few vectorised passes beat the
    per-slot gather (measured on XLA:CPU at Mixtral's L=32 E=8 S=128: 12k bits)."""
    bound = -(-num_slots // num_layers)
    return NEIGHBOURS * bound * num_layers * 32 * words > 1 << 15


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
    init=lambda num_layers, num_experts, history: ring.init(num_layers, num_experts, history,
                                                            counts=False),
    observe=ring.observe,
    victim_keys=_victim_keys,
    start_token=ring.start_token,
    history_of=ring.history_of,
)
