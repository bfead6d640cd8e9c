"""Hypothesis strategies for property tests of code built on the cache (the ``testing`` extra:
``pip install 'pallas-cache[testing]'``; this is the only module of the package that imports
hypothesis).

Each strategy draws plain data (see :mod:`pallas_cache.testing.operations`): a failing example
prints as readable records, and shrinks towards small geometries, few routes and short
sequences. Jitted steps outrun hypothesis's default deadline (their first call compiles), so
give such tests ``@settings(deadline=None)``::

    from hypothesis import given, settings, strategies as st
    from pallas_cache.testing import strategies as pcst

    @settings(deadline=None)
    @given(geometry=pcst.geometries(), data=st.data())
    def test_my_loop(geometry, data): ...
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np
from hypothesis import strategies as st

from pallas_cache.evictions import Eviction
from pallas_cache.testing.operations import (BeginPrefill, Ensure, EnsureHybrid, Forget, Geometry,
                                             Materialize, Operation, PolicySpec, PrefetchPrefill,
                                             ReleasePrefill, Reset, Resize)

__all__ = [
    "FetchRules",
    "OPERATION_KINDS",
    "evictions",
    "fetch_policies",
    "fetch_rules",
    "geometries",
    "histories",
    "operations",
    "policy_specs",
    "routes",
]

#: The operation kinds :func:`operations` draws by default.
OPERATION_KINDS = ("ensure", "ensure_hybrid", "materialize", "forget", "resize", "reset",
                   "prefill")


def evictions(choices: Sequence[str | Eviction] | None = None) -> st.SearchStrategy[str]:
    """An eviction's value (``"lru"``, ``"pair_lfu"``, ``"route_knn"``, ``"route_lfu"``),
    from ``choices`` (default: every :class:`~pallas_cache.Eviction`); shrinks towards the first."""
    values = [Eviction.coerce(c).value for c in (choices or list(Eviction))]
    return st.sampled_from(values)


def histories(max_history: int = 8) -> st.SearchStrategy[int]:
    """A token-ring size ``W`` for the ROUTE_* evictions, in ``[1, max_history]``."""
    return st.integers(1, max_history)


@st.composite
def geometries(draw: Any, *, max_layers: int = 4, max_experts: int = 8, max_extra_slots: int = 8,
               max_spare_capacity: int = 4,
               eviction: st.SearchStrategy[str] | None = None,
               history: st.SearchStrategy[int] | None = None) -> Geometry:
    """A :class:`~pallas_cache.testing.operations.Geometry`: ``1 <= L <= max_layers``,
    ``1 <= E <= max_experts``, ``S = E + [0, max_extra_slots]`` usable slots (so pools that hold
    one layer and pools that hold several), ``C = S + [0, max_spare_capacity]`` allocated, an
    eviction from ``eviction`` (default :func:`evictions`) and a ring from ``history`` (default
    :func:`histories`). ``geometry.init()`` builds the cold state."""
    L = draw(st.integers(1, max_layers))
    E = draw(st.integers(1, max_experts))
    S = E + draw(st.integers(0, max_extra_slots))
    C = S + draw(st.integers(0, max_spare_capacity))
    return Geometry(L, E, S, C, eviction=draw(evictions() if eviction is None else eviction),
                    history=draw(histories() if history is None else history))


@st.composite
def routes(draw: Any, num_experts: int, *, shape: tuple[int, ...] | None = None,
           max_routes: int = 8, padding: bool = True, duplicates: bool = True,
           bad_ids: bool = False) -> np.ndarray:
    """An int32 route array (layer-local expert ids) for ``num_experts`` experts.

    Args:
      num_experts: ``E``; valid ids are ``[0, E)``.
      shape: the array's shape (e.g. ``(tokens, top_k)``); default a 1-D array of
        ``[1, max_routes]`` routes.
      padding: allow ``-1`` entries (ignored routes).
      duplicates: allow one expert twice (else the ids of an array are distinct, so at most
        ``E`` of them are not padding).
      bad_ids: mix in ids outside ``[-1, E)`` (``E``, ``-2``, large and negative ones), which
        the cache refuses with ``ERR_EXPERT_ID``; off by default.
    """
    if shape is None:
        shape = (draw(st.integers(1, max_routes)),)
    size = int(np.prod(shape, dtype=np.int64))
    if not (padding or duplicates) and size > num_experts:
        raise ValueError(f"{size} routes without padding or duplicates need at least {size} "
                         f"experts, got num_experts={num_experts}")
    ids = st.integers(0, num_experts - 1)
    if padding:
        ids = st.one_of(ids, st.just(-1))
    if bad_ids:
        ids = st.one_of(ids, st.sampled_from([num_experts, num_experts + 7, -2, 2**31 - 1,
                                              -(2**31)]))
    if duplicates:
        values = draw(st.lists(ids, min_size=size, max_size=size))
    else:
        values = draw(st.lists(ids, min_size=size, max_size=size,
                               unique_by=lambda v: v if v != -1 else object()))
    return np.asarray(values, np.int32).reshape(shape)


def policy_specs(*, max_cap: int = 8) -> st.SearchStrategy[PolicySpec]:
    """A :class:`~pallas_cache.testing.operations.PolicySpec`: a fraction in ``[0, 1]`` (the
    edges, halves and a few awkward values such as 0.4 and 0.415 included), a fixed cap in
    ``[0, max_cap]``, or ``full``."""
    fractions = st.one_of(st.sampled_from([0.0, 0.4, 0.415, 0.5, 1.0]),
                          st.floats(0.0, 1.0, allow_nan=False))
    return st.one_of(
        fractions.map(lambda q: PolicySpec("fraction", q)),
        st.integers(0, max_cap).map(lambda n: PolicySpec("fixed_cap", n)),
        st.just(PolicySpec("full")),
    )


def fetch_policies(*, max_cap: int = 8) -> st.SearchStrategy[Any]:
    """A :class:`~pallas_cache.FetchPolicy` (built from :func:`policy_specs`)."""
    return policy_specs(max_cap=max_cap).map(PolicySpec.build)


class FetchRules(NamedTuple):
    """The static options of an ``ensure_hybrid`` call, as string values."""

    order: str
    admission: str


def fetch_rules(eviction: str | Eviction | None = None) -> st.SearchStrategy[FetchRules]:
    """An ``(order, admission)`` pair of :class:`FetchRules` (string values). ``admission="reuse"``
    is drawn only when ``eviction`` allows it (LRU, the default), since the other evictions
    refuse it (docs/semantics.md §5.5)."""
    admissions = ["promote_one", "none"]
    if Eviction.coerce(eviction or Eviction.LRU).policy.allows_reuse:
        admissions.append("reuse")
    return st.builds(FetchRules, st.sampled_from(["recency", "lowest_id"]),
                     st.sampled_from(admissions))


def operations(geometry: Geometry, *, min_size: int = 1, max_size: int = 12,
               kinds: Sequence[str] = OPERATION_KINDS, max_routes: int = 8,
               bad_values: bool = False) -> st.SearchStrategy[list[Operation]]:
    """A list of operation records for a cache of ``geometry``, to run with
    :func:`~pallas_cache.testing.operations.run_operation`. The arguments are checked when it is
    called (ValueError naming the kind), before anything is drawn.

    Args:
      geometry: the cache they run on (layers, ids, slots and sizes are drawn in its range).
      min_size, max_size: the sequence length.
      kinds: which of :data:`OPERATION_KINDS` to draw: ``ensure``, ``ensure_hybrid`` (policy,
        order and admission drawn too), ``materialize``, ``forget`` (a slot of the capacity:
        those at or past the usable size are refused), ``resize`` (a size in ``[E, C]``),
        ``reset``, ``prefill`` (``begin_prefill``, ``prefetch_prefill_layer``,
        ``release_prefill_layer``; only when the capacity holds the two buffers, ``C >= 2E``:
        ``kinds=["prefill"]`` alone on a smaller capacity raises ValueError).
      max_routes: at most this many routes per ensure call (padding and duplicates included).
      bad_values: also draw values the cache refuses with an error bit: layers outside
        ``[0, L)``, ids outside ``[-1, E)``, slots past the capacity, sizes outside ``[E, C]``.
    """
    L, E, C = geometry.num_layers, geometry.num_experts, geometry.capacity
    if isinstance(kinds, str):
        raise TypeError(f"kinds must be a sequence of kinds, got the string {kinds!r}")
    unknown = set(kinds) - set(OPERATION_KINDS)
    if unknown:
        raise ValueError(f"unknown operation kinds {sorted(unknown)}; expected {OPERATION_KINDS}")
    if not kinds:
        raise ValueError("kinds is empty: give at least one of " + ", ".join(OPERATION_KINDS))
    kinds = [k for k in kinds if k != "prefill" or C >= 2 * E]
    if not kinds:
        raise ValueError(f"kinds=['prefill'] cannot draw: prefill needs a capacity of at least "
                         f"2E = {2 * E} slots (its two buffers), the geometry has capacity {C}")
    layer = st.integers(0, L - 1)
    slot = st.integers(0, C - 1)
    size = st.integers(E, C)
    if bad_values:
        layer = st.one_of(layer, st.sampled_from([L, -1, 2**31 - 1]))
        slot = st.one_of(slot, st.sampled_from([C, -1]))
        size = st.one_of(size, st.sampled_from([E - 1, C + 1]))
    route_arrays = routes(E, max_routes=max_routes, bad_ids=bad_values).map(
        lambda r: tuple(int(v) for v in r))
    rules = fetch_rules(geometry.eviction)

    def one(kind: str) -> st.SearchStrategy[Operation]:
        if kind == "ensure":
            return st.builds(Ensure, layer, route_arrays)
        if kind == "ensure_hybrid":
            return st.builds(lambda lyr, r, p, rl: EnsureHybrid(lyr, r, p, rl.order, rl.admission),
                             layer, route_arrays, policy_specs(), rules)
        if kind == "materialize":
            return st.builds(Materialize, layer)
        if kind == "forget":
            return st.builds(Forget, slot)
        if kind == "resize":
            return st.builds(Resize, size)
        if kind == "reset":
            return st.just(Reset())
        return st.one_of(st.just(BeginPrefill()), st.builds(PrefetchPrefill, layer),
                         st.builds(ReleasePrefill, layer))

    return st.lists(st.one_of([one(kind) for kind in kinds]), min_size=min_size,
                    max_size=max_size)
