"""The decode-time cache operations: ensure, ensure_hybrid, materialize_layer, forget_slot.

Each is a pure function ``op(state, ...) -> (state, plan)``, jittable with a traced layer and
vmappable; ``order``, ``admission`` and ``backend`` are static, the policy is traced
(docs/semantics.md §5; how a step is computed: docs/design.md, "The state and the step").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_cache import clock, errors, evictions, selection, validate
from pallas_cache.kernels import dispatch
from pallas_cache.hints import Backend, IndexLike, RoutesLike
from pallas_cache.policy import Admission, FetchOrder, FetchPolicy
from pallas_cache.state import CacheState, check_state
from pallas_cache.tree import Record, pytree_dataclass, static_field, varying_axes

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

# Up to this many route pairs, the RECENCY fetch order ranks the routes (see _misses_in_fetch_order).
_RANK_ROUTES_MAX = 256
# Up to this many compared pairs, a small result (histogram row, fetch-order list) is a masked sum
# (one fused reduction); above it, a scatter (two kernels, but O(K) work for many routes).
_MASKED_SUM_MAX = 4096


@pytree_dataclass
class CopyPlan(Record):
    """The host-to-device copies a step needs before its multiply.

    Attributes:
      dst_slots: int32[K']. Destination slot of each copy, in fetch order; -1 past ``count``.
      src_rows: int32[K']. The **layer-local** host row (expert id) of each copy, so it indexes the
        layer's own host bank; -1 past ``count``.
      count: int32[]. Number of valid entries.
      num_slots: static. The capacity ``C`` the plan was made for (the pool's allocated leading
        axis, not the usable size ``S``; None for a hand-built plan).
      num_experts: static. The experts per layer ``E`` its ``src_rows`` index (None likewise).
        Both let :func:`~pallas_cache.moe.apply_copy_plan` refuse a pool or bank of another
        geometry at trace time instead of dropping or misdirecting copies.
    """

    dst_slots: jax.Array
    src_rows: jax.Array
    count: jax.Array
    num_slots: int | None = static_field(default=None)
    num_experts: int | None = static_field(default=None)


@pytree_dataclass
class EnsurePlan(Record):
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
class MaterializePlan(Record):
    """What ``materialize_layer`` asks the caller to copy: the whole layer, position = id.

    Attributes:
      copy: ``E`` entries ``(e, e)`` for every expert, count ``E``; all -1 / 0 on error.
      error: int32[]. 0 or ERR_LAYER.
    """

    copy: CopyPlan
    error: jax.Array


@pytree_dataclass
class ForgetPlan(Record):
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


def _misses_in_fetch_order(flat_routes, is_route, miss, recency_row, by_recency, num_out):
    """The misses in fetch order, as int32[num_out] expert ids (-1 past the number of misses).

    RECENCY: descending pre-call recency, ties to the lower id (never-routed experts, recency -1,
    come last in id order). LOWEST_ID: ascending id, a prefix sum and a masked sum (a scatter
    above ``_MASKED_SUM_MAX`` compared pairs). Loop-free:
    with few routes (``K * K <= _RANK_ROUTES_MAX``) each missed route's position is the number of
    distinct missed experts ahead of it, one ``K x K`` comparison; otherwise ``num_out``
    unrolled argmin rounds over the ``E`` experts (:func:`~pallas_cache.selection.first_in_order`).
    Either way no sort, which is expensive on CPU.
    """
    num_experts = miss.shape[0]
    if by_recency is False:
        position = jnp.cumsum(miss, dtype=jnp.int32) - 1
        if num_out * num_experts > _MASKED_SUM_MAX:
            return jnp.full((num_out,), -1, jnp.int32).at[
                _drop_unless(miss, position, num_out)].set(lax.iota(jnp.int32, num_experts),
                                                           mode="drop")
        at = miss[None, :] & (position[None, :] == lax.iota(jnp.int32, num_out)[:, None])
        return jnp.sum(jnp.where(at, lax.iota(jnp.int32, num_experts)[None, :] + 1, 0), axis=1,
                       dtype=jnp.int32) - 1
    # Larger recency = fetched earlier, ties to the lower id: ascending order of its bitwise not.
    key = ~recency_row if by_recency is True else ~jnp.where(by_recency, recency_row, 0)
    num_routes = flat_routes.shape[0]
    if num_routes * num_routes > _RANK_ROUTES_MAX:
        return selection.first_in_order(key, miss, num_out)
    expert = jnp.clip(flat_routes, 0, num_experts - 1)
    route_key = key[expert]
    earlier = lax.iota(jnp.int32, num_routes)
    earlier = earlier[None, :] < earlier[:, None]  # [j, i]: route i comes before route j
    # One representative route per distinct missed expert: its first occurrence.
    duplicate = jnp.any(earlier & (flat_routes[None, :] == flat_routes[:, None]), axis=1)
    leads = is_route & miss[expert] & ~duplicate
    ahead = leads[None, :] & ((route_key[None, :] < route_key[:, None]) | (
        (route_key[None, :] == route_key[:, None]) & (expert[None, :] < expert[:, None])))
    position = jnp.sum(ahead, axis=1, dtype=jnp.int32)
    # Output p is the lead at position p (positions of leads are distinct): a [num_out, K]
    # masked sum, one fused reduction where a scatter into a fresh -1 buffer takes two kernels.
    at = leads[None, :] & (position[None, :] == lax.iota(jnp.int32, num_out)[:, None])
    return jnp.sum(jnp.where(at, expert[None, :] + 1, 0), axis=1, dtype=jnp.int32) - 1


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


def _gate(flag, value, otherwise):
    """``value`` where the rule ``flag`` holds, else ``otherwise``: a Python branch for a static
    flag (the unused path is never traced), a ``where`` for a traced one."""
    if flag is True:
        return value
    if flag is False:
        return otherwise
    return jnp.where(flag, value, otherwise)


@pytree_dataclass
class Rules(Record):
    """The options of an ensure call: which paths of the core run (docs/semantics.md §7.1).

    Build it with :meth:`of`, which gives Python bools: the core then branches in Python and the
    unused paths are not even traced (plain ``ensure`` has no promotion or REUSE code at all). A
    sweep that runs several rules in one program stacks them (``jnp.stack`` over the fields, e.g.
    ``jax.tree.map(lambda *x: jnp.stack(x), *rules)``) and vmaps: the fields are then traced
    bools and every path runs, selected per lane.

    Attributes (Python bool, or bool[] when traced):
      hybrid: stamp recency (ensure_hybrid); plain ``ensure`` does not.
      by_recency: misses in RECENCY order, else ascending id.
      promote_one: the PROMOTE_ONE admission applies (RECENCY order; fraction checked on device).
      reuse: the REUSE admission applies (RECENCY order; fraction checked on device).
    """

    hybrid: bool | jax.Array
    by_recency: bool | jax.Array
    promote_one: bool | jax.Array
    reuse: bool | jax.Array

    @classmethod
    def of(cls, *, hybrid: bool, order=FetchOrder.RECENCY,
           admission=Admission.PROMOTE_ONE) -> "Rules":
        """The rules of ``ensure`` (``hybrid=False``, LOWEST_ID, NONE) or of ``ensure_hybrid``
        with ``order``/``admission`` (enums or their string values), as Python bools."""
        order, admission = FetchOrder.coerce(order), Admission.coerce(admission)
        # Admission rules act with the recency order only (docs/semantics.md §5.5).
        by_recency = order is FetchOrder.RECENCY
        return cls(bool(hybrid), by_recency, by_recency and admission is Admission.PROMOTE_ONE,
                   by_recency and admission is Admission.REUSE)


def ensure_with_rules(state: CacheState, layer, routes, policy: FetchPolicy, rules: Rules, *,
                      backend: str = "xla"):
    """The core of :func:`ensure` and :func:`ensure_hybrid`, with the options as a :class:`Rules`.

    For sweeps that run several orders/admissions in one vmapped program (the replay); a decode
    loop calls the public ops. Not jitted itself (call it under ``jit``/``scan``); inputs are not
    coerced: ``layer`` an int32 scalar, ``routes`` int32 of any shape, ``policy`` a scalar
    :class:`FetchPolicy`, ``backend`` a resolved name. With ``"pallas"``/``"interpret"``, Python-bool
    rules and an eviction the kernel ranks (its record's ``kernel``: the four built-in ones), the
    whole call is the fused kernel of :mod:`~pallas_cache.kernels.step`; otherwise (traced rules,
    a record without kernel hooks) the XLA step below runs on every backend, loop-free
    (docs/semantics.md §7.1).

    Returns:
      ``(state, EnsurePlan)``, exactly as the public op with the same options.
    """
    # C is the static capacity (shapes, out-of-range scatter indices); the usable size S is
    # state.cache_size, which the victim search masks (docs/semantics.md §5.15).
    L, E, C = state.num_layers, state.num_experts, state.capacity
    evictions.check_admission(state.eviction, rules.reuse)
    flat_routes = routes.reshape(-1)
    num_out = min(flat_routes.shape[0], E)  # K': distinct routes of one layer never exceed E

    fused_step = dispatch.fused_step_for(state, rules, flat_routes.shape[0], backend,
                                         mesh_axes=varying_axes(state, layer, routes, policy))
    if fused_step is not None:
        return _fused_ensure(fused_step, state, layer, routes, policy, rules)

    error = errors.layer_bits(layer, L) | errors.route_bits(flat_routes, E)
    accepted = error == 0
    state = clock.rebase_if_due(state, accepted)

    layer_c = jnp.clip(layer, 0, L - 1)  # any in-range index; a refused call writes nothing
    step = state.step + 1
    base = layer_c * E

    is_route = (flat_routes >= 0) & (flat_routes < E)
    # The histogram row. Few routes: a [K, E] compare-and-count (padding and out-of-range ids
    # match no expert), one fused reduction where a scatter-add into a fresh buffer takes two
    # kernels; many routes: the scatter-add.
    if flat_routes.shape[0] * E <= _MASKED_SUM_MAX:
        observed = jnp.sum(flat_routes[:, None] == lax.iota(jnp.int32, E)[None, :], axis=0,
                           dtype=jnp.int32)
    else:
        observed = jnp.zeros((E,), jnp.int32).at[_drop_unless(is_route, flat_routes, E)].add(
            1, mode="drop")
    routed = observed > 0
    slot_row = state.slot_for_id[layer_c]
    hit = routed & (slot_row >= 0)
    miss = routed & (slot_row < 0)
    num_active = jnp.sum(routed, dtype=jnp.int32)
    num_missing = jnp.sum(miss, dtype=jnp.int32)

    # Hit refresh: also what makes a hit slot ineligible as a victim of this step.
    usage = state.usage.at[_drop_unless(hit & accepted, slot_row, C)].set(step, mode="drop")
    recency_row = state.recency[layer_c]
    num_fetch = policy.split(num_missing)

    # Every miss in fetch order and the first K' victims, whatever the split says: fixed-size,
    # loop-free, and what the admission rules below read. Only the first num_fetch are installed.
    experts = _misses_in_fetch_order(flat_routes, is_route, miss, recency_row,
                                     rules.by_recency, num_out)
    # The eviction policy ranks the victims (docs/semantics.md §5.16); only the usable slots
    # [0, cache_size) are candidates (§5.15).
    eviction_state = evictions.observe_call(state.eviction, state.eviction_state, layer_c, routed,
                                            accepted)
    victims = evictions.rank_victims(state.eviction, eviction_state, state.id_of_slot, usage, step,
                                     num_out, num_out=num_out, layer=layer_c, num_experts=E,
                                     cache_size=state.cache_size)

    # PROMOTE_ONE (docs/semantics.md §5.5): with F = 0, the first miss in recency order takes the
    # first victim if that slot is empty and the miss was routed before. Both are computed above,
    # so the decision is a few scalar reads (the same as selection.promotion_decision).
    if rules.promote_one is not False and num_out > 0:
        first, slot = experts[0], victims[0]
        promoted = ((policy.fraction16 > 0) & (num_fetch == 0) & (first >= 0)
                    & (recency_row[jnp.maximum(first, 0)] >= 0) & (slot >= 0)
                    & (state.id_of_slot[jnp.maximum(slot, 0)] == -1))
        num_fetch = jnp.where(_gate(rules.promote_one, promoted, False), 1, num_fetch)

    # REUSE (docs/semantics.md §5.5) looks past the split at every miss.
    if rules.reuse is not False:
        reuse = _gate(rules.reuse, policy.fraction16 > 0, False)
        num_fetch = jnp.where(
            reuse, _reuse_admitted(num_fetch, experts, victims, recency_row, usage, num_out),
            num_fetch)

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
    id_of_slot = state.id_of_slot.at[_drop_unless(installs, victims, C)].set(
        base + experts, mode="drop")
    usage = usage.at[_drop_unless(installs, victims, C)].set(step, mode="drop")

    # Each route reads its expert's slot after installation; not resident -> CPU route. (An
    # evicted expert of this layer was not routed: routed residents are hits, never victims.)
    new_row = slot_row.at[_drop_unless(installs, experts, E)].set(victims, mode="drop")
    route_slot = jnp.where(is_route & accepted, new_row[jnp.clip(flat_routes, 0, E - 1)], -1)
    cpu = is_route & accepted & (route_slot < 0)

    def row_update(table, row):
        return lax.dynamic_update_slice(table, row[None], (layer_c, jnp.int32(0)))

    # A hybrid call stamps every routed expert, in both fetch orders (docs/semantics.md §10).
    recency = state.recency
    if rules.hybrid is not False:
        stamped = routed & accepted & _gate(rules.hybrid, True, False)
        recency = row_update(recency, jnp.where(stamped, step, recency_row))
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
        eviction_state=eviction_state,
    )
    plan = EnsurePlan(
        slots=route_slot.reshape(routes.shape),
        cpu=cpu.reshape(routes.shape),
        copy=CopyPlan(dst_slots=victims, src_rows=experts, count=num_fetch, num_slots=C,
                      num_experts=E),
        active=num_active,
        missing=num_missing,
        fetched=num_fetch,
        error=error,
    )
    return new_state, plan


def _fused_ensure(fused_step, state, layer, routes, policy, rules):
    """:func:`ensure_with_rules` as the fused kernel (kernels/step.py), the plan rebuilt from its
    outputs."""
    E, C = state.num_experts, state.capacity
    flat_routes = routes.reshape(-1)
    state, slots, cpu, dst, src, count, active, missing, error = fused_step(
        state, layer, flat_routes, policy, rules)
    plan = EnsurePlan(
        slots=slots.reshape(routes.shape), cpu=cpu.reshape(routes.shape),
        copy=CopyPlan(dst_slots=dst, src_rows=src, count=count, num_slots=C, num_experts=E),
        active=active, missing=missing, fetched=count, error=error)
    return state, plan


@functools.partial(jax.jit, static_argnames=("rules", "backend"))
def _ensure(state: CacheState, layer, routes, policy: FetchPolicy, rules: Rules, backend: str):
    """:func:`ensure_with_rules` with static rules, jitted so that an eager call compiles once;
    under an outer ``jit`` or ``scan`` it is simply inlined."""
    return ensure_with_rules(state, layer, routes, policy, rules, backend=backend)


def ensure(state: CacheState, layer: IndexLike, expert_ids: RoutesLike, *,
           backend: Backend = None) -> tuple[CacheState, EnsurePlan]:
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
      TypeError: ``expert_ids`` or ``layer`` is not an integer type; a state field of another
        dtype than :func:`~pallas_cache.state.init` gives (:func:`~pallas_cache.state.check_state`).
      ValueError: a state field of another shape than its geometry asks for.
    """
    check_state(state)
    return _ensure(state, validate.as_index("layer", layer), validate.as_routes(expert_ids),
                   FetchPolicy.full(),
                   Rules.of(hybrid=False, order=FetchOrder.LOWEST_ID, admission=Admission.NONE),
                   backend=dispatch.resolve_backend(backend))


def ensure_hybrid(state: CacheState, layer: IndexLike, expert_ids: RoutesLike, policy: FetchPolicy,
                  *, order: FetchOrder | str = FetchOrder.RECENCY,
                  admission: Admission | str = Admission.PROMOTE_ONE,
                  backend: Backend = None) -> tuple[CacheState, EnsurePlan]:
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
    rules = Rules.of(hybrid=True, order=order, admission=admission)
    check_state(state)
    evictions.check_admission(state.eviction, Admission.coerce(admission) is Admission.REUSE)
    if not isinstance(policy, FetchPolicy):
        raise TypeError(f"policy must be a FetchPolicy, got {policy!r}")
    policy.validate()
    return _ensure(state, validate.as_index("layer", layer), validate.as_routes(expert_ids), policy,
                   rules, backend=dispatch.resolve_backend(backend))


def materialize_layer(state: CacheState, layer: IndexLike) -> tuple[CacheState, MaterializePlan]:
    """Copy a whole layer into slots ``[0, E)``, position = expert id, for a prefill (docs/semantics.md §5.6).

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
    error = errors.layer_bits(layer, L)
    accepted = error == 0
    state = clock.rebase_if_due(state, accepted)
    layer_c = jnp.clip(layer, 0, L - 1)
    step = state.step + 1
    base = layer_c * E

    slots = lax.iota(jnp.int32, C)
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
    copy = CopyPlan(dst_slots=experts, src_rows=experts, count=count, num_slots=C, num_experts=E)
    return new_state, MaterializePlan(copy=copy, error=error)


def forget_slot(state: CacheState, slot: IndexLike) -> tuple[CacheState, ForgetPlan]:
    """Drop one slot after its copy failed (docs/semantics.md §5.7).

    The slot becomes empty, the expert it held non-resident, and its usage the smallest int32, so
    it is the very first victim. A slot that is already empty is left as it is (idempotent).

    Returns:
      ``(state, ForgetPlan)``; ``plan.old`` is the flat id it held or -1. A slot outside
      ``[0, S)`` (``S`` the usable size ``state.cache_size``) sets ERR_SLOT (state unchanged).
    """
    return _forget_slot(state, validate.as_index("slot", slot))


@jax.jit
def _forget_slot(state: CacheState, slot):
    L, E, C = state.num_layers, state.num_experts, state.capacity
    error = errors.slot_bits(slot, state.cache_size)  # an unusable slot is out of range
    accepted = error == 0
    slot_c = jnp.clip(slot, 0, C - 1)
    old = jnp.where(accepted, state.id_of_slot[slot_c], -1)
    drop = old >= 0
    new_state = state.replace(
        id_of_slot=state.id_of_slot.at[_drop_unless(drop, slot_c, C)].set(-1, mode="drop"),
        slot_for_id=state.slot_for_id.reshape(-1).at[_drop_unless(drop, old, L * E)].set(
            -1, mode="drop").reshape(L, E),
        usage=state.usage.at[_drop_unless(drop, slot_c, C)].set(validate.INT32_MIN, mode="drop"),
    )
    return new_state, ForgetPlan(old=old, error=error)


from pallas_cache import reprs as _reprs  # noqa: E402  (the short reprs, where the classes are)

_reprs.install_on(EnsurePlan, CopyPlan, MaterializePlan, ForgetPlan)

# The fused kernel's module (and Pallas with it) is imported with the ops, never first inside a
# trace: a first import of Pallas during a trace changes JAX's compile-cache key (jax 0.12), and
# the first jitted step would compile twice.
dispatch.import_kernel()
