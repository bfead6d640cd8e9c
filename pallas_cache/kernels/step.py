"""The fused cache step: one whole ``ensure`` / ``ensure_hybrid`` call as one Pallas kernel (docs/semantics.md §7)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_cache import evictions
from pallas_cache.kernels import common, phases
from pallas_cache.kernels import ring as token_ring
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


def _barrier(interpret: bool):
    """A CTA barrier on the GPU: the stores before it are seen by every thread's loads after it.
    The interpreter runs one thread (and has no barrier)."""
    if not interpret:
        plgpu.debug_barrier()


def step_kernel(
    call: CallRefs, state: StateRefs, state_out: StateRefs, plan: PlanRefs, scratch: tuple, *,
    num_layers: int, num_experts: int, num_out: int, hybrid: bool, by_recency: bool,
    promote_one: bool, reuse: bool, ranking: evictions.KernelRanking, block: int,
    stamp_block: int, interpret: bool,
):
    """The step's phases in the XLA step's order (pallas_cache/step.py), plus the kernel's own
    writes of the state and the plan at the end; the count's reads of the layer's rows (and
    the fetch order, after a streamed search) come right after the victim search, ahead of
    admit (docs/design.md, "The step in phases"). Every read of a state leaf comes before any
    write to it (the outputs alias the inputs), but for the stamps, which are read back after
    the rebase and the hit refresh wrote them."""
    L, E = num_layers, num_experts
    K, C = call.routes.shape[0], state.residency.id_of_slot.shape[0]
    e_width, o_width = common.next_pow2(E), common.next_pow2(num_out)
    k_width = max(1, min(common.next_pow2(K), _PAIR_BLOCK // max(e_width, o_width)))
    sz = phases.Sizes(L, E, K, C, num_out, e_width, o_width, k_width)
    barrier = functools.partial(_barrier, interpret)
    # The scalars first: every one of them is read in the first wave of loads.
    layer, step0, limit = call.layer[0], state.clock.step[...], call.size[0]
    fraction16, cap = call.fraction16[0], call.cap[0]
    e_idx = lax.iota(jnp.int32, e_width)
    e_ok = e_idx < E

    layer_c = jnp.minimum(jnp.maximum(layer, 0), L - 1)
    base = layer_c * E
    lanes = (phases.route_lanes(call.routes, state.residency.slot_for_id, layer_c, sz)
             if K <= phases.RANK_ROUTES else None)
    observed, bad = phases.observe_routes(call.routes, e_idx, sz, lanes)
    error, accepted = phases.validate(layer, bad, L, limit, E, C)
    row = (layer_c, e_idx)  # the layer's row of an [L, E] ref
    stats_idx = (layer_c, lax.iota(jnp.int32, 4))
    step = phases.rebase_if_due(call, state, state_out, step0, accepted, block=block,
                                stamp_block=stamp_block)
    barrier()  # the rebase's usage / recency stores before the reads of them by other threads
    hits = phases.classify(state, state_out, observed, lanes, row, e_idx, e_ok, layer=layer,
                           layer_c=layer_c, accepted=accepted, sz=sz, barrier=barrier)
    num_fetch = phases.split(fraction16, cap, hits.num_missing)
    phases.refresh_hits(state_out, hits, step, accepted)
    barrier()  # the hit refresh (and the ring) before the scan's loads by other threads
    o_idx = lax.iota(jnp.int32, o_width)
    order = functools.partial(phases.fetch_order, lanes, state_out.routing.recency, layer_c,
                              hits.miss, hits.num_missing, o_idx, num_experts=E,
                              by_recency=by_recency, with_recs=promote_one or reuse)
    # The fetch order after a streamed victim search (a loop over the pool's blocks), which does
    # not read it: held across that loop it made ptxas spill ROUTE_KNN at (64, 512, 16384, 8);
    # before a search of one block, where after it made ROUTE_LFU spill at (48, 128, 4096, 8)
    # (docs/design.md, "Registers").
    streamed = phases.streamed(C, block)
    if not streamed:
        experts, recs = order()
    need = phases.victims_needed(num_fetch, hits.num_missing, accepted, promote_one=promote_one,
                                 reuse=reuse)
    victims, vusage, occupants = phases.rank_victims(
        call, state, state_out, scratch, hits, need, o_idx, step=step, base=base, limit=limit,
        layer_c=layer_c, ranking=ranking, block=block, sz=sz, barrier=barrier)
    if streamed:
        experts, recs = order()
    # The layer's rows, the collect flag and the route counts after the victim search, not in
    # the first waves: held across it they made ptxas spill (benchmarks/RESULTS.md, "Spills").
    rows = phases.read_count_rows(state, stats_idx, row, e_ok,
                                  phases.route_counts(call.routes, e_idx, observed, sz), ranking)
    collect = call.collect[0]
    num_fetch = phases.admit(fraction16, experts, recs, victims, vusage, occupants, num_fetch,
                             promote_one=promote_one, reuse=reuse, num_out=num_out)
    installed = phases.install_pairs(victims, experts, occupants, num_fetch, o_idx, accepted,
                                     num_out)
    phases.route_slots(call, state, plan, lanes, installed, layer_c=layer_c, accepted=accepted,
                       sz=sz)
    barrier()  # every read of id_of_slot / slot_for_id / the rows (victims, plan) before the writes
    phases.write_state(state_out, rows, hits, installed, step=step, base=base, layer_c=layer_c,
                       row=row, e_ok=e_ok, stats_idx=stats_idx, accepted=accepted,
                       observe_on=accepted & collect, hybrid=hybrid, ranking=ranking, sz=sz)
    phases.write_plan(plan, hits, installed, o_idx, error, accepted, num_out)


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
