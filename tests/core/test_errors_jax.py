"""Bad input (docs/semantics.md §6): a value error inside a ``scan`` returns the state unchanged
(test_rules.py holds that rule on every adapter), static misuse raises at call or trace time
naming the value, and ``check`` / ``checked`` turn error bits into a readable exception."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import pallas_cache as pc

L, E, S = 2, 4, 8


def ids(*values):
    values = list(values) + [-1] * (8 - len(values))
    return jnp.asarray(values, jnp.int32)


def warm_state(rebase_threshold=2**30):
    """A cache with history: residents, recency, counters, a histogram."""
    state = pc.set_collect_routing(pc.init(L, E, S, rebase_threshold=rebase_threshold), True)
    state, _ = pc.ensure(state, 0, ids(0, 1, 2))
    state, _ = pc.ensure_hybrid(state, 1, ids(1, 3), pc.FetchPolicy.fraction(0.4))
    state, _ = pc.forget_slot(state, 1)
    return state


# ---- value errors inside a compiled loop ----------------------------------------------------


def test_a_refused_call_inside_a_scan_changes_nothing_and_the_loop_goes_on():
    state = warm_state()
    layers = jnp.asarray([0, 9, 1], jnp.int32)

    def body(state, layer):
        state, plan = pc.ensure_hybrid(state, layer, ids(2, 3), pc.FetchPolicy.fraction(0.5))
        return state, plan.error

    final, errors = jax.jit(lambda s: jax.lax.scan(body, s, layers))(state)
    assert np.asarray(errors).tolist() == [0, pc.ERR_LAYER, 0]
    expected = state
    for layer in (0, 1):
        expected, _ = pc.ensure_hybrid(expected, layer, ids(2, 3), pc.FetchPolicy.fraction(0.5))
    chex.assert_trees_all_equal(final, expected)


# ---- static misuse: raised at call/trace time, naming the value -------------------------------


@pytest.mark.parametrize("routes, match", [
    (np.asarray([0.0, 1.0], np.float32), "float32"),
    (jnp.asarray([0.5, 1.0]), "float32"),
    (np.asarray([True, False]), "bool"),
    ([0.5, 1], "float"),
])
def test_non_integer_routes_raise_type_error(routes, match):
    state = pc.init(L, E, S)
    with pytest.raises(TypeError, match=match):
        pc.ensure(state, 0, routes)
    with pytest.raises(TypeError, match=match):
        jax.jit(pc.ensure_hybrid)(state, 0, jnp.asarray(routes), pc.FetchPolicy.full())


@pytest.mark.parametrize("layer, error, match", [
    (1.5, TypeError, "1.5"), (True, TypeError, "True"), (jnp.float32(1), TypeError, "1"),
    (jnp.asarray([0, 1], jnp.int32), ValueError, r"\(2,\)"), ("0", TypeError, "'0'"),
])
def test_a_layer_or_slot_of_the_wrong_type_or_rank_raises(layer, error, match):
    state = pc.init(L, E, S)
    with pytest.raises(error, match=match):
        pc.ensure(state, layer, ids(0))
    with pytest.raises(error, match=match):
        pc.forget_slot(state, layer)
    with pytest.raises(error, match=match):
        pc.materialize_layer(state, layer)


def test_a_policy_must_be_scalar_integer_fields():
    state = pc.init(L, E, S)
    batched = pc.FetchPolicy(jnp.asarray([1, 2], jnp.int32), jnp.asarray([0, 0], jnp.int32))
    with pytest.raises(ValueError, match=r"\(2,\)"):
        pc.ensure_hybrid(state, 0, ids(0), batched)
    floats = pc.FetchPolicy(jnp.float32(0.4), jnp.int32(0))
    with pytest.raises(TypeError, match="float32"):
        pc.ensure_hybrid(state, 0, ids(0), floats)
    with pytest.raises(TypeError, match="0.4"):
        pc.ensure_hybrid(state, 0, ids(0), 0.4)


@pytest.mark.parametrize("kwargs, match", [
    ({"order": "sideways"}, "sideways"), ({"admission": "promote_two"}, "promote_two"),
    ({"order": 1}, "1"), ({"backend": "cuda"}, "cuda"),
])
def test_unknown_static_options_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pc.ensure_hybrid(pc.init(L, E, S), 0, ids(0), pc.FetchPolicy.full(), **kwargs)


@pytest.mark.parametrize("banks, error, match", [
    ((0,), ValueError, "0"), ((-4,), ValueError, "-4"), ((1.5,), TypeError, "1.5"),
    ((True,), TypeError, "True"), ("abc", TypeError, "abc"), (4096, TypeError, "4096"),
])
def test_bank_sizes_must_be_a_tuple_of_positive_ints(banks, error, match):
    state = pc.begin_prefill(pc.init(L, E, S))
    with pytest.raises(error, match=match):
        pc.prefetch_prefill_layer(state, 0, banks)


def test_geometry_misuse_raises_with_the_values():
    with pytest.raises(ValueError, match="3.*4"):
        pc.init(2, 4, 3)
    with pytest.raises(pc.RebuildRejected, match="3") as rejected:
        pc.rebuild(pc.init(2, 4, 8), 3)
    assert (rejected.value.requested, rejected.value.minimum) == (3, 4)
    with pytest.raises(TypeError, match="8.0"):
        pc.rebuild(pc.init(2, 4, 8), 8.0)
    with pytest.raises(pc.PrefillDoesNotFit, match="7") as too_small:
        pc.begin_prefill(pc.init(2, 4, 7))
    assert isinstance(too_small.value, ValueError)
    with pytest.raises(TypeError, match="'yes'"):
        pc.set_collect_routing(pc.init(2, 4, 8), "yes")
    with pytest.raises(ValueError, match="nan"):
        pc.FetchPolicy.fraction(float("nan"))
    with pytest.raises(ValueError, match="-1"):
        pc.FetchPolicy.fixed_cap(-1)


# ---- check() and the checkify path ------------------------------------------------------------


def test_check_passes_a_clean_plan_through_and_raises_a_readable_error_otherwise():
    state = warm_state()
    _, plan = pc.ensure(state, 0, ids(1))
    assert pc.check(plan) is plan
    _, plan = pc.ensure(state, 7, ids(1, 99))
    with pytest.raises(pc.CacheError) as raised:
        pc.check(plan)
    message = str(raised.value)
    assert "ERR_EXPERT_ID" in message and "ERR_LAYER" in message and "unchanged" in message
    assert raised.value.bits == pc.ERR_EXPERT_ID | pc.ERR_LAYER
    assert isinstance(raised.value, ValueError)
    _, forget = pc.forget_slot(state, -3)
    with pytest.raises(pc.CacheError, match="ERR_SLOT"):
        pc.check(forget)


def test_check_on_a_batched_plan_raises_if_any_member_failed():
    states = jax.tree.map(lambda x: jnp.stack([x, x]), warm_state())
    routes = jnp.stack([ids(0), ids(E)])
    _, plans = jax.vmap(pc.ensure, in_axes=(0, None, 0))(states, 0, routes)
    assert np.asarray(plans.error).tolist() == [0, pc.ERR_EXPERT_ID]
    with pytest.raises(pc.CacheError, match="ERR_EXPERT_ID"):
        pc.check(plans)


def test_checked_raises_under_jit_through_checkify():
    state = warm_state()

    @jax.jit
    def step(state, layer, routes):
        state, plan = pc.ensure(state, layer, routes)
        return state, pc.checked(plan)

    checked_step = checkify.checkify(step)
    err, (after, plan) = checked_step(state, jnp.int32(0), ids(1, 2))
    err.throw()  # a clean call does not raise
    err, (after, plan) = checked_step(state, jnp.int32(0), ids(1, E))
    with pytest.raises(checkify.JaxRuntimeError, match="error bits 1"):
        err.throw()
    chex.assert_trees_all_equal(after, state)
