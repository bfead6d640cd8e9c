"""The decode-time cache operations: ensure, ensure_hybrid, materialize_layer, forget_slot.

Each is a pure function ``op(state, ...) -> (state, plan)``: jittable with a **traced** layer,
vmappable over a batch of states and/or policies, usable inside ``lax.scan``; fixed-size outputs,
no host sync. ``order``, ``admission`` and ``backend`` are static (pass them as
``static_argnames`` when jitting); the policy is traced.

How a step is computed (docs/semantics.md §5.2-§5.5), over the ``E`` experts of the layer rather than over the
routes, so that duplicates and padding need no special casing:

1. ``routed[e]``: expert ``e`` appears among the routes (padding ``-1`` is ignored; a mask does
   not care which occurrence came first). ``hit = routed & resident``,
   ``miss = routed & ~resident``.
2. Hits refresh their slots' usage to this step, which also protects them from eviction.
3. The misses are ranked by the fetch order; ``F`` of them (the split, raised by the admission
   rule) are installed into the first ``F`` victims of ``backend.select_victims``, which takes
   the smallest ``(usage, slot)`` among slots not touched this step. The k-th miss takes the k-th
   victim, and its old occupant loses residency.
4. Each route reads its slot from the updated map; a route whose expert is still not resident is
   a CPU route.

Every write is gated by one ``accepted`` flag, computed from the inputs before anything else
(docs/semantics.md §6, docs/design.md): a refused call returns the input state and an empty plan with the error
bits, and no op ever writes part of an update.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_cache.kernels import dispatch as backends
from pallas_cache import clock, errors, validate
from pallas_cache.policy import Admission, FetchOrder, FetchPolicy
from pallas_cache.state import CacheState
from pallas_cache.tree import pytree_dataclass

__all__ = [
    "CopyPlan",
    "EnsurePlan",
    "ForgetPlan",
    "MaterializePlan",
    "ensure",
    "ensure_hybrid",
    "forget_slot",
    "materialize_layer",
]

@pytree_dataclass
class CopyPlan:
    """The host-to-device copies a step needs before its multiply.

    Attributes:
      dst_slots: int32[K']. Destination slot of each copy, in fetch order; -1 past ``count``.
      src_rows: int32[K']. The **layer-local** host row (expert id) of each copy, so it indexes the
        layer's own host bank; -1 past ``count``.
      count: int32[]. Number of valid entries.
    """

    dst_slots: jax.Array
    src_rows: jax.Array
    count: jax.Array


@pytree_dataclass
class EnsurePlan:
    """What one ensure / ensure_hybrid call decided (docs/semantics.md §4).

    Attributes:
      slots: int32, the shape of ``expert_ids``. The slot each route reads its expert from; -1 for
        a CPU route or padding.
      cpu: bool, the shape of ``expert_ids``. True for routes the caller computes on the CPU from
        host RAM (hybrid only). Every non-padding route has exactly one of ``slots >= 0`` and
        ``cpu``; duplicates of one expert get the same answer.
      copy: the copies to make, ``K' = min(K, E)`` entries (``K`` = number of routes).
      active: int32[]. Distinct experts routed.
      missing: int32[]. Distinct routed experts that were not resident, before any cap.
      fetched: int32[]. Distinct experts being copied in (``copy.count``).
      error: int32[]. 0, or the error bits of ``errors`` (then everything else is empty and the
        state was returned unchanged).
    """

    slots: jax.Array
    cpu: jax.Array
    copy: CopyPlan
    active: jax.Array
    missing: jax.Array
    fetched: jax.Array
    error: jax.Array


@pytree_dataclass
class MaterializePlan:
    """What ``materialize_layer`` asks the caller to copy: the whole layer, position = id.

    Attributes:
      copy: ``E`` entries ``(e, e)`` for every expert, count ``E``; all -1 / 0 on error.
      error: int32[]. 0 or ERR_LAYER.
    """

    copy: CopyPlan
    error: jax.Array


@pytree_dataclass
class ForgetPlan:
    """What ``forget_slot`` dropped.

    Attributes:
      old: int32[]. The flat id (``layer * E + expert``) the slot held, or -1 (empty, or error).
      error: int32[]. 0 or ERR_SLOT.
    """

    old: jax.Array
    error: jax.Array

    def __int__(self):
        return int(self.old)


def _drop_unless(mask, index, out_of_range):
    """``index`` where ``mask`` holds, else an index a ``mode="drop"`` scatter ignores."""
    return jnp.where(mask, index, out_of_range)


def _misses_in_fetch_order(miss, recency_row, by_recency, n, num_out):
    """The first ``n`` misses in fetch order, as int32[num_out] expert ids (-1 past ``n``).

    RECENCY: descending pre-call recency, ties to the lower id (never-routed experts, recency -1,
    come last in id order). LOWEST_ID: ascending id. Like victim selection, ``n`` rounds of "take
    the best, knock it out": ``n`` is a handful while a sort is expensive on CPU.
    """
    num_experts = miss.shape[0]
    out = jnp.full((num_out,), -1, jnp.int32)
    if num_out == 0:
        return out
    # Larger priority = fetched earlier, ties to the lower id: the argmin of its bitwise not.
    rank_key = ~jnp.where(by_recency, recency_row, 0)
    ids = lax.iota(jnp.int32, num_experts)

    def take_next(carry):
        k, remaining, out = carry
        expert = backends.argmin_among(rank_key, remaining)
        return k + 1, remaining & (ids != expert), out.at[k].set(expert)

    n = jnp.minimum(n, num_out)
    _, _, out = lax.while_loop(lambda c: c[0] < n, take_next, (jnp.int32(0), miss, out))
    return out


def _reuse_admitted(num_fetch, experts, victims, recency_row, usage, num_out):
    """docs/semantics.md §5.5 REUSE: how many misses, walking in recency order, are admitted.

    The first ``num_fetch`` are; the k-th after them is admitted iff its recency is ``>= 0`` and
    ``>=`` the usage of the victim it would take (the k-th victim); the first rejection stops.
    ``experts``/``victims`` hold the candidates in order (-1 past the number of misses).
    """
    if num_out == 0:
        return num_fetch
    position = lax.iota(jnp.int32, num_out)
    candidate = experts >= 0
    recency = recency_row[jnp.maximum(experts, 0)]
    victim_usage = usage[jnp.maximum(victims, 0)]
    admitted = (position < num_fetch) | (
        candidate & (victims >= 0) & (recency >= 0) & (recency >= victim_usage)
    )
    first_rejected = jnp.min(jnp.where(admitted, num_out, position))
    return first_rejected.astype(jnp.int32)


@pytree_dataclass
class _Rules:
    """The static options of a call, as traced flags for the jitted core.

    The public functions take ``order``/``admission`` as static Python values (so under a user's
    ``jit`` they are constants and XLA folds the unused paths away); passing them to the core as
    data lets an eager caller switch options without recompiling.

    Attributes (bool[]):
      hybrid: stamp recency (ensure_hybrid); plain ``ensure`` does not.
      by_recency: misses in RECENCY order, else ascending id.
      promote_one: the PROMOTE_ONE admission applies (RECENCY order; fraction checked on device).
      reuse: the REUSE admission applies (RECENCY order; fraction checked on device).
    """

    hybrid: jax.Array
    by_recency: jax.Array
    promote_one: jax.Array
    reuse: jax.Array

    @classmethod
    def of(cls, hybrid: bool, order: FetchOrder, admission: Admission) -> "_Rules":
        # Admission rules act with the recency order only (docs/semantics.md §5.5).
        by_recency = order is FetchOrder.RECENCY
        flags = (hybrid, by_recency, by_recency and admission is Admission.PROMOTE_ONE,
                 by_recency and admission is Admission.REUSE)
        return cls(*(jnp.asarray(flag, jnp.bool_) for flag in flags))


@functools.partial(jax.jit, static_argnames=("backend",))
def _ensure(state: CacheState, layer, routes, policy: FetchPolicy, rules: _Rules, backend: str):
    """The shared body of ensure and ensure_hybrid, on coerced inputs.

    Jitted so that an eager call compiles its loops once instead of on every call; under an
    outer ``jit`` or ``scan`` it is simply inlined.
    """
    L, E, S = state.num_layers, state.num_experts, state.cache_size
    flat_routes = routes.reshape(-1)
    num_out = min(flat_routes.shape[0], E)  # K': distinct routes of one layer never exceed E

    error = errors.layer_bits(layer, L) | errors.route_bits(flat_routes, E)
    accepted = error == 0
    state = clock.rebase_if_due(state, accepted)

    layer_c = jnp.clip(layer, 0, L - 1)  # any in-range index; a refused call writes nothing
    step = state.step + 1
    base = layer_c * E

    is_route = (flat_routes >= 0) & (flat_routes < E)
    route_index = _drop_unless(is_route, flat_routes, E)
    observed = jnp.zeros((E,), jnp.int32).at[route_index].add(1, mode="drop")  # the histogram row
    routed = observed > 0
    slot_row = state.slot_for_id[layer_c]
    hit = routed & (slot_row >= 0)
    miss = routed & (slot_row < 0)
    num_active = jnp.sum(routed, dtype=jnp.int32)
    num_missing = jnp.sum(miss, dtype=jnp.int32)

    # Hit refresh: also what makes a hit slot ineligible as a victim of this step.
    usage = state.usage.at[_drop_unless(hit & accepted, slot_row, S)].set(step, mode="drop")
    recency_row = state.recency[layer_c]
    num_fetch = policy.split(num_missing)

    # PROMOTE_ONE (docs/semantics.md §5.5). A fixed cap (fraction 0) never promotes, so "rule off" is passed to
    # the decision as fraction 0. The promoted expert is the first miss in recency order and its
    # slot the first victim, so installing F = 1 through the normal path fetches exactly that pair.
    promoted, _ = backends.promotion_decision(
        usage, state.id_of_slot, step, recency_row, miss,
        jnp.where(rules.promote_one, policy.fraction16, 0), num_fetch, backend=backend,
    )
    num_fetch = jnp.where(promoted >= 0, 1, num_fetch)

    # REUSE (docs/semantics.md §5.5) looks past the split at every miss; otherwise only the F installed ones.
    reuse = rules.reuse & (policy.fraction16 > 0)
    candidates = jnp.where(reuse, num_missing, num_fetch)
    experts = _misses_in_fetch_order(miss, recency_row, rules.by_recency, candidates, num_out)
    victims = backends.select_victims(usage, step, candidates, num_out=num_out, backend=backend)
    num_fetch = jnp.where(
        reuse, _reuse_admitted(num_fetch, experts, victims, recency_row, usage, num_out), num_fetch)

    # Install the first num_fetch misses into the first num_fetch victims.
    installs = (lax.iota(jnp.int32, num_out) < num_fetch) & accepted
    victims = jnp.where(installs, victims, -1)
    experts = jnp.where(installs, experts, -1)
    # The victims' old occupants (any layer) lose residency and the new experts gain it: one
    # scatter, since the two id sets are disjoint (an occupant is resident, a miss is not).
    evicted = state.id_of_slot[jnp.maximum(victims, 0)]
    slot_for_id = state.slot_for_id.reshape(-1).at[jnp.concatenate([
        _drop_unless(installs & (evicted >= 0), evicted, L * E),
        _drop_unless(installs, base + experts, L * E),
    ])].set(jnp.concatenate([jnp.full_like(victims, -1), victims]), mode="drop").reshape(L, E)
    id_of_slot = state.id_of_slot.at[_drop_unless(installs, victims, S)].set(
        base + experts, mode="drop")
    usage = usage.at[_drop_unless(installs, victims, S)].set(step, mode="drop")

    # Each route reads its expert's slot after installation; not resident -> CPU route. (An
    # evicted expert of this layer was not routed: routed residents are hits, never victims.)
    new_row = slot_row.at[_drop_unless(installs, experts, E)].set(victims, mode="drop")
    route_slot = jnp.where(is_route & accepted, new_row[jnp.clip(flat_routes, 0, E - 1)], -1)
    cpu = is_route & accepted & (route_slot < 0)

    def row_update(table, row):
        return lax.dynamic_update_slice(table, row[None], (layer_c, jnp.int32(0)))

    # A hybrid call stamps every routed expert, in both fetch orders (docs/semantics.md §10).
    stamped = routed & accepted & rules.hybrid
    recency = row_update(state.recency, jnp.where(stamped, step, recency_row))
    num_fetch = jnp.where(accepted, num_fetch, 0)
    num_active = jnp.where(accepted, num_active, 0)
    num_missing = jnp.where(accepted, num_missing, 0)
    # Columns of CacheState.stats: calls, active, missing, fetched.
    counters = jnp.stack([accepted.astype(jnp.int32), num_active, num_missing, num_fetch])
    stats = row_update(state.stats, state.stats[layer_c] + counters)
    observe = accepted & state.collect_routing
    routing_freq = row_update(
        state.routing_freq, state.routing_freq[layer_c] + jnp.where(observe, observed, 0))

    new_state = state.replace(
        slot_for_id=slot_for_id,
        id_of_slot=id_of_slot,
        usage=usage,
        step=jnp.where(accepted, step, state.step),
        recency=recency,
        stats=stats,
        routing_freq=routing_freq,
    )
    plan = EnsurePlan(
        slots=route_slot.reshape(routes.shape),
        cpu=cpu.reshape(routes.shape),
        copy=CopyPlan(dst_slots=victims, src_rows=experts, count=num_fetch),
        active=num_active,
        missing=num_missing,
        fetched=num_fetch,
        error=error,
    )
    return new_state, plan


def ensure(state: CacheState, layer, expert_ids, *, backend=None):
    """Make every routed expert of ``layer`` resident, evicting by global LRU (docs/semantics.md §5.2).

    Args:
      state: the cache.
      layer: int, possibly traced; must be in ``[0, L)`` (else ERR_LAYER).
      expert_ids: integer array of any shape: layer-local expert ids in ``[0, E)``, ``-1`` for
        padding (ignored everywhere); anything else sets ERR_EXPERT_ID. Duplicates collapse.
      backend: static; "xla", "pallas", "interpret", or None for the platform default.

    Returns:
      ``(state, EnsurePlan)``. Misses are fetched in ascending expert id; ``cpu`` is all False.

    Raises:
      TypeError: ``expert_ids`` or ``layer`` is not an integer type.
    """
    return _ensure(state, validate.as_index("layer", layer), validate.as_routes(expert_ids),
                   FetchPolicy.full(), _Rules.of(False, FetchOrder.LOWEST_ID, Admission.NONE),
                   backend=backends.resolve_backend(backend))


def ensure_hybrid(state: CacheState, layer, expert_ids, policy: FetchPolicy, *,
                  order=FetchOrder.RECENCY, admission=Admission.PROMOTE_ONE, backend=None):
    """Fetch what the split says, hand the other misses to the CPU (docs/semantics.md §5.4, 5.5).

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
    order = FetchOrder.coerce(order)
    admission = Admission.coerce(admission)
    if not isinstance(policy, FetchPolicy):
        raise TypeError(f"policy must be a FetchPolicy, got {policy!r}")
    policy.validate()
    return _ensure(state, validate.as_index("layer", layer), validate.as_routes(expert_ids), policy,
                   _Rules.of(True, order, admission), backend=backends.resolve_backend(backend))


def materialize_layer(state: CacheState, layer):
    """Copy a whole layer into slots ``[0, E)``, position = expert id, for a prefill (docs/semantics.md §5.6).

    Using the occupancy on entry: every slot holding an expert of this layer is emptied (usage 0),
    and every other layer's expert in ``[0, E)`` loses residency; then the clock advances and
    slot ``e`` holds expert ``e`` with this step's usage. Idempotent; recency and counters are
    untouched.

    Returns:
      ``(state, MaterializePlan)``: ``plan.copy`` lists ``(e, e)`` for every expert, count ``E``.
      A layer outside ``[0, L)`` sets ERR_LAYER (state unchanged, empty copy).
    """
    return _materialize_layer(state, validate.as_index("layer", layer))


@jax.jit
def _materialize_layer(state: CacheState, layer):
    L, E, S = state.num_layers, state.num_experts, state.cache_size
    error = errors.layer_bits(layer, L)
    accepted = error == 0
    state = clock.rebase_if_due(state, accepted)
    layer_c = jnp.clip(layer, 0, L - 1)
    step = state.step + 1
    base = layer_c * E

    slots = lax.iota(jnp.int32, S)
    occupant = state.id_of_slot
    own_layer = (occupant >= base) & (occupant < base + E)
    target = slots < E  # the slots the layer is copied into
    displaced = accepted & target & (occupant >= 0) & ~own_layer
    slot_for_id = state.slot_for_id.reshape(-1).at[_drop_unless(displaced, occupant, L * E)].set(
        -1, mode="drop").reshape(L, E)
    slot_for_id = jnp.where(
        accepted & (lax.iota(jnp.int32, L) == layer_c)[:, None],
        lax.iota(jnp.int32, E)[None, :],
        slot_for_id,
    )
    stale = accepted & own_layer
    id_of_slot = jnp.where(accepted & target, base + slots, jnp.where(stale, -1, occupant))
    usage = jnp.where(accepted & target, step, jnp.where(stale, 0, state.usage))

    experts = jnp.where(accepted, lax.iota(jnp.int32, E), -1)
    new_state = state.replace(
        slot_for_id=slot_for_id,
        id_of_slot=id_of_slot,
        usage=usage,
        step=jnp.where(accepted, step, state.step),
    )
    count = jnp.where(accepted, E, 0).astype(jnp.int32)
    copy = CopyPlan(dst_slots=experts, src_rows=experts, count=count)
    return new_state, MaterializePlan(copy=copy, error=error)


def forget_slot(state: CacheState, slot):
    """Drop one slot after its copy failed (docs/semantics.md §5.7).

    The slot becomes empty, the expert it held non-resident, and its usage the smallest int32, so
    it is the very first victim. A slot that is already empty is left as it is (idempotent).

    Returns:
      ``(state, ForgetPlan)``; ``plan.old`` is the flat id it held or -1. A slot outside
      ``[0, S)`` sets ERR_SLOT (state unchanged).
    """
    return _forget_slot(state, validate.as_index("slot", slot))


@jax.jit
def _forget_slot(state: CacheState, slot):
    L, E, S = state.num_layers, state.num_experts, state.cache_size
    error = errors.slot_bits(slot, S)
    accepted = error == 0
    slot_c = jnp.clip(slot, 0, S - 1)
    old = jnp.where(accepted, state.id_of_slot[slot_c], -1)
    drop = old >= 0
    new_state = state.replace(
        id_of_slot=state.id_of_slot.at[_drop_unless(drop, slot_c, S)].set(-1, mode="drop"),
        slot_for_id=state.slot_for_id.reshape(-1).at[_drop_unless(drop, old, L * E)].set(
            -1, mode="drop").reshape(L, E),
        usage=state.usage.at[_drop_unless(drop, slot_c, S)].set(validate.INT32_MIN, mode="drop"),
    )
    return new_state, ForgetPlan(old=old, error=error)
