"""Capacity and the usable size (docs/semantics.md §5.15): properties, lockstep and rules.

Two property tests drive random sequences of every operation:

* **Equivalence**: a pool of capacity ``C > S`` whose usable size is ``S`` (the reference and a
  JAX adapter) against a plain pool of ``S`` slots (the reference). After every step every plan
  is equal and every state field is equal on the usable part, while the slots past ``S`` hold
  nothing. Geometries include ``S < 2E <= C`` (prefill is a value error there, where the plain
  pool raises) and ``C < 2E`` (both raise).
* **Lockstep with resize**: the JAX cache against the reference, both of capacity ``C``, with
  ``resize`` (refused targets included) interleaved with every other operation, prefill chunks
  open across shrinks and grows, and ``rebuild`` with an explicit capacity.

Both also run under the eviction policies PAIR_LFU and ROUTE_KNN (docs/semantics.md §5.16):
their rankings must see the usable pool only (ROUTE_KNN's horizon ``ceil(S / L)`` from the
usable size), and ``resize`` keeps their per-expert and per-token bookkeeping.

The rule tests below each say how they fail when the rule is implemented the naive way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pallas_cache as pc
from conftest import (
    ADAPTER,
    EVICTION_FIELDS,
    STATE_FIELDS,
    assert_invariants,
    assert_plan_well_formed,
    assert_same_plan,
    assert_same_state,
    examples,
)
from pallas_cache.selection import promotion_decision, select_victims
from test_lockstep import (
    ADMISSIONS,
    BANK_CHOICES,
    ORDERS,
    REBASE_THRESHOLDS,
    assert_same_reports,
    build_policy,
    draw_layer,
    draw_policy,
    draw_routes,
    whole_layer,
)

ERR_CACHE_SIZE = pc.ERR_CACHE_SIZE

# ---- driving any cache through one drawn operation ------------------------------------------

BASE_OPS = (
    ["ensure"] * 4 + ["ensure_hybrid"] * 8 + ["begin_prefill"] * 2 + ["prefetch_prefill_layer"] * 3
    + ["release_prefill_layer"] * 2 + ["materialize_layer", "forget_slot", "reset", "reset_stats",
                                       "set_collect_routing", "reset_routing"]
)


def draw_op(data, kinds, L, E, C, route_shape, admissions=ADMISSIONS):
    kind = data.draw(st.sampled_from(kinds), label="op")
    args = {}
    if kind in ("ensure", "ensure_hybrid", "materialize_layer", "release_prefill_layer",
                "prefetch_prefill_layer"):
        args["layer"] = draw_layer(data, L)
    if kind in ("ensure", "ensure_hybrid"):
        args["routes"] = draw_routes(data, E, route_shape)
    if kind == "ensure_hybrid":
        args["policy"] = draw_policy(data, E)
        args["order"] = data.draw(st.sampled_from(ORDERS), label="order")
        args["admission"] = data.draw(st.sampled_from(admissions), label="admission")
    if kind == "prefetch_prefill_layer":
        args["banks"] = data.draw(st.sampled_from(BANK_CHOICES), label="banks")
    if kind == "forget_slot":  # unusable slots (>= S) included: ERR_SLOT
        args["slot"] = data.draw(st.sampled_from(list(range(C)) * 2 + [-1, C]), label="slot")
    if kind == "set_collect_routing":
        args["on"] = data.draw(st.booleans(), label="collect")
    if kind == "resize":  # refused targets too: below E, above C, negative
        args["size"] = data.draw(st.sampled_from(list(range(E - 1, C + 2)) + [-1]), label="size")
    if kind == "rebuild":
        args["size"] = data.draw(st.sampled_from(list(range(E - 1, C + 1))), label="size")
    return kind, args


def do(cache, kind, args):
    """Run one operation; returns its plan view, None, or the name of the static error raised."""
    errors = cache.adapter.errors
    try:
        if kind == "ensure":
            return cache.ensure(args["layer"], args["routes"])
        if kind == "ensure_hybrid":
            return cache.ensure_hybrid(args["layer"], args["routes"],
                                       build_policy(cache, args["policy"]), order=args["order"],
                                       admission=args["admission"])
        if kind in ("materialize_layer", "release_prefill_layer"):
            return getattr(cache, kind)(args["layer"])
        if kind == "prefetch_prefill_layer":
            return cache.prefetch_prefill_layer(args["layer"], args["banks"])
        if kind == "forget_slot":
            return cache.forget_slot(args["slot"])
        if kind == "set_collect_routing":
            return cache.set_collect_routing(args["on"])
        if kind == "resize":
            return cache.resize(args["size"])
        if kind == "rebuild":
            return cache.rebuild(args["size"], capacity=args["capacity"])
        return getattr(cache, kind)()
    except (errors.PrefillDoesNotFit, errors.RebuildRejected) as error:
        return type(error).__name__


def assert_same_outcome(mine, theirs, context):
    if mine is None or isinstance(mine, str):
        assert mine == theirs, context
    else:
        assert not isinstance(theirs, str), f"{context}: expected {theirs}, got a plan"
        assert_same_plan(mine, theirs, context)


def assert_usable_part_equal(big, truth, context):
    """``big`` (capacity C) equals ``truth`` (a pool of its usable size) on the usable part; the
    slots past it are empty with usage 0."""
    size = truth.capacity
    assert int(big.cache_size) == size == int(truth.cache_size), context
    for name in STATE_FIELDS:
        mine, theirs = getattr(big, name), getattr(truth, name)
        if name in ("id_of_slot", "usage"):
            assert (mine[size:] == (-1 if name == "id_of_slot" else 0)).all(), \
                f"{name} past the usable size {context}"
            mine = mine[:size]
        np.testing.assert_array_equal(mine, theirs, err_msg=f"state.{name} {context}")
    for name in EVICTION_FIELDS:  # per expert / per token: compared whole
        mine, theirs = getattr(big, name), getattr(truth, name)
        assert (mine is None) == (theirs is None), f"state.{name} on one side only {context}"
        if mine is not None:
            np.testing.assert_array_equal(mine, theirs, err_msg=f"state.{name} {context}")


def eviction_options(data, eviction):
    """``init`` options, the admissions and the extra ops of an eviction policy (None = LRU):
    REUSE is refused by the others (docs/semantics.md §5.16); the ring policies (ROUTE_KNN,
    ROUTE_LFU) draw their ring size and ``start_token`` calls, as tests/test_lockstep.py does."""
    if eviction is None:
        return {}, ADMISSIONS, []
    options = {"eviction": eviction}
    extra = []
    if eviction in ("route_knn", "route_lfu"):
        options["history"] = data.draw(st.sampled_from((1, 3, 6)), label="history")
        extra = ["start_token"] * 2
    return options, ("promote_one", "none"), extra


# ---- equivalence: capacity C with usable size S == a pool of S ------------------------------

# (L, E, S, C, route shape): S == E; S < 2E <= C (prefill: a value error vs a raise); S >= 2E;
# C < 2E (both raise); 2-D routes; batches larger than E.
EQUIVALENCE_GEOMETRIES = {
    "jax-eager": [
        (2, 3, 3, 9, (4,)),
        (2, 3, 5, 8, (4,)),
        (3, 4, 9, 16, (2, 3)),
        (1, 2, 2, 3, (3,)),
        (3, 2, 4, 7, (3,)),
    ],
    "jax-jit": [(2, 3, 5, 8, (4,)), (3, 4, 9, 16, (2, 3))],
}
EQUIVALENCE_GEOMETRIES["jax-interpret"] = EQUIVALENCE_GEOMETRIES["jax-jit"]


def run_equivalence(data, adapter_name, eviction=None):
    L, E, S, C, route_shape = data.draw(
        st.sampled_from(EQUIVALENCE_GEOMETRIES[adapter_name]), label="geometry")
    threshold = data.draw(st.sampled_from(REBASE_THRESHOLDS), label="rebase threshold")
    options, admissions, extra_ops = eviction_options(data, eviction)
    truth = ADAPTER["reference"].init(L, E, S, rebase_threshold=threshold, **options)
    bigs = [ADAPTER["reference"].init(L, E, S, rebase_threshold=threshold, capacity=C, **options),
            ADAPTER[adapter_name].init(L, E, S, rebase_threshold=threshold, capacity=C,
                                       **options)]
    bigs[1].pad_routes = False
    steps = []
    if data.draw(st.booleans(), label="warm the pool and open a chunk?"):
        steps = [("ensure", {"layer": layer, "routes": whole_layer(E, route_shape)})
                 for layer in data.draw(st.permutations(range(L)), label="warm order")]
        steps.append(("begin_prefill", {}))
    num_ops = len(steps) + data.draw(st.integers(1, 40), label="number of ops")
    for index in range(num_ops):
        kind, args = steps[index] if index < len(steps) else draw_op(
            data, BASE_OPS + extra_ops, L, E, C, route_shape, admissions)
        context = f"op {index} {kind}({args})"
        expected = do(truth, kind, args)
        for big in bigs:
            outcome = do(big, kind, args)
            if expected == "PrefillDoesNotFit" and C >= 2 * E:
                # The pool of S < 2E raises (a shape); within capacity C >= 2E the usable size
                # is a value: begin_prefill changes nothing, prefetch reports ERR_CACHE_SIZE.
                if kind == "prefetch_prefill_layer":
                    assert outcome.error & ERR_CACHE_SIZE, context
                    assert outcome.entry_count == outcome.gather_count == outcome.run_count == 0
                else:
                    assert outcome is None, context
            else:
                assert_same_outcome(outcome, expected, f"{context} on {big.adapter}")
                if kind in ("ensure", "ensure_hybrid"):
                    assert_plan_well_formed(outcome, args["routes"], E)
            assert_usable_part_equal(big.state, truth.state, f"after {context} on {big.adapter}")
            assert_invariants(big.state)
            assert bool(big.prefill_overlap_fits()) == bool(truth.prefill_overlap_fits())
    for big in bigs:
        assert_same_reports(big, truth, f"the sequence on {big.adapter}")


@examples(0.5, ci=0.32)
@given(data=st.data())
def test_eager_capacity_above_the_usable_size_equals_a_pool_of_that_size(data):
    """FAILS if any rule reads slots past the usable size: an unusable slot taken as a victim
    (usage 0 makes it the first), counted as empty by the promotion rule, accepted by
    forget_slot, or prefill refused by a raise instead of a bit."""
    run_equivalence(data, "jax-eager")


@examples(0.5, ci=0.32)
@given(data=st.data())
def test_jitted_capacity_above_the_usable_size_equals_a_pool_of_that_size(data):
    run_equivalence(data, "jax-jit")


@examples(0.25, ci=0.16)
@given(data=st.data())
def test_interpreted_kernels_with_capacity_equal_a_pool_of_the_usable_size(data):
    """FAILS if the victim search (XLA, or the fused kernel) picks a slot at or past the usable
    size."""
    run_equivalence(data, "jax-interpret")


# ---- lockstep with resize ---------------------------------------------------------------------

# (L, E, C, route shape, initial usable size)
RESIZE_GEOMETRIES = {
    "jax-eager": [(2, 3, 9, (4,), 4), (3, 4, 12, (2, 3), 12), (1, 2, 5, (3,), 2), (2, 3, 5, (4,), 3)],
    "jax-jit": [(2, 3, 9, (4,), 4), (3, 4, 12, (2, 3), 12)],
}
RESIZE_GEOMETRIES["jax-interpret"] = RESIZE_GEOMETRIES["jax-jit"]
RESIZE_OPS = BASE_OPS + ["resize"] * 6 + ["rebuild"]


def run_resize_lockstep(data, adapter_name, eviction=None):
    L, E, C, route_shape, size = data.draw(
        st.sampled_from(RESIZE_GEOMETRIES[adapter_name]), label="geometry")
    threshold = data.draw(st.sampled_from(REBASE_THRESHOLDS), label="rebase threshold")
    options, admissions, extra_ops = eviction_options(data, eviction)
    ref = ADAPTER["reference"].init(L, E, size, rebase_threshold=threshold, capacity=C,
                                    **options)
    cache = ADAPTER[adapter_name].init(L, E, size, rebase_threshold=threshold, capacity=C,
                                       **options)
    cache.pad_routes = False
    steps = []
    if data.draw(st.booleans(), label="warm the pool and open a chunk?"):
        steps = [("resize", {"size": C})]
        steps += [("ensure", {"layer": layer, "routes": whole_layer(E, route_shape)})
                  for layer in data.draw(st.permutations(range(L)), label="warm order")]
        steps.append(("begin_prefill", {}))
    num_ops = len(steps) + data.draw(st.integers(1, 40), label="number of ops")
    for index in range(num_ops):
        kind, args = steps[index] if index < len(steps) else draw_op(
            data, RESIZE_OPS + extra_ops, L, E, C, route_shape, admissions)
        if kind == "rebuild":
            args["capacity"] = C  # same shapes, so the compiled functions are reused
        context = f"op {index} {kind}({args})"
        old_size = int(ref.state.cache_size)
        expected = do(ref, kind, args)
        outcome = do(cache, kind, args)
        assert_same_outcome(outcome, expected, context)
        if kind in ("ensure", "ensure_hybrid"):
            assert_plan_well_formed(outcome, args["routes"], E)
        if kind == "resize" and outcome.error == 0:
            assert outcome.count == max(0, old_size - args["size"]), context
        assert_same_state(cache.state, ref.state, f"after {context}")
        assert_invariants(cache.state)
    assert_same_reports(cache, ref, "the sequence")


@examples(0.5, ci=0.32)
@given(data=st.data())
def test_eager_resize_interleaved_with_every_op_matches_the_reference(data):
    run_resize_lockstep(data, "jax-eager")


@examples(0.5, ci=0.32)
@given(data=st.data())
def test_jitted_resize_interleaved_with_every_op_matches_the_reference(data):
    run_resize_lockstep(data, "jax-jit")


@examples(0.25, ci=0.16)
@given(data=st.data())
def test_interpreted_resize_interleaved_with_every_op_matches_the_reference(data):
    run_resize_lockstep(data, "jax-interpret")


# ---- the eviction policies with a capacity (docs/semantics.md §5.16) -------------------------


@examples(0.25, ci=0.16)
@pytest.mark.parametrize("eviction", ["pair_lfu", "route_knn"])
@given(data=st.data())
def test_capacity_above_the_usable_size_equals_a_pool_of_that_size_under_each_eviction(
        eviction, data):
    """FAILS if PAIR_LFU's or ROUTE_KNN's ranking takes an unusable slot (id -1 ranks it as a
    free slot, usage 0 before every filled one) or ROUTE_KNN's horizon ``ceil(S / L)`` is read
    from the capacity instead of the traced usable size."""
    run_equivalence(data, "jax-jit", eviction)


@examples(0.25, ci=0.16)
@pytest.mark.parametrize("eviction", ["pair_lfu", "route_knn"])
@given(data=st.data())
def test_resize_interleaved_with_every_op_matches_the_reference_under_each_eviction(
        eviction, data):
    """FAILS if ``resize`` changes (or a shrink clears) the policy's bookkeeping in one
    implementation only, if a grown slot is not a free usable slot for the ranking, or if the
    horizon does not follow the resized pool."""
    run_resize_lockstep(data, "jax-jit", eviction)


# ---- rules -----------------------------------------------------------------------------------


def filled(adapter, L=3, E=2, S=4, C=8):
    """A pool of usable size S (capacity C) whose S slots hold layers 0 and 1."""
    cache = adapter.init(L, E, S, capacity=C)
    cache.ensure(0, [0, 1])
    cache.ensure(1, [0, 1])
    return cache


@pytest.mark.kernels
@pytest.mark.traced
def test_victims_never_lie_past_the_usable_size(adapter):
    """FAILS if the victim search ignores the usable size: the unusable slots 4..7 carry usage 0,
    the smallest of all, so a naive argmin would install layer 2 there."""
    cache = filled(adapter)
    plan = cache.ensure(2, [0, 1])
    assert plan.valid("dst_slots") == [0, 1], "the two least recently used usable slots"
    state = cache.state
    assert (state.id_of_slot[4:] == -1).all()
    assert state.slot_of(0, 0) is None and state.slot_of(0, 1) is None


@pytest.mark.kernels
@pytest.mark.traced
def test_promote_one_does_not_count_an_unusable_slot_as_empty(adapter):
    """FAILS if the promotion rule (or its kernel) reads past the usable size: the usable pool is
    full, so PROMOTE_ONE must not fire, though the slots past it are 'empty' (id -1)."""
    cache = filled(adapter)
    policy = cache.adapter.Policy.fraction(0.4)
    cache.ensure_hybrid(2, [0], policy)  # first-time miss: CPU, but now it has a recency
    plan = cache.ensure_hybrid(2, [0], policy)
    assert (plan.missing, plan.fetched) == (1, 0), "no empty usable slot: the miss stays on the CPU"
    assert plan.cpu.tolist()[0]


def test_resize_shrink_frees_the_tail_and_lists_it(adapter):
    """FAILS if a shrink keeps the freed experts resident, moves survivors, or does not list every
    freed slot with its old occupant (an empty freed slot as -1)."""
    cache = adapter.init(2, 3, 8, capacity=10)
    cache.ensure(0, [0, 1, 2])
    cache.ensure(1, [0, 1])  # slots 0..4 hold 0,1,2,3,4; slots 5..7 empty
    plan = cache.resize(4)
    assert plan.error == 0 and plan.count == 4
    assert plan.freed_slots[:4].tolist() == [4, 5, 6, 7]
    assert plan.freed_ids[:4].tolist() == [4, -1, -1, -1]
    assert (plan.freed_slots[4:] == -1).all() and (plan.freed_ids[4:] == -1).all()
    state = cache.state
    assert int(state.cache_size) == 4
    assert state.id_of_slot.tolist() == [0, 1, 2, 3] + [-1] * 6
    assert state.slot_of(1, 1) is None and state.slot_of(1, 0) == 3
    grow = cache.resize(10)
    assert (grow.error, grow.count) == (0, 0)
    assert int(cache.state.cache_size) == 10 and cache.state.resident_slots() == 4


@pytest.mark.traced
@pytest.mark.parametrize("target", [2, 11, -1])
def test_resize_outside_e_capacity_is_refused_unchanged(adapter, target):
    """FAILS if a size below E or above the capacity is applied (or clamped) instead of refused
    with ERR_CACHE_SIZE and the state returned unchanged."""
    cache = adapter.init(2, 3, 8, capacity=10)
    cache.ensure(0, [0, 1, 2])
    before = cache.state
    plan = cache.resize(target)
    assert plan.error == ERR_CACHE_SIZE and plan.count == 0
    assert (plan.freed_slots == -1).all()
    assert_same_state(cache.state, before, "after a refused resize")


def test_a_shrink_below_2e_waits_for_the_second_buffer_and_then_ends_it(adapter):
    """FAILS if a shrink takes slots [E, 2E) while a staged layer there is unreleased, or if an
    accepted shrink leaves buffer 1's record: after growing back, re-staging layer 1 would then
    report already_loaded for bytes the caller released."""
    E = 3
    cache = adapter.init(2, E, 9, capacity=9)
    cache.begin_prefill()
    assert cache.prefetch_prefill_layer(1, (1 << 20,)).error == 0  # buffer 1 = slots [3, 6)
    before = cache.state
    assert cache.resize(2 * E - 1).error == ERR_CACHE_SIZE
    assert_same_state(cache.state, before, "after a shrink refused for the busy buffer")
    assert cache.resize(2 * E).error == 0, "2E keeps both buffers: allowed"
    cache.release_prefill_layer(1)
    assert cache.resize(E).error == 0
    assert cache.state.prefill_layer.tolist() == [-1, -1]
    assert cache.prefetch_prefill_layer(1, (1 << 20,)).error == ERR_CACHE_SIZE
    assert cache.resize(9).error == 0
    again = cache.prefetch_prefill_layer(1, (1 << 20,))
    assert again.error == 0 and not again.already_loaded and again.entry_count == 1


@pytest.mark.traced
def test_prefill_below_2e_within_a_larger_capacity_is_a_value_error(adapter):
    """FAILS if a usable size below 2E raises PrefillDoesNotFit (it is data, possibly traced) or
    if begin_prefill opens a chunk / prefetch stages into slots the pool does not have."""
    cache = adapter.init(2, 4, 6, capacity=16)
    before = cache.state
    cache.begin_prefill()
    assert_same_state(cache.state, before, "begin_prefill below 2E changes nothing")
    plan = cache.prefetch_prefill_layer(1, (1 << 20,))
    assert plan.error == ERR_CACHE_SIZE | adapter.errors.ERR_PREFILL_NOT_BEGUN
    assert_same_state(cache.state, before, "a refused prefetch")
    assert not cache.prefill_overlap_fits()
    with pytest.raises(adapter.errors.PrefillDoesNotFit):
        adapter.init(2, 4, 6, capacity=7).begin_prefill()


@pytest.mark.traced
def test_forget_slot_past_the_usable_size_is_err_slot(adapter):
    """FAILS if the slot range is checked against the capacity instead of the usable size."""
    cache = filled(adapter)
    before = cache.state
    plan = cache.forget_slot(5)
    assert (plan.old, plan.error) == (-1, adapter.errors.ERR_SLOT)
    assert_same_state(cache.state, before, "a refused forget_slot")
    assert cache.forget_slot(3).error == 0


def test_a_capacity_2048_state_resized_to_48_behaves_like_a_48_slot_pool():
    """docs/semantics.md §5.15's example: FAILS if any plan of the resized state differs from a
    fresh 48-slot pool's, or if prefill raises instead of reporting ERR_CACHE_SIZE."""
    L, E = 4, 32
    big, plan = pc.resize(pc.init(L, E, 2048), 48)
    assert int(plan.error) == 0 and int(plan.count) == 2000
    small = pc.init(L, E, 48)
    rng = np.random.default_rng(3)
    policy = pc.FetchPolicy.fraction(0.4)
    step = jax.jit(pc.ensure_hybrid)
    for call in range(60):
        layer, routes = call % L, jnp.asarray(rng.integers(-1, E, size=8), jnp.int32)
        big, mine = step(big, layer, routes, policy)
        small, theirs = step(small, layer, routes, policy)
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
            np.testing.assert_array_equal(a, b, err_msg=f"call {call}")
    np.testing.assert_array_equal(big.id_of_slot[:48], small.id_of_slot)
    assert (np.asarray(big.id_of_slot[48:]) == -1).all()
    with pytest.raises(pc.PrefillDoesNotFit):
        pc.begin_prefill(small)
    assert bool(pc.prefill_overlap_fits(big)) is False
    _, staged = pc.prefetch_prefill_layer(pc.begin_prefill(big), 0, (1 << 20,))
    assert int(staged.error) & ERR_CACHE_SIZE


def test_describe_and_stats_see_only_the_usable_slots():
    """FAILS if describe lists (or counts as empty) the slots past the usable size."""
    state = pc.init(2, 3, 4, capacity=9)
    state, _ = pc.ensure(state, 0, jnp.asarray([0, 1], jnp.int32))
    view = pc.describe(state)
    assert len(view.rows) == 4 and view.cache_size == 4 and view.capacity == 9
    assert [r.status for r in view.rows] == ["resident", "resident", "empty", "empty"]
    assert "S=4 (capacity 9)" in view.header() and "resident=2/4" in view.header()
    shrunk, _ = pc.resize(state, 3)
    grown, _ = pc.resize(shrunk, 9)
    assert len(pc.describe(grown).rows) == 9
    assert pc.diff(state, pc.resize(state, 3)[0]).unchanged, "the freed slot 3 was empty"
    full, _ = pc.ensure(state, 1, jnp.asarray([0, 1], jnp.int32))  # slot 3: layer 1, expert 1
    change = pc.diff(full, pc.resize(full, 3)[0])
    assert change.evicted == [(3, 1, 1)] and not change.installed and not change.refreshed


def test_init_and_rebuild_check_the_capacity():
    """FAILS if a capacity below the usable size is accepted, or if rebuild inherits the old
    capacity instead of allocating as init does."""
    with pytest.raises(ValueError, match="capacity 3 is below cache_size 4"):
        pc.init(2, 3, 4, capacity=3)
    with pytest.raises(TypeError):
        pc.init(2, 3, 4, capacity=4.0)
    state = pc.init(2, 3, 4, capacity=9)
    assert (state.capacity, int(state.cache_size)) == (9, 4)
    rebuilt = pc.rebuild(state, 5)
    assert (rebuilt.capacity, int(rebuilt.cache_size)) == (5, 5)
    rebuilt = pc.rebuild(state, 5, capacity=12)
    assert (rebuilt.capacity, int(rebuilt.cache_size)) == (12, 5)
    again = pc.reset(pc.resize(state, 7)[0])
    assert (again.capacity, int(again.cache_size)) == (9, 7), "reset keeps both"


INT32_MAX = 2**31 - 1


@pytest.mark.parametrize("call, match", [
    (lambda: pc.init(4, 8, 2**31), r"cache_size must fit in int32 \(<= 2147483647\), got 2147483648"),
    (lambda: pc.init(2**31, 8, 16), "num_layers must fit in int32"),
    (lambda: pc.init(1, 2**31, 2**31), "num_experts must fit in int32"),
    (lambda: pc.init(2, 8, 16, capacity=2**31), "capacity must fit in int32"),
    (lambda: pc.init(2**16, 2**15, 2**15), r"2147483648 flat ids do not fit in int32"),
    (lambda: pc.init(1, 2**29, INT32_MAX - 1 - 2**29), r"= 2147483647 clock stamps"),
    (lambda: pc.init(2, 8, 16, rebase_threshold=2**31), "rebase_threshold must fit in int32"),
    (lambda: pc.init(2, 8, 16, history=2**31), "history must fit in int32"),
    (lambda: pc.rebuild(pc.init(2, 4, 8), 2**31), "cache_size must fit in int32"),
    (lambda: pc.rebuild(pc.init(2, 4, 8), 8, capacity=2**31), "capacity must fit in int32"),
    (lambda: pc.rebuild(pc.init(1, 2**3, 8), INT32_MAX - 2**3 - 1), "clock stamps"),
])
def test_init_and_rebuild_refuse_unrepresentable_sizes_before_allocating(call, match, monkeypatch):
    """FAILS if a size whose int32 quantities overflow reaches the allocation (docs/semantics.md
    §5.1): ``init(4, 8, 2**31)`` took 26 s and 17 GB before an OverflowError, ``init(2**31, 8,
    16)`` tried to allocate 64 GiB, and ``capacity=None`` was not range-checked at all. The
    cold state is replaced by a stub here, so a missed check fails at once, allocating nothing."""
    from pallas_cache import state as state_module

    real = state_module._empty_state
    monkeypatch.setattr(state_module, "_empty_state",
                        lambda *args, **kwargs: real(*args, **kwargs) if args[2] <= 64 else "alloc")
    with pytest.raises(ValueError, match=match):
        call()


def test_the_largest_representable_sizes_are_accepted(monkeypatch):
    """FAILS if the int32 checks refuse a size one below their limit (the boundary is
    ``C + L * E + 1 <= 2**31 - 2``; the cold state is stubbed, so nothing is allocated)."""
    from pallas_cache import state as state_module

    monkeypatch.setattr(state_module, "_empty_state", lambda *args, **kwargs: args)
    L, E = 1, 2**29
    assert pc.init(L, E, INT32_MAX - 2 - L * E)[2] == INT32_MAX - 2 - L * E
    assert pc.init(2, 8, 16, capacity=INT32_MAX - 2 - 16)[2] == INT32_MAX - 18


# ---- kernels and the dispatch point ------------------------------------------------------------


def test_select_victims_and_promotion_mask_by_data():
    """FAILS if either decision ignores the traced usable size: the unusable tail has the
    smallest usage, so it would be picked first; one compiled function serves every size."""
    usage = jnp.asarray([5, 3, 4, 6, 0, 0, 0, 0], jnp.int32)
    ids = jnp.asarray([0, 1, 2, 3, -1, -1, -1, -1], jnp.int32)
    victims = jax.jit(lambda u, size: select_victims(u, jnp.int32(7), jnp.int32(3), num_out=3,
                                                     cache_size=size))
    assert victims(usage, jnp.int32(4)).tolist() == [1, 2, 0]
    assert victims(usage, jnp.int32(8)).tolist() == [4, 5, 6]
    decide = jax.jit(lambda size: promotion_decision(
        usage, ids, jnp.int32(7), jnp.asarray([2, -1], jnp.int32), jnp.asarray([True, False]),
        jnp.int32(26214), jnp.int32(0), cache_size=size))
    assert [int(x) for x in decide(jnp.int32(4))] == [-1, -1], "no usable empty slot"
    assert [int(x) for x in decide(jnp.int32(5))] == [0, 4]


@pytest.mark.parametrize("eviction", ["pair_lfu", "route_knn", "route_lfu"])
def test_a_long_run_with_capacity_equals_a_pool_of_the_usable_size_under_each_eviction(eviction):
    """FAILS if ROUTE_KNN's (or ROUTE_LFU's) horizon ``H = ceil(S / L)`` comes from the capacity
    (here 8 tokens instead of 2: neighbours' routes 2..7 tokens ahead would count), or a
    ranking reads a slot past the usable size. A long run of one geometry, so that such a difference shows up
    for sure (the drawn sequences above are short)."""
    L, E, S, C = 2, 4, 4, 16
    options = {"eviction": eviction, "history": 16} if eviction != "pair_lfu" else {
        "eviction": eviction}
    truth = ADAPTER["reference"].init(L, E, S, **options)
    big = ADAPTER["jax-jit"].init(L, E, S, capacity=C, **options)
    rng = np.random.default_rng(7)
    for call in range(240):
        layer = call % L if call % 7 else int(rng.integers(L))  # mostly tokens of L layers
        routes = rng.choice(E, 2, replace=False).astype(np.int32)
        spec = ("fraction", 0.5) if call % 3 == 0 else ("full", None)
        context = f"call {call} (layer={layer}, routes={routes.tolist()})"
        plan = big.ensure_hybrid(layer, routes, build_policy(big, spec), order="recency",
                                 admission="promote_one")
        expected = truth.ensure_hybrid(layer, routes, build_policy(truth, spec),
                                       order="recency", admission="promote_one")
        assert_same_plan(plan, expected, context)
        assert_usable_part_equal(big.state, truth.state, context)
