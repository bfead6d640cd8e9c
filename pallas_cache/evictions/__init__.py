"""The eviction policies: which resident a miss evicts (docs/semantics.md §5.16). Each policy is
one :class:`EvictionPolicy` record in its own module; :class:`Eviction` is the registry, and the
functions below are what the ops, the fused kernel and the views call on a state's policy."""

from __future__ import annotations

import enum

from pallas_cache import selection, validate
from pallas_cache.evictions import lru, pair_lfu, route_knn, route_lfu
from pallas_cache.evictions.base import EvictionPolicy, KernelRanking
from pallas_cache.evictions.pair_lfu import DECAY_Q16, ONE_Q16, PairLfuState, decay_q16
from pallas_cache.evictions.ring import TokenRingState, ring_bits
from pallas_cache.evictions.route_knn import NEIGHBOURS

__all__ = [
    "DECAY_Q16", "NEIGHBOURS", "ONE_Q16", "Eviction", "EvictionPolicy", "KernelRanking",
    "PairLfuState", "TokenRingState", "check_admission", "cold_state", "decay_q16", "history_of",
    "observe_call", "policy_of", "rank_victims", "ring_bits", "start_token",
]


class Eviction(enum.Enum):
    """How the evictable residents are ranked as victims (docs/semantics.md §5.16): the registry
    of the policies, each member's value its name and ``policy`` its record."""

    LRU = lru.POLICY  # ascending (usage, slot): global least recently used
    PAIR_LFU = pair_lfu.POLICY  # ascending (prot, freq, last_use, slot)
    ROUTE_KNN = route_knn.POLICY  # largest predicted next use, from the most similar past tokens
    ROUTE_LFU = route_lfu.POLICY  # ascending (prot, L * ring frequency - predicted next use, ...)

    def __new__(cls, policy: EvictionPolicy):
        member = object.__new__(cls)
        member._value_ = policy.name
        member.policy = policy
        return member

    @classmethod
    def coerce(cls, value: "Eviction | str") -> "Eviction":
        return validate.coerce_enum(cls, value, "eviction")


def coerce(eviction) -> "Eviction | EvictionPolicy":
    """An :class:`Eviction` (or its string value), or an :class:`EvictionPolicy` record as is."""
    return eviction if isinstance(eviction, EvictionPolicy) else Eviction.coerce(eviction)


def policy_of(eviction) -> EvictionPolicy:
    """The record of an :class:`Eviction` member (a record is its own)."""
    return eviction.policy if isinstance(eviction, Eviction) else eviction


def name_of(eviction) -> str:
    """The policy's string value."""
    return policy_of(eviction).name


def cold_state(eviction, num_layers: int, num_experts: int, history):
    """The bookkeeping of a cold cache under ``eviction`` (``None`` for LRU)."""
    return policy_of(eviction).init(num_layers, num_experts, history)


def history_of(state) -> int | None:
    """The ring size ``W`` a state's policy was given (None for a policy without a ring)."""
    return policy_of(state.eviction).history_of(state.eviction_state)


def start_token(state):
    """The state with the next accepted call starting a token (ROUTE_KNN, ROUTE_LFU;
    docs/semantics.md §5.16), for callers whose token boundaries the layer sequence does not show
    (a token that calls one layer only). Jittable; the other policies return the state
    unchanged."""
    policy = policy_of(state.eviction)
    bookkeeping = policy.start_token(state.eviction_state, state.num_layers)
    if bookkeeping is state.eviction_state:
        return state
    return state.replace(eviction_state=bookkeeping)


def check_admission(eviction, reuse) -> None:
    """REUSE compares a miss's recency with its *LRU* victim's usage (docs/semantics.md §5.5), so
    it is refused at trace time with any other eviction (``reuse`` a Python bool or a traced flag,
    which may be on)."""
    policy = policy_of(eviction)
    if not policy.allows_reuse and reuse is not False:
        name = eviction.name if isinstance(eviction, Eviction) else policy.name
        raise ValueError(f"admission REUSE needs eviction LRU; got eviction {name} "
                         f"(REUSE compares recency with the LRU victim's usage)")


def observe_call(eviction, state, layer, routed, accepted):
    """The bookkeeping ``state`` after an accepted call of ``layer`` routing the experts
    ``routed`` (bool[E]); a refused call changes nothing."""
    return policy_of(eviction).observe(state, layer, routed, accepted)


def rank_victims(eviction, state, id_of_slot, usage, step, n, *, num_out: int, layer=None,
                 num_experts=None, cache_size=None):
    """The first ``n`` victims under ``eviction``: the evictable slots (``usage != step``) of the
    usable pool ``[0, cache_size)`` (docs/semantics.md §5.15) in ascending ``(key..., slot)``
    order of the policy's victim keys (free usable slots first, by ``(usage, slot)``).

    Args:
      state: the policy's bookkeeping *after* this call's :func:`observe_call`.
      id_of_slot, usage: int32[C], usage after this call's hit refresh.
      step: int32[], this call's step. n: int32[], how many victims to return.
      num_out: static output length.
      layer, num_experts: the call's layer (traced) and ``E``.
      cache_size: int32[], the usable size ``S`` (traced; ``None``: every slot is usable). It
        masks the candidates and sets the ring policies' horizon ``ceil(S / L)``.

    Returns:
      int32[num_out]: victims in claim order; entries ``>= n`` are -1.
    """
    keys = policy_of(eviction).victim_keys(state, id_of_slot, usage, layer, num_experts,
                                           cache_size)
    return selection.select_victims(usage, step, n, num_out=num_out, cache_size=cache_size,
                                    keys=keys)
