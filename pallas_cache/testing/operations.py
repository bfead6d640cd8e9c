"""Cache operations as plain data, and the driver that runs them on the library.

A test draws a list of these records (:func:`pallas_cache.testing.strategies.operations`),
prints it when it fails (each is a frozen dataclass of Python ints, strings and tuples), and runs
it with :func:`run_operation`; another implementation (the NumPy reference) can run the same
records: each record applies itself (:meth:`Operation.apply`) through the functions of the side
it is given. No hypothesis here, and no JAX at import: the library loads when a record runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import pallas_cache as pc  # its names load on first use: nothing here reads one at import

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
    "Rebuild",
    "Reset",
    "ResetRouting",
    "ResetStats",
    "Resize",
    "SetCollectRouting",
    "StartToken",
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
        from pallas_cache import validate

        L, E, S, C = (validate.positive_int(name, getattr(self, name)) for name in (
            "num_layers", "num_experts", "cache_size", "capacity"))
        if S < E:
            raise ValueError(f"cache_size {S} cannot hold one layer of {E} experts")
        if C < S:
            raise ValueError(f"capacity {C} is below cache_size {S}")
        validate.positive_int("history", self.history)
        pc.evictions.coerce(self.eviction)

    def init(self) -> pc.CacheState:
        """A cold :class:`~pallas_cache.CacheState` of this geometry."""
        return pc.init(self.num_layers, self.num_experts, self.cache_size,
                       capacity=self.capacity, eviction=self.eviction, history=self.history)


#: The kinds a :class:`PolicySpec` names.
POLICY_KINDS = ("fraction", "fixed_cap", "full")


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """A :class:`~pallas_cache.FetchPolicy` as plain data: ``kind`` is ``"fraction"`` (``value``
    the fraction ``q``), ``"fixed_cap"`` (``value`` the cap) or ``"full"`` (``value`` None).
    Another ``kind``, or a value the policy's constructor refuses (a NaN or string fraction, a
    negative or fractional cap, a value for ``full``), raises when the spec is made, naming it
    (``TypeError`` for a type, ``ValueError`` for a value)."""

    kind: str
    value: float | int | None = None

    def __post_init__(self):
        if self.kind not in POLICY_KINDS:
            raise ValueError(f"unknown policy kind {self.kind!r}; expected one of "
                             f"{', '.join(POLICY_KINDS)}")
        if self.kind == "full":
            if self.value is not None:
                raise ValueError(f"PolicySpec('full') takes no value, got {self.value!r}")
            return
        try:
            self.build()
        except (TypeError, ValueError) as error:
            raise type(error)(f"PolicySpec({self.kind!r}, {self.value!r}): {error}") from None

    def build(self, policy: Any = None) -> Any:
        """The :class:`~pallas_cache.FetchPolicy` this spec names, or ``policy``'s: a class with
        the same constructors (``fraction``, ``fixed_cap``, ``full``), e.g. the reference's
        ``ReferencePolicy``."""
        make = pc.FetchPolicy if policy is None else policy
        return make.full() if self.kind == "full" else getattr(make, self.kind)(self.value)


def _as_written(routes: Any) -> Any:
    """The record's routes as the library takes them: the nested tuple itself, read exactly by
    ``pc.ensure`` (a float or bool refused, an id outside int32 refused with ERR_EXPERT_ID), as
    the reference reads it; a cast here would wrap ``2**31`` or truncate ``1.7``."""
    return routes


@dataclasses.dataclass(frozen=True)
class Operation:
    """A cache operation as plain data, the base of the records below: ``op.apply(api, state)``
    runs it through ``api``, the library (``pallas_cache``) or its twin
    (``pallas_cache.reference``), which name and take the operations alike (any object with
    those functions will do: the project's tests pass their adapters)."""

    #: The function of ``api`` the record calls with the state and its fields, in order (the
    #: records whose call is not that name their own ``_call``).
    _function: ClassVar[str] = ""
    #: Whether the operation returns ``(state, plan)``; else it returns the state alone.
    _returns_plan: ClassVar[bool] = True

    def apply(self, api: Any, state: Any, *, routes: Callable[[Any], Any] | None = None,
              policy: Callable[[PolicySpec], Any] | None = None, **ensure_options: Any
              ) -> tuple[Any, Any]:
        """``(new_state, plan)``, ``plan`` None for the operations that return only a state.
        ``routes`` and ``policy`` build ``api``'s routes array and fetch policy from the
        record's (default: the routes as written, :meth:`PolicySpec.build`);
        ``ensure_options`` (``backend=``) go to the ensure calls only."""
        out = self._call(api, state, routes or _as_written, policy or PolicySpec.build,
                         ensure_options)
        return out if self._returns_plan else (out, None)

    def _call(self, api: Any, state: Any, routes: Callable[[Any], Any],
              policy: Callable[[PolicySpec], Any], ensure_options: dict[str, Any]) -> Any:
        if not self._function:
            raise TypeError(f"not a cache operation record: {self!r}")
        fields = (getattr(self, field.name) for field in dataclasses.fields(self))
        return getattr(api, self._function)(state, *fields)


@dataclasses.dataclass(frozen=True)
class Ensure(Operation):
    """``pc.ensure(state, layer, routes)``; ``routes`` a nested tuple of ints (-1 = padding)."""

    layer: int
    routes: tuple

    def _call(self, api, state, routes, policy, ensure_options):
        return api.ensure(state, self.layer, routes(self.routes), **ensure_options)


@dataclasses.dataclass(frozen=True)
class EnsureHybrid(Operation):
    """``pc.ensure_hybrid(state, layer, routes, policy.build(), order=..., admission=...)``."""

    layer: int
    routes: tuple
    policy: PolicySpec
    order: str = "recency"
    admission: str = "promote_one"

    def __post_init__(self):
        if not isinstance(self.policy, PolicySpec):
            raise TypeError(f"EnsureHybrid.policy must be a PolicySpec (plain data, e.g. "
                            f"PolicySpec('fraction', 0.4)), got {self.policy!r} "
                            f"({type(self.policy).__name__})")

    def _call(self, api, state, routes, policy, ensure_options):
        return api.ensure_hybrid(state, self.layer, routes(self.routes), policy(self.policy),
                                 order=self.order, admission=self.admission, **ensure_options)


@dataclasses.dataclass(frozen=True)
class Materialize(Operation):
    """``pc.materialize_layer(state, layer)``."""

    layer: int

    _function: ClassVar[str] = "materialize_layer"


@dataclasses.dataclass(frozen=True)
class Forget(Operation):
    """``pc.forget_slot(state, slot)``."""

    slot: int

    _function: ClassVar[str] = "forget_slot"


@dataclasses.dataclass(frozen=True)
class Resize(Operation):
    """``pc.resize(state, cache_size)``."""

    cache_size: int

    _function: ClassVar[str] = "resize"


@dataclasses.dataclass(frozen=True)
class Rebuild(Operation):
    """``pc.rebuild(state, cache_size, capacity=capacity)`` (no plan; host-side: the shapes
    change). ``capacity`` None: the call's default (the new ``cache_size``). A size below one
    layer raises ``RebuildRejected``."""

    cache_size: int
    capacity: int | None = None

    _returns_plan: ClassVar[bool] = False

    def _call(self, api, state, routes, policy, ensure_options):
        options = {} if self.capacity is None else {"capacity": self.capacity}
        return api.rebuild(state, self.cache_size, **options)


@dataclasses.dataclass(frozen=True)
class Reset(Operation):
    """``pc.reset(state)`` (no plan)."""

    _function: ClassVar[str] = "reset"
    _returns_plan: ClassVar[bool] = False


@dataclasses.dataclass(frozen=True)
class ResetStats(Operation):
    """``pc.reset_stats(state)`` (no plan)."""

    _function: ClassVar[str] = "reset_stats"
    _returns_plan: ClassVar[bool] = False


@dataclasses.dataclass(frozen=True)
class ResetRouting(Operation):
    """``pc.reset_routing(state)`` (no plan)."""

    _function: ClassVar[str] = "reset_routing"
    _returns_plan: ClassVar[bool] = False


@dataclasses.dataclass(frozen=True)
class SetCollectRouting(Operation):
    """``pc.set_collect_routing(state, on)`` (no plan)."""

    on: bool

    _function: ClassVar[str] = "set_collect_routing"
    _returns_plan: ClassVar[bool] = False


@dataclasses.dataclass(frozen=True)
class StartToken(Operation):
    """``pc.evictions.start_token(state)`` (no plan): the next accepted call starts a token
    (the ROUTE_* evictions; the others leave the state as it is). ``api.start_token`` where
    ``api`` has one (the reference), else ``api.evictions.start_token`` (the library)."""

    _returns_plan: ClassVar[bool] = False

    def _call(self, api, state, routes, policy, ensure_options):
        start = api.start_token if hasattr(api, "start_token") else api.evictions.start_token
        return start(state)


@dataclasses.dataclass(frozen=True)
class BeginPrefill(Operation):
    """``pc.begin_prefill(state)`` (no plan)."""

    _function: ClassVar[str] = "begin_prefill"
    _returns_plan: ClassVar[bool] = False


@dataclasses.dataclass(frozen=True)
class PrefetchPrefill(Operation):
    """``pc.prefetch_prefill_layer(state, layer, bank_feat_bytes)``."""

    layer: int
    bank_feat_bytes: tuple[int, ...] = (4096,)

    _function: ClassVar[str] = "prefetch_prefill_layer"


@dataclasses.dataclass(frozen=True)
class ReleasePrefill(Operation):
    """``pc.release_prefill_layer(state, layer)`` (no plan)."""

    layer: int

    _function: ClassVar[str] = "release_prefill_layer"
    _returns_plan: ClassVar[bool] = False


def run_operation(state: pc.CacheState, op: Operation, *, backend: str | None = None
                  ) -> tuple[pc.CacheState, Any]:
    """Run one operation record on the library: ``(new_state, plan)``, ``plan`` None for the
    operations that return only a state (reset, begin/release prefill). ``backend`` goes to the
    ensure calls."""
    return apply_operation(pc, state, op, backend=backend)


def apply_operation(api: Any, state: Any, op: Operation, *,
                    routes: Callable[[Any], Any] | None = None,
                    policy: Callable[[PolicySpec], Any] | None = None, **ensure_options: Any
                    ) -> tuple[Any, Any]:
    """``op.apply(api, state, ...)`` (:meth:`Operation.apply`), after checking that ``op`` is
    an operation record (TypeError otherwise)."""
    if not isinstance(op, Operation):
        raise TypeError(f"not a cache operation record: {op!r}")
    return op.apply(api, state, routes=routes, policy=policy, **ensure_options)


def run_operations(state: pc.CacheState, ops: list[Operation] | tuple[Operation, ...], *,
                   backend: str | None = None) -> list[tuple[pc.CacheState, Any]]:
    """Run a sequence; returns ``(state, plan)`` after every operation, in order."""
    results = []
    for op in ops:
        state, plan = run_operation(state, op, backend=backend)
        results.append((state, plan))
    return results
