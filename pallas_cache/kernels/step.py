"""The fused cache step: one whole ``ensure`` / ``ensure_hybrid`` call as one Pallas kernel (docs/semantics.md §7)."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_cache import errors, evictions
from pallas_cache import policy as policy_rules
from pallas_cache.kernels import common
from pallas_cache.kernels import ring as token_ring
from pallas_cache.kernels.common import INT32_MAX, INT32_MIN
from pallas_cache.plans import CopyPlan, EnsurePlan
from pallas_cache.tree import varying_axes, varying_like, varying_shape

__all__ = ["fused_step", "supports"]

# Most elements of one in-kernel [routes, experts] or [routes, picks] comparison.
_PAIR_BLOCK = 4096


class CallRefs(NamedTuple):
    """The call's read-only inputs, one ref each."""

    layer: Any  # i32[1]
    routes: Any  # i32[K]
    fraction16: Any  # i32[1]: FetchPolicy.fraction16
    cap: Any  # i32[1]: FetchPolicy.cap
    size: Any  # i32[1]: the usable size
    threshold: Any  # i32[1]: the clock rebase threshold
    collect: Any  # bool[1]


class StateRefs(NamedTuple):
    """The state parts the kernel rewrites in place, each leaf a ref of the leaf's own shape
    (docs/design.md, "The kernel's operands"): an input each, aliased to the output of the same
    path. A field added to one of these parts of ``CacheState`` is a ref here with no list to
    edit (read, aliased and written back with no index to shift)."""

    residency: Any  # Residency: slot_for_id i32[L, E], id_of_slot i32[C], usage i32[C]
    clock: Any  # Clock: step i32[]
    routing: Any  # Routing: recency i32[L, E], freq i32[L, E]
    stats: Any  # i32[L, 4]
    tables: tuple  # the eviction's [L, E] tables (KernelRanking.tables)
    ring: tuple  # (RingRefs,) for an eviction with per-call inputs (its token ring), else ()


class PlanRefs(NamedTuple):
    """The plan's outputs."""

    slots: Any  # i32[K]
    cpu: Any  # bool[K]
    dst_slots: Any  # i32[K']
    src_rows: Any  # i32[K']
    count: Any  # i32[1]
    active: Any  # i32[1]
    missing: Any  # i32[1]
    error: Any  # i32[1]


def _state_refs(state, ranking) -> StateRefs:
    """The state's in-place leaves, as they are (no reshape: an aliased operand of another shape
    than its loop-carried buffer is a copy in and a copy out per call)."""
    return StateRefs(
        residency=state.residency, clock=state.clock, routing=state.routing, stats=state.stats,
        tables=tuple(ranking.tables(state.eviction_state)),
        ring=(token_ring.refs_of(state.eviction_state),) if ranking.per_call else ())


def _with_state(state, ranking, out: StateRefs):
    """``state`` with the kernel's in-place leaves ``out``."""
    eviction_state = state.eviction_state
    if out.tables:
        eviction_state = ranking.from_tables(tuple(out.tables))
    if out.ring:
        eviction_state = token_ring.ring_from(eviction_state, out.ring[0])
    return state.replace(residency=out.residency, clock=out.clock, routing=out.routing,
                         stats=out.stats, eviction_state=eviction_state)


def supports(state, rules, num_routes: int) -> bool:
    """Whether :func:`fused_step` runs this call: static rules, an eviction whose record has
    kernel hooks, a route."""
    static = all(isinstance(getattr(rules, f), bool)
                 for f in ("hybrid", "by_recency", "promote_one", "reuse"))
    ranking = state.eviction.kernel
    return (static and ranking is not None and num_routes >= 1
            and (not ranking.per_call or token_ring.supports(state.eviction_state)))


def _zero(ref):
    """The fill of a masked load from ``ref``: ``False`` for a bool ref, else 0."""
    return False if ref.dtype == jnp.bool_ else 0


def _store_scalar(ref, value, mask):
    plgpu.store(ref.at[pl.ds(0, 1)], jnp.full((1,), value, ref.dtype), mask=jnp.full((1,), mask))


def _candidate(key, index, prev_key, prev_index):
    """A pool block's slots still in the search: eligible (``index`` is ``INT32_MAX`` for a slot
    that is not: one vector, not an index and a mask, to spare registers) and strictly after
    ``(prev_key..., prev_index)``."""
    return (index != INT32_MAX) & common.after(key, index, prev_key, prev_index)


def _barrier(interpret: bool):
    """A CTA barrier on the GPU: the stores before it are seen by every thread's loads after it.
    The interpreter runs one thread (and has no barrier)."""
    if not interpret:
        plgpu.debug_barrier()


class _Sizes(NamedTuple):
    """The kernel's static sizes: ``L`` layers, ``E`` experts, ``K`` routes, ``C`` slots,
    ``num_out`` plan entries, and the power-of-two widths of its vectors: experts, plan
    entries, one chunk of routes."""

    L: int
    E: int
    K: int
    C: int
    num_out: int
    e_width: int
    o_width: int
    k_width: int

    @property
    def num_chunks(self) -> int:
        return -(-self.K // self.k_width)


class _Lanes(NamedTuple):
    """Up to ``_RANK_ROUTES`` routes, the routes as one vector of lanes and what the call reads
    per route, all loaded in the first two waves (phase observe routes)."""

    r: Any  # i32[K']: the routes, -1 past K
    index: Any  # i32[K']: the lane
    lane: Any  # bool[K']: index < K
    valid: Any  # bool[K']: an expert id
    first: Any  # bool[K']: valid and the route's first occurrence
    slots: Any  # i32[K']: its slot before the call, -1 when not valid


class _Hits(NamedTuple):
    """Phase classify's output: which experts the call routes, the hit slots to refresh (over
    the route lanes, else over the layer's row), the misses over the row (None with route
    lanes), the counts, and the token ring's view of the call (None without a ring)."""

    routed: Any  # bool[e_width]
    hit: Any  # bool[K'] or bool[e_width]: a hit, once per expert
    hit_slots: Any  # i32[K'] or i32[e_width]
    miss: Any  # bool[e_width] or None
    num_active: Any  # i32[]
    num_missing: Any  # i32[]
    ring_call: Any  # token_ring.RingCall or None


def _route_chunk(routes_ref, c, k_width: int):
    """Chunk ``c`` of the routes: ``(routes, index, lane)``, the routes -1 past the end."""
    start = c * k_width
    index = start + lax.iota(jnp.int32, k_width)
    lane = index < routes_ref.shape[0]
    r = plgpu.load(routes_ref.at[index], mask=lane, other=-1)
    return r, index, lane


def step_kernel(
    call: CallRefs, state: StateRefs, state_out: StateRefs, plan: PlanRefs, scratch: tuple, *,
    num_layers: int, num_experts: int, num_out: int, hybrid: bool, by_recency: bool,
    promote_one: bool, reuse: bool, ranking: evictions.KernelRanking, block: int,
    stamp_block: int, interpret: bool,
):
    """The step's phases in the XLA step's order (pallas_cache/step.py), plus the kernel's own
    writes of the state and the plan at the end; the count's reads of the layer's rows come
    right after the victim search, ahead of admit (docs/design.md, "The step in phases"). Every read of a state leaf
    comes before any write to it (the outputs alias the inputs), but for the stamps, which are
    read back after the rebase and the hit refresh wrote them."""
    L, E = num_layers, num_experts
    K, C = call.routes.shape[0], state.residency.id_of_slot.shape[0]
    e_width, o_width = common.next_pow2(E), common.next_pow2(num_out)
    k_width = max(1, min(common.next_pow2(K), _PAIR_BLOCK // max(e_width, o_width)))
    sz = _Sizes(L, E, K, C, num_out, e_width, o_width, k_width)
    barrier = functools.partial(_barrier, interpret)
    # The scalars first: every one of them is read in the first wave of loads.
    layer, step0, limit = call.layer[0], state.clock.step[...], call.size[0]
    fraction16, cap = call.fraction16[0], call.cap[0]
    e_idx = lax.iota(jnp.int32, e_width)
    e_ok = e_idx < E

    layer_c = jnp.minimum(jnp.maximum(layer, 0), L - 1)
    base = layer_c * E
    lanes = (_route_lanes(call.routes, state.residency.slot_for_id, layer_c, sz)
             if K <= _RANK_ROUTES else None)
    observed, bad = _observe_routes(call.routes, e_idx, sz, lanes)
    error, accepted = _validate(layer, bad, L, limit, E, C)
    row = (layer_c, e_idx)  # the layer's row of an [L, E] ref
    stats_idx = (layer_c, lax.iota(jnp.int32, 4))
    step = _rebase_if_due(call, state, state_out, step0, accepted, block=block,
                          stamp_block=stamp_block)
    barrier()  # the rebase's usage / recency stores before the reads of them by other threads
    hits = _classify(state, state_out, observed, lanes, row, e_idx, e_ok, layer=layer,
                     layer_c=layer_c, accepted=accepted, sz=sz, barrier=barrier)
    num_fetch = _split(fraction16, cap, hits.num_missing)
    _refresh_hits(state_out, hits, step, accepted)
    barrier()  # the hit refresh (and the ring) before the scan's loads by other threads
    o_idx = lax.iota(jnp.int32, o_width)
    experts, recs = _fetch_order(lanes, state_out.routing.recency, layer_c, hits.miss,
                                 hits.num_missing,
                                 o_idx, num_experts=E, by_recency=by_recency,
                                 with_recs=promote_one or reuse)
    need = _victims_needed(num_fetch, hits.num_missing, accepted, promote_one=promote_one,
                           reuse=reuse)
    victims, vusage, occupants = _rank_victims(
        call, state, state_out, scratch, hits, need, o_idx, step=step, base=base, limit=limit,
        layer_c=layer_c, ranking=ranking, block=block, sz=sz, barrier=barrier)
    # The layer's rows, the collect flag and the route counts after the victim search, not in
    # the first waves: held across it they made ptxas spill (benchmarks/RESULTS.md, "Spills").
    rows = _count(state, stats_idx, row, e_ok, _route_counts(call.routes, e_idx, observed, sz),
                  ranking)
    collect = call.collect[0]
    num_fetch = _admit(fraction16, experts, recs, victims, vusage, occupants, num_fetch,
                       promote_one=promote_one, reuse=reuse, num_out=num_out)
    installed = _install(victims, experts, occupants, num_fetch, o_idx, accepted, num_out)
    _route_slots(call, state, plan, lanes, installed, layer_c=layer_c, accepted=accepted,
                 sz=sz)
    barrier()  # every read of id_of_slot / slot_for_id / the rows (victims, plan) before the writes
    _write_state(state_out, rows, hits, installed, step=step, base=base, layer_c=layer_c,
                 row=row,
                 e_ok=e_ok, stats_idx=stats_idx, accepted=accepted,
                 observe_on=accepted & collect,
                 hybrid=hybrid, ranking=ranking, sz=sz)
    _write_plan(plan, hits, installed, o_idx, error, accepted, num_out)


# Most routes held as one vector of lanes (:class:`_Lanes`: the routes read once, a route's
# first occurrence found by comparing lanes); longer route lists (prefill) work per expert, over
# the layer's row, one chunk of routes at a time.
_RANK_ROUTES = 64
# Up to this many routes each is also read as a scalar: a route's first occurrence is then K
# lane-wise compares, not a [routes, routes] reduction (whose result changes layout through
# shared memory, a barrier, on the GPU).
_SCALAR_ROUTES = 8


def _two_sums(a, b):
    """``(sum(a), sum(b))`` of two bool vectors of one width as one packed reduction (each sum
    is at most the width, below 2**15)."""
    if a.shape[0] >= 1 << 15:
        return jnp.sum(a.astype(jnp.int32)), jnp.sum(b.astype(jnp.int32))
    packed = jnp.sum(a.astype(jnp.int32) + (b.astype(jnp.int32) << 16))
    return packed & 0xFFFF, packed >> 16


def _route_lanes(routes_ref, sfi_ref, layer_c, sz: _Sizes) -> _Lanes:
    """Phase observe routes, up to ``_RANK_ROUTES`` routes: :class:`_Lanes`, the routes and
    each one's pre-call slot (the layer ``layer_c`` clamped: a refused call reads in range)."""
    width = common.next_pow2(sz.K)
    index = lax.iota(jnp.int32, width)
    lane = index < sz.K
    r = plgpu.load(routes_ref.at[index], mask=lane, other=-1)
    valid = lane & (r >= 0) & (r < sz.E)
    slots = plgpu.load(sfi_ref.at[layer_c, jnp.clip(r, 0, sz.E - 1)], mask=valid, other=-1)
    if sz.K <= _SCALAR_ROUTES:
        repeat = jnp.zeros((width,), jnp.bool_)
        for i in range(sz.K - 1):
            repeat = repeat | ((r == routes_ref[i]) & (index > i))
    else:
        pairs = (r[None, :] == r[:, None]) & (index[None, :] < index[:, None]) & lane[None, :]
        repeat = jnp.max(pairs.astype(jnp.int32), axis=1) > 0
    return _Lanes(r, index, lane, valid, valid & ~repeat, slots)


def _observe_routes(routes_ref, e_idx, sz: _Sizes, lanes: _Lanes | None):
    """Phase observe routes: the histogram row (padding and bad ids count nowhere) and whether
    any route is a bad id, one chunk of routes at a time (the route lanes when they are the one
    chunk)."""

    def observe(c, carry):
        observed, bad = carry
        if lanes is not None and sz.num_chunks == 1 and lanes.r.shape[0] == sz.k_width:
            r, lane = lanes.r, lanes.lane  # the routes, read once
        else:
            r, _, lane = _route_chunk(routes_ref, c, sz.k_width)
        bad = bad | common.any_true(lane & ((r < -1) | (r >= sz.E)))
        match = (r[:, None] == e_idx[None, :]) & lane[:, None]
        return observed + jnp.sum(match.astype(jnp.int32), axis=0), bad

    init = (jnp.zeros((sz.e_width,), jnp.int32), jnp.bool_(False))
    if sz.num_chunks == 1:
        return observe(0, init)
    return lax.fori_loop(0, sz.num_chunks, observe, init)


def _validate(layer, bad, num_layers: int, size, num_experts: int, capacity: int):
    """Phase validate (docs/semantics.md §6): ``(error, accepted)`` (a refused call writes
    nothing); ``size`` the state's usable size, outside ``[E, C]`` only in a hand-built state."""
    bad_layer = (layer < 0) | (layer >= num_layers)
    bad_size = (size < num_experts) | (size > capacity)
    error = (jnp.where(bad_layer, jnp.int32(errors.ERR_LAYER), jnp.int32(0))
             | jnp.where(bad, jnp.int32(errors.ERR_EXPERT_ID), jnp.int32(0))
             | jnp.where(bad_size, jnp.int32(errors.ERR_CACHE_SIZE), jnp.int32(0)))
    return error, ~(bad_layer | bad | bad_size)


def _rebase_if_due(call, state, state_out, step0, accepted, *, block, stamp_block):
    """Phase rebase (docs/semantics.md §5.12), first, as in the XLA step: a device-side branch
    that renumbers every live stamp in place; returns this call's stamp (the renumbered clock
    + 1). Every stamp read after it is a renumbered one, read from ``state_out`` (the
    interpreter keeps the aliased input unchanged)."""
    due = accepted & (step0 >= call.threshold[0])
    return lax.cond(due, functools.partial(_rebase, state.residency.usage, state.routing.recency, state_out.residency.usage,
                                           state_out.routing.recency, block=block,
                                           stamp_block=stamp_block),
                    lambda s: s, step0) + 1


def _classify(state, state_out, observed, lanes: _Lanes | None, row, e_idx, e_ok, *, layer,
              layer_c, accepted, sz: _Sizes, barrier) -> _Hits:
    """Phase classify: the routed experts, hit or missed, counted (over the route lanes, where
    each expert's first route counts, else over the layer's row), and the eviction's
    observation of the call (the token ring's bookkeeping, before the hit refresh's barrier)."""
    routed = e_ok & (observed > 0)
    if lanes is not None:
        hit, hit_slots, miss = lanes.first & (lanes.slots >= 0), lanes.slots, None
        num_active, num_missing = _two_sums(lanes.first, lanes.first & (lanes.slots < 0))
    else:
        hit_slots = plgpu.load(state.residency.slot_for_id.at[row], mask=e_ok, other=-1)
        hit, miss = routed & (hit_slots >= 0), routed & (hit_slots < 0)
        num_active, num_missing = _two_sums(routed, miss)
    ring_call = None
    if state.ring:
        bits = (token_ring.bitmask(lanes.r, lanes.first, sz.E) if lanes is not None
                else token_ring.bitmask(e_idx, routed, sz.E))
        ring_call = token_ring.observe(state.ring[0], state_out.ring[0], layer=layer,
                                       layer_c=layer_c, routed=routed, bits=bits, e_idx=e_idx,
                                       accepted=accepted, num_layers=sz.L, num_experts=sz.E,
                                       barrier=barrier)
    return _Hits(routed, hit, hit_slots, miss, num_active, num_missing, ring_call)


def _split(fraction16, cap, num_missing):
    """Phase split (docs/semantics.md §5.3): how many misses the policy fetches."""
    return policy_rules.split_count(fraction16, cap, num_missing)


def _refresh_hits(state_out, hits: _Hits, step, accepted):
    """Phase refresh hits: each hit slot's usage becomes this call's stamp, which also makes it
    ineligible as a victim of this step (the pool scan skips it by its usage, once per block,
    as it skips every slot touched this step)."""
    common.scatter(state_out.residency.usage, jnp.where(hits.hit, hits.hit_slots, -1),
                   jnp.full(hits.hit.shape, step), hits.hit & accepted)


def _victims_needed(num_fetch, num_missing, accepted, *, promote_one: bool, reuse: bool):
    """How many victims the rules read: the split's count, at least one for PROMOTE_ONE, every
    miss for REUSE; 0 for a refused call."""
    need = num_fetch
    if promote_one:
        need = jnp.maximum(need, jnp.minimum(num_missing, 1))
    if reuse:
        need = num_missing
    return jnp.where(accepted, need, 0)


def _rank_victims(call, state, state_out, scratch, hits: _Hits, need, o_idx, *, step, base,
                  limit, layer_c, ranking, block, sz: _Sizes, barrier):
    """Phase rank victims: the first ``need`` victims ``(victims, usage, occupants)``
    [o_width], -1 padded: ascending (key, slot) among the usable slots not touched this step,
    the key the eviction record's (LRU: (usage,); PAIR_LFU: (class/freq after this call's
    decay, usage)); none (no pool read at all) when ``need`` is 0.

    No branch around the search (a branch there costs registers and spills under ptxas, see
    benchmarks/kernel_compile.py): with need 0 its loads are masked off and its loops run 0
    rounds."""
    E, C = sz.E, sz.C

    keyed = bool(state.tables or state.ring)  # the key reads the occupants

    def pool_load(start, width, when=True):
        """The block's contiguous loads (usage, and the occupants when the key reads them),
        issued apart so the streamed search can issue the next block's before this one's
        rounds; masked off unless ``when``. Int32 vectors, 1 + ``keyed`` of them."""
        index = start + lax.iota(jnp.int32, width)
        valid = (index < C) & searching & when  # no pool read when no victim is needed
        u = plgpu.load(state_out.residency.usage.at[index], mask=valid, other=0)
        if not keyed:
            return (u,)
        return u, plgpu.load(state.residency.id_of_slot.at[index], mask=valid, other=-1)

    def pool_block(start, width, loaded=None):
        index = start + lax.iota(jnp.int32, width)
        valid = (index < C) & searching
        u, *occupant = pool_load(start, width) if loaded is None else loaded
        ok = valid & (index < limit) & (u != step)
        if not keyed:
            return ranking.key((), None, u, None, None), jnp.where(ok, index, INT32_MAX)
        (occupant,) = occupant
        at = jnp.maximum(occupant, 0)  # a global id: layer * E + expert
        tables = tuple(plgpu.load(common.flat_at(ref, at), mask=valid, other=_zero(ref))
                       for ref in state.tables)
        own = (occupant >= base) & (occupant < base + E)
        computed = token_ring.per_slot(prediction, occupant, valid, ranking.per_call,
                                       num_layers=sz.L, num_experts=E)
        return ranking.key(tables, occupant, u, own, computed), jnp.where(ok, index, INT32_MAX)

    searching = need > 0
    # The per-call inputs of the key (a token ring's), only when a victim is searched.
    prediction = (token_ring.predict(hits.ring_call, state_out.ring[0], scratch[0],
                                     layer_c=layer_c, size=limit, searching=searching,
                                     num_layers=sz.L, capacity=C, barrier=barrier)
                  if state.ring else None)
    if -(-C // block) == 1:
        return _victims_one_block(pool_block, state.residency.id_of_slot, need, o_idx,
                                  width=ranking.width, block=block)
    # PAIR_LFU's key (the tables gathered per slot) with the next block's loads held through
    # the rounds made ptxas spill 44 bytes at (61, 256, 16384): it loads each block at its start.
    return _victims_streamed(pool_block, pool_load, state.residency.id_of_slot, need, o_idx,
                             width=ranking.width, block=block, num_loads=1 + keyed,
                             prefetch=not state.tables)


def _admit(fraction16, experts, recs, victims, vusage, occupants, num_fetch, *,
           promote_one: bool, reuse: bool, num_out: int):
    """Phase admit (docs/semantics.md §5.5): the number of misses installed, the split's count
    raised by PROMOTE_ONE or REUSE (the rules of :mod:`~pallas_cache.policy`), in the
    reference's order."""
    fraction_on = fraction16 > 0
    if promote_one:
        num_fetch = policy_rules.admit_promote_one(
            fraction_on, num_fetch, experts, recs, victims, occupants,
            first=functools.partial(common.lane, k=0))
    if reuse:
        num_fetch = policy_rules.admit_reuse(fraction_on, num_fetch, experts, recs, victims,
                                             vusage, num_out)
    return num_fetch


def _install(victims, experts, occupants, num_fetch, o_idx, accepted, num_out: int):
    """Phase install: the k-th miss takes the k-th victim for ``k < num_fetch`` (-1 past it,
    all -1 for a refused call): ``(installs, victims, experts, occupants, num_fetch)``; the
    writes are :func:`_write_state`'s."""
    installs = (o_idx < num_fetch) & (o_idx < num_out) & accepted
    victims = jnp.where(installs, victims, -1)
    experts = jnp.where(installs, experts, -1)
    occupants = jnp.where(installs, occupants, -1)
    return installs, victims, experts, occupants, jnp.where(accepted, num_fetch, 0)


def _route_slots(call, state, plan, lanes: _Lanes | None, installed, *, layer_c, accepted,
                 sz: _Sizes):
    """Phase route slots: each route's slot, from the pre-call map and this call's installs,
    written to the plan (``slots``, ``cpu``): over the route lanes, their pre-call slots with
    one round per install (none when nothing is fetched), else one chunk of routes at a time."""
    E = sz.E
    installs, victims, experts, _, num_fetch = installed
    if lanes is not None:
        def install(o, slots):
            return jnp.where(lanes.r == common.lane(experts, o), common.lane(victims, o), slots)

        is_route = lanes.valid & accepted
        slots = jnp.where(is_route, lax.fori_loop(0, num_fetch, install, lanes.slots), -1)
        plgpu.store(plan.slots.at[lanes.index], slots, mask=lanes.lane)
        plgpu.store(plan.cpu.at[lanes.index], is_route & (slots < 0), mask=lanes.lane)
        return

    def plan_chunk(c, _):
        r, index, lane = _route_chunk(call.routes, c, sz.k_width)
        is_route = lane & (r >= 0) & (r < E) & accepted
        old = plgpu.load(state.residency.slot_for_id.at[layer_c, jnp.clip(r, 0, E - 1)],
                         mask=is_route, other=-1)
        match = (r[:, None] == experts[None, :]) & installs[None, :]
        new = jnp.max(jnp.where(match, victims[None, :], -1), axis=1)
        slot = jnp.where(is_route, jnp.where(jnp.max(match.astype(jnp.int32), axis=1) > 0,
                                             new, old), -1)
        plgpu.store(plan.slots.at[index], slot, mask=lane)
        plgpu.store(plan.cpu.at[index], is_route & (slot < 0), mask=lane)
        return 0

    lax.fori_loop(0, sz.num_chunks, plan_chunk, 0)


def _route_counts(routes_ref, e_idx, observed, sz: _Sizes):
    """The layer's routes per expert (over ``e_idx``) for the histogram and the tables, formed
    again after the victim search: up to ``_SCALAR_ROUTES`` routes, ``K`` lane-wise compares
    with the routes read again as scalars (each thread counts its own experts: no reduction,
    no layout change); ``observed`` itself, held across the search, for more routes."""
    if sz.K > _SCALAR_ROUTES:
        return observed
    counts = jnp.zeros(e_idx.shape, jnp.int32)
    for i in range(sz.K):
        counts = counts + jnp.where(e_idx == routes_ref[i], 1, 0)
    return counts


def _count(state, stats_idx, row, e_ok, observed, ranking):
    """Phase count: the rows this call adds to (the layer's stats, histogram and eviction
    tables), read after the victim search (no write of the call comes before the barrier ahead
    of the writes), ``observed`` the route counts (:func:`_route_counts`): ``(stats row,
    histogram row + observed, the tables' rows after the call, the routed experts)``;
    :func:`_write_state` adds the counters to the stats and writes them (the histogram where
    routed and collected, the hybrid recency stamps where routed)."""
    stats_row = plgpu.load(state.stats.at[stats_idx])
    hist_row = plgpu.load(state.routing.freq.at[row], mask=e_ok, other=0)
    table_rows = tuple(plgpu.load(ref.at[row], mask=e_ok, other=_zero(ref))
                       for ref in state.tables)
    # What the writes store, formed here: one vector per row held to the end, not the row and
    # the counts; the routed mask from these counts, not classify's (held across the search).
    routed = e_ok & (observed > 0)
    return (stats_row, hist_row + observed, tuple(ranking.observe_row(table_rows, routed)),
            routed)


def _write_state(state_out, rows, hits: _Hits, installed, *, step, base, layer_c, row, e_ok,
                 stats_idx, accepted, observe_on, hybrid: bool, ranking, sz: _Sizes):
    """Write state: only the touched entries, only when accepted: the installs, the hybrid
    recency stamps, the counters, the histogram, the eviction's tables, the clock."""
    installs, victims, experts, occupants, num_fetch = installed
    stats_row, hist_row, table_rows, routed = rows
    common.scatter(state_out.residency.usage, victims, jnp.full((sz.o_width,), step), installs)
    common.scatter(state_out.residency.id_of_slot, victims, base + experts, installs)
    sfi = state_out.residency.slot_for_id
    common.scatter(sfi, common.flat_index(sfi, occupants),
                   jnp.full((sz.o_width,), -1, jnp.int32), installs & (occupants >= 0))
    common.scatter(sfi, (layer_c, experts), victims, installs)
    if hybrid:
        plgpu.store(state_out.routing.recency.at[row], jnp.full((sz.e_width,), step),
                    mask=routed & accepted)
    counters = jnp.where(lax.iota(jnp.int32, 4) == 0, 1, jnp.where(
        lax.iota(jnp.int32, 4) == 1, hits.num_active,
        jnp.where(lax.iota(jnp.int32, 4) == 2, hits.num_missing, num_fetch)))
    plgpu.store(state_out.stats.at[stats_idx], stats_row + counters,
                mask=jnp.full((4,), accepted))
    plgpu.store(state_out.routing.freq.at[row], hist_row, mask=routed & observe_on)
    for out_ref, value in zip(state_out.tables, table_rows):
        plgpu.store(out_ref.at[row], value, mask=e_ok & accepted)
    plgpu.store(state_out.clock.step, step, mask=accepted)


def _write_plan(plan, hits: _Hits, installed, o_idx, error, accepted, num_out: int):
    """Write plan: the copies, the counts and the error (the per-route slots are
    :func:`_route_slots`')."""
    _, victims, experts, _, num_fetch = installed
    out = o_idx < num_out
    plgpu.store(plan.dst_slots.at[o_idx], victims, mask=out)
    plgpu.store(plan.src_rows.at[o_idx], experts, mask=out)
    _store_scalar(plan.count, num_fetch, True)
    _store_scalar(plan.active, jnp.where(accepted, hits.num_active, 0), True)
    _store_scalar(plan.missing, jnp.where(accepted, hits.num_missing, 0), True)
    _store_scalar(plan.error, error, True)



def _fetch_order(lanes: _Lanes | None, rec_ref, layer_c, miss, num_missing, o_idx, *,
                 num_experts, by_recency, with_recs):
    """The misses in fetch order, ``(experts, recs)`` [o_width], -1 padded: RECENCY ascends by
    ``~recency`` (the most recently routed first), ties to the lower id; LOWEST_ID by id.
    ``recs``: each one's recency (read by the admissions, which apply under RECENCY only; -1
    when ``with_recs`` is False).

    One argmin round per miss, none when nothing misses: over the route lanes (a repeated
    route has its first's key and id, so the strict order takes it once), else over the
    layer's ``E`` experts (``miss``)."""
    if lanes is not None:
        ids, live0 = lanes.r, lanes.valid & (lanes.slots < 0)
        at = (layer_c, jnp.clip(ids, 0, num_experts - 1))
    else:
        ids, live0 = lax.iota(jnp.int32, miss.shape[0]), miss
        at = (layer_c, ids)
    order_key = (~plgpu.load(rec_ref.at[at], mask=live0, other=-1) if by_recency
                 else jnp.zeros(ids.shape, jnp.int32))

    def order_round(k, carry):
        prev_key, prev_e, experts, recs = carry
        live = live0 & common.after((order_key,), ids, (prev_key,), prev_e)
        (key,), e = common.lex_min((order_key,), ids, live)
        return (key, e, jnp.where(o_idx == k, e, experts),
                jnp.where(o_idx == k, ~key, recs))

    minus = jnp.full(o_idx.shape, -1, jnp.int32)
    _, _, experts, recs = lax.fori_loop(
        0, num_missing, order_round, (jnp.int32(INT32_MIN), jnp.int32(-1), minus, minus))
    return experts, recs if by_recency and with_recs else minus


def _next(key, index, start, prev_key, prev_i, *, block):
    """``common.lex_min(key, index, _candidate(key, index, prev_key, prev_i))`` over the block
    of ``block`` slots at ``start``, ``(key, i)`` scalars, ``i`` = ``INT32_MAX`` when no slot is
    left. A key of one component (LRU) takes one reduction, not two: every candidate's key is at
    least the previous round's, so its offset from that key and its position pack into one
    int32, ordered as ``(key, slot)``, and one minimum finds both, exactly, when the smallest
    candidate's offset fits ``31 - log2(block)`` bits. When it does not (a block's first round,
    whose floor is ``INT32_MIN``; a gap of ``2**19 - 1`` or more between two successive keys of a
    block of 4096) or no slot is left, the two reductions decide, in a branch the other rounds
    skip. (A first round that took the block's smallest key as its floor would need that
    reduction under a condition, which the compiler turns into predicated barriers.)"""
    cand = _candidate(key, index, prev_key, prev_i)
    if len(key) > 1:
        return common.lex_min(key, index, cand)
    (k,) = key
    floor = prev_key[0]
    shift = block.bit_length() - 1
    offset = (k - floor).astype(jnp.uint32)  # the true difference where k >= floor
    fits = cand & (k >= floor) & (offset < jnp.uint32((1 << (31 - shift)) - 1))
    packed = jnp.where(fits, (offset.astype(jnp.int32) << shift) | lax.iota(jnp.int32, block),
                       INT32_MAX)
    least = jnp.min(packed)
    return lax.cond(least != INT32_MAX,
                    lambda: ((floor + (least >> shift),), start + (least & (block - 1))),
                    lambda: common.lex_min(key, index, cand))


def _victims_one_block(pool_block, ios_ref, need, o_idx, *, width, block):
    """The first ``need`` victims of a pool of one block, ``(victims, usage, occupants)``
    [o_width], -1 padded: the block is loaded once and each round takes its smallest key
    strictly after the previous round's; the occupants are gathered once, after the rounds."""
    key, index = pool_block(0, block)
    minus = jnp.full(o_idx.shape, -1, jnp.int32)

    def victim_cond(carry):
        count, _, _, done, *_ = carry
        return (count < need) & ~done

    def victim_round(carry):
        count, prev_key, prev_i, done, victims, vusage = carry
        m, i = _next(key, index, jnp.int32(0), prev_key, prev_i, block=block)
        found = i != INT32_MAX
        at = found & (o_idx == count)
        return (count + found.astype(jnp.int32), m, i, ~found, jnp.where(at, i, victims),
                jnp.where(at, m[-1], vusage))

    start_key = (jnp.int32(INT32_MIN),) * width
    _, _, _, _, victims, vusage = lax.while_loop(
        victim_cond, victim_round,
        (jnp.int32(0), start_key, jnp.int32(-1), jnp.bool_(False), minus, minus))
    occupants = plgpu.load(ios_ref.at[jnp.maximum(victims, 0)], mask=victims >= 0, other=-1)
    return victims, vusage, occupants


def _victims_streamed(pool_block, pool_load, ios_ref, need, o_idx, *, width, block,
                      num_loads, prefetch: bool):
    """:func:`_victims_one_block` for a pool of several blocks, in one pass over it: each block
    is loaded once (with ``prefetch``, the next one's loads issued before this one's rounds)
    and yields its keys in ascending order into a set of the ``need`` smallest seen so far until
    its next key would not enter; the set is sorted at the end ([picks, picks] rank). The set's
    worst member is kept as scalars: a key entering a set that is not full raises it to the
    larger of the two, one entering a full set replaces it and the new worst is the set's
    maximum, a reduction over the picks only on such an entry."""
    o_width, num_blocks = o_idx.shape[0], -(-ios_ref.shape[0] // block)
    none = jnp.full((o_width,), INT32_MAX, jnp.int32)
    lowest = (jnp.int32(INT32_MIN),) * width

    def block_pass(b, carry):
        start = pl.multiple_of(b * block, block)
        *carry, loaded = carry
        if prefetch:
            # The first block's loads here (the others came with the block before): a call
            # that searches no victim runs no block and issues none.
            first = pool_load(start, block, when=b == 0)
            loaded = tuple(jnp.where(b == 0, x, y) for x, y in zip(first, loaded))
            ahead = pool_load(start + block, block)  # masked off past the pool
        else:
            loaded = ahead = pool_load(start, block)
        key, index = pool_block(start, block, loaded)

        def victim_round(c):
            best_key, best_i, count, worst_key, worst_i, prev_key, prev_i, _ = c
            m, i = _next(key, index, start, prev_key, prev_i, block=block)
            full = count >= need
            enters = (i != INT32_MAX) & (~full | common.after(worst_key, worst_i, m, i))
            at = enters & jnp.where(full, best_i == worst_i, o_idx == count)
            best_key = tuple(jnp.where(at, x, y) for x, y in zip(m, best_key))
            best_i = jnp.where(at, i, best_i)

            def new_worst():
                return common.lex_max(best_key, best_i, o_idx < count)

            raise_to = enters & common.after(m, i, worst_key, worst_i)
            worst_key, worst_i = lax.cond(
                enters & full, new_worst,
                lambda: (tuple(jnp.where(raise_to, x, y) for x, y in zip(m, worst_key)),
                         jnp.where(raise_to, i, worst_i)))
            return (best_key, best_i, count + (enters & ~full).astype(jnp.int32), worst_key,
                    worst_i, m, i, enters)

        best_key, best_i, count, worst_key, worst_i = carry
        best_key, best_i, count, worst_key, worst_i, *_ = lax.while_loop(
            lambda c: c[-1], victim_round,
            (best_key, best_i, count, worst_key, worst_i, lowest, jnp.int32(-1), need > 0))
        return best_key, best_i, count, worst_key, worst_i, ahead

    # No block at all when no victim is searched (the loads would be masked off anyway).
    best_key, best_i, count, *_ = lax.fori_loop(
        0, jnp.where(need > 0, jnp.int32(num_blocks), jnp.int32(0)), block_pass,
        ((none,) * width, none, jnp.int32(0), lowest, jnp.int32(INT32_MIN),
         (jnp.zeros((block,), jnp.int32),) * num_loads))
    filled = o_idx < count
    ahead = filled[None, :] & common.after(tuple(k[:, None] for k in best_key), best_i[:, None],
                                     tuple(k[None, :] for k in best_key), best_i[None, :])
    rank = jnp.sum(ahead.astype(jnp.int32), axis=1)
    placed = (rank[None, :] == o_idx[:, None]) & filled[None, :]
    victims = jnp.max(jnp.where(placed, best_i[None, :], -1), axis=1)
    vusage = jnp.max(jnp.where(placed, best_key[-1][None, :], INT32_MIN), axis=1)
    occupants = plgpu.load(ios_ref.at[jnp.maximum(victims, 0)], mask=victims >= 0, other=-1)
    return victims, jnp.where(victims >= 0, vusage, -1), occupants


def _rebase(usage_ref, rec_ref, usage_out, rec_out, step0, *, block, stamp_block):
    """Renumber every live stamp (usage >= 1, recency >= 0, the clock) to its dense rank, in
    place; returns the clock's rank. One pass per distinct value, ascending: pass ``r`` writes
    rank ``r`` over the entries holding the ``r``-th smallest value ``m_r`` and finds
    ``m_{r+1}``, the smallest live value above ``m_r``. A rank never exceeds its value (every
    live stamp of a reachable state is >= 1), so an entry already renumbered is never above
    ``m_r`` and a pass reads the same candidates whether it sees the entry before or after its
    write. O(N) per distinct value, O(N^2) in all: it runs about once per threshold calls."""
    parts = ((usage_ref, usage_out, 1, block), (rec_ref, rec_out, 0, stamp_block))

    def one_pass(carry):
        m, r, _, rank_step = carry

        def scan(src, dst, low, width):
            size = math.prod(src.shape)
            def body(b, best):
                start = pl.multiple_of(b * width, width)
                index = start + lax.iota(jnp.int32, width)  # row-major over [L, E] stamps
                valid = index < size
                v = plgpu.load(common.flat_at(src, index), mask=valid, other=low - 1)
                live = valid & (v >= low)
                plgpu.store(common.flat_at(dst, index), jnp.full((width,), r),
                            mask=live & (v == m) & (r >= 1))
                above = live & (v > m)
                return (jnp.minimum(best[0], jnp.min(jnp.where(above, v, INT32_MAX))),
                        best[1] | common.any_true(above))

            return lax.fori_loop(0, -(-size // width), body,
                                 (jnp.int32(INT32_MAX), jnp.bool_(False)))

        nxt, found = jnp.where(step0 > m, step0, INT32_MAX), step0 > m
        for src, dst, low, width in parts:
            part_min, part_found = scan(src, dst, low, width)
            nxt, found = jnp.minimum(nxt, part_min), found | part_found
        rank_step = jnp.where((r >= 1) & (step0 == m), r, rank_step)
        return nxt, r + 1, found, rank_step

    _, _, _, rank_step = lax.while_loop(
        lambda carry: carry[2], one_pass,
        (jnp.int32(INT32_MIN), jnp.int32(0), jnp.bool_(True), jnp.int32(0)))
    return rank_step


def fused_step(state, layer, routes, policy, rules, *, interpret: bool, debug: bool = False,
               block: int | None = None):
    """One ensure / ensure_hybrid call as one ``pallas_call`` (``grid=()``; ``vmap`` adds programs).

    Args:
      state: a ``CacheState`` whose eviction's record has kernel hooks (:func:`supports`).
      layer: int32[] (traced). routes: int32[K], ``K >= 1``. policy: a scalar ``FetchPolicy``.
      rules: a ``step.Rules`` of Python bools. interpret: run in the Pallas interpreter.
      block: the victim scan's width over the slots (a power of two dividing ``next_pow2(C)``).

    Returns:
      ``(state, EnsurePlan)``: the new state (leaves updated in place) and the plan, as
      ``step.ensure_with_rules`` returns them for ``K`` flat routes.
    """
    L, E, C = state.num_layers, state.num_experts, state.capacity
    K = routes.shape[0]
    num_out = min(K, E)
    block = (common.default_block(C, interpret) if block is None
             else common.check_block(block, C))
    ranking = state.eviction.kernel
    scalar = lambda x: jnp.reshape(x, (1,))  # noqa: E731
    call = CallRefs(layer=scalar(layer), routes=routes, fraction16=scalar(policy.fraction16),
                    cap=scalar(policy.cap), size=scalar(state.cache_size),
                    threshold=scalar(state.settings.rebase_threshold),
                    collect=scalar(state.settings.collect_routing))
    leaves = _state_refs(state, ranking)
    # Inside a shard_map (check_vma) every input and output varies over the mesh axes any input
    # varies over: the state leaves alias their outputs, whose type is then the inputs' (docs/
    # design.md, "Several devices"); outside one there are no such axes and nothing changes.
    axes = varying_axes(call, leaves)
    call, leaves = varying_like((call, leaves), call, leaves)
    out = functools.partial(varying_shape, axes=axes)
    i32 = functools.partial(out, dtype=jnp.int32)
    plan_shape = PlanRefs(slots=i32((K,)), cpu=out((K,), jnp.bool_),
                          dst_slots=i32((num_out,)), src_rows=i32((num_out,)), count=i32((1,)),
                          active=i32((1,)), missing=i32((1,)), error=i32((1,)))
    state_shape = jax.tree.map(lambda x: out(x.shape, x.dtype), leaves)
    # Every state leaf aliases the output leaf of the same name (flat indices: the call's leaves
    # come first among the inputs, the state's first among the outputs).
    num_call = len(jax.tree.leaves(call))
    aliases = {num_call + j: j for j in range(len(jax.tree.leaves(leaves)))}
    kernel = functools.partial(
        step_kernel, num_layers=L, num_experts=E, num_out=num_out, hybrid=rules.hybrid,
        by_recency=rules.by_recency, promote_one=rules.promote_one, reuse=rules.reuse,
        ranking=ranking, block=block,
        stamp_block=common.stamp_block(L * E, block, interpret), interpret=interpret)
    # Per-call buffers the kernel writes and reads back (the token ring's counters).
    scratch = ((out(*token_ring.scratch_shape(state.eviction_state, C)),)
               if ranking.per_call else ())
    state_out, plan, _ = pl.pallas_call(
        kernel,
        out_shape=(state_shape, plan_shape, scratch),
        grid=(),
        input_output_aliases=aliases,
        compiler_params=common.compiler_params(block),
        interpret=interpret,
        debug=debug,
        name="pallas_cache_step",
    )(call, leaves)
    return _with_state(state, ranking, state_out), _ensure_plan(plan, C, E)


def _ensure_plan(plan: PlanRefs, capacity: int, num_experts: int) -> EnsurePlan:
    """The kernel's plan outputs as the plan record."""
    count = plan.count.reshape(())
    copy = CopyPlan(dst_slots=plan.dst_slots, src_rows=plan.src_rows, count=count,
                    num_slots=capacity, num_experts=num_experts)
    return EnsurePlan(slots=plan.slots, cpu=plan.cpu, copy=copy, active=plan.active.reshape(()),
                      missing=plan.missing.reshape(()), fetched=count,
                      error=plan.error.reshape(()))
