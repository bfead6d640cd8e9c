"""The evictions: which resident a miss evicts (docs/semantics.md §5.16). Each eviction is one
:class:`EvictionPolicy` record of pure functions in its own module; :class:`Eviction` is the
registry. A state holds its record (``state.eviction``), and the ops, the fused kernel and the
views call the record's functions directly."""

from __future__ import annotations

import enum

from pallas_cache import selection, validate
from pallas_cache.evictions import base, lru, pair_lfu, route_knn, route_lfu
from pallas_cache.evictions.base import EvictionPolicy, KernelRanking, PerCall, PerCallInputs
from pallas_cache.evictions.pair_lfu import DECAY_Q16, ONE_Q16, PairLfuState, decay_q16
from pallas_cache.evictions.ring import NEIGHBOURS, TokenRingState, ring_bits

__all__ = [
    "DECAY_Q16", "NEIGHBOURS", "ONE_Q16", "Eviction", "EvictionPolicy", "KernelRanking",
    "PairLfuState", "PerCall", "PerCallInputs", "TokenRingState", "check_admission", "coerce",
    "decay_q16", "rank_victims", "ring_bits", "start_token",
]


class Eviction(enum.Enum):
    """How the evictable residents are ranked as victims (docs/semantics.md §5.16): the registry
    of the evictions, each member's value its name and ``policy`` its record.
    ``Eviction(record)`` is the member of a registered record (``Eviction(state.eviction)``)."""

    LRU = lru.POLICY  # ascending (usage, slot): global least recently used
    PAIR_LFU = pair_lfu.POLICY  # ascending (prot, freq, last_use, slot)
    ROUTE_KNN = route_knn.POLICY  # largest predicted next use, from the most similar past tokens
    ROUTE_LFU = route_lfu.POLICY  # ascending (prot, L * ring frequency - predicted next use, ...)

    def __new__(cls, record: EvictionPolicy):
        member = object.__new__(cls)
        member._value_ = record.name
        member.policy = record
        return member

    @classmethod
    def _missing_(cls, value):
        for member in cls:
            if member.policy is value:
                return member
        return None

    @classmethod
    def coerce(cls, value: "Eviction | str") -> "Eviction":
        return validate.coerce_enum(cls, value, "eviction")


base.REGISTERED.update({member.value: member.policy for member in Eviction})


def coerce(eviction) -> EvictionPolicy:
    """The record of an eviction: an :class:`EvictionPolicy` as is, else the record of an
    :class:`Eviction` member or its string value."""
    return eviction if isinstance(eviction, EvictionPolicy) else Eviction.coerce(eviction).policy


def start_token(state):
    """The state with the next accepted call starting a token (ROUTE_KNN, ROUTE_LFU;
    docs/semantics.md §5.16), for callers whose token boundaries the layer sequence does not show
    (a token that calls one layer only). Jittable; the other evictions return the state
    unchanged."""
    bookkeeping = state.eviction.start_token(state.eviction_state, state.num_layers)
    if bookkeeping is state.eviction_state:
        return state
    return state.replace(eviction_state=bookkeeping)


def check_admission(eviction: EvictionPolicy, reuse) -> None:
    """REUSE compares a miss's recency with its *LRU* victim's usage (docs/semantics.md §5.5), so
    it is refused at trace time with any other eviction (``reuse`` a Python bool or a traced flag,
    which may be on)."""
    if not eviction.allows_reuse and reuse is not False:
        raise ValueError(f"admission REUSE needs eviction LRU; got eviction "
                         f"{eviction.name.upper()} "
                         f"(REUSE compares recency with the LRU victim's usage)")


def rank_victims(eviction: EvictionPolicy, state, id_of_slot, usage, step, n, *, num_out: int,
                 layer=None, num_experts=None, cache_size=None):
    """The first ``n`` victims under ``eviction``: the evictable slots (``usage != step``) of the
    usable pool ``[0, cache_size)`` (docs/semantics.md §5.15) in ascending ``(key..., slot)``
    order of the eviction's victim keys (free usable slots first, by ``(usage, slot)``).

    Args:
      state: the eviction's bookkeeping *after* this call's ``eviction.observe``.
      id_of_slot, usage: int32[C], usage after this call's hit refresh.
      step: int32[], this call's step. n: int32[], how many victims to return.
      num_out: static output length.
      layer, num_experts: the call's layer (traced) and ``E``.
      cache_size: int32[], the usable size ``S`` (traced; ``None``: every slot is usable). It
        masks the candidates and sets the ring evictions' horizon ``ceil(S / L)``.

    Returns:
      int32[num_out]: victims in claim order; entries ``>= n`` are -1.
    """
    keys = eviction.victim_keys(state, id_of_slot, usage, layer, num_experts, cache_size)
    return selection.select_victims(usage, step, n, num_out=num_out, cache_size=cache_size,
                                    keys=keys)
