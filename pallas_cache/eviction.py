"""Which resident a miss evicts: the eviction policies of the cache (docs/semantics.md §5.15).
The policy is fixed by ``init(..., eviction=...)`` and stored as static metadata of the state
(``CacheState.eviction``), so the ops branch on it in Python and an LRU state carries no extra
field (``CacheState.ranking`` is ``None``). A policy only ranks victims: free usable slots first
in the LRU order ``(usage, slot)``, then the policy's ranking of the evictable residents; which
misses are installed and the PROMOTE_ONE rule are unchanged. ``Eviction.PAIR_LFU`` keeps per
expert a Q16 frequency decayed at every call of its layer (half-life 32 visits) and a protection
bit (routed by the last call of its layer); residents rank by ``(prot, freq, last_use, slot)``
with ``last_use`` the slot's ``usage`` (so the clock rebase covers it), all in exact int32 and
loop-free (reasons: docs/design.md, "Eviction policies").
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from jax import lax

from pallas_cache.tree import pytree_dataclass
from pallas_cache.validate import INT32_MAX

__all__ = [
    "DECAY_Q16", "ONE_Q16", "Eviction", "PairLfuState", "check_admission", "cold_ranking",
    "decay_q16", "observe_call", "rank_victims",
]

#: The per-visit decay of PAIR_LFU's frequency, ``2**(-1/32)`` in Q16 (half-life 32 visits).
DECAY_Q16 = 64132
#: What one routed call adds to an expert's frequency: 1.0 in Q16.
ONE_Q16 = 65536
# Residents' frequencies stay below 2**22 (the fixed point of f -> f*DECAY/2**16 + 2**16 is about
# 3.06M), so (class, freq) packs into one int32 key: class * 2**23 + freq.
_CLASS_SHIFT = 23


class Eviction(enum.Enum):
    """How the evictable residents are ranked as victims (docs/semantics.md §5.15)."""

    LRU = "lru"  # ascending (usage, slot): global least recently used
    PAIR_LFU = "pair_lfu"  # ascending (prot, freq, last_use, slot)
    ROUTE_KNN = "route_knn"  # predicted next use from similar past tokens (not implemented yet)

    @classmethod
    def coerce(cls, value) -> "Eviction":
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        choices = ", ".join(f"{cls.__name__}.{m.name}" for m in cls)
        raise ValueError(f"unknown eviction {value!r}; expected one of {choices}")


@pytree_dataclass
class PairLfuState:
    """PAIR_LFU's per-expert bookkeeping (docs/semantics.md §5.15).

    Attributes:
      freq: int32[L, E]. Q16 routing frequency, decayed by ``DECAY_Q16 / 2**16`` at every
        accepted call of the layer, +``ONE_Q16`` for each distinct routed expert.
      prot: bool[L, E]. Whether the expert was routed by the last accepted call of its layer.
    """

    freq: jax.Array
    prot: jax.Array


def cold_ranking(eviction: Eviction, num_layers: int, num_experts: int, history: int):
    """The bookkeeping of a cold cache under ``eviction``: ``None`` for LRU."""
    del history  # the ring size of ROUTE_KNN
    if eviction is Eviction.LRU:
        return None
    if eviction is Eviction.PAIR_LFU:
        return PairLfuState(freq=jnp.zeros((num_layers, num_experts), jnp.int32),
                            prot=jnp.zeros((num_layers, num_experts), jnp.bool_))
    raise NotImplementedError(f"{eviction} is not implemented yet")


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
    raise NotImplementedError(f"{eviction} is not implemented yet")


def _first_in_lex_order(major, minor, candidate, num_out: int):
    """The first ``num_out`` candidate indices in ascending ``(major, minor, index)`` order,
    int32[num_out], -1 past the candidates: ``num_out`` unrolled rounds of one three-key
    reduction each, round ``r`` taking the smallest triple strictly after round ``r - 1``'s."""
    size = major.shape[0]
    index = lax.iota(jnp.int32, size)

    def smaller(a, b):
        a_first = (a[0] < b[0]) | ((a[0] == b[0]) & (
            (a[1] < b[1]) | ((a[1] == b[1]) & (a[2] < b[2]))))
        return tuple(jnp.where(a_first, x, y) for x, y in zip(a, b))

    picks, last = [], None
    big = jnp.int32(INT32_MAX)
    for _ in range(num_out):
        live = candidate
        if last is not None:
            m, n, i = last
            live = live & ((major > m) | ((major == m) & (
                (minor > n) | ((minor == n) & (index > i)))))
        last = lax.reduce(
            (jnp.where(live, major, big), jnp.where(live, minor, big), jnp.where(live, index, big)),
            (big, big, big), smaller, (0,))
        picks.append(last[2])
    if not picks:
        return jnp.full((0,), -1, jnp.int32)
    picks = jnp.stack(picks)
    return jnp.where(picks == INT32_MAX, -1, picks).astype(jnp.int32)


def rank_victims(eviction: Eviction, ranking, id_of_slot, usage, step, n, *, num_out: int,
                 candidate=None):
    """The first ``n`` victims under a non-LRU ``eviction`` (LRU is the victims kernel's job).

    Free slots (``id_of_slot == -1``) first in ascending ``(usage, slot)``; then the occupied
    slots in the policy's order. Only evictable slots (``usage != step``) and, if given,
    ``candidate`` slots are ranked.

    Args:
      ranking: the policy's bookkeeping *after* this call's :func:`observe_call`.
      id_of_slot, usage: int32[S], usage after this call's hit refresh.
      step: int32[], this call's step. n: int32[], how many victims to return.
      num_out: static output length. candidate: optional bool[S], slots that may be victims.

    Returns:
      int32[num_out]: victims in claim order; entries ``>= n`` are -1.
    """
    evictable = usage != step
    if candidate is not None:
        evictable = evictable & candidate
    if eviction is Eviction.PAIR_LFU:
        free = id_of_slot < 0
        occupant = jnp.maximum(id_of_slot, 0)
        freq = ranking.freq.reshape(-1)[occupant]
        prot = ranking.prot.reshape(-1)[occupant].astype(jnp.int32)
        # (class, freq) in one int32: class 0 = free (ranked by usage alone), 1 = unprotected,
        # 2 = protected resident.
        major = jnp.where(free, 0, ((1 + prot) << _CLASS_SHIFT) + freq)
        out = _first_in_lex_order(major, usage, evictable, num_out)
        return jnp.where(lax.iota(jnp.int32, num_out) < n, out, -1)
    raise NotImplementedError(f"{eviction} is not implemented yet")
