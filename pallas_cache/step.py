"""The ensure step (docs/semantics.md §5.2-§5.5) in named phases, loop-free XLA, and the switch to
the fused kernel, whose step (:mod:`~pallas_cache.kernels.step`) has the same phases in the same
order (docs/design.md, "The step in phases").

:func:`ensure_with_rules` is the core of ``ensure`` and ``ensure_hybrid``, with the options as a
:class:`Rules`; it calls the phases in order: observe routes, validate, rebase, classify, split,
refresh hits, fetch order, rank victims, admit, install, route slots, count. Each phase is a
function of arrays; the admission rules and the split are :mod:`~pallas_cache.policy`'s, shared
with the kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_cache import clock, errors, evictions, selection
from pallas_cache.kernels import dispatch
from pallas_cache.plans import CopyPlan, EnsurePlan
from pallas_cache.policy import (Admission, FetchOrder, FetchPolicy, admit_promote_one,
                                 admit_reuse, split_count)
from pallas_cache.state import CacheState, Clock, Residency, Routing
from pallas_cache.tree import Record, pytree_dataclass, varying_axes

__all__ = ["Rules", "drop_unless", "ensure_with_rules"]

# Up to this many route pairs, the RECENCY fetch order ranks the routes (see _fetch_order).
_RANK_ROUTES_MAX = 256
# Up to this many compared pairs, a small result (histogram row, fetch-order list) is a masked sum
# (one fused reduction); above it, a scatter (two kernels, but O(K) work for many routes).
_MASKED_SUM_MAX = 4096


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


class Hits(NamedTuple):
    """Phase classify's output: the layer's row of the map, which experts the call routes, hit
    and missed, and their counts."""

    slot_row: jax.Array  # int32[E]: slot_for_id of the layer
    routed: jax.Array  # bool[E]
    hit: jax.Array  # bool[E]
    miss: jax.Array  # bool[E]
    num_active: jax.Array  # int32[]
    num_missing: jax.Array  # int32[]


class Installs(NamedTuple):
    """Phase install's pairs: the k-th miss into the k-th victim for ``k < num_fetch``, -1
    past it (and everywhere for a refused call)."""

    installs: jax.Array  # bool[K']
    victims: jax.Array  # int32[K']
    experts: jax.Array  # int32[K']
    occupants: jax.Array  # int32[K']: each victim's occupant before the call
    num_fetch: jax.Array  # int32[]: 0 for a refused call


def drop_unless(mask, index, out_of_range):
    """``index`` where ``mask`` holds, else an index a ``mode="drop"`` scatter ignores."""
    return jnp.where(mask, index, out_of_range)


def _gate(flag, value, otherwise):
    """``value`` where the rule ``flag`` holds, else ``otherwise``: a Python branch for a static
    flag (the unused path is never traced), a ``where`` for a traced one."""
    if flag is True:
        return value
    if flag is False:
        return otherwise
    return jnp.where(flag, value, otherwise)


def ensure_with_rules(state: CacheState, layer, routes, policy: FetchPolicy, rules: Rules, *,
                      backend: str = "xla"):
    """The core of ``ensure`` and ``ensure_hybrid``, with the options as a :class:`Rules`.

    For sweeps that run several orders/admissions in one vmapped program (the replay); a decode
    loop calls the public ops. Not jitted itself (call it under ``jit``/``scan``); inputs are not
    coerced: ``layer`` an int32 scalar, ``routes`` int32 of any shape, ``policy`` a scalar
    :class:`FetchPolicy`, ``backend`` a resolved name. With ``"pallas"``/``"interpret"``, Python-bool
    rules and an eviction the kernel ranks (its record's ``kernel``: the four built-in ones), the
    whole call is the fused kernel of :mod:`~pallas_cache.kernels.step`; otherwise (traced rules,
    a record without kernel hooks) the XLA phases below run on every backend, loop-free
    (docs/semantics.md §7.1).

    Returns:
      ``(state, EnsurePlan)``, exactly as the public op with the same options.
    """
    # C is the static capacity (shapes, out-of-range scatter indices); the usable size S is
    # state.cache_size, which the victim search masks (docs/semantics.md §5.15).
    L, E = state.num_layers, state.num_experts
    evictions.check_admission(state.eviction, rules.reuse)
    flat_routes = routes.reshape(-1)
    num_out = min(flat_routes.shape[0], E)  # K': distinct routes of one layer never exceed E
    fused_step = dispatch.fused_step_for(state, rules, flat_routes.shape[0], backend,
                                         mesh_axes=varying_axes(state, layer, routes, policy))
    if fused_step is not None:
        state, plan = fused_step(state, layer, flat_routes, policy, rules)
        return state, plan.replace(slots=plan.slots.reshape(routes.shape),
                                   cpu=plan.cpu.reshape(routes.shape))

    observed, is_route = _observe_routes(flat_routes, E)
    error, accepted, layer_c = _validate(layer, flat_routes, L, E, state.cache_size,
                                         state.capacity)
    state = clock.rebase_if_due(state, accepted)
    step = state.step + 1
    hits, eviction_state = _classify(state, observed, layer_c, accepted)
    num_fetch = split_count(policy.fraction16, policy.cap, hits.num_missing)
    usage = _refresh_hits(state.residency.usage, hits, step, accepted)
    recency_row = state.routing.recency[layer_c]
    experts, recs = _fetch_order(flat_routes, is_route, hits.miss, recency_row, rules, num_out)
    victims, vusage, occupants = _rank_victims(state, eviction_state, usage, step, layer_c,
                                               rules, num_out)
    num_fetch = _admit(rules, policy.fraction16, num_fetch, experts, recs, victims, vusage,
                       occupants)
    installed = _install_pairs(victims, experts, occupants, num_fetch, accepted)
    slot_for_id, id_of_slot, usage = _install(state, usage, installed, layer_c, step)
    route_slot, cpu = _route_slots(flat_routes, is_route, hits.slot_row, installed, accepted)
    recency, stats, routing_freq, num_active, num_missing = _count(
        state, hits, observed, installed.num_fetch, recency_row, layer_c, step, accepted, rules)
    new_state = state.replace(
        residency=Residency(slot_for_id=slot_for_id, id_of_slot=id_of_slot, usage=usage),
        clock=Clock(step=jnp.where(accepted, step, state.step)),
        routing=Routing(recency=recency, freq=routing_freq), stats=stats,
        eviction_state=eviction_state)
    copy = CopyPlan(dst_slots=installed.victims, src_rows=installed.experts,
                    count=installed.num_fetch, num_slots=state.capacity, num_experts=E)
    return new_state, EnsurePlan(
        slots=route_slot.reshape(routes.shape), cpu=cpu.reshape(routes.shape), copy=copy,
        active=num_active, missing=num_missing, fetched=installed.num_fetch, error=error)


def _observe_routes(flat_routes, num_experts: int):
    """Phase observe routes: the histogram row int32[E] (padding and out-of-range ids count
    nowhere) and which routes name an expert. Few routes: a [K, E] compare-and-count, one fused
    reduction where a scatter-add into a fresh buffer takes two kernels; many routes: the
    scatter-add."""
    E = num_experts
    is_route = (flat_routes >= 0) & (flat_routes < E)
    if flat_routes.shape[0] * E <= _MASKED_SUM_MAX:
        observed = jnp.sum(flat_routes[:, None] == lax.iota(jnp.int32, E)[None, :], axis=0,
                           dtype=jnp.int32)
    else:
        observed = jnp.zeros((E,), jnp.int32).at[drop_unless(is_route, flat_routes, E)].add(
            1, mode="drop")
    return observed, is_route


def _validate(layer, flat_routes, num_layers: int, num_experts: int, cache_size, capacity: int):
    """Phase validate (docs/semantics.md §6): ``(error, accepted, layer_c)``, ``layer_c`` any
    in-range index (a refused call writes nothing)."""
    error = (errors.layer_bits(layer, num_layers) | errors.route_bits(flat_routes, num_experts)
             | errors.size_bits(cache_size, num_experts, capacity))
    return error, error == 0, jnp.clip(layer, 0, num_layers - 1)


def _classify(state: CacheState, observed, layer_c, accepted):
    """Phase classify: the routed experts, hit or missed, and the eviction's bookkeeping after
    its observation of the call (a refused call changes nothing)."""
    routed = observed > 0
    slot_row = state.residency.slot_for_id[layer_c]
    hit = routed & (slot_row >= 0)
    miss = routed & (slot_row < 0)
    eviction_state = state.eviction.observe(state.eviction_state, layer_c, routed, accepted)
    hits = Hits(slot_row, routed, hit, miss, jnp.sum(routed, dtype=jnp.int32),
                jnp.sum(miss, dtype=jnp.int32))
    return hits, eviction_state


def _refresh_hits(usage, hits: Hits, step, accepted):
    """Phase refresh hits: each hit slot's usage becomes this step, also what makes it
    ineligible as a victim of this step."""
    at = drop_unless(hits.hit & accepted, hits.slot_row, usage.shape[0])
    return usage.at[at].set(step, mode="drop")


def _fetch_order(flat_routes, is_route, miss, recency_row, rules: Rules, num_out: int):
    """Phase fetch order: every miss in fetch order, ``(experts, recs)`` int32[K'], -1 past the
    number of misses, ``recs`` each one's pre-call recency (None when no admission rule reads
    it). Every miss, whatever the split says: fixed-size, loop-free, and what the admission
    rules read; only the first ``num_fetch`` are installed."""
    experts = _misses_in_fetch_order(flat_routes, is_route, miss, recency_row,
                                     rules.by_recency, num_out)
    if rules.promote_one is False and rules.reuse is False:
        return experts, None
    return experts, jnp.where(experts >= 0, recency_row[jnp.maximum(experts, 0)], -1)


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
                drop_unless(miss, position, num_out)].set(lax.iota(jnp.int32, num_experts),
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


def _rank_victims(state: CacheState, eviction_state, usage, step, layer_c, rules: Rules,
                  num_out: int):
    """Phase rank victims: the first K' victims ``(victims, vusage, occupants)`` int32[K'], -1
    past the evictable slots, ranked by the eviction (docs/semantics.md §5.16) among the usable
    slots ``[0, cache_size)`` (§5.15) not touched this step; ``vusage`` each one's usage (None
    unless REUSE reads it), ``occupants`` the expert each holds."""
    victims = evictions.rank_victims(state.eviction, eviction_state, state.residency.id_of_slot, usage, step,
                                     num_out, num_out=num_out, layer=layer_c,
                                     num_experts=state.num_experts, cache_size=state.cache_size)
    at = jnp.maximum(victims, 0)
    occupants = jnp.where(victims >= 0, state.residency.id_of_slot[at], -1)
    vusage = None if rules.reuse is False else jnp.where(victims >= 0, usage[at], -1)
    return victims, vusage, occupants


def _admit(rules: Rules, fraction16, num_fetch, experts, recs, victims, vusage, occupants):
    """Phase admit (docs/semantics.md §5.5): the split's ``F`` raised by PROMOTE_ONE or REUSE
    (the rules of :mod:`~pallas_cache.policy`), each where its rule and a fraction policy
    hold."""
    num_out = experts.shape[0]
    if rules.promote_one is not False and num_out > 0:
        num_fetch = admit_promote_one(_gate(rules.promote_one, fraction16 > 0, False), num_fetch,
                                      experts, recs, victims, occupants, first=lambda v: v[0])
    if rules.reuse is not False and num_out > 0:
        num_fetch = admit_reuse(_gate(rules.reuse, fraction16 > 0, False), num_fetch, experts,
                                recs, victims, vusage, num_out)
    return num_fetch


def _install_pairs(victims, experts, occupants, num_fetch, accepted) -> Installs:
    """Phase install, its pairs: the first ``num_fetch`` misses into the first victims."""
    installs = (lax.iota(jnp.int32, victims.shape[0]) < num_fetch) & accepted
    return Installs(installs, jnp.where(installs, victims, -1), jnp.where(installs, experts, -1),
                    jnp.where(installs, occupants, -1), jnp.where(accepted, num_fetch, 0))


def _install(state: CacheState, usage, installed: Installs, layer_c, step):
    """Phase install: the victims' old occupants (any layer) lose residency and the new experts
    gain it, one scatter, since the two id sets are disjoint (an occupant is resident, a miss is
    not); each victim holds its expert with this step's usage. ``(slot_for_id, id_of_slot,
    usage)``."""
    L, E, C = state.num_layers, state.num_experts, state.capacity
    installs, victims, experts, occupants, _ = installed
    base = layer_c * E
    slot_for_id = state.residency.slot_for_id.reshape(-1).at[jnp.concatenate([
        drop_unless(installs & (occupants >= 0), occupants, L * E),
        drop_unless(installs, base + experts, L * E),
    ])].set(jnp.concatenate([jnp.full_like(victims, -1), victims]), mode="drop").reshape(L, E)
    id_of_slot = state.residency.id_of_slot.at[drop_unless(installs, victims, C)].set(
        base + experts, mode="drop")
    usage = usage.at[drop_unless(installs, victims, C)].set(step, mode="drop")
    return slot_for_id, id_of_slot, usage


def _route_slots(flat_routes, is_route, slot_row, installed: Installs, accepted):
    """Phase route slots: each route reads its expert's slot after installation; not resident
    -> a CPU route. (An evicted expert of this layer was not routed: routed residents are hits,
    never victims.)"""
    E = slot_row.shape[0]
    new_row = slot_row.at[drop_unless(installed.installs, installed.experts, E)].set(
        installed.victims, mode="drop")
    route_slot = jnp.where(is_route & accepted, new_row[jnp.clip(flat_routes, 0, E - 1)], -1)
    return route_slot, is_route & accepted & (route_slot < 0)


def _count(state: CacheState, hits: Hits, observed, num_fetch, recency_row, layer_c, step,
           accepted, rules: Rules):
    """Phase count: a hybrid call's recency stamps on every routed expert, in both fetch orders
    (docs/semantics.md §10), the layer's counters and, when collecting, its histogram.
    ``(recency, stats, routing_freq, active, missing)``, the last two 0 for a refused call."""

    def row_update(table, row):
        return lax.dynamic_update_slice(table, row[None], (layer_c, jnp.int32(0)))

    recency = state.routing.recency
    if rules.hybrid is not False:
        stamped = hits.routed & accepted & _gate(rules.hybrid, True, False)
        recency = row_update(recency, jnp.where(stamped, step, recency_row))
    num_active = jnp.where(accepted, hits.num_active, 0)
    num_missing = jnp.where(accepted, hits.num_missing, 0)
    # Columns of CacheState.stats: calls, active, missing, fetched.
    counters = jnp.stack([accepted.astype(jnp.int32), num_active, num_missing, num_fetch])
    stats = row_update(state.stats, state.stats[layer_c] + counters)
    observe = accepted & state.settings.collect_routing
    routing_freq = row_update(
        state.routing.freq, state.routing.freq[layer_c] + jnp.where(observe, observed, 0))
    return recency, stats, routing_freq, num_active, num_missing
