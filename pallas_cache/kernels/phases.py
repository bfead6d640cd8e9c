"""The fused step's phases (:mod:`~pallas_cache.kernels.step`), in the order its kernel calls
them. A phase doing its XLA twin's work (pallas_cache/step.py) has its name: ``observe_routes``,
``validate``, ``rebase_if_due``, ``classify``, ``split``, ``refresh_hits``, ``fetch_order``,
``rank_victims``, ``admit``, ``install_pairs``, ``route_slots``. The kernel's own:
``route_lanes`` (short route lists read once into lanes), ``victims_needed``, ``route_counts``
and ``read_count_rows`` (the layer's rows the count adds to, read right after the victim search
on purpose), ``write_state`` (the XLA step's install and count writes) and ``write_plan``: the
outputs alias the inputs, so every write comes after the barrier that follows the last read."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_cache import errors
from pallas_cache import policy as policy_rules
from pallas_cache.kernels import common, search
from pallas_cache.kernels import ring as token_ring
from pallas_cache.kernels.common import INT32_MAX, INT32_MIN


# Most routes held as one vector of lanes (:class:`_Lanes`: the routes read once, a route's
# first occurrence found by comparing lanes); longer route lists (prefill) work per expert, over
# the layer's row, one chunk of routes at a time.
RANK_ROUTES = 64


# Up to this many routes each is also read as a scalar: a route's first occurrence is then K
# lane-wise compares, not a [routes, routes] reduction (whose result changes layout through
# shared memory, a barrier, on the GPU).
_SCALAR_ROUTES = 8


class Sizes(NamedTuple):
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
    """Up to ``RANK_ROUTES`` routes, the routes as one vector of lanes and what the call reads
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


def _zero(ref):
    """The fill of a masked load from ``ref``: ``False`` for a bool ref, else 0."""
    return False if ref.dtype == jnp.bool_ else 0


def _store_scalar(ref, value, mask):
    plgpu.store(ref.at[pl.ds(0, 1)], jnp.full((1,), value, ref.dtype), mask=jnp.full((1,), mask))


def _route_chunk(routes_ref, c, k_width: int):
    """Chunk ``c`` of the routes: ``(routes, index, lane)``, the routes -1 past the end."""
    start = c * k_width
    index = start + lax.iota(jnp.int32, k_width)
    lane = index < routes_ref.shape[0]
    r = plgpu.load(routes_ref.at[index], mask=lane, other=-1)
    return r, index, lane


def _two_sums(a, b):
    """``(sum(a), sum(b))`` of two bool vectors of one width as one packed reduction (each sum
    is at most the width, below 2**15)."""
    if a.shape[0] >= 1 << 15:
        return jnp.sum(a.astype(jnp.int32)), jnp.sum(b.astype(jnp.int32))
    packed = jnp.sum(a.astype(jnp.int32) + (b.astype(jnp.int32) << 16))
    return packed & 0xFFFF, packed >> 16


def route_lanes(routes_ref, slot_for_id_ref, layer_c, sz: Sizes) -> _Lanes:
    """Phase observe routes, up to ``RANK_ROUTES`` routes: :class:`_Lanes`, the routes and
    each one's pre-call slot (the layer ``layer_c`` clamped: a refused call reads in range)."""
    width = common.next_pow2(sz.K)
    index = lax.iota(jnp.int32, width)
    lane = index < sz.K
    r = plgpu.load(routes_ref.at[index], mask=lane, other=-1)
    valid = lane & (r >= 0) & (r < sz.E)
    slots = plgpu.load(slot_for_id_ref.at[layer_c, jnp.clip(r, 0, sz.E - 1)], mask=valid, other=-1)
    if sz.K <= _SCALAR_ROUTES:
        repeat = jnp.zeros((width,), jnp.bool_)
        for i in range(sz.K - 1):
            repeat = repeat | ((r == routes_ref[i]) & (index > i))
    else:
        pairs = (r[None, :] == r[:, None]) & (index[None, :] < index[:, None]) & lane[None, :]
        repeat = jnp.max(pairs.astype(jnp.int32), axis=1) > 0
    return _Lanes(r, index, lane, valid, valid & ~repeat, slots)


def observe_routes(routes_ref, e_idx, sz: Sizes, lanes: _Lanes | None):
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


def validate(layer, bad, num_layers: int, size, num_experts: int, capacity: int):
    """Phase validate (docs/semantics.md §6): ``(error, accepted)`` (a refused call writes
    nothing); ``size`` the state's usable size, outside ``[E, C]`` only in a hand-built state."""
    bad_layer = (layer < 0) | (layer >= num_layers)
    bad_size = (size < num_experts) | (size > capacity)
    error = (jnp.where(bad_layer, jnp.int32(errors.ERR_LAYER), jnp.int32(0))
             | jnp.where(bad, jnp.int32(errors.ERR_EXPERT_ID), jnp.int32(0))
             | jnp.where(bad_size, jnp.int32(errors.ERR_CACHE_SIZE), jnp.int32(0)))
    return error, ~(bad_layer | bad | bad_size)


def rebase_if_due(call, state, state_out, step0, accepted, *, block, stamp_block):
    """Phase rebase (docs/semantics.md §5.12), first, as in the XLA step: a device-side branch
    that renumbers every live stamp in place; returns this call's stamp (the renumbered clock
    + 1). Every stamp read after it is a renumbered one, read from ``state_out`` (the
    interpreter keeps the aliased input unchanged)."""
    due = accepted & (step0 >= call.threshold[0])
    return lax.cond(due, functools.partial(search.rebase, state.residency.usage,
                                           state.routing.recency, state_out.residency.usage,
                                           state_out.routing.recency, block=block,
                                           stamp_block=stamp_block),
                    lambda s: s, step0) + 1


def classify(state, state_out, observed, lanes: _Lanes | None, row, e_idx, e_ok, *, layer,
             layer_c, accepted, sz: Sizes, barrier) -> _Hits:
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


def split(fraction16, cap, num_missing):
    """Phase split (docs/semantics.md §5.3): how many misses the policy fetches."""
    return policy_rules.split_count(fraction16, cap, num_missing)


def refresh_hits(state_out, hits: _Hits, step, accepted):
    """Phase refresh hits: each hit slot's usage becomes this call's stamp, which also makes it
    ineligible as a victim of this step (the pool scan skips it by its usage, once per block,
    as it skips every slot touched this step)."""
    common.scatter(state_out.residency.usage, jnp.where(hits.hit, hits.hit_slots, -1),
                   jnp.full(hits.hit.shape, step), hits.hit & accepted)


def fetch_order(lanes: _Lanes | None, recency_ref, layer_c, miss, num_missing, o_idx, *,
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
    order_key = (~plgpu.load(recency_ref.at[at], mask=live0, other=-1) if by_recency
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


def victims_needed(num_fetch, num_missing, accepted, *, promote_one: bool, reuse: bool):
    """How many victims the rules read: the split's count, at least one for PROMOTE_ONE, every
    miss for REUSE; 0 for a refused call."""
    need = num_fetch
    if promote_one:
        need = jnp.maximum(need, jnp.minimum(num_missing, 1))
    if reuse:
        need = num_missing
    return jnp.where(accepted, need, 0)


def streamed(capacity: int, block: int) -> bool:
    """Whether :func:`rank_victims` streams the pool (more than one block of slots)."""
    return -(-capacity // block) > 1


def rank_victims(call, state, state_out, scratch, hits: _Hits, need, o_idx, *, step, base,
                 limit, layer_c, ranking, block, sz: Sizes, barrier):
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
    if not streamed(C, block):
        return search.victims_one_block(pool_block, state.residency.id_of_slot, need, o_idx,
                                        width=ranking.width, block=block)
    # PAIR_LFU's key (the tables gathered per slot) with the next block's loads held through
    # the rounds made ptxas spill 44 bytes at (61, 256, 16384): it loads each block at its start.
    return search.victims_streamed(pool_block, pool_load, state.residency.id_of_slot, need, o_idx,
                                   width=ranking.width, block=block, num_loads=1 + keyed,
                                   prefetch=not state.tables)


def route_counts(routes_ref, e_idx, observed, sz: Sizes):
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


def read_count_rows(state, stats_idx, row, e_ok, observed, ranking):
    """Phase count: the rows this call adds to (the layer's stats, histogram and eviction
    tables), read after the victim search (no write of the call comes before the barrier ahead
    of the writes), ``observed`` the route counts (:func:`route_counts`): ``(stats row,
    histogram row + observed, the tables' rows after the call, the routed experts)``;
    :func:`write_state` adds the counters to the stats and writes them (the histogram where
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


def admit(fraction16, experts, recs, victims, vusage, occupants, num_fetch, *,
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


def install_pairs(victims, experts, occupants, num_fetch, o_idx, accepted, num_out: int):
    """Phase install: the k-th miss takes the k-th victim for ``k < num_fetch`` (-1 past it,
    all -1 for a refused call): ``(installs, victims, experts, occupants, num_fetch)``; the
    writes are :func:`write_state`'s."""
    installs = (o_idx < num_fetch) & (o_idx < num_out) & accepted
    victims = jnp.where(installs, victims, -1)
    experts = jnp.where(installs, experts, -1)
    occupants = jnp.where(installs, occupants, -1)
    return installs, victims, experts, occupants, jnp.where(accepted, num_fetch, 0)


def route_slots(call, state, plan, lanes: _Lanes | None, installed, *, layer_c, accepted,
                sz: Sizes):
    """Phase route slots: each route's slot, from the pre-call map and this call's installs,
    written to the plan (``slots``, ``cpu``): over the route lanes, their pre-call slots with
    one round per install (none when nothing is fetched), else one chunk of routes at a time."""
    E = sz.E
    installs, victims, experts, _, num_fetch = installed
    if lanes is not None:
        def take_victim_of_install(o, slots):
            return jnp.where(lanes.r == common.lane(experts, o), common.lane(victims, o), slots)

        is_route = lanes.valid & accepted
        slots = jnp.where(is_route,
                          lax.fori_loop(0, num_fetch, take_victim_of_install, lanes.slots), -1)
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


def write_state(state_out, rows, hits: _Hits, installed, *, step, base, layer_c, row, e_ok,
                stats_idx, accepted, observe_on, hybrid: bool, ranking, sz: Sizes):
    """Write state: only the touched entries, only when accepted: the installs, the hybrid
    recency stamps, the counters, the histogram, the eviction's tables, the clock."""
    installs, victims, experts, occupants, num_fetch = installed
    stats_row, hist_row, table_rows, routed = rows
    common.scatter(state_out.residency.usage, victims, jnp.full((sz.o_width,), step), installs)
    common.scatter(state_out.residency.id_of_slot, victims, base + experts, installs)
    slot_for_id = state_out.residency.slot_for_id
    common.scatter(slot_for_id, common.flat_index(slot_for_id, occupants),
                   jnp.full((sz.o_width,), -1, jnp.int32), installs & (occupants >= 0))
    common.scatter(slot_for_id, (layer_c, experts), victims, installs)
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


def write_plan(plan, hits: _Hits, installed, o_idx, error, accepted, num_out: int):
    """Write plan: the copies, the counts and the error (the per-route slots are
    :func:`route_slots`')."""
    _, victims, experts, _, num_fetch = installed
    out = o_idx < num_out
    plgpu.store(plan.dst_slots.at[o_idx], victims, mask=out)
    plgpu.store(plan.src_rows.at[o_idx], experts, mask=out)
    _store_scalar(plan.count, num_fetch, True)
    _store_scalar(plan.active, jnp.where(accepted, hits.num_active, 0), True)
    _store_scalar(plan.missing, jnp.where(accepted, hits.num_missing, 0), True)
    _store_scalar(plan.error, error, True)
