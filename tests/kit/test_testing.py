"""pallas_cache.testing, the users' toolkit: each strategy draws what it promises (and reaches
every case it names), each assertion names the first difference, and check_plan rejects each
kind of wrong plan while passing every plan the library makes."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis.errors import NoSuchExample
from hypothesis import strategies as st

import pallas_cache as pc
from pallas_cache import testing as pct
from pallas_cache.testing import strategies as pcst

DEEP = os.environ.get("PALLAS_CACHE_PROFILE", "ci") == "deep"
# find() must reach each case within this many examples, deterministically; no shrinking (the
# first example found is enough, and shrinking a sequence is the slow part).
FIND = settings(database=None, derandomize=True, max_examples=2000, phases=[Phase.generate],
                suppress_health_check=list(HealthCheck))
# Drawing only (no compile): cheap, so many examples even in the ci profile.
DRAWS = settings(max_examples=300 if DEEP else 60, deadline=None)


def reaches(strategy, condition):
    """Whether ``strategy`` draws an example satisfying ``condition`` (hypothesis.find)."""
    return find(strategy, condition, settings=FIND) is not None


# ---- strategies --------------------------------------------------------------------------------


@DRAWS
@given(pcst.geometries())
def test_geometries_are_valid(geometry):
    """FAILS if a drawn geometry is one init refuses (S < E, C < S) or leaves its bounds."""
    assert 1 <= geometry.num_layers <= 4 and 1 <= geometry.num_experts <= 8
    assert geometry.num_experts <= geometry.cache_size <= geometry.capacity
    assert geometry.capacity - geometry.cache_size <= 4
    assert geometry.eviction in {e.value for e in pc.Eviction}
    assert 1 <= geometry.history <= 8


def test_geometries_reach_every_case():
    """FAILS on a naive geometry strategy that draws C == S always (never a spare capacity),
    S > E always (never a pool of exactly one layer), or one eviction only."""
    geometries = pcst.geometries()
    assert reaches(geometries, lambda g: g.capacity > g.cache_size)
    assert reaches(geometries, lambda g: g.cache_size == g.num_experts)
    assert reaches(geometries, lambda g: g.cache_size >= 2 * g.num_experts)
    for eviction in pc.Eviction:
        assert reaches(geometries, lambda g, e=eviction.value: g.eviction == e)
    assert reaches(pcst.histories(), lambda w: w == 8)
    state = pct.Geometry(2, 3, 4, 6, eviction="route_knn", history=5).init()
    assert (state.num_layers, state.num_experts, state.capacity) == (2, 3, 6)
    assert int(state.cache_size) == 4 and pc.Eviction(state.eviction) is pc.Eviction.ROUTE_KNN


@DRAWS
@given(st.data())
def test_routes_stay_in_range_unless_bad_ids_are_asked_for(data):
    """FAILS if routes() draws an id outside [-1, E) without bad_ids, a shape other than the
    one asked, padding with padding=False, or a duplicate with duplicates=False."""
    E = data.draw(st.integers(1, 8))
    shape = data.draw(st.sampled_from([None, (2, 2), (3,)]))
    r = data.draw(pcst.routes(E, shape=shape))
    assert r.dtype == np.int32 and np.all((r >= -1) & (r < E))
    if shape is not None:
        assert r.shape == shape
    plain = data.draw(pcst.routes(E, padding=False))
    assert np.all(plain >= 0)
    distinct = data.draw(pcst.routes(E, duplicates=False, shape=(min(E, 3),)))
    real = distinct[distinct >= 0]
    assert len(set(real.tolist())) == real.size


def test_routes_reach_padding_duplicates_and_bad_ids():
    """FAILS on a naive routes strategy that never pads, never repeats an expert, or never
    draws a bad id when asked (or draws one when not)."""
    assert reaches(pcst.routes(4), lambda r: np.any(r == -1))
    assert reaches(pcst.routes(4), lambda r: np.unique(r[r >= 0]).size < np.sum(r >= 0))
    assert reaches(pcst.routes(4, bad_ids=True), lambda r: np.any((r < -1) | (r >= 4)))
    assert reaches(pcst.routes(4, bad_ids=True), lambda r: np.any(r == 2**31 - 1))
    with pytest.raises(ValueError, match="experts"):
        find(pcst.routes(2, shape=(3,), padding=False, duplicates=False), lambda r: True)


def test_fetch_policies_reach_every_kind_and_stay_valid():
    """FAILS on a naive policy strategy that draws one kind (fractions only), never an edge
    (0 or 1), or builds a policy other than the one its spec names."""
    specs = pcst.policy_specs()
    for kind in ("fraction", "fixed_cap", "full"):
        assert reaches(specs, lambda p, k=kind: p.kind == k)
    assert reaches(specs, lambda p: p.kind == "fraction" and p.value == 0.0)
    assert reaches(specs, lambda p: p.kind == "fraction" and p.value == 1.0)
    assert reaches(specs, lambda p: p.kind == "fixed_cap" and p.value == 0)
    built = pct.PolicySpec("fraction", 0.415).build()
    pct.assert_plans_equal(built, pc.FetchPolicy.fraction(0.415))
    pct.assert_plans_equal(pct.PolicySpec("fixed_cap", 3).build(), pc.FetchPolicy.fixed_cap(3))
    assert reaches(pcst.fetch_policies(), lambda p: int(p.cap) > 0)


def test_fetch_rules_offer_reuse_only_where_the_eviction_allows_it():
    """FAILS if fetch_rules draws admission="reuse" for an eviction that refuses it (every call
    would raise), or never draws it under LRU, or misses an order."""
    assert reaches(pcst.fetch_rules(), lambda r: r.admission == "reuse")
    assert reaches(pcst.fetch_rules(), lambda r: r.order == "lowest_id")
    for eviction in ("pair_lfu", "route_knn", "route_lfu"):
        with pytest.raises(NoSuchExample):
            find(pcst.fetch_rules(eviction), lambda r: r.admission == "reuse", settings=FIND)


@DRAWS
@given(st.data())
def test_operations_stay_in_range_unless_bad_values_are_asked_for(data):
    """FAILS if operations() draws a layer, id or size the cache refuses without bad_values,
    or a prefill operation on a pool that cannot lend the buffers (it raises, not refuses)."""
    geometry = data.draw(pcst.geometries())
    L, E, C = geometry.num_layers, geometry.num_experts, geometry.capacity
    for op in data.draw(pcst.operations(geometry)):
        if hasattr(op, "layer"):
            assert 0 <= op.layer < L, op
        if hasattr(op, "routes"):
            assert all(-1 <= r < E for r in op.routes), op
        if isinstance(op, pct.Forget):
            assert 0 <= op.slot < C
        if isinstance(op, pct.Resize):
            assert E <= op.cache_size <= C
        if isinstance(op, (pct.BeginPrefill, pct.PrefetchPrefill, pct.ReleasePrefill)):
            assert C >= 2 * E
        if isinstance(op, pct.EnsureHybrid) and geometry.eviction != "lru":
            assert op.admission != "reuse"
    only = data.draw(pcst.operations(geometry, kinds=["ensure", "resize"]))
    assert all(isinstance(op, (pct.Ensure, pct.Resize)) for op in only)


def test_operations_reach_every_kind_and_bad_values():
    """FAILS on a naive sequence strategy that leaves out a kind (resize, prefill...), or never
    draws a bad value when asked."""
    geometry = pct.Geometry(2, 2, 4, 6)
    kinds = [pct.Ensure, pct.EnsureHybrid, pct.Materialize, pct.Forget, pct.Resize, pct.Reset,
             pct.BeginPrefill, pct.PrefetchPrefill, pct.ReleasePrefill]
    for kind in kinds:
        assert reaches(pcst.operations(geometry),
                       lambda ops, k=kind: any(isinstance(op, k) for op in ops))
    assert reaches(pcst.operations(geometry, bad_values=True),
                   lambda ops: any(getattr(op, "layer", 0) >= 2 for op in ops))
    assert reaches(pcst.operations(geometry, bad_values=True),
                   lambda ops: any(isinstance(op, pct.Resize) and op.cache_size > 6 for op in ops))
    with pytest.raises(ValueError, match="unknown operation kinds"):
        find(pcst.operations(geometry, kinds=["ensure", "flush"]), lambda ops: True)


@settings(max_examples=40 if DEEP else 6, deadline=None)
@given(st.data())
def test_every_plan_of_a_random_sequence_passes_check_plan(data):
    """FAILS if check_plan rejects a plan the library makes (a check stricter than the rules),
    or an operation record does not run: random sequences of every kind, bad values included,
    on small geometries."""
    geometry = data.draw(pcst.geometries(max_layers=2, max_experts=3, max_extra_slots=3,
                                         eviction=pcst.evictions(["lru", "pair_lfu"])))
    ops = data.draw(pcst.operations(geometry, bad_values=True, max_size=8, max_routes=4))
    state = geometry.init()
    for op in ops:
        new_state, plan = pct.run_operation(state, op)
        if isinstance(op, (pct.Ensure, pct.EnsureHybrid)):
            pct.check_plan(state, op.layer, np.asarray(op.routes, np.int64), plan, new_state)
        else:
            pct.check_state(new_state)
        state = new_state


# ---- assertions --------------------------------------------------------------------------------


def _two_states():
    state = pc.init(2, 4, 6, eviction="pair_lfu")
    a, _ = pc.ensure(state, 0, np.array([1, 2]))
    b, _ = pc.ensure(state, 0, np.array([1, 3]))
    return a, b


def test_assert_states_equal_names_the_first_differing_field_and_index():
    """FAILS on a naive comparison that raises without saying where (chex-style "trees differ"),
    names a later field than the first in tree order, or drops the index."""
    a, b = _two_states()
    pct.assert_states_equal(a, a)
    with pytest.raises(AssertionError) as failure:
        pct.assert_states_equal(a, b)
    # Expert 2 is resident in a, expert 3 in b: residency.slot_for_id is the first leaf, [0, 2]
    # its first differing entry.
    assert str(failure.value).startswith("states differ at .residency.slot_for_id[0, 2]: ")
    assert "first of 2 differing entries" in str(failure.value)
    bumped = a.replace(eviction_state=a.eviction_state.replace(
        freq=a.eviction_state.freq.at[1, 3].add(1)))
    with pytest.raises(AssertionError, match=r"\.eviction_state\.freq\[1, 3\]: 0 != 1$"):
        pct.assert_states_equal(a, bumped)


def test_assert_states_equal_compares_static_fields_shapes_and_batches():
    """FAILS on a naive comparison of leaves alone (two states of different eviction policies
    but the same leaves would pass), or one that crashes on a shape mismatch or a batch."""
    lru = pc.init(1, 2, 2)
    fake = dataclasses.replace(lru, eviction=pc.Eviction.ROUTE_KNN)
    with pytest.raises(AssertionError, match=r"\.eviction \(static\)"):
        pct.assert_states_equal(lru, fake)
    with pytest.raises(AssertionError, match=r"\.id_of_slot: shape \(2,\) != \(3,\)"):
        pct.assert_states_equal(lru, pc.init(1, 2, 2, capacity=3))
    a, b = _two_states()
    with pytest.raises(AssertionError, match=r"\.slot_for_id\[1, 0, 2\]"):
        pct.assert_states_equal(pc.stack_states([a, a]), pc.stack_states([a, b]))


def test_assert_plans_equal_names_the_field_and_the_static_geometry():
    """FAILS on a naive plan comparison that misses the copy plan's static geometry (a plan
    for another pool), or names the wrong field."""
    state = pc.init(2, 4, 6)
    _, plan = pc.ensure(state, 0, np.array([1, 2, 2, -1]))
    pct.assert_plans_equal(plan, plan)
    hand = plan.replace(copy=plan.copy.replace(num_slots=None))
    with pytest.raises(AssertionError, match=r"plans differ at \.copy\.num_slots \(static\)"):
        pct.assert_plans_equal(plan, hand)
    other = plan.replace(slots=plan.slots.at[2].set(5))
    with pytest.raises(AssertionError, match=r"plans differ at \.slots\[2\]: 1 != 5$"):
        pct.assert_plans_equal(plan, other)


# ---- check_plan --------------------------------------------------------------------------------


def _hybrid_call():
    """A call with a hit (expert 1), a fetched miss and a CPU miss, duplicates and padding."""
    state = pc.init(2, 4, 6)
    state, _ = pc.ensure(state, 0, np.array([1]))
    routes = np.array([[1, 2], [3, 2], [-1, 3]], np.int32)
    after, plan = pc.ensure_hybrid(state, 0, routes, pc.FetchPolicy.fixed_cap(1),
                                   admission="none")
    return state, routes, plan, after


def test_check_plan_passes_the_librarys_plans():
    state, routes, plan, after = _hybrid_call()
    assert int(plan.fetched) == 1 and int(plan.missing) == 2 and bool(plan.cpu.any())
    pct.check_plan(state, 0, routes, plan, after)
    bad = np.array([1, 9], np.int32)
    refused_state, refused = pc.ensure(state, 0, bad)
    pct.check_plan(state, 0, bad, refused, refused_state)
    pct.check_plan(state, 5, routes, *reversed(pc.ensure(state, 5, routes)))


def _tampered(plan, **fields):
    return plan.replace(**fields)


@pytest.mark.parametrize("tamper, message", [
    # a route to both a slot and the CPU
    (lambda p, r: _tampered(p, cpu=p.cpu.at[0, 0].set(True)), "exactly one of a slot"),
    # a route to neither
    (lambda p, r: _tampered(p, slots=p.slots.at[0, 0].set(-1)), "exactly one of a slot"),
    # padding given a slot
    (lambda p, r: _tampered(p, slots=p.slots.at[2, 0].set(0)), "padding route 4"),
    # one duplicate of expert 2 answered differently
    (lambda p, r: _tampered(p, slots=p.slots.at[1, 1].set(-1), cpu=p.cpu.at[1, 1].set(True)),
     "duplicate routes"),
    # a copy into a slot outside the usable pool
    (lambda p, r: _tampered(p, copy=p.copy.replace(dst_slots=p.copy.dst_slots.at[0].set(6))),
     "outside the usable"),
    # a copy over this call's hit (expert 1 sits in slot 0)
    (lambda p, r: _tampered(p, copy=p.copy.replace(dst_slots=p.copy.dst_slots.at[0].set(0))),
     "holds a hit"),
    # a copy of an expert that was not routed
    (lambda p, r: _tampered(p, copy=p.copy.replace(src_rows=p.copy.src_rows.at[0].set(0))),
     "not a routed expert that missed"),
    # a copy entry past count left filled
    (lambda p, r: _tampered(p, copy=p.copy.replace(count=p.copy.count - 1)), "past count"),
    # counts that do not add up
    (lambda p, r: _tampered(p, active=p.active + 1), "plan.active"),
    (lambda p, r: _tampered(p, missing=p.missing - 1), "plan.missing"),
    (lambda p, r: _tampered(p, error=p.error | pc.ERR_LAYER), "error bits"),
])
def test_check_plan_rejects_each_kind_of_wrong_plan(tamper, message):
    """FAILS if check_plan lets through a plan that breaks one rule (each case one naive
    check_plan: one that skips that rule)."""
    state, routes, plan, after = _hybrid_call()
    with pytest.raises(AssertionError, match=message):
        pct.check_plan(state, 0, routes, tamper(plan, routes), after)


def test_check_plan_rejects_wrong_state_changes():
    """FAILS if check_plan accepts a state that counted the call wrong, moved an untouched
    expert, or a refused call that changed the state."""
    state, routes, plan, after = _hybrid_call()
    wrong_stats = after.replace(stats=after.stats.at[0, 1].add(1))
    with pytest.raises(AssertionError, match="stats row 0 grew"):
        pct.check_plan(state, 0, routes, plan, wrong_stats)
    other_layer = after.replace(stats=after.stats.at[1, 0].add(1))
    with pytest.raises(AssertionError, match="stats of layer 1 changed"):
        pct.check_plan(state, 0, routes, plan, other_layer)
    no_tick = after.replace(clock=after.clock.replace(step=after.step + 1))
    with pytest.raises(AssertionError, match="step went from"):
        pct.check_plan(state, 0, routes, plan, no_tick)
    bad = np.array([1, 9], np.int32)
    _, refused = pc.ensure(state, 0, bad)
    with pytest.raises(AssertionError, match="a refused call changed the state"):
        pct.check_plan(state, 0, bad, refused, after)
    broken = after.replace(residency=after.residency.replace(
        id_of_slot=after.residency.id_of_slot.at[0].set(-1)))
    with pytest.raises(AssertionError, match="state_after: slot_for_id"):
        pct.check_plan(state, 0, routes, plan, broken)


# ---- assert_lockstep ---------------------------------------------------------------------------


@settings(max_examples=40 if DEEP else 4, deadline=None)
@given(geometry=pcst.geometries(max_layers=3, max_experts=6), data=st.data())
@pytest.mark.parametrize("backend, jit, bad_values", [("xla", False, False),
                                                      ("xla", True, True),
                                                      ("interpret", True, False)])
def test_assert_lockstep_passes_on_random_sequences(backend, jit, bad_values, geometry, data):
    """FAILS if the reference and the library part on any drawn sequence (any backend, eager or
    under jit, refused values included), or if the comparison sees a difference where none is."""
    sequence = data.draw(pcst.operations(geometry, max_size=8, bad_values=bad_values))
    assert pct.assert_lockstep(sequence, geometry=geometry, backend=backend,
                               jit=jit) == len(sequence)


NO_EVICTION = pct.Geometry(1, 4, 4, 4)  # every expert fits: no step's plan reads ``usage``
MID_SEQUENCE = [pct.Ensure(0, (0, 1)), pct.Ensure(0, (1,)), pct.Ensure(0, (2, 1)), pct.Reset()]


def _break_ensure(monkeypatch, routes, change):
    """Make the library's ensure of exactly ``routes`` return ``change(state, plan)``."""
    real = pc.ensure

    def broken(state, layer, ids, **kwargs):
        state, plan = real(state, layer, ids, **kwargs)
        return change(state, plan) if tuple(np.asarray(ids).tolist()) == routes else (state, plan)

    monkeypatch.setattr(pc, "ensure", broken)


def _plus_one(array, index):
    return array.at[index].add(1)


def _naive_lockstep(sequence, geometry, *, plans_only=False, at_end=False):
    """The naive variants: compare the plans only, or only the last step's plan and state."""
    from pallas_cache.testing.lockstep import _reference_step
    truth, state = pc.reference.init(1, 4, 4, capacity=4), geometry.init()
    for index, op in enumerate(sequence):
        truth, expected = _reference_step(truth, op)
        state, plan = pct.run_operation(state, op)
        if at_end and index < len(sequence) - 1:
            continue
        pairs = [(expected, plan)] + ([] if plans_only else [(truth, state)])
        for a, b in pairs:
            assert pct.record_difference(a, b) is None, f"op {index}"


def test_assert_lockstep_names_the_step_operation_and_state_field(monkeypatch):
    """FAILS if a state that differs only between two steps (``usage`` bumped at step 1, cleared
    by the reset of step 3; no plan reads it) goes unseen: comparing only plans or only the last
    step (both shown passing here) misses it."""
    _break_ensure(monkeypatch, (1,), lambda s, p: (s.replace(residency=s.residency.replace(
        usage=_plus_one(s.residency.usage, 1))), p))
    _naive_lockstep(MID_SEQUENCE, NO_EVICTION, plans_only=True)
    _naive_lockstep(MID_SEQUENCE, NO_EVICTION, at_end=True)
    with pytest.raises(AssertionError) as failure:
        pct.assert_lockstep(MID_SEQUENCE, geometry=NO_EVICTION)
    assert str(failure.value) == ("op 1 Ensure(layer=0, routes=(1,)) on xla: states differ at "
                                  ".residency.usage[1]: 2 != 3 (reference != library)")


def test_assert_lockstep_names_the_plan_field(monkeypatch):
    """FAILS if a wrong plan at step 2 is reported at another step, as a state difference, or
    without the plan's field and index."""
    _break_ensure(monkeypatch, (2, 1), lambda s, p: (s, dataclasses.replace(p, slots=_plus_one(p.slots, 1))))
    with pytest.raises(AssertionError, match=r"^op 2 Ensure\(layer=0, routes=\(2, 1\)\) on interpret: "
                       r"plans differ at \.slots\[1\]: 1 != 2 \(reference != library\)$"):
        pct.assert_lockstep(MID_SEQUENCE, geometry=NO_EVICTION, backend="interpret")


def test_assert_lockstep_sees_a_different_eviction():
    """FAILS if the library's and the reference's eviction are not compared (a geometry whose
    eviction the library runs differently from the one the reference is given)."""
    class Mismatch(pct.Geometry):
        def init(self):
            return pc.init(1, 2, 2, capacity=2, eviction="pair_lfu")

    with pytest.raises(AssertionError, match=r"^op 0 Reset\(\) on xla: states differ at "
                       r"\.eviction: 'lru' != 'pair_lfu'"):
        pct.assert_lockstep([pct.Reset()], geometry=Mismatch(1, 2, 2, 2))


def test_record_difference_reads_across_the_reference_and_the_library():
    """FAILS if an int64 reference against the int32 library, or the ring as bools against
    bitmask words, count as differences; or if a value difference is not named."""
    for eviction in ("lru", "route_knn"):
        ours = pc.init(2, 3, 4, eviction=eviction, history=5)
        theirs = pc.reference.init(2, 3, 4, eviction=eviction, history=5)
        assert pct.record_difference(theirs, ours, "state") is None
    theirs.residency.usage[2] = 7
    assert pct.record_difference(theirs, ours, "state") == "state.residency.usage[2]: 7 != 0"


def test_each_operation_record_runs_its_own_operation_on_both_sides():
    """FAILS if the one dispatch of the records (``apply_operation``) runs a record as another
    operation or skips it: a symmetric mistake there would pass every lockstep comparison, so
    each record's result is checked against the library's and the reference's own call."""
    from pallas_cache import reference
    from pallas_cache.testing import operations as ops

    # A ring eviction collecting routing, so that every record below changes the state.
    options = {"eviction": "route_knn", "history": 2}
    lib = pc.set_collect_routing(pc.init(2, 4, 6, **options), True)
    ref = reference.set_collect_routing(reference.init(2, 4, 6, **options), True)
    lib, _ = pc.ensure(lib, 0, np.array([1, 2], np.int32))
    ref, _ = reference.ensure(ref, 0, np.array([1, 2], np.int64))
    slot = int(np.asarray(lib.residency.slot_for_id)[0, 1])
    cases = [(ops.Forget(slot=slot), lambda s: pc.forget_slot(s, slot),
              lambda s: reference.forget_slot(s, slot)),
             (ops.Resize(cache_size=4), lambda s: pc.resize(s, 4),
              lambda s: reference.resize(s, 4)),
             (ops.Materialize(layer=1), lambda s: pc.materialize_layer(s, 1),
              lambda s: reference.materialize_layer(s, 1)),
             (ops.Reset(), lambda s: (pc.reset(s), None), lambda s: (reference.reset(s), None)),
             (ops.ResetStats(), lambda s: (pc.reset_stats(s), None),
              lambda s: (reference.reset_stats(s), None)),
             (ops.ResetRouting(), lambda s: (pc.reset_routing(s), None),
              lambda s: (reference.reset_routing(s), None)),
             (ops.SetCollectRouting(on=False), lambda s: (pc.set_collect_routing(s, False), None),
              lambda s: (reference.set_collect_routing(s, False), None)),
             (ops.StartToken(), lambda s: (pc.evictions.start_token(s), None),
              lambda s: (reference.start_token(s), None)),
             (ops.Rebuild(cache_size=5, capacity=7),
              lambda s: (pc.rebuild(s, 5, capacity=7), None),
              lambda s: (reference.rebuild(s, 5, capacity=7), None))]
    for record, on_lib, on_ref in cases:
        got, want = pct.run_operation(lib, record), on_lib(lib)
        pct.assert_states_equal(got[0], want[0])
        assert pct.record_difference(got[0], lib) is not None, record  # it did something
        got_ref = ops.apply_operation(reference, ref, record,
                                      routes=lambda r: np.asarray(r, np.int64),
                                      policy=lambda spec: None)
        assert pct.record_difference(got_ref[0], on_ref(ref)[0]) is None, record


# ---- the kit accepts and refuses exactly what the library does ---------------------------------


GEOMETRY = pct.Geometry(2, 4, 6, 6)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("sequence", [
    [pct.Ensure(0, (2**31, 1)), pct.Ensure(0, (1, 2))],
    [pct.Ensure(0, (2**64 - 1, 1))],
    [pct.Ensure(2**31, (0, 1)), pct.Materialize(-(2**40))],
    [pct.Resize(2**32 + 4), pct.Forget(2**40), pct.Ensure(0, (1,))],
    [pct.EnsureHybrid(2**31, (2**31, 0), pct.PolicySpec("full")), pct.ReleasePrefill(2**33)],
])
def test_assert_lockstep_runs_values_outside_int32_as_the_library_refuses_them(jit, sequence):
    """FAILS on NumPy's OverflowError (``np.asarray((2**31, 1), np.int32)`` in the kit, or
    ``jnp.int32(2**31)`` under ``jit=True``) instead of comparing the two sides' plans: the
    library refuses each of these with an error bit, as the reference does, eager or jitted."""
    assert pct.assert_lockstep(sequence, geometry=GEOMETRY, jit=jit) == len(sequence)


@pytest.mark.parametrize("jit", [False, True])
def test_assert_lockstep_compares_the_two_sides_refusals(jit):
    """FAILS if ``Ensure(0, (1.7, 1))`` passes as expert 1 on both sides (the kit cast the float
    to int32) while ``pc.ensure`` raises TypeError on a float id: both sides must refuse it, and
    the sequence goes on from the unchanged states."""
    sequence = [pct.Ensure(0, (1, 2)), pct.Ensure(0, (1.7, 1)), pct.Ensure(1, (True, 1)),
                pct.Ensure(0, (3,))]
    with pytest.raises(TypeError):
        pc.ensure(pc.init(2, 4, 6), 0, (1.7, 1))
    with pytest.raises(TypeError):
        pct.run_operation(pc.init(2, 4, 6), pct.Ensure(0, (1.7, 1)))
    assert pct.assert_lockstep(sequence, geometry=GEOMETRY, jit=jit) == 4


@pytest.mark.parametrize("jit", [False, True])
def test_assert_lockstep_sees_a_float_id_the_library_refuses_eager_or_jitted(monkeypatch, jit):
    """FAILS if the kit casts ``(1.7, 1)`` to int32 for the library (eager or under ``jit``),
    so a reference that truncates floats (patched in here) and the library look alike."""
    from pallas_cache import reference

    exact = reference.ensure
    monkeypatch.setattr(reference, "ensure", lambda state, layer, ids: exact(
        state, layer, np.asarray(ids, np.int64)))
    with pytest.raises(AssertionError, match=r"^op 0 Ensure\(layer=0, routes=\(1.7, 1\)\) on "
                       r"xla.*: the library refused it \(TypeError: .*\) but the reference ran"):
        pct.assert_lockstep([pct.Ensure(0, (1.7, 1))], geometry=GEOMETRY, jit=jit)


@pytest.mark.parametrize("jit", [False, True])
def test_assert_lockstep_runs_the_bookkeeping_records_and_a_rejected_rebuild(jit):
    """FAILS if the stats, routing, token and rebuild records do not run on both sides (eager or
    jitted), or if a rebuild below one layer, which each side refuses with its own
    ``RebuildRejected`` (the reference's is a twin, not the library's class), counts as refused
    differently."""
    sequence = [pct.Ensure(0, (1, 2)), pct.SetCollectRouting(True), pct.Ensure(1, (0, 3)),
                pct.StartToken(), pct.Ensure(1, (2,)), pct.ResetStats(), pct.ResetRouting(),
                pct.Rebuild(3), pct.Ensure(0, (1,)), pct.Rebuild(5, capacity=6),
                pct.Ensure(1, (3, 0))]
    geometry = pct.Geometry(2, 4, 6, 6, eviction="route_knn", history=2)
    assert pct.assert_lockstep(sequence, geometry=geometry, jit=jit) == len(sequence)


def test_assert_lockstep_names_a_refusal_on_one_side_only(monkeypatch):
    """FAILS if a library that refuses what the reference runs crashes the comparison instead of
    failing it with the step and both sides' outcomes."""
    def refuse(state, layer, routes, **options):
        raise ValueError("refused here")

    monkeypatch.setattr(pc, "ensure", refuse)
    with pytest.raises(AssertionError, match=r"^op 0 Ensure\(layer=0, routes=\(1,\)\) on xla: "
                       r"the library refused it \(ValueError: refused here\) but the reference "
                       r"ran it$"):
        pct.assert_lockstep([pct.Ensure(0, (1,))], geometry=GEOMETRY)
    with pytest.raises(TypeError, match=r"sequence\[1\] is not an operation record"):
        pct.assert_lockstep([pct.Reset(), "reset"], geometry=GEOMETRY)


@pytest.mark.parametrize("routes", [np.array([2**64 - 1, 1], np.uint64), [2**64 - 1, 1],
                                    np.array([2**32, 1], np.int64)])
def test_check_plan_reads_wide_ids_as_the_library_does(routes):
    """FAILS if check_plan reads uint64 ``2**64 - 1`` as -1 (padding) and blames the library for
    refusing it ("error bits 1 ..., expected 0"), or refuses the Python list
    ``[2**64 - 1, 1]`` as "dtype float64": the library refuses the id (ERR_EXPERT_ID), and so
    does the check."""
    state = pc.init(2, 4, 6)
    after, plan = pc.ensure(state, 0, routes)
    assert int(plan.error) == pc.errors.ERR_EXPERT_ID
    pct.check_plan(state, 0, routes, plan, after)
    after, plan = pc.ensure(state, 2**40, [1])
    pct.check_plan(state, 2**40, [1], plan, after)


def test_an_unknown_policy_kind_is_refused_when_the_spec_is_made():
    """FAILS if ``PolicySpec("half")`` is made and ends later in an AttributeError inside the
    reference's policy class."""
    with pytest.raises(ValueError, match=r"unknown policy kind 'half'; expected one of fraction, "
                                         r"fixed_cap, full"):
        pct.PolicySpec("half")
    assert pct.PolicySpec("fixed_cap", 2).build() == pc.FetchPolicy.fixed_cap(2)


def test_operations_of_prefill_alone_on_a_small_capacity_say_why():
    """FAILS on hypothesis's "one_of() ... has no values" (at draw time) where
    ``kinds=["prefill"]`` meets a capacity below 2E: a ValueError naming prefill and the
    capacity, when the strategy is made."""
    with pytest.raises(ValueError, match=r"prefill needs a capacity of at least 2E = 8 slots.*"
                                         r"capacity 6"):
        pcst.operations(GEOMETRY, kinds=["prefill"])
    with pytest.raises(ValueError, match="kinds is empty"):
        pcst.operations(GEOMETRY, kinds=[])
    with pytest.raises(TypeError, match="kinds must be a sequence"):
        pcst.operations(GEOMETRY, kinds="ensure")
    # with another kind, prefill is left out on such a capacity, as documented
    ops = find(pcst.operations(GEOMETRY, kinds=["prefill", "reset"]), lambda ops: True,
               settings=FIND)
    assert all(isinstance(op, pct.Reset) for op in ops)


def test_a_geometry_init_refuses_is_refused_when_made_and_so_is_an_unknown_backend():
    """FAILS if ``Geometry(2, 4, 2, 2)`` (a pool below one layer) is made and its strategy ends
    in hypothesis's "Cannot have max_value=2 < min_value=4", or an unknown backend is reported
    as the library refusing an ensure (audit of the testing kit)."""
    with pytest.raises(ValueError, match="cache_size 2 cannot hold one layer of 4 experts"):
        pct.Geometry(2, 4, 2, 2)
    with pytest.raises(ValueError, match="capacity 5 is below cache_size 6"):
        pct.Geometry(2, 4, 6, 5)
    with pytest.raises(TypeError, match="num_layers must be an integer"):
        pct.Geometry(2.0, 4, 6, 6)
    with pytest.raises(ValueError, match="unknown eviction 'nope'"):
        pct.Geometry(2, 4, 6, 6, eviction="nope")
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        pct.assert_lockstep([pct.Ensure(0, (1,))], geometry=GEOMETRY, backend="nope")
