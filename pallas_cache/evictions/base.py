"""The record an eviction is: its bookkeeping's init, what an accepted call records, the
victim keys it ranks by, what it refuses, and (for an eviction the fused kernel ranks) the kernel's
hooks (docs/semantics.md §5.16)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, NamedTuple


def _unchanged(state, num_layers):
    return state


def _no_history(state):
    return None


def no_bookkeeping(num_layers, num_experts, history):
    """``EvictionPolicy.init`` of an eviction that keeps no bookkeeping."""
    return None


def no_tables(state):
    """``KernelRanking.tables`` of an eviction whose kernel keeps no per-expert tables."""
    return ()


def from_no_tables(tables):
    """``KernelRanking.from_tables`` of :func:`no_tables`."""
    return None


def no_rows(rows, routed):
    """``KernelRanking.observe_row`` of :func:`no_tables`."""
    return ()


#: The registered records by name, filled by the registry (``pallas_cache.evictions``, which
#: importing this module imports first): what a pickled registered record loads as.
REGISTERED: dict[str, "EvictionPolicy"] = {}


def _registered(name: str) -> "EvictionPolicy":
    """The registered record named ``name``."""
    return REGISTERED[name]


class PerCall(enum.Enum):
    """A per-call input of the victim key that the fused kernel computes from the token ring
    (``KernelRanking.per_call``), not stored."""

    NEXT_USE = "next_use"  # ROUTE_KNN's predicted next use of the occupant
    PROT = "prot"  # routed by the latest call of its layer
    FREQ = "freq"  # the ring tokens that routed it


class PerCallInputs(NamedTuple):
    """What ``KernelRanking.key`` reads per call, int32 per slot; ``None`` for an input the
    record's ``per_call`` does not ask for."""

    num_layers: int
    next_use: Any = None
    prot: Any = None
    freq: Any = None


@dataclasses.dataclass(frozen=True)
class KernelRanking:
    """How the fused kernel (kernels/step.py) ranks an eviction's victims and keeps its bookkeeping.

    Attributes:
      tables: ``state -> tuple`` of the bookkeeping's per-expert ``[L, E]`` arrays the kernel
        reads and rewrites in place (``()`` for none).
      from_tables: ``tuple of [L, E] arrays -> state``, the inverse of ``tables``.
      width: the number of victim key components (the usage last), as ``key`` returns them.
      key: ``(tables at each slot's occupant, occupant, usage, own, computed) -> keys``: the
        victim key of a block of slots, from the tables as they stood *before* this call
        (``own``: the occupant is an expert of this call's layer, so this call's bookkeeping
        changes its entries) and the per-call inputs ``computed`` (``None`` without
        ``per_call``; else a :class:`PerCallInputs`).
      observe_row: ``(rows, routed) -> rows``: the layer's rows of ``tables`` after an accepted
        call routing ``routed`` (bool[E]).
      per_call: the :class:`PerCall` inputs the key reads that the kernel computes per call
        from the token ring (:class:`~pallas_cache.evictions.ring.TokenRingState`, which the
        kernel then updates in place), not stored. ``()``: the bookkeeping is ``tables`` alone.
    """

    tables: Callable[[Any], tuple]
    from_tables: Callable[[tuple], Any]
    width: int
    key: Callable[..., tuple]
    observe_row: Callable[[tuple, Any], tuple]
    per_call: tuple[PerCall, ...] = ()

    def __post_init__(self):
        if not isinstance(self.per_call, tuple) or not all(
                isinstance(x, PerCall) for x in self.per_call):
            raise ValueError(f"KernelRanking.per_call must be a tuple of PerCall members "
                             f"({', '.join(f'PerCall.{m.name}' for m in PerCall)}), "
                             f"got {self.per_call!r}")


@dataclasses.dataclass(frozen=True)
class EvictionPolicy:
    """One eviction as pure functions (docs/semantics.md §5.16).

    Attributes:
      name: the eviction's string value (``"lru"``, ``"pair_lfu"``, ...).
      init: ``(num_layers, num_experts, history) -> state``: the bookkeeping of a cold cache
        (``None`` for an eviction that keeps none).
      observe: ``(state, layer, routed, accepted) -> state``: the bookkeeping after an accepted
        call of ``layer`` routing ``routed`` (bool[E]); a refused call changes nothing.
      victim_keys: ``(state, id_of_slot, usage, layer, num_experts, cache_size) -> keys``: one
        int32[C] array per key component, compared lexicographically with the slot last, from
        the bookkeeping after this call's ``observe`` and the usage after its hit refresh; free
        slots must rank first in ``(usage, slot)`` order.
      start_token: ``(state, num_layers) -> state``: the next accepted call starts a token.
      history_of: ``state -> int | None``: the ring size ``init`` was given, kept by ``reset``.
      allows_reuse: whether the REUSE admission may run with the eviction.
      kernel: the fused kernel's hooks, or ``None``: the eviction ranks in the XLA step only.
      view_columns: the bookkeeping's per-expert ``[L, E]`` fields ``describe`` shows per slot
        (fields of :class:`~pallas_cache.host.views.SlotRow`: ``prot``, ``freq``).
    """

    name: str
    init: Callable[[int, int, int], Any]
    observe: Callable[..., Any]
    victim_keys: Callable[..., tuple]
    start_token: Callable[[Any, int], Any] = _unchanged
    history_of: Callable[[Any], int | None] = _no_history
    allows_reuse: bool = False
    kernel: KernelRanking | None = None
    view_columns: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"EvictionPolicy({self.name!r})"

    def __reduce_ex__(self, protocol):
        """A registered record pickles as its name and loads as the very record of the
        registry (so a state's static ``eviction`` compares, hashes and jits as before); any
        other record pickles field by field, as a dataclass does."""
        if REGISTERED.get(self.name) is self:
            return (_registered, (self.name,))
        return super().__reduce_ex__(protocol)
