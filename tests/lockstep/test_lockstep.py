"""Lockstep property tests: the JAX cache against the NumPy reference, whole states and plans
after every step (operation records of pallas_cache.testing, run by tests/harness.py's
``steps`` and pallas_cache.testing.lockstep's ``run``): plain pools, a capacity above the usable size
against a pool of that size, and ``resize`` interleaved with every other operation."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import pallas_cache as pc
from pallas_cache import reference
from pallas_cache.testing import lockstep
from pallas_cache.testing.operations import (BeginPrefill, Ensure, EnsureHybrid, Forget,
                                             Materialize, PolicySpec, PrefetchPrefill, Rebuild,
                                             ReleasePrefill, Reset, ResetRouting, ResetStats,
                                             Resize, SetCollectRouting, StartToken)
from tests.harness import (
    ADAPTER,
    assert_invariants,
    assert_plan_well_formed,
    assert_same,
    entries,
    evictions_under_test,
    examples,
    steps,
)

BIG_BANK = 512 * 1024
SMALL_BANK = 4 * 1024
BANK_CHOICES = ((BIG_BANK,), (BIG_BANK, SMALL_BANK))

# (L, E, C, route shape, rebuild targets): C is the pool's slot count (its capacity; the plain
# lockstep's usable size, the capacity tests draw a usable size in [E, C]). Pairs share (L, E) so
# a rebuild lands on a geometry compiled anyway, and every test of this module uses these shapes,
# so each JAX program compiles once for the module. Covers E == 1, L == 1, C == E, C == 2E, C odd,
# C < 2E, 2-D routes, and route batches larger than E.
GEOMETRIES = {
    "jax-eager": [
        (1, 1, 1, (3,), (1, 2)),
        (1, 1, 2, (3,), (1, 2)),
        (2, 3, 3, (5,), (3, 6)),
        (2, 3, 6, (5,), (3, 6)),
        (3, 4, 12, (2, 3), (12,)),
        (4, 2, 7, (4,), (7,)),
    ],
    "jax-jit": [
        (1, 1, 2, (3,), (2,)),
        (2, 3, 6, (5,), (6,)),
        (3, 4, 12, (2, 3), (12,)),
    ],
}
GEOMETRIES["jax-interpret"] = GEOMETRIES["jax-jit"]
#: The capacity and resize runs under another eviction policy repeat every rule under one more
#: option: the two larger jit geometries (each ring size compiles the programs again).
EVICTION_GEOMETRIES = GEOMETRIES["jax-jit"][1:]
REBASE_THRESHOLDS = (2**30, 4, 11)
QUICK_FRACTIONS = (0.0, 0.25, 0.4, 0.415, 0.5, 0.75, 1.0)
ERR_CACHE_SIZE = pc.ERR_CACHE_SIZE


# ---- comparing -----------------------------------------------------------------------------


def assert_same_caches(cache, ref, context):
    native = cache.state
    chex.assert_type([native.residency.slot_for_id, native.residency.id_of_slot, native.residency.usage, native.step], jnp.int32)
    assert_same(cache.state, ref.state, f"after {context}")
    assert_invariants(cache.state)


def assert_same_outcome(mine, theirs, context):
    """Two outcomes of ``Cache.apply``: equal plans, or the same static error (or None)."""
    if mine is None or isinstance(mine, str) or theirs is None or isinstance(theirs, str):
        assert mine == theirs, context
    else:
        assert_same(mine, theirs, context)


def compare_caches(context, op, expected, got):
    """The plain lockstep: the same outcome, the same whole state, the invariants."""
    (theirs, ref), (mine, cache) = expected, got
    assert_same_outcome(mine, theirs, context)
    if isinstance(op, (Ensure, EnsureHybrid)) and not isinstance(mine, str):
        assert_plan_well_formed(mine, op.routes, cache.state.num_experts)
    if isinstance(op, PrefetchPrefill) and not isinstance(mine, str):
        banks = op.bank_feat_bytes
        assert entries(mine, banks) == entries(theirs, banks), context
    assert_same_caches(cache, ref, context)
    assert cache.prefill_overlap_fits() == ref.prefill_overlap_fits(), context


def assert_same_reports(cache, ref, context):
    mine, theirs = cache.stats(), ref.stats()
    for name in ("calls", "active", "missing", "fetched", "miss_rate", "fetch_rate",
                 "active_per_call", "missing_per_call", "fetched_per_call"):
        assert getattr(mine, name) == getattr(theirs, name), f"stats.{name} after {context}"
    assert [counters(s) for s in cache.per_layer_stats()] == [counters(s) for s in ref.per_layer_stats()]
    for layer in range(cache.state.num_layers):
        assert counters(cache.layer_stats(layer)) == counters(ref.layer_stats(layer))
        np.testing.assert_array_equal(cache.routing_histogram(layer), ref.routing_histogram(layer))
    mine, theirs = cache.routing_skew(), ref.routing_skew()
    assert (mine is None) == (theirs is None), context
    if mine is not None:
        for name in ("slots_per_layer", "oracle_slots", "working_set_max"):
            assert getattr(mine, name) == getattr(theirs, name), name
        for name in ("working_set_mean", "experts_for_90pct", "oracle_hit_at_slots", "norm_entropy"):
            assert getattr(mine, name) == pytest.approx(getattr(theirs, name), rel=1e-12, abs=1e-12)
        assert len(mine.per_layer) == len(theirs.per_layer)
        for a, b in zip(mine.per_layer, theirs.per_layer):
            for name in ("layer", "routed", "working_set", "experts_for_90pct"):
                assert getattr(a, name) == getattr(b, name), name
            for name in ("norm_entropy", "oracle_hit_at_slots"):
                assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-12, abs=1e-12)


def counters(s):
    return (s.calls, s.active, s.missing, s.fetched)


# ---- drawing operation sequences -----------------------------------------------------------


def draw_layer(data, L):
    """Mostly in range; one draw in ten out of range (ERR_LAYER)."""
    if data.draw(st.integers(0, 9), label="bad layer?") == 0:
        return data.draw(st.sampled_from([-1, L, L + 3]), label="bad layer")
    return data.draw(st.integers(0, L - 1), label="layer")


def draw_routes(data, E, shape):
    size = int(np.prod(shape))
    if data.draw(st.integers(0, 4), label="whole layer?") == 0:
        return whole_layer(E, shape)
    hot = data.draw(st.integers(1, E), label="hot experts")  # a small range makes hits likely
    routes = data.draw(st.lists(st.integers(-1, hot - 1), min_size=size, max_size=size), label="routes")
    if data.draw(st.integers(0, 19), label="bad id?") == 0:
        routes[data.draw(st.integers(0, size - 1))] = data.draw(st.sampled_from([E, E + 5, -2, -7]))
    return np.asarray(routes, np.int32).reshape(shape)


def whole_layer(E, shape):
    """Routes to every expert of a layer (padded with -1 to the geometry's route shape)."""
    size = int(np.prod(shape))
    return np.resize(np.concatenate([np.arange(E), -np.ones(size, int)]), size).astype(np.int32).reshape(shape)


def draw_policy(data, E):
    """A :class:`PolicySpec`; each side builds its own policy from it."""
    kind = data.draw(st.sampled_from(["fraction", "fraction", "fixed_cap", "full"]), label="policy")
    if kind == "fraction":
        return PolicySpec(kind, data.draw(st.one_of(st.sampled_from(QUICK_FRACTIONS),
                                                    st.floats(0.0, 1.0)), label="q"))
    if kind == "fixed_cap":
        return PolicySpec(kind, data.draw(st.integers(0, E + 1), label="cap"))
    return PolicySpec(kind)


#: The record kinds a sequence draws, weighted by repetition.
BASE_OPS = (
    [Ensure] * 4 + [EnsureHybrid] * 8 + [BeginPrefill] * 2 + [PrefetchPrefill] * 3
    + [ReleasePrefill] * 2 + [Materialize, Forget, Reset, ResetStats, SetCollectRouting,
                              ResetRouting]
)
ORDERS = ("recency", "lowest_id")
ADMISSIONS = ("promote_one", "none", "reuse")
#: The evictions keeping a token ring (docs/semantics.md §5.16): they draw a ring size and
#: ``start_token`` calls.
RING_EVICTIONS = [param.values[0] for param in evictions_under_test(ring=True)]


def eviction_options(data, eviction):
    """``init`` options, the admissions and the extra ops of an eviction policy (None = LRU):
    REUSE only where the policy allows it (docs/semantics.md §5.16); the ring policies draw
    their ring size and ``start_token`` calls."""
    if eviction is None:
        return {}, ADMISSIONS, []
    options, extra = {"eviction": eviction}, []
    if eviction in RING_EVICTIONS:
        options["history"] = data.draw(st.sampled_from((1, 3, 6)), label="history")
        extra = [StartToken] * 2
    allows_reuse = pc.evictions.coerce(eviction).allows_reuse
    return options, ADMISSIONS if allows_reuse else ("promote_one", "none"), extra


def draw_op(data, kinds, L, E, C, route_shape, admissions, rebuild_sizes, capacity=None):
    """One operation record of a kind in ``kinds`` (record classes) on a pool of ``C`` slots;
    bad layers, ids, slots, sizes and rebuild targets included. ``capacity``: a rebuild's."""
    kind = data.draw(st.sampled_from(kinds), label="op")
    if kind in (Ensure, EnsureHybrid, Materialize, ReleasePrefill, PrefetchPrefill):
        layer = draw_layer(data, L)
    if kind is Ensure:
        return Ensure(layer, draw_routes(data, E, route_shape))
    if kind is EnsureHybrid:
        routes, policy = draw_routes(data, E, route_shape), draw_policy(data, E)
        order = data.draw(st.sampled_from(ORDERS), label="order")
        return EnsureHybrid(layer, routes, policy, order,
                            data.draw(st.sampled_from(admissions), label="admission"))
    if kind is PrefetchPrefill:
        return PrefetchPrefill(layer, data.draw(st.sampled_from(BANK_CHOICES), label="banks"))
    if kind in (Materialize, ReleasePrefill):
        return kind(layer)
    if kind is Forget:  # unusable slots (>= the usable size) included: ERR_SLOT
        return Forget(data.draw(st.sampled_from(list(range(C)) * 2 + [-1, C]), label="slot"))
    if kind is SetCollectRouting:
        return SetCollectRouting(data.draw(st.booleans(), label="collect"))
    if kind is Resize:  # refused targets too: below E, above C, negative
        return Resize(data.draw(st.sampled_from(list(range(E - 1, C + 2)) + [-1]), label="size"))
    if kind is Rebuild:
        return Rebuild(data.draw(st.sampled_from(rebuild_sizes), label="rebuild to"), capacity)
    return kind()


def draw_ops(data, kinds, L, E, C, route_shape, admissions, rebuild_sizes, *, capacity=None,
             warm=()):
    """A drawn sequence. Half the sequences start by warming every layer into the pool (so
    residents sit above the prefill buffers' slots and chunks see gathers) and opening a prefill
    chunk, after ``warm``. ``capacity``: rebuild keeps it (the shapes, so compiles are reused);
    without it a rebuild changes the pool's slot count ``C`` to its target."""
    ops = []
    if data.draw(st.booleans(), label="warm the pool and open a chunk?"):
        ops = list(warm) + [Ensure(layer, whole_layer(E, route_shape))
                            for layer in data.draw(st.permutations(range(L)), label="warm order")]
        ops.append(BeginPrefill())
    for _ in range(data.draw(st.integers(1, 40), label="number of ops")):
        op = draw_op(data, kinds, L, E, C, route_shape, admissions, rebuild_sizes, capacity)
        if isinstance(op, Rebuild) and capacity is None and op.cache_size >= E:
            C = op.cache_size
        ops.append(op)
    return ops


def draw_start(data, adapter_name, eviction, geometries=None):
    """The geometry (from ``geometries``, default all of the adapter's), the rebase threshold and
    the eviction's options of one sequence."""
    L, E, C, route_shape, rebuild_targets = data.draw(
        st.sampled_from(geometries or GEOMETRIES[adapter_name]), label="geometry")
    threshold = data.draw(st.sampled_from(REBASE_THRESHOLDS), label="rebase threshold")
    options, admissions, extra_ops = eviction_options(data, eviction)
    return (L, E, C, route_shape, rebuild_targets), {"rebase_threshold": threshold, **options}, \
        admissions, extra_ops


def jax_cache(adapter_name, *args, **kwargs):
    # The drawn route shape is the compiled one.
    return ADAPTER[adapter_name].unpadded().cache(*args, **kwargs)


# ---- the plain lockstep --------------------------------------------------------------------


def run_lockstep(data, adapter_name, eviction=None):
    """One drawn sequence on ``adapter_name`` against the reference; ``eviction`` (a name, None
    = the default LRU) fixes both caches' policy (docs/semantics.md §5.16), and then REUSE, which
    it refuses, is not drawn; the ring policies also draw their ring size and ``start_token``
    calls. A rebase threshold is drawn too, so sequences cross the int32-clock renumbering
    (docs/semantics.md §5.12)."""
    (L, E, C, route_shape, rebuild_targets), options, admissions, extra_ops = draw_start(
        data, adapter_name, eviction)
    ops = draw_ops(data, BASE_OPS + [Rebuild] + extra_ops, L, E, C, route_shape, admissions,
                   list(rebuild_targets) + [E - 1])
    cache = jax_cache(adapter_name, L, E, C, **options)
    ref = ADAPTER["reference"].cache(L, E, C, **options)
    assert_same_caches(cache, ref, "init")

    clock = [int(ref.state.step)]

    def compare(context, op, expected, got):
        compare_caches(context, op, expected, got)
        step = int(expected[1].state.step)
        note_events(op, got[0], clock[0], step)
        clock[0] = step

    lockstep.run(ops, steps(ref, ops), {adapter_name: steps(cache, ops)}, compare)
    assert_same_reports(cache, ref, "the sequence")


def note_events(op, plan, previous_step, step):
    """Hypothesis statistics (``--hypothesis-show-statistics``): which rules the run exercised."""
    if not isinstance(op, (Ensure, EnsureHybrid, Materialize, PrefetchPrefill)) \
            or isinstance(plan, str):
        return
    if plan.error:
        event(f"{type(op).__name__} refused")
        return
    if isinstance(op, (Ensure, EnsureHybrid, Materialize)) and step <= previous_step:
        event("clock rebased")
    if isinstance(op, EnsureHybrid) and plan.cpu.sum():
        event("hybrid step with CPU routes")
    if isinstance(op, EnsureHybrid) and plan.missing > plan.fetched > 0:
        event("hybrid step with capped fetches")
    if isinstance(op, PrefetchPrefill) and plan.gather.count:
        event("prefill gather")
    if isinstance(op, PrefetchPrefill) and plan.already_loaded:
        event("prefill already loaded")


#: The JAX adapters every drawn sequence runs on (conftest.py).
JAX_ADAPTERS = ("jax-eager", "jax-jit", "jax-interpret")


def drawn(run, adapter_name, budget, **options):
    """``run(data, adapter_name, **options)`` as a hypothesis test with the adapter's number of
    examples, ``budget[adapter_name]`` (the interpreter's compiles cost the most)."""

    @budget[adapter_name]
    @given(data=st.data())
    def sequence(data):
        run(data, adapter_name, **options)

    sequence()


# The ci profile runs 12 plain sequences per adapter, 6 interpreted (the capacity and resize runs
# below repeat every rule under one more option, on the same compiled programs); deep: 1000, 333.
PLAIN_BUDGET = {"jax-eager": examples(1.0, ci=0.48), "jax-jit": examples(1.0, ci=0.48),
                "jax-interpret": examples(1 / 3, ci=0.24)}


@pytest.mark.parametrize("adapter_name", JAX_ADAPTERS)
def test_matches_the_reference_after_every_step(adapter_name):
    """FAILS if any op (ensure, ensure_hybrid with every policy, order and admission,
    materialize, forget, prefill, reset, rebuild, stats, routing, the clock rebase) disagrees
    with the reference in any state or plan field, or breaks a docs/semantics.md §3 invariant:
    eagerly, under an outer jit with a traced layer, slot or flag, or with the Pallas kernels
    in the interpreter."""
    drawn(run_lockstep, adapter_name, PLAIN_BUDGET)


def test_a_long_run_across_the_clock_rebase_matches_the_reference():
    """FAILS if the int32-clock renumbering (docs/semantics.md §5.12) differs from the reference
    in any plan or state field: a cache started below a small threshold runs across several
    rebases, with forgotten slots, prefill-emptied slots and never-routed experts alive at the
    time."""
    L, E, C, route_shape, _ = GEOMETRIES["jax-jit"][2]
    rng = np.random.default_rng(7)
    specs = [PolicySpec("fraction", 0.4), PolicySpec("fixed_cap", 1)]
    ops = []
    for step in range(200):
        ops.append(EnsureHybrid(int(rng.integers(L)),
                                rng.integers(-1, E, size=route_shape).astype(np.int32),
                                specs[step % 2], "recency",
                                "reuse" if step % 3 else "promote_one"))
        if step % 17 == 0:
            ops.append(Forget(step % C))
    cache = jax_cache("jax-jit", L, E, C, rebase_threshold=20)
    ref = ADAPTER["reference"].cache(L, E, C, rebase_threshold=20)

    def compare(context, op, expected, got):
        compare_caches(context, op, expected, got)
        assert int(got[1].state.step) <= 20 + 1, context

    lockstep.run(ops, steps(ref, ops), {"jax-jit": steps(cache, ops)}, compare)


def test_large_call_paths_match_the_reference():
    """FAILS if the step's size-dependent formulations differ from the reference in any plan or
    state field: above a static size the histogram row and the LOWEST_ID fetch list are
    scatters instead of masked sums, RECENCY goes through ``first_in_order``, and a pool of more
    than 256 slots takes the two-level victim search. The drawn geometries are small and reach
    only the first of each; this one (many routes per call, 300 slots) reaches the others."""
    L, E, C, K = 2, 128, 300, 64  # K * E and 64 * E above the masked-sum limit, C above 256
    rules = (None, ("recency", "promote_one"), ("recency", "reuse"), ("lowest_id", "none"))
    rng = np.random.default_rng(11)
    ops = []
    for t in range(48):
        layer = int(rng.integers(0, L))
        hot = int(rng.integers(8, E + 1))
        routes = rng.integers(-1, hot, K).astype(np.int32)  # duplicates and padding included
        rule = rules[t % len(rules)]
        if rule is None:
            ops.append(Ensure(layer, routes))
        else:
            ops.append(EnsureHybrid(layer, routes, PolicySpec("fraction", (0.0, 0.4, 1.0)[t % 3]),
                                    rule[0], rule[1]))
    cache = ADAPTER["jax-jit"].cache(L, E, C)
    ref = ADAPTER["reference"].cache(L, E, C)
    lockstep.run(ops, steps(ref, ops), {"jax-jit": steps(cache, ops)}, compare_caches)


# ---- capacity C above the usable size S == a pool of S (docs/semantics.md §5.15) ------------


def assert_usable_part_equal(big, truth, context):
    """``big`` (capacity C) equals ``truth`` (a pool of its usable size) on the usable part; the
    slots past it are empty with usage 0. The eviction bookkeeping (per expert, per token) is
    compared whole."""
    size = truth.capacity
    assert int(big.cache_size) == size == int(truth.cache_size), context
    ids, usage = np.asarray(big.residency.id_of_slot), np.asarray(big.residency.usage)
    assert (ids[size:] == -1).all() and (usage[size:] == 0).all(), \
        f"a slot past the usable size holds something {context}"
    if isinstance(big, reference.ReferenceCache):
        big = reference.copy_state(big)
        big.residency.id_of_slot, big.residency.usage = ids[:size], usage[:size]
    else:
        big = big.replace(residency=big.residency.replace(
            id_of_slot=big.residency.id_of_slot[:size], usage=big.residency.usage[:size]))
    assert_same(big, truth, context)


def compare_usable(context, op, expected, got):
    """A pool of capacity C and usable size S against a pool of S slots."""
    (theirs, truth), (mine, big) = expected, got
    C, E = big.state.capacity, big.state.num_experts
    if theirs == "PrefillDoesNotFit" and C >= 2 * E:
        # The pool of S < 2E raises (a shape); within capacity C >= 2E the usable size is a
        # value: begin_prefill changes nothing, prefetch reports ERR_CACHE_SIZE.
        if isinstance(op, PrefetchPrefill):
            assert mine.error & ERR_CACHE_SIZE, context
            assert mine.transfers.count == mine.gather.count == mine.runs.count == 0, context
        else:
            assert mine is None, context
    else:
        assert_same_outcome(mine, theirs, context)
        if isinstance(op, (Ensure, EnsureHybrid)):
            assert_plan_well_formed(mine, op.routes, E)
    assert_usable_part_equal(big.state, truth.state, f"after {context}")
    assert_invariants(big.state)
    assert bool(big.prefill_overlap_fits()) == bool(truth.prefill_overlap_fits()), context


def run_equivalence(data, adapter_name, eviction=None):
    """A drawn sequence on a pool of capacity C and usable size S (the reference and
    ``adapter_name``) against the reference's pool of S slots. Usable sizes include S == E,
    S < 2E <= C (prefill is a value error there, where the plain pool raises) and C < 2E (both
    raise)."""
    (L, E, C, route_shape, _), options, admissions, extra_ops = draw_start(
        data, adapter_name, eviction, eviction and EVICTION_GEOMETRIES)
    S = data.draw(st.integers(E, C), label="usable size")
    ops = draw_ops(data, BASE_OPS + extra_ops, L, E, C, route_shape, admissions, [])
    truth = ADAPTER["reference"].cache(L, E, S, **options)
    bigs = {"reference": ADAPTER["reference"].cache(L, E, S, capacity=C, **options),
            adapter_name: jax_cache(adapter_name, L, E, S, capacity=C, **options)}
    lockstep.run(ops, steps(truth, ops), {name: steps(big, ops) for name, big in bigs.items()},
                 compare_usable)
    for name, big in bigs.items():
        assert_same_reports(big, truth, f"the sequence on {name}")


CAPACITY_BUDGET = {"jax-eager": examples(0.5, ci=0.32), "jax-jit": examples(0.5, ci=0.32),
                   "jax-interpret": examples(0.25, ci=0.16)}


@pytest.mark.parametrize("adapter_name", JAX_ADAPTERS)
def test_capacity_above_the_usable_size_equals_a_pool_of_that_size(adapter_name):
    """FAILS if any rule reads slots past the usable size: an unusable slot taken as a victim
    (usage 0 makes it the first; by the XLA search or the fused kernel), counted as empty by the
    promotion rule, accepted by forget_slot, or prefill refused by a raise instead of a bit;
    eagerly, with the usable size traced, or in the interpreted kernels."""
    drawn(run_equivalence, adapter_name, CAPACITY_BUDGET)


@examples(0.25, ci=0.16)
@pytest.mark.parametrize("eviction", evictions_under_test(default=False))
@given(data=st.data())
def test_capacity_above_the_usable_size_equals_a_pool_of_that_size_under_each_eviction(
        eviction, data):
    """FAILS if PAIR_LFU's or ROUTE_KNN's ranking takes an unusable slot (id -1 ranks it as a
    free slot, usage 0 before every filled one) or ROUTE_KNN's horizon ``ceil(S / L)`` is read
    from the capacity instead of the traced usable size."""
    run_equivalence(data, "jax-jit", eviction)


@pytest.mark.parametrize("adapter_name", ["jax-jit", "jax-interpret"])
@pytest.mark.parametrize("eviction", evictions_under_test(default=False))
def test_a_long_run_with_capacity_equals_a_pool_of_the_usable_size_under_each_eviction(
        eviction, adapter_name):
    """FAILS if ROUTE_KNN's (or ROUTE_LFU's) horizon ``H = ceil(S / L)`` comes from the capacity
    (here 8 tokens instead of 2: neighbours' routes 2..7 tokens ahead would count), or a
    ranking reads a slot past the usable size: in the XLA step, and in the fused kernel, whose
    counters' static bound is the capacity's horizon. A long run of one geometry, so that such a
    difference shows up for sure (the drawn sequences above are short)."""
    L, E, S, C = 2, 4, 4, 16
    options = {"eviction": eviction, "history": 16} if eviction in RING_EVICTIONS else {
        "eviction": eviction}
    rng = np.random.default_rng(7)
    ops = []
    for call in range(240):
        ops.append(EnsureHybrid(
            call % L if call % 7 else int(rng.integers(L)),  # mostly tokens of L layers
            rng.choice(E, 2, replace=False).astype(np.int32),
            PolicySpec("fraction", 0.5) if call % 3 == 0 else PolicySpec("full")))
    truth = ADAPTER["reference"].cache(L, E, S, **options)
    big = ADAPTER[adapter_name].cache(L, E, S, capacity=C, **options)
    lockstep.run(ops, steps(truth, ops), {adapter_name: steps(big, ops)}, compare_usable)


# ---- resize interleaved with every op (docs/semantics.md §5.15) ------------------------------


def run_resize_lockstep(data, adapter_name, eviction=None):
    """The JAX cache against the reference, both of capacity C, with ``resize`` (refused targets
    included) interleaved with every other operation, prefill chunks open across shrinks and
    grows, and ``rebuild`` with an explicit capacity."""
    (L, E, C, route_shape, _), options, admissions, extra_ops = draw_start(
        data, adapter_name, eviction, eviction and EVICTION_GEOMETRIES)
    size = data.draw(st.integers(E, C), label="initial usable size")
    ops = draw_ops(data, BASE_OPS + [Resize] * 6 + [Rebuild] + extra_ops, L, E, C,
                   route_shape, admissions, list(range(E - 1, C + 1)), capacity=C,
                   warm=[Resize(C)])
    ref = ADAPTER["reference"].cache(L, E, size, capacity=C, **options)
    cache = jax_cache(adapter_name, L, E, size, capacity=C, **options)
    sizes = [size]

    def compare(context, op, expected, got):
        compare_caches(context, op, expected, got)
        plan = got[0]
        if isinstance(op, Resize) and plan.error == 0:
            assert plan.count == max(0, sizes[0] - op.cache_size), context
        sizes[0] = int(expected[1].state.cache_size)

    lockstep.run(ops, steps(ref, ops), {adapter_name: steps(cache, ops)}, compare)
    assert_same_reports(cache, ref, "the sequence")


@pytest.mark.parametrize("adapter_name", JAX_ADAPTERS)
def test_resize_interleaved_with_every_op_matches_the_reference(adapter_name):
    """FAILS if a shrink, a grow or a refused resize differs from the reference in any plan or
    state field, with every other op (prefill chunks open across shrinks included) around it:
    eagerly, with the target size traced, or where the fused kernel's victim search or
    promotion rule ignores a resized pool."""
    drawn(run_resize_lockstep, adapter_name, CAPACITY_BUDGET)


@examples(0.25, ci=0.16)
@pytest.mark.parametrize("eviction", evictions_under_test(default=False))
@given(data=st.data())
def test_resize_interleaved_with_every_op_matches_the_reference_under_each_eviction(
        eviction, data):
    """FAILS if ``resize`` changes (or a shrink clears) the policy's bookkeeping in one
    implementation only, if a grown slot is not a free usable slot for the ranking, or if the
    horizon does not follow the resized pool."""
    run_resize_lockstep(data, "jax-jit", eviction)
