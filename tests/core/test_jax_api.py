"""The JAX API surface, what only the JAX functions have: route shapes and dtypes, traced layers
and policies (no recompiles), the static enums, the two backend functions against brute force,
the split without int32 overflow, the clock's dense-rank renumbering, host-side byte counts.
The cache's rules themselves are in test_rules.py and test_policy.py, on every adapter."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pallas_cache as pc
from pallas_cache import clock
from pallas_cache import selection
from pallas_cache.kernels import dispatch as backends
from pallas_cache.policy import admit_promote_one
from pallas_cache.reference import ReferencePolicy

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


ROUTE_WIDTH = 8


def ids(*values):
    """Routes padded with -1 to a common width, so most tests share one compiled step."""
    values = list(values) + [-1] * (ROUTE_WIDTH - len(values))
    return jnp.asarray(values, jnp.int32)


def resident_slots(state):
    return int((state.residency.id_of_slot >= 0).sum())


def valid(array, count):
    return np.asarray(array)[: int(count)].tolist()


SPLIT = jax.jit(pc.FetchPolicy.split)


@given(f=st.integers(0, 65536), missing=st.integers(0, 2**31 - 1), cap=st.integers(0, 2**31 - 1))
def test_the_split_matches_its_definition_without_overflow(f, missing, cap):
    """FAILS with the direct int32 formula: M * f overflows as soon as M >= 32768."""
    policy = pc.FetchPolicy(jnp.int32(f), jnp.int32(cap))
    expected = ReferencePolicy(fraction16=f, cap=cap).split(missing)
    assert int(SPLIT(policy, jnp.int32(missing))) == expected
    assert 0 <= expected <= missing
    if f:
        assert abs(expected - f / 65536 * missing) <= 1


def test_enums_accept_their_string_values_and_reject_others():
    assert pc.FetchOrder.coerce("lowest_id") is pc.FetchOrder.LOWEST_ID
    assert pc.Admission.coerce("REUSE") is pc.Admission.REUSE
    with pytest.raises(ValueError, match="sideways"):
        pc.ensure_hybrid(pc.init(1, 2, 2), 0, ids(0), pc.FetchPolicy.full(), order="sideways")
    with pytest.raises(ValueError, match="promote_two"):
        pc.ensure_hybrid(pc.init(1, 2, 2), 0, ids(0), pc.FetchPolicy.full(), admission="promote_two")


def test_changing_the_fraction_never_recompiles():
    state = pc.init(2, 4, 8)
    traces = []

    @jax.jit
    def step(state, policy):
        traces.append(1)
        return pc.ensure_hybrid(state, 0, ids(0, 1, 2), policy)

    for q in (0.1, 0.4, 0.9):
        state, _ = step(state, pc.FetchPolicy.fraction(q))
    state, _ = step(state, pc.FetchPolicy.fixed_cap(2))
    assert len(traces) == 1


def brute_force_victims(usage, step, n):
    order = sorted((s for s in range(len(usage)) if usage[s] != step), key=lambda s: (usage[s], s))
    return order[:n]


SELECT_VICTIMS = jax.jit(selection.select_victims, static_argnames=("num_out",))


@jax.jit
def promote_one_after(usage, id_of_slot, step, recency, miss, fraction16, num_fetch):
    """The step's PROMOTE_ONE on one layer's vectors: the misses in recency order (the fetch
    order's), the victims in LRU order, the shared rule of pallas_cache.policy deciding."""
    num_out = min(miss.shape[0], usage.shape[0])
    experts = selection.first_in_order(~recency, miss, num_out)
    recs = jnp.where(experts >= 0, recency[jnp.maximum(experts, 0)], -1)
    victims = selection.select_victims(usage, step, num_out, num_out=num_out)
    occupants = jnp.where(victims >= 0, id_of_slot[jnp.maximum(victims, 0)], -1)
    return admit_promote_one(fraction16 > 0, num_fetch, experts, recs, victims, occupants,
                             first=lambda v: v[0])


stamps = st.one_of(st.integers(-3, 6), st.sampled_from([INT32_MIN, INT32_MAX]))


@given(size=st.sampled_from([1, 5, 12]), step=st.one_of(st.integers(-1, 6), st.just(INT32_MAX)),
       data=st.data())
def test_select_victims_is_n_repeated_argmins(size, step, data):
    usage = data.draw(st.lists(stamps, min_size=size, max_size=size), label="usage")
    num_out = size if size < 12 else 4  # a few static shapes, so a few compilations
    n = data.draw(st.integers(0, num_out), label="n")
    got = SELECT_VICTIMS(jnp.asarray(usage, jnp.int32), jnp.int32(step), jnp.int32(n), num_out=num_out)
    expected = brute_force_victims(usage, step, n)
    assert np.asarray(got).tolist() == expected + [-1] * (num_out - len(expected))


SMALLEST_VALUES = jax.jit(selection.smallest_values, static_argnames=("num_out",))


@given(size=st.sampled_from([1, 7, 300]), data=st.data())
def test_smallest_values_are_the_sorted_candidates(size, data):
    """FAILS if ``smallest_values`` returns positions instead of values on the two-level path
    (300 entries), drops the largest admissible value ``INT32_MAX - 1``, or misses the -1 fill
    past the candidates."""
    values = data.draw(st.lists(st.integers(0, INT32_MAX - 1), min_size=size, max_size=size,
                                unique=True), label="values")
    if data.draw(st.booleans(), label="largest"):
        values[0] = INT32_MAX - 1 if INT32_MAX - 1 not in values[1:] else values[0]
    candidate = data.draw(st.lists(st.booleans(), min_size=size, max_size=size), label="candidate")
    num_out = min(size, 3)
    got = SMALLEST_VALUES(jnp.asarray(values, jnp.int32), jnp.asarray(candidate), num_out=num_out)
    expected = sorted(v for v, c in zip(values, candidate) if c)[:num_out]
    assert np.asarray(got).tolist() == expected + [-1] * (num_out - len(expected))


def brute_force_promotion(usage, id_of_slot, step, recency, miss, fraction16, num_fetch):
    misses = [e for e in range(len(miss)) if miss[e]]
    if not (fraction16 > 0 and num_fetch == 0 and misses):
        return -1, -1
    first = sorted(misses, key=lambda e: (-recency[e], e))[0]
    victims = brute_force_victims(usage, step, 1)
    if not victims or id_of_slot[victims[0]] != -1 or recency[first] < 0:
        return -1, -1
    return first, victims[0]


@given(data=st.data())
def test_the_shared_promote_one_rule_is_the_promote_one_rule(data):
    """FAILS if the rule both backends call (policy.admit_promote_one) promotes without a
    fraction policy, with F > 0, into an occupied slot, or a miss never routed before, or
    misses a promotion the brute force makes."""
    S = data.draw(st.sampled_from([1, 8]))
    E = data.draw(st.sampled_from([1, 6]))
    usage = data.draw(st.lists(st.integers(0, 5), min_size=S, max_size=S))
    id_of_slot = data.draw(st.lists(st.integers(-1, 3), min_size=S, max_size=S))
    recency = data.draw(st.lists(st.integers(-1, 5), min_size=E, max_size=E))
    miss = data.draw(st.lists(st.booleans(), min_size=E, max_size=E))
    step = data.draw(st.integers(0, 5))
    fraction16 = data.draw(st.sampled_from([0, 1, 26214, 65536]))
    num_fetch = data.draw(st.integers(0, 2))
    got = promote_one_after(
        jnp.asarray(usage, jnp.int32), jnp.asarray(id_of_slot, jnp.int32), jnp.int32(step),
        jnp.asarray(recency, jnp.int32), jnp.asarray(miss), jnp.int32(fraction16), jnp.int32(num_fetch))
    promoted = brute_force_promotion(usage, id_of_slot, step, recency, miss, fraction16,
                                     num_fetch) != (-1, -1)
    assert int(got) == (1 if promoted else num_fetch)


def test_backend_resolution():
    expected = "pallas" if jax.default_backend() == "gpu" else "xla"
    assert backends.resolve_backend(None) == expected
    with pytest.raises(ValueError, match="cuda"):
        backends.resolve_backend("cuda")
    with pytest.raises(ValueError, match="triton"):
        pc.ensure(pc.init(1, 2, 2), 0, ids(0), backend="triton")


def test_routes_of_any_shape_come_back_in_that_shape():
    state = pc.init(2, 4, 8)
    routes = jnp.asarray([[0, 1, -1], [1, 3, 3]], jnp.int32)
    state, plan = pc.ensure_hybrid(state, 1, routes, pc.FetchPolicy.fraction(0.5))
    chex.assert_shape([plan.slots, plan.cpu], (2, 3))
    chex.assert_shape([plan.copy.dst_slots, plan.copy.src_rows], (4,))
    chex.assert_type([plan.slots, plan.copy.dst_slots, plan.active, plan.error], jnp.int32)
    chex.assert_type(plan.cpu, jnp.bool_)
    assert int(plan.slots[0, 2]) == -1 and not bool(plan.cpu[0, 2]), "padding gets neither"
    assert int(plan.slots[1, 1]) == int(plan.slots[1, 2]) and bool(plan.cpu[1, 1]) == bool(plan.cpu[1, 2])


def test_a_batch_larger_than_e_has_copy_arrays_of_length_e():
    state = pc.init(1, 3, 3)
    state, plan = pc.ensure(state, 0, ids(2, 2, 1, 1, 0, 0, -1, 2))
    chex.assert_shape([plan.copy.dst_slots, plan.copy.src_rows], (3,))
    assert int(plan.copy.count) == 3 and int(plan.active) == 3


def test_an_empty_or_all_padding_batch_is_a_call_that_touches_nothing():
    state = pc.init(1, 3, 3)
    state, plan = pc.ensure(state, 0, jnp.zeros((0,), jnp.int32))
    chex.assert_shape([plan.copy.dst_slots], (0,))
    assert int(state.step) == 1 and pc.stats(state).calls == 1 and pc.stats(state).active == 0
    state, plan = pc.ensure_hybrid(state, 0, ids(-1, -1), pc.FetchPolicy.fraction(0.4))
    assert (np.asarray(plan.slots) == -1).all() and not np.asarray(plan.cpu).any()


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int64, np.uint32])
def test_any_integer_dtype_is_accepted(dtype):
    state = pc.init(1, 4, 4)
    _, plan = pc.ensure(state, np.int64(0), np.asarray([1, 2], dtype))
    assert valid(plan.copy.src_rows, plan.copy.count) == [1, 2]


def test_the_layer_is_traced_never_static():
    traces = []

    @jax.jit
    def step(state, layer):
        traces.append(1)
        return pc.ensure(state, layer, ids(0, 1))

    state = pc.init(3, 4, 8)
    for layer in (0, 1, 2, 1):
        state, plan = step(state, jnp.int32(layer))
    assert len(traces) == 1
    assert resident_slots(state) == 6


def test_jit_and_eager_agree():
    state = pc.init(3, 4, 8)
    jitted = jax.jit(pc.ensure_hybrid, static_argnames=("order", "admission", "backend"))
    eager_state, jit_state = state, state
    rng = np.random.default_rng(3)
    for step in range(12):
        layer, routes = int(rng.integers(3)), jnp.asarray(rng.integers(-1, 4, 5), jnp.int32)
        policy = pc.FetchPolicy.fraction(float(rng.random()))
        eager_state, eager_plan = pc.ensure_hybrid(eager_state, layer, routes, policy)
        jit_state, jit_plan = jitted(jit_state, layer, routes, policy)
        chex.assert_trees_all_equal(eager_state, jit_state)
        chex.assert_trees_all_equal(eager_plan, jit_plan)


def test_dense_rank_keeps_sentinels_and_every_order():
    usage = jnp.asarray([0, 50, INT32_MIN, 70, 50, 90], jnp.int32)
    recency = jnp.asarray([[-1, 60, 90], [50, -1, 10]], jnp.int32)
    new_usage, new_recency, new_step = clock.dense_rank_stamps(usage, recency, jnp.int32(95))
    assert np.asarray(new_usage).tolist() == [0, 2, INT32_MIN, 4, 2, 5]
    assert np.asarray(new_recency).tolist() == [[-1, 3, 5], [2, -1, 1]]
    assert int(new_step) == 6


def test_entry_bytes_do_not_overflow_int32():
    state = pc.begin_prefill(pc.init(2, 8, 16))
    huge = 2**30
    state, plan = pc.prefetch_prefill_layer(state, 0, (huge,))
    assert plan.entry_bytes((huge,))[0] == 8 * huge
