"""Cache operations as plain data, and the driver that runs them on the library.

A test draws a list of these records (:func:`pallas_cache.testing.strategies.operations`),
prints it when it fails (each is a frozen dataclass of Python ints, strings and tuples), and runs
it with :func:`run_operation`; another implementation (the NumPy reference) can run the same
records. No hypothesis here: the records and the driver need only the library.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Union

import numpy as np

import pallas_cache as pc
from pallas_cache import validate
from pallas_cache.state import CacheState

__all__ = [
    "BeginPrefill",
    "Ensure",
    "EnsureHybrid",
    "Forget",
    "Geometry",
    "Materialize",
    "Operation",
    "PolicySpec",
    "PrefetchPrefill",
    "ReleasePrefill",
    "Reset",
    "Resize",
    "run_operation",
    "run_operations",
]


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A cache's geometry and eviction policy, as :func:`pallas_cache.init` takes them.

    Attributes:
      num_layers, num_experts, cache_size, capacity: ``L, E, S, C`` (``E <= S <= C``).
      eviction: an :class:`~pallas_cache.Eviction` value (``"lru"``, ``"pair_lfu"``, ...).
      history: the token ring of the ROUTE_* evictions (read by those only).
    """

    num_layers: int
    num_experts: int
    cache_size: int
    capacity: int
    eviction: str = "lru"
    history: int = 128

    def __post_init__(self):
        """The static checks :func:`pallas_cache.init` makes, when the record is made (so a
        strategy or a lockstep run over it never starts): TypeError/ValueError naming the
        field."""
        L, E, S, C = (validate.positive_int(name, getattr(self, name)) for name in (
            "num_layers", "num_experts", "cache_size", "capacity"))
        if S < E:
            raise ValueError(f"cache_size {S} cannot hold one layer of {E} experts")
        if C < S:
            raise ValueError(f"capacity {C} is below cache_size {S}")
        validate.positive_int("history", self.history)
        pc.evictions.coerce(self.eviction)

    def init(self) -> CacheState:
        """A cold :class:`~pallas_cache.CacheState` of this geometry."""
        return pc.init(self.num_layers, self.num_experts, self.cache_size,
                       capacity=self.capacity, eviction=self.eviction, history=self.history)


#: The kinds a :class:`PolicySpec` names.
POLICY_KINDS = ("fraction", "fixed_cap", "full")


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """A :class:`~pallas_cache.FetchPolicy` as plain data: ``kind`` is ``"fraction"`` (``value``
    the fraction ``q``), ``"fixed_cap"`` (``value`` the cap) or ``"full"`` (``value`` None).
    Another ``kind`` raises ``ValueError`` naming it, when the spec is made."""

    kind: str
    value: float | int | None = None

    def __post_init__(self):
        if self.kind not in POLICY_KINDS:
            raise ValueError(f"unknown policy kind {self.kind!r}; expected one of "
                             f"{', '.join(POLICY_KINDS)}")

    def build(self) -> pc.FetchPolicy:
        """The :class:`~pallas_cache.FetchPolicy` this spec names."""
        if self.kind == "fraction":
            return pc.FetchPolicy.fraction(self.value)
        if self.kind == "fixed_cap":
            return pc.FetchPolicy.fixed_cap(self.value)
        if self.kind == "full":
            return pc.FetchPolicy.full()
        raise ValueError(f"unknown policy kind {self.kind!r}; expected fraction, fixed_cap, full")


@dataclasses.dataclass(frozen=True)
class Ensure:
    """``pc.ensure(state, layer, routes)``; ``routes`` a nested tuple of ints (-1 = padding)."""

    layer: int
    routes: tuple


@dataclasses.dataclass(frozen=True)
class EnsureHybrid:
    """``pc.ensure_hybrid(state, layer, routes, policy.build(), order=..., admission=...)``."""

    layer: int
    routes: tuple
    policy: PolicySpec
    order: str = "recency"
    admission: str = "promote_one"


@dataclasses.dataclass(frozen=True)
class Materialize:
    """``pc.materialize_layer(state, layer)``."""

    layer: int


@dataclasses.dataclass(frozen=True)
class Forget:
    """``pc.forget_slot(state, slot)``."""

    slot: int


@dataclasses.dataclass(frozen=True)
class Resize:
    """``pc.resize(state, cache_size)``."""

    cache_size: int


@dataclasses.dataclass(frozen=True)
class Reset:
    """``pc.reset(state)`` (no plan)."""


@dataclasses.dataclass(frozen=True)
class BeginPrefill:
    """``pc.begin_prefill(state)`` (no plan)."""


@dataclasses.dataclass(frozen=True)
class PrefetchPrefill:
    """``pc.prefetch_prefill_layer(state, layer, bank_feat_bytes)``."""

    layer: int
    bank_feat_bytes: tuple[int, ...] = (4096,)


@dataclasses.dataclass(frozen=True)
class ReleasePrefill:
    """``pc.release_prefill_layer(state, layer)`` (no plan)."""

    layer: int


Operation = Union[Ensure, EnsureHybrid, Materialize, Forget, Resize, Reset, BeginPrefill,
                  PrefetchPrefill, ReleasePrefill]


def _routes(routes: tuple) -> tuple:
    """The record's routes as the library takes them: the nested tuple itself, read exactly by
    ``pc.ensure`` (a float or bool refused, an id outside int32 refused with ERR_EXPERT_ID), as
    the reference reads it; a cast here would wrap ``2**31`` or truncate ``1.7``."""
    return routes


def run_operation(state: CacheState, op: Operation, *, backend: str | None = None
                  ) -> tuple[CacheState, Any]:
    """Run one operation record on the library: ``(new_state, plan)``, ``plan`` None for the
    operations that return only a state (reset, begin/release prefill). ``backend`` goes to the
    ensure calls."""
    return apply_operation(pc, state, op, routes=_routes, policy=PolicySpec.build,
                           backend=backend)


def apply_operation(api: Any, state: Any, op: Operation, *, routes: Callable[[tuple], Any],
                    policy: Callable[[PolicySpec], Any], **ensure_options: Any
                    ) -> tuple[Any, Any]:
    """One operation record through ``api``: the library (``pallas_cache``) or its twin
    (``pallas_cache.reference``), which name and take the operations alike. ``routes`` and
    ``policy`` build that side's routes array and fetch policy; ``ensure_options`` go to the
    ensure calls only."""
    if isinstance(op, Ensure):
        return api.ensure(state, op.layer, routes(op.routes), **ensure_options)
    if isinstance(op, EnsureHybrid):
        return api.ensure_hybrid(state, op.layer, routes(op.routes), policy(op.policy),
                                 order=op.order, admission=op.admission, **ensure_options)
    if isinstance(op, Materialize):
        return api.materialize_layer(state, op.layer)
    if isinstance(op, Forget):
        return api.forget_slot(state, op.slot)
    if isinstance(op, Resize):
        return api.resize(state, op.cache_size)
    if isinstance(op, Reset):
        return api.reset(state), None
    if isinstance(op, BeginPrefill):
        return api.begin_prefill(state), None
    if isinstance(op, PrefetchPrefill):
        return api.prefetch_prefill_layer(state, op.layer, op.bank_feat_bytes)
    if isinstance(op, ReleasePrefill):
        return api.release_prefill_layer(state, op.layer), None
    raise TypeError(f"not a cache operation record: {op!r}")


def run_operations(state: CacheState, ops: list[Operation] | tuple[Operation, ...], *,
                   backend: str | None = None) -> list[tuple[CacheState, Any]]:
    """Run a sequence; returns ``(state, plan)`` after every operation, in order."""
    results = []
    for op in ops:
        state, plan = run_operation(state, op, backend=backend)
        results.append((state, plan))
    return results
