"""The decode-time cache operations: ensure, ensure_hybrid, materialize_layer, forget_slot.

Each is a pure function ``op(state, ...) -> (state, plan)``, jittable with a traced layer and
vmappable; ``order``, ``admission`` and ``backend`` are static, the policy is traced
(docs/semantics.md §5; how a step is computed: docs/design.md, "The state and the step").
``ensure`` and ``ensure_hybrid`` run the step of :mod:`~pallas_cache.step`, in named phases;
``Rules`` and ``ensure_with_rules`` are re-exported from there, the plans from
:mod:`~pallas_cache.plans`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_cache import clock, errors, validate
from pallas_cache.kernels import dispatch
from pallas_cache.hints import Backend, IndexLike, RoutesLike
from pallas_cache.plans import CopyPlan, EnsurePlan, ForgetPlan, MaterializePlan
from pallas_cache.policy import Admission, FetchOrder, FetchPolicy
from pallas_cache.state import CacheState, Clock, Residency, check_state
from pallas_cache.step import Rules, ensure_with_rules
from pallas_cache.step import drop_unless as _drop_unless

__all__ = [
    "CopyPlan",
    "EnsurePlan",
    "ForgetPlan",
    "MaterializePlan",
    "Rules",
    "ensure",
    "ensure_hybrid",
    "ensure_with_rules",
    "forget_slot",
    "materialize_layer",
]


@functools.partial(jax.jit, static_argnames=("rules", "backend"))
def _ensure(state: CacheState, layer, routes, policy: FetchPolicy, rules: Rules, backend: str):
    """:func:`ensure_with_rules` with static rules, jitted so that an eager call compiles once;
    under an outer ``jit`` or ``scan`` it is simply inlined."""
    return ensure_with_rules(state, layer, routes, policy, rules, backend=backend)


def ensure(state: CacheState, layer: IndexLike, expert_ids: RoutesLike, *,
           backend: Backend = None) -> tuple[CacheState, EnsurePlan]:
    """Make every routed expert of ``layer`` resident, evicting by the state's eviction (§5.2).

    Writes ``residency``, ``clock``, ``stats``, ``routing`` (``freq`` while collecting,
    ``recency`` when the clock rebases) and ``eviction_state``.

    The victims are the first in the order of ``state.eviction`` (global LRU by default; the
    others of docs/semantics.md §5.16 as :func:`~pallas_cache.state.init` chose).

    Args:
      state: the cache.
      layer: int, possibly traced; must be in ``[0, L)`` (else ERR_LAYER).
      expert_ids: integer array of any shape: layer-local expert ids in ``[0, E)``, ``-1`` for
        padding (ignored everywhere); anything else sets ERR_EXPERT_ID. Duplicates collapse.
      backend: static; "xla", "pallas", "interpret", or None for the platform default.

    Returns:
      ``(state, EnsurePlan)``. Misses are fetched in ascending expert id; ``cpu`` is all False.

    Raises:
      TypeError: ``expert_ids`` or ``layer`` is not an integer type; a state field of another
        dtype than :func:`~pallas_cache.state.init` gives (:func:`~pallas_cache.state.check_state`).
      ValueError: a state field of another shape than its geometry asks for.
    """
    check_state(state)
    return _ensure(state, validate.as_index("layer", layer), validate.as_routes(expert_ids),
                   FetchPolicy.full(),
                   Rules.of(hybrid=False, order=FetchOrder.LOWEST_ID, admission=Admission.NONE),
                   backend=dispatch.check_runs_here(dispatch.resolve_backend(backend), state))


def ensure_hybrid(state: CacheState, layer: IndexLike, expert_ids: RoutesLike, policy: FetchPolicy,
                  *, order: FetchOrder | str = FetchOrder.RECENCY,
                  admission: Admission | str = Admission.PROMOTE_ONE,
                  backend: Backend = None) -> tuple[CacheState, EnsurePlan]:
    """Fetch what the split says, hand the other misses to the CPU (docs/semantics.md §5.4, 5.5).

    Writes ``residency``, ``clock``, ``routing``, ``stats`` and ``eviction_state``.

    Args:
      state, layer, expert_ids, backend: as in :func:`ensure`.
      policy: a traced :class:`FetchPolicy` (scalar fields; vmap to sweep several).
      order: static :class:`FetchOrder` (or its string value): which misses win the fetches.
      admission: static :class:`Admission` (or its string value). PROMOTE_ONE and REUSE act only
        with ``order=RECENCY`` and a fraction policy; otherwise the plain split is used.

    Returns:
      ``(state, EnsurePlan)``. The copy plan is in fetch order. Routes to the misses that were
      not fetched come back with ``slots = -1`` and ``cpu = True``. Every routed expert's recency
      becomes this step.

    Raises:
      TypeError/ValueError: bad input types, a policy that is not scalar, an unknown enum.
    """
    rules = Rules.of(hybrid=True, order=order, admission=admission)
    check_state(state)  # the eviction's check of the admission is the step's, at trace time
    if not isinstance(policy, FetchPolicy):
        raise TypeError(f"policy must be a FetchPolicy, got {policy!r}")
    policy.validate()
    return _ensure(state, validate.as_index("layer", layer), validate.as_routes(expert_ids), policy,
                   rules,
                   backend=dispatch.check_runs_here(dispatch.resolve_backend(backend), state))


def materialize_layer(state: CacheState, layer: IndexLike) -> tuple[CacheState, MaterializePlan]:
    """Copy a whole layer into slots ``[0, E)``, position = expert id, for a prefill (docs/semantics.md §5.6).

    Writes ``residency``, ``clock`` (and ``routing.recency`` when the clock rebases).

    Using the occupancy on entry: every slot holding an expert of this layer is emptied (usage 0),
    and every other layer's expert in ``[0, E)`` loses residency; then the clock advances and
    slot ``e`` holds expert ``e`` with this step's usage. Idempotent; recency and counters are
    untouched.

    Returns:
      ``(state, MaterializePlan)``: ``plan.copy`` lists ``(e, e)`` for every expert, count ``E``.
      A layer outside ``[0, L)`` sets ERR_LAYER (state unchanged, empty copy).
    """
    check_state(state)
    return _materialize_layer(state, validate.as_index("layer", layer))


@jax.jit
def _materialize_layer(state: CacheState, layer):
    L, E, C = state.num_layers, state.num_experts, state.capacity  # [0, E) is always usable
    error = errors.layer_bits(layer, L) | errors.size_bits(state.cache_size, E, C)
    accepted = error == 0
    state = clock.rebase_if_due(state, accepted)
    layer_c = jnp.clip(layer, 0, L - 1)
    step = state.step + 1
    base = layer_c * E

    slots = lax.iota(jnp.int32, C)
    occupant = state.residency.id_of_slot
    own_layer = (occupant >= base) & (occupant < base + E)
    target = slots < E  # the slots the layer is copied into
    displaced = accepted & target & (occupant >= 0) & ~own_layer
    slot_for_id = state.residency.slot_for_id.reshape(-1).at[_drop_unless(displaced, occupant, L * E)].set(
        -1, mode="drop").reshape(L, E)
    slot_for_id = jnp.where(
        accepted & (lax.iota(jnp.int32, L) == layer_c)[:, None],
        lax.iota(jnp.int32, E)[None, :],
        slot_for_id,
    )
    stale = accepted & own_layer
    id_of_slot = jnp.where(accepted & target, base + slots, jnp.where(stale, -1, occupant))
    usage = jnp.where(accepted & target, step, jnp.where(stale, 0, state.residency.usage))

    experts = jnp.where(accepted, lax.iota(jnp.int32, E), -1)
    new_state = state.replace(
        residency=Residency(slot_for_id=slot_for_id, id_of_slot=id_of_slot, usage=usage),
        clock=Clock(step=jnp.where(accepted, step, state.step)),
    )
    count = jnp.where(accepted, E, 0).astype(jnp.int32)
    copy = CopyPlan(dst_slots=experts, src_rows=experts, count=count, num_slots=C, num_experts=E)
    return new_state, MaterializePlan(copy=copy, error=error)


def forget_slot(state: CacheState, slot: IndexLike) -> tuple[CacheState, ForgetPlan]:
    """Drop one slot after its copy failed (docs/semantics.md §5.7).

    Writes ``residency``.

    The slot becomes empty, the expert it held non-resident, and its usage the smallest int32, so
    it is the very first victim. A slot that is already empty is left as it is (idempotent).

    Returns:
      ``(state, ForgetPlan)``; ``plan.old`` is the flat id it held or -1. A slot outside
      ``[0, S)`` (``S`` the usable size ``state.cache_size``) sets ERR_SLOT (state unchanged).
    """
    check_state(state)
    return _forget_slot(state, validate.as_index("slot", slot))


@jax.jit
def _forget_slot(state: CacheState, slot):
    L, E, C = state.num_layers, state.num_experts, state.capacity
    # An unusable slot is out of range; so is every slot of a hand-built state whose usable
    # size is outside [E, C].
    error = errors.slot_bits(slot, state.cache_size) | errors.size_bits(state.cache_size, E, C)
    accepted = error == 0
    slot_c = jnp.clip(slot, 0, C - 1)
    old = jnp.where(accepted, state.residency.id_of_slot[slot_c], -1)
    drop = old >= 0
    residency = state.residency
    new_state = state.replace(residency=Residency(
        id_of_slot=residency.id_of_slot.at[_drop_unless(drop, slot_c, C)].set(-1, mode="drop"),
        slot_for_id=residency.slot_for_id.reshape(-1).at[_drop_unless(drop, old, L * E)].set(
            -1, mode="drop").reshape(L, E),
        usage=residency.usage.at[_drop_unless(drop, slot_c, C)].set(validate.INT32_MIN,
                                                                    mode="drop"),
    ))
    return new_state, ForgetPlan(old=old, error=error)


# The fused kernel's module (and Pallas with it) is imported with the ops, never first inside a
# trace: a first import of Pallas during a trace changes JAX's compile-cache key (jax 0.12), and
# the first jitted step would compile twice.
dispatch.import_kernel()
