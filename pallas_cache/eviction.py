"""Which resident a miss evicts: the eviction policies of the cache (docs/semantics.md §5.16).
The policy is fixed by ``init(..., eviction=...)`` and stored as static metadata of the state
(``CacheState.eviction``), so the ops branch on it in Python and an LRU state carries no extra
field (``CacheState.ranking`` is ``None``). A policy only ranks victims: free usable slots first
in the LRU order ``(usage, slot)``, then the policy's ranking of the evictable residents; which
misses are installed and the PROMOTE_ONE rule are unchanged. ``Eviction.PAIR_LFU`` keeps per
expert a Q16 frequency decayed at every call of its layer (half-life 32 visits) and a protection
bit (routed by the last call of its layer); residents rank by ``(prot, freq, last_use, slot)``
with ``last_use`` the slot's ``usage`` (so the clock rebase covers it). ``Eviction.ROUTE_KNN``
keeps a ring of the last ``W`` tokens' routes as bitmasks and a similarity of each past token to
the current one, and evicts the resident whose next use the three most similar past tokens
predict furthest away. ``Eviction.ROUTE_LFU`` keeps the same ring and ranks residents by
``(prot, L * F - NU, last_use, slot)``: protected if routed by their layer's latest call, then
the fewest ring tokens routing them (``F``) against ROUTE_KNN's predicted next use. All of it is exact integer arithmetic and loop-free (reasons:
docs/design.md, "Eviction policies").
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap

from pallas_cache.kernels.dispatch import first_in_order
from pallas_cache import validate
from pallas_cache.tree import pytree_dataclass
from pallas_cache.validate import INT32_MAX

__all__ = [
    "DECAY_Q16", "NEIGHBOURS", "ONE_Q16", "RING_EVICTIONS", "Eviction", "PairLfuState", "RouteKnnState",
    "check_admission", "cold_ranking", "decay_q16", "history_of", "observe_call", "rank_victims",
    "ring_bits", "start_token",
]

#: The per-visit decay of PAIR_LFU's frequency, ``2**(-1/32)`` in Q16 (half-life 32 visits).
DECAY_Q16 = 64132
#: What one routed call adds to an expert's frequency: 1.0 in Q16.
ONE_Q16 = 65536
#: ROUTE_KNN's neighbours per call (``K``).
NEIGHBOURS = 3
# Residents' frequencies stay below 2**22 (the fixed point of f -> f*DECAY/2**16 + 2**16 is about
# 3.06M), so (class, freq) packs into one int32 key: class * 2**23 + freq.
_CLASS_SHIFT = 23


class Eviction(enum.Enum):
    """How the evictable residents are ranked as victims (docs/semantics.md §5.16)."""

    LRU = "lru"  # ascending (usage, slot): global least recently used
    PAIR_LFU = "pair_lfu"  # ascending (prot, freq, last_use, slot)
    ROUTE_KNN = "route_knn"  # largest predicted next use, from the most similar past tokens
    ROUTE_LFU = "route_lfu"  # ascending (prot, L * ring frequency - predicted next use, ...)

    @classmethod
    def coerce(cls, value) -> "Eviction":
        return validate.coerce_enum(cls, value, "eviction")


#: The policies whose bookkeeping is the token ring (``RouteKnnState``).
RING_EVICTIONS = (Eviction.ROUTE_KNN, Eviction.ROUTE_LFU)


@pytree_dataclass
class PairLfuState:
    """PAIR_LFU's per-expert bookkeeping (docs/semantics.md §5.16).

    Attributes:
      freq: int32[L, E]. Q16 routing frequency, decayed by ``DECAY_Q16 / 2**16`` at every
        accepted call of the layer, +``ONE_Q16`` for each distinct routed expert.
      prot: bool[L, E]. Whether the expert was routed by the last accepted call of its layer.
    """

    freq: jax.Array
    prot: jax.Array


@pytree_dataclass
class RouteKnnState:
    """ROUTE_KNN's and ROUTE_LFU's token ring (docs/semantics.md §5.16); ``W`` = ``history``
    tokens.

    Attributes:
      masks: uint32[W, L, ceil(E/32)]. ``R``: per ring position (token ``t`` at ``t mod W``) and
        layer, the bitmask of the experts that token's call to the layer routed (bit ``e % 32`` of
        word ``e // 32``); all zero for a layer the token did not call.
      sim: int32[W]. Similarity of the token at each ring position to the current token (0 for
        the current token and for positions holding no past token).
      match: int32[W]. Per ring position ``j``, ``sum_m popcount(R[j, m] & R[T, m])`` over the
        current token's calls so far (past tokens only): at the next token start it becomes the
        aligned part of ``sim`` (``sim_{j+1}``), so no start rescans the ring.
      head: int32[]. Ring position of the current token ``T``.
      count: int32[]. Tokens in the ring, the current one included (``min(T + 1, W)``).
      last_layer: int32[]. The layer of the last accepted call (-1 before any, ``L`` after
        :func:`start_token`): a call to a layer ``<=`` it starts a token.
      counts: int32[L, E] under ROUTE_LFU, ``None`` (no leaves) under ROUTE_KNN. ``F``: how many
        tokens of the ring routed each expert, kept in step with ``masks`` (a token leaving the
        ring subtracts its routes, a call adds its own) so the ranking need not recount the ring.
    """

    masks: jax.Array
    sim: jax.Array
    match: jax.Array
    head: jax.Array
    count: jax.Array
    last_layer: jax.Array
    counts: jax.Array | None = None


def cold_ranking(eviction: Eviction, num_layers: int, num_experts: int, history: int):
    """The bookkeeping of a cold cache under ``eviction``: ``None`` for LRU."""
    if eviction is Eviction.LRU:
        return None
    if eviction is Eviction.PAIR_LFU:
        return PairLfuState(freq=jnp.zeros((num_layers, num_experts), jnp.int32),
                            prot=jnp.zeros((num_layers, num_experts), jnp.bool_))
    words = -(-num_experts // 32)
    counts = (jnp.zeros((num_layers, num_experts), jnp.int32)
              if eviction is Eviction.ROUTE_LFU else None)
    return RouteKnnState(masks=jnp.zeros((history, num_layers, words), jnp.uint32),
                         sim=jnp.zeros((history,), jnp.int32),
                         match=jnp.zeros((history,), jnp.int32), head=jnp.zeros((), jnp.int32),
                         count=jnp.ones((), jnp.int32), last_layer=jnp.full((), -1, jnp.int32),
                         counts=counts)


def history_of(ranking) -> int | None:
    """The ring size ``W`` of ROUTE_KNN / ROUTE_LFU bookkeeping (None for the others)."""
    return ranking.masks.shape[-3] if isinstance(ranking, RouteKnnState) else None


def ring_bits(masks, num_experts: int):
    """ROUTE_KNN's ring as bool[..., W, L, E] (host views and tests)."""
    return _unpacked(masks, num_experts).astype(jnp.bool_)


def _unpacked(masks, num_experts: int):
    """Bitmask words ``[..., ceil(E/32)]`` as int32 0/1 ``[..., E]``."""
    bits = (masks[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits.reshape(masks.shape[:-1] + (-1,))[..., :num_experts].astype(jnp.int32)


def start_token(state):
    """The state with the next accepted call starting a token (ROUTE_KNN, ROUTE_LFU;
    docs/semantics.md §5.16), for callers whose token boundaries the layer sequence does not show
    (a token that calls one layer only). Jittable; the other policies return the state
    unchanged."""
    if state.eviction not in RING_EVICTIONS:
        return state
    ranking = state.ranking.replace(
        last_layer=jnp.full((), state.slot_for_id.shape[-2], jnp.int32))
    return state.replace(ranking=ranking)


def check_admission(eviction: Eviction, reuse) -> None:
    """REUSE compares a miss's recency with its *LRU* victim's usage (docs/semantics.md §5.5), so
    it is refused at trace time with any other eviction (``reuse`` a Python bool or a traced flag,
    which may be on)."""
    if eviction is not Eviction.LRU and reuse is not False:
        raise ValueError(f"admission REUSE needs eviction LRU; got eviction {eviction.name} "
                         f"(REUSE compares recency with the LRU victim's usage)")


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


def observe_call(eviction: Eviction, ranking, layer, routed, accepted):
    """The bookkeeping after an accepted call of ``layer`` routing the experts ``routed``
    (bool[E]); a refused call changes nothing. ``None`` stays ``None`` (LRU)."""
    if eviction is Eviction.LRU:
        return ranking
    if eviction is Eviction.PAIR_LFU:
        row = decay_q16(ranking.freq[layer]) + jnp.where(routed, ONE_Q16, 0)
        freq = lax.dynamic_update_slice(
            ranking.freq, jnp.where(accepted, row, ranking.freq[layer])[None], (layer, jnp.int32(0)))
        prot = lax.dynamic_update_slice(
            ranking.prot, jnp.where(accepted, routed, ranking.prot[layer])[None],
            (layer, jnp.int32(0)))
        return PairLfuState(freq=freq, prot=prot)
    if _branches_on_cpu(ranking):
        return _observe_ring(ranking, layer, routed, accepted)
    return _observe_token(ranking, layer, routed, accepted)


def _branches_on_cpu(ring) -> bool:
    """Whether XLA:CPU runs the ring's bookkeeping as one conditional (:func:`_observe_ring`):
    with one mask word per layer (``E <= 32``; measured at Mixtral's L=32 E=8, faster loaded or
    not). At the fine-grained L=48 E=128 the straight-line form, whose ops XLA:CPU spreads over
    a free core, measured faster on a quiet machine and no slower on a loaded one."""
    return ring.masks.shape[-1] == 1


@custom_vmap
def _observe_ring(ring, layer, routed, accepted):
    """:func:`_observe_token`, on XLA:CPU as one ``lax.cond`` on ``accepted`` (docs/design.md,
    "ROUTE_KNN's per-call cost"); the same integers everywhere. Under ``vmap`` (the replay's
    lanes) and on other platforms, the straight-line form."""
    def branching(ring, layer, routed, accepted):
        return lax.cond(accepted, lambda r: _observe_token(r, layer, routed, accepted),
                        lambda r: r, ring)
    return lax.platform_dependent(ring, layer, routed, accepted, cpu=branching,
                                  default=_observe_token)


@_observe_ring.def_vmap
def _observe_ring_vmap(axis_size, in_batched, ring, layer, routed, accepted):
    in_axes = jax.tree.map(lambda batched: 0 if batched else None, tuple(in_batched))
    out = jax.vmap(_observe_token, in_axes=in_axes, axis_size=axis_size)(
        ring, layer, routed, accepted)
    return out, jax.tree.map(lambda _: True, out)


def _popcount_sum(a, b, axes):
    return jnp.sum(lax.population_count(a & b).astype(jnp.int32), axis=axes)


def _observe_token(ring, layer, routed, accepted):
    """ROUTE_KNN's bookkeeping of one call: a token start if the layer does not increase
    (re-aligned similarities), then the call's bitmask recorded and matched against every past
    token's same layer."""
    history, _, words = ring.masks.shape
    start = accepted & (layer <= ring.last_layer)
    head = jnp.where(start, (ring.head + 1) % history, ring.head)
    count = jnp.where(start, jnp.minimum(ring.count + 1, history), ring.count)
    # The row of T, R[T, ·]: cleared at a token start (the oldest token leaves), then R[T, l] = b.
    # Built apart and written back with one update: each in-place update of the ring that
    # another op of the step still reads costs XLA a copy of the whole ring.
    old_row = ring.masks[head]  # [L, w]
    row = jnp.where(start, jnp.uint32(0), old_row)
    age = (head - lax.iota(jnp.int32, history)) % history  # 0 = the current token
    # At a token start: sim_j = sum_m popcount(R[j-1, m] & R[T-1, m]), 0 if j-1 left the ring;
    # the previous token's calls accumulated exactly that as match_{j-1}.
    aligned = jnp.roll(ring.match, 1)
    sim = jnp.where(start, jnp.where((age >= 1) & (age + 2 <= count), aligned, 0), ring.sim)
    match = jnp.where(start, 0, ring.match)
    # Record the call's bitmask b in R[T, layer]; sim_j += 2 * popcount(R[j, layer] & b).
    padded = jnp.zeros((words * 32,), jnp.uint32).at[:routed.shape[0]].set(routed)
    bitmask = jnp.sum(padded.reshape(words, 32) << jnp.arange(32, dtype=jnp.uint32), axis=1,
                      dtype=jnp.uint32)
    # Every write below is gated by `accepted` on its own (a refused call changes nothing),
    # rather than one select over the whole ring.
    row = row.at[layer].set(jnp.where(accepted, bitmask, row[layer]))
    masks = lax.dynamic_update_slice(ring.masks, row[None], (head, jnp.int32(0), jnp.int32(0)))
    counts = ring.counts
    if counts is not None:  # ROUTE_LFU: F follows the ring, whose one changed row is R[T, ·]
        experts = counts.shape[1]
        counts = counts + _unpacked(row, experts) - _unpacked(old_row, experts)
    past = accepted & (age >= 1) & (age <= count - 1)
    common = jnp.where(past, _popcount_sum(masks[:, layer], bitmask[None], 1), 0)
    return RouteKnnState(masks=masks, sim=sim + 2 * common, match=match + common, head=head,
                         count=count, last_layer=jnp.where(accepted, layer, ring.last_layer),
                         counts=counts)


def _first_in_lex_order(keys, candidate, num_out: int):
    """The first ``num_out`` candidate indices in ascending ``(*keys, index)`` order,
    int32[num_out], -1 past the candidates: ``num_out`` unrolled rounds of one variadic reduction
    each, round ``r`` taking the smallest tuple strictly after round ``r - 1``'s."""
    size = keys[0].shape[0]
    keys = tuple(keys) + (lax.iota(jnp.int32, size),)

    def before(a, b):  # a < b lexicographically
        out = a[-1] < b[-1]
        for x, y in zip(reversed(a[:-1]), reversed(b[:-1])):
            out = (x < y) | ((x == y) & out)
        return out

    def smaller(a, b):
        a_first = before(a, b)
        return tuple(jnp.where(a_first, x, y) for x, y in zip(a, b))

    picks, last = [], None
    big = jnp.int32(INT32_MAX)
    for _ in range(num_out):
        live = candidate
        if last is not None:
            live = live & before(last, keys)
        last = lax.reduce(tuple(jnp.where(live, k, big) for k in keys),
                          (big,) * len(keys), smaller, (0,))
        picks.append(last[-1])
    if not picks:
        return jnp.full((0,), -1, jnp.int32)
    picks = jnp.stack(picks)
    return jnp.where(picks == INT32_MAX, -1, picks).astype(jnp.int32)


def rank_victims(eviction: Eviction, ranking, id_of_slot, usage, step, n, *, num_out: int,
                 layer=None, num_experts=None, candidate=None, cache_size=None):
    """The first ``n`` victims under a non-LRU ``eviction`` (LRU is the victims kernel's job).

    Free usable slots (``id_of_slot == -1``) first in ascending ``(usage, slot)``; then the
    occupied slots in the policy's order. Only evictable slots (``usage != step``) of the usable
    pool ``[0, cache_size)`` (docs/semantics.md §5.15) and, if given, ``candidate`` slots are
    ranked.

    Args:
      ranking: the policy's bookkeeping *after* this call's :func:`observe_call`.
      id_of_slot, usage: int32[C], usage after this call's hit refresh.
      step: int32[], this call's step. n: int32[], how many victims to return.
      num_out: static output length. candidate: optional bool[C], slots that may be victims.
      layer, num_experts: the call's layer (traced) and ``E`` (ROUTE_KNN, ROUTE_LFU only).
      cache_size: int32[], the usable size ``S`` (traced; ``None``: every slot is usable). It
        masks the candidates and sets the ring policies' horizon ``ceil(S / L)``.

    Returns:
      int32[num_out]: victims in claim order; entries ``>= n`` are -1.
    """
    evictable = usage != step
    if cache_size is not None:
        evictable = evictable & (lax.iota(jnp.int32, usage.shape[0]) < cache_size)
    if candidate is not None:
        evictable = evictable & candidate
    if eviction is Eviction.PAIR_LFU:
        free = id_of_slot < 0
        occupant = jnp.maximum(id_of_slot, 0)
        freq = ranking.freq.reshape(-1)[occupant]
        prot = ranking.prot.reshape(-1)[occupant].astype(jnp.int32)
        # (class, freq) in one int32: class 0 = free (ranked by usage alone), 1 = unprotected,
        # 2 = protected resident.
        keys = (jnp.where(free, 0, ((1 + prot) << _CLASS_SHIFT) + freq), usage)
    elif eviction is Eviction.ROUTE_LFU:
        free = id_of_slot < 0
        prot, score = _ring_frequency_key(ranking, id_of_slot, layer, num_experts, cache_size)
        # Class 0 = free (ranked by usage alone), 1 = unprotected, 2 = protected resident.
        keys = (jnp.where(free, 0, 1 + prot), jnp.where(free, 0, score), usage)
    else:
        # Largest predicted next use first: free slots below every -NU.
        keys = (jnp.where(id_of_slot < 0, -(1 << 30),
                          -_next_use(ranking, id_of_slot, layer, num_experts, cache_size)), usage)
    out = _first_in_lex_order(keys, evictable, num_out)
    return jnp.where(lax.iota(jnp.int32, num_out) < n, out, -1)


def _next_use(ring, id_of_slot, layer, num_experts, cache_size=None, per_slot=None):
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
    neighbour = first_in_order(-by_age, past, min(NEIGHBOURS, history))  # ages, -1 = none
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
    """Whether :func:`_next_use` reads per slot: when the unpacked form's bits per call,
    ``K * ceil(C / L) * L * 32w``, pass ``2**15`` (fine-grained, L=48 E=128 S=768: 295k bits
    against 39k gathered words). Below, the unpacked form's few vectorised passes beat the
    per-slot gather (measured on XLA:CPU at Mixtral's L=32 E=8 S=128: 12k bits)."""
    bound = -(-num_slots // num_layers)
    return NEIGHBOURS * bound * num_layers * 32 * words > 1 << 15


def _next_use_per_slot(ring, id_of_slot, layer, num_experts, neighbour, found, bound, horizon):
    """:func:`_next_use` per slot: the rows of the neighbours' next ``bound + 1`` tokens laid
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


def _ring_frequency_key(ring, id_of_slot, layer, num_experts, cache_size=None):
    """ROUTE_LFU's key of every slot's occupant (docs/semantics.md §5.16): ``prot`` int32[C]
    (1 if routed by the latest call of its layer the ring holds: this token's for layers up to
    ``layer``, the previous token's after it) and ``L * F - NU`` int32[C], ``F`` the ring tokens
    that routed the occupant (the ``counts`` the bookkeeping keeps), ``NU`` :func:`_next_use`."""
    history, num_layers, _ = ring.masks.shape
    layers = lax.iota(jnp.int32, num_layers)
    current = _unpacked(ring.masks[ring.head], num_experts)  # [L, E]
    previous = _unpacked(ring.masks[(ring.head - 1) % history], num_experts)
    prot = jnp.where((layers <= layer)[:, None], current,
                     jnp.where(ring.count >= 2, previous, 0))
    predicted = _next_use(ring, id_of_slot, layer, num_experts, cache_size)
    occupant = jnp.maximum(id_of_slot, 0)
    score = num_layers * ring.counts.reshape(-1)[occupant] - predicted
    return prot.reshape(-1)[occupant], score
