"""Lockstep property tests: the JAX cache against the NumPy reference, field by field.

Hypothesis draws a geometry and a random sequence of every operation (ensure; ensure_hybrid with
every policy kind, fetch order and admission rule; materialize_layer; forget_slot, bad slots
included; the prefill chunk ops; reset; rebuild, rejected targets included; stats windows;
routing collection on and off; padding routes, duplicates, batches larger than E, bad ids and
layers). Both implementations run it; after **every** step every state field and every plan
field must be equal, and the docs/semantics.md §3 invariants must hold. A rebase threshold is drawn too, so
sequences cross the int32-clock renumbering (docs/semantics.md §5.12).

Cost control (the file must stay well under three minutes on two cores with the 'ci' profile):
compilation is the cost, so geometries come from a small fixed list, each geometry has one fixed
route shape (routes are padded with -1 to it), rebuild only moves between sizes already in the
list, and the jitted wrappers are module-level so every compiled function is reused across
examples. Both sides run through the adapters of conftest.py (``jax-eager``: the public functions,
which jit their bodies internally; ``jax-jit``: every function under an outer ``jax.jit`` with a
traced layer/slot; ``jax-interpret``: that, with the Pallas kernels in the interpreter), and are
compared through the same normalised views as every rule test.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from conftest import (
    ADAPTER,
    assert_invariants,
    assert_plan_well_formed,
    assert_same_plan,
    assert_same_state,
)

BIG_BANK = 512 * 1024
SMALL_BANK = 4 * 1024
BANK_CHOICES = ((BIG_BANK,), (BIG_BANK, SMALL_BANK))

# (L, E, S, route shape, rebuild targets). Pairs of geometries share (L, E) so a rebuild lands on a
# geometry that is compiled anyway. Covers E == 1, L == 1, S == E, S == 2E, S odd, 2-D routes, and
# route batches larger than E.
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
REBASE_THRESHOLDS = (2**30, 4, 11)
QUICK_FRACTIONS = (0.0, 0.25, 0.4, 0.415, 0.5, 0.75, 1.0)


# ---- comparing -----------------------------------------------------------------------------


def assert_same_caches(cache, ref, context):
    native = cache.native
    chex.assert_type([native.slot_for_id, native.id_of_slot, native.usage, native.step], jnp.int32)
    assert_same_state(cache.state, ref.state, f"after {context}")
    assert_invariants(cache.state)


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


# ---- drawing operations --------------------------------------------------------------------


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
    """A policy spec ``(kind, argument)``; each side builds its own from it."""
    kind = data.draw(st.sampled_from(["fraction", "fraction", "fixed_cap", "full"]), label="policy")
    if kind == "fraction":
        return kind, data.draw(st.one_of(st.sampled_from(QUICK_FRACTIONS), st.floats(0.0, 1.0)), label="q")
    if kind == "fixed_cap":
        return kind, data.draw(st.integers(0, E + 1), label="cap")
    return kind, None


def build_policy(cache, spec):
    kind, argument = spec
    make = getattr(cache.adapter.Policy, kind)
    return make() if argument is None else make(argument)


OP_KINDS = (
    ["ensure"] * 4 + ["ensure_hybrid"] * 8 + ["begin_prefill"] * 2 + ["prefetch_prefill_layer"] * 3
    + ["release_prefill_layer"] * 2 + ["materialize_layer", "forget_slot", "reset", "rebuild",
                                       "reset_stats", "set_collect_routing", "reset_routing"]
)
ORDERS = ("recency", "lowest_id")
ADMISSIONS = ("promote_one", "none", "reuse")


#: The evictions keeping a token ring (docs/semantics.md §5.16): they draw a ring size and
#: ``start_token`` calls.
RING_EVICTIONS = ("route_knn", "route_lfu")


def run_lockstep(data, adapter_name, eviction=None):
    """One drawn sequence on ``adapter_name`` against the reference; ``eviction`` (a name, None
    = the default LRU) fixes both caches' policy (docs/semantics.md §5.16), and then REUSE, which
    it refuses, is not drawn; the ring policies also draw their ring size and ``start_token``
    calls."""
    L, E, S, route_shape, rebuild_targets = data.draw(
        st.sampled_from(GEOMETRIES[adapter_name]), label="geometry")
    threshold = data.draw(st.sampled_from(REBASE_THRESHOLDS), label="rebase threshold")
    options = {"eviction": eviction}
    if eviction in RING_EVICTIONS:
        options["history"] = data.draw(st.sampled_from((1, 3, 6)), label="history")
    cache = ADAPTER[adapter_name].init(L, E, S, rebase_threshold=threshold, **options)
    cache.pad_routes = False  # the drawn route shape is the compiled one
    ref = ADAPTER["reference"].init(L, E, S, rebase_threshold=threshold, **options)
    admissions = ADMISSIONS if eviction in (None, "lru") else ("promote_one", "none")
    op_kinds = OP_KINDS + (["start_token"] * 2 if eviction in RING_EVICTIONS else [])
    assert_same_caches(cache, ref, "init")
    # Half the sequences start by warming every layer into the pool (so residents sit above the
    # prefill buffers' slots and chunks see gathers) and opening a prefill chunk.
    prefix = []
    if data.draw(st.booleans(), label="warm the pool and open a chunk?"):
        warm_order = data.draw(st.permutations(range(L)), label="warm order")
        prefix = [("ensure", {"layer": layer, "routes": whole_layer(E, route_shape)})
                  for layer in warm_order] + [("begin_prefill", {})]
    num_ops = len(prefix) + data.draw(st.integers(1, 40), label="number of ops")
    for step in range(num_ops):
        if step < len(prefix):
            kind, given_args = prefix[step]
        else:
            kind, given_args = data.draw(st.sampled_from(op_kinds), label="op"), {}
        previous_step, plan = int(ref.state.step), None
        context = f"op {step} {kind}"
        if kind == "ensure":
            layer = given_args["layer"] if given_args else draw_layer(data, L)
            routes = given_args["routes"] if given_args else draw_routes(data, E, route_shape)
            context += f"(layer={layer}, routes={routes.tolist()})"
            plan = cache.ensure(layer, routes)
            assert_same_plan(plan, ref.ensure(layer, routes), context)
            assert_plan_well_formed(plan, routes, E)
        elif kind == "ensure_hybrid":
            layer, routes = draw_layer(data, L), draw_routes(data, E, route_shape)
            spec = draw_policy(data, E)
            order = data.draw(st.sampled_from(ORDERS), label="order")
            admission = data.draw(st.sampled_from(admissions), label="admission")
            context += (f"(layer={layer}, routes={routes.tolist()}, policy={spec}, "
                        f"order={order}, admission={admission})")
            plan = cache.ensure_hybrid(layer, routes, build_policy(cache, spec), order=order,
                                       admission=admission)
            expected = ref.ensure_hybrid(layer, routes, build_policy(ref, spec), order=order,
                                         admission=admission)
            assert_same_plan(plan, expected, context)
            assert_plan_well_formed(plan, routes, E)
        elif kind == "materialize_layer":
            layer = draw_layer(data, L)
            context += f"(layer={layer})"
            plan = cache.materialize_layer(layer)
            assert_same_plan(plan, ref.materialize_layer(layer), context)
        elif kind == "forget_slot":
            slot = data.draw(st.sampled_from(list(range(S)) * 3 + [-1, S]), label="slot")
            context += f"(slot={slot})"
            assert_same_plan(cache.forget_slot(slot), ref.forget_slot(slot), context)
        elif kind == "begin_prefill":
            if ref.prefill_overlap_fits():
                cache.begin_prefill()
                ref.begin_prefill()
            else:
                with pytest.raises(cache.adapter.errors.PrefillDoesNotFit):
                    cache.begin_prefill()
                with pytest.raises(ref.adapter.errors.PrefillDoesNotFit):
                    ref.begin_prefill()
            assert cache.prefill_overlap_fits() == ref.prefill_overlap_fits()
        elif kind == "prefetch_prefill_layer":
            layer = draw_layer(data, L)
            banks = data.draw(st.sampled_from(BANK_CHOICES), label="banks")
            context += f"(layer={layer}, banks={banks})"
            if not ref.prefill_overlap_fits():
                with pytest.raises(cache.adapter.errors.PrefillDoesNotFit):
                    cache.prefetch_prefill_layer(layer, banks)
                continue
            plan = cache.prefetch_prefill_layer(layer, banks)
            expected = ref.prefetch_prefill_layer(layer, banks)
            assert_same_plan(plan, expected, context)
            assert plan.entry_bytes(banks) == expected.entry_bytes(banks)
        elif kind == "release_prefill_layer":
            layer = draw_layer(data, L)
            context += f"(layer={layer})"
            cache.release_prefill_layer(layer)
            ref.release_prefill_layer(layer)
        elif kind == "reset":
            cache.reset()
            ref.reset()
        elif kind == "rebuild":
            target = data.draw(st.sampled_from(list(rebuild_targets) + [E - 1]), label="rebuild to")
            context += f"(cache_size={target})"
            if target < E:
                with pytest.raises(cache.adapter.errors.RebuildRejected) as rejected:
                    cache.rebuild(target)
                assert (rejected.value.requested, rejected.value.minimum) == (target, E)
                with pytest.raises(ref.adapter.errors.RebuildRejected):
                    ref.rebuild(target)
            else:
                cache.rebuild(target)
                ref.rebuild(target)
                S = target
        elif kind == "reset_stats":
            cache.reset_stats()
            ref.reset_stats()
        elif kind == "set_collect_routing":
            on = data.draw(st.booleans(), label="collect")
            context += f"({on})"
            cache.set_collect_routing(on)
            ref.set_collect_routing(on)
        elif kind == "reset_routing":
            cache.reset_routing()
            ref.reset_routing()
        elif kind == "start_token":
            cache.start_token()
            ref.start_token()
        assert_same_caches(cache, ref, context)
        note_events(kind, plan if kind in PLAN_OPS else None, previous_step, int(ref.state.step))
    assert_same_reports(cache, ref, "the sequence")


PLAN_OPS = ("ensure", "ensure_hybrid", "materialize_layer", "prefetch_prefill_layer")


def note_events(kind, plan, previous_step, step):
    """Hypothesis statistics (``--hypothesis-show-statistics``): which rules the run exercised."""
    if plan is None:
        return
    if plan.error:
        event(f"{kind} refused")
        return
    if kind in ("ensure", "ensure_hybrid", "materialize_layer") and step <= previous_step:
        event("clock rebased")
    if kind == "ensure_hybrid" and plan.cpu.sum():
        event("hybrid step with CPU routes")
    if kind == "ensure_hybrid" and plan.missing > plan.fetched > 0:
        event("hybrid step with capped fetches")
    if kind == "prefetch_prefill_layer" and plan.gather_count:
        event("prefill gather")
    if kind == "prefetch_prefill_layer" and plan.already_loaded:
        event("prefill already loaded")


@given(data=st.data())
def test_eager_matches_the_reference_after_every_step(data):
    run_lockstep(data, "jax-eager")


@given(data=st.data())
def test_jitted_matches_the_reference_after_every_step(data):
    run_lockstep(data, "jax-jit")


# The Pallas kernels under the interpreter: the same sequences, fewer of them (each geometry
# compiles the interpreted kernels once; the "deep" profile still runs many).
@settings(max_examples=max(6, settings.default.max_examples // 3))
@given(data=st.data())
def test_the_interpret_backend_matches_the_reference_after_every_step(data):
    run_lockstep(data, "jax-interpret")


def test_a_long_run_across_the_clock_rebase_matches_the_reference():
    """A cache started just below a (small) threshold runs across several rebases, with forgotten
    slots, prefill-emptied slots and never-routed experts alive at the time (docs/semantics.md §5.12)."""
    L, E, S = 3, 4, 9
    cache = ADAPTER["jax-jit"].init(L, E, S, rebase_threshold=20)
    cache.pad_routes = False
    ref = ADAPTER["reference"].init(L, E, S, rebase_threshold=20)
    rng = np.random.default_rng(7)
    specs = [("fraction", 0.4), ("fixed_cap", 1)]
    for step in range(200):
        layer = int(rng.integers(L))
        routes = rng.integers(-1, E, size=5).astype(np.int32)
        spec = specs[step % 2]
        admission = "reuse" if step % 3 else "promote_one"
        plan = cache.ensure_hybrid(layer, routes, build_policy(cache, spec), order="recency",
                                   admission=admission)
        expected = ref.ensure_hybrid(layer, routes, build_policy(ref, spec), order="recency",
                                     admission=admission)
        assert_same_plan(plan, expected, f"step {step}")
        if step % 17 == 0:
            cache.forget_slot(step % S)
            ref.forget_slot(step % S)
        assert_same_caches(cache, ref, f"step {step}")
        assert int(cache.state.step) <= 20 + 1
