"""Bad input (docs/semantics.md §6, docs/design.md): clear errors, and nothing lost.

Value errors (known only on device) must return the input state **unchanged** -- not even the
clock moves, and no rebase happens -- with the matching error bit in an otherwise empty plan,
eagerly and under ``jit``. Static misuse must raise at call/trace time naming the offending
value. ``check`` turns error bits into a readable exception; ``checked`` does it under ``jit``
through ``checkify``.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import pallas_cache as pc

L, E, S = 2, 4, 8
BIG_BANK = 512 * 1024

JIT = {
    "ensure": jax.jit(pc.ensure, static_argnames=("backend",)),
    "ensure_hybrid": jax.jit(pc.ensure_hybrid, static_argnames=("order", "admission", "backend")),
    "materialize_layer": jax.jit(pc.materialize_layer),
    "forget_slot": jax.jit(pc.forget_slot),
    "prefetch_prefill_layer": jax.jit(pc.prefetch_prefill_layer, static_argnames=("bank_feat_bytes",)),
}


def op(mode, name):
    return JIT[name] if mode == "jit" else getattr(pc, name)


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


def assert_refused(before, after, plan, bits):
    assert int(plan.error) == bits
    chex.assert_trees_all_equal(after, before)  # every leaf, the clock included


def assert_empty_ensure_plan(plan, shape, width):
    chex.assert_shape([plan.slots, plan.cpu], shape)
    assert (np.asarray(plan.slots) == -1).all() and not np.asarray(plan.cpu).any()
    chex.assert_shape([plan.copy.dst_slots, plan.copy.src_rows], (width,))
    assert (np.asarray(plan.copy.dst_slots) == -1).all() and (np.asarray(plan.copy.src_rows) == -1).all()
    assert [int(plan.copy.count), int(plan.active), int(plan.missing), int(plan.fetched)] == [0, 0, 0, 0]


MODES = ["eager", "jit"]


# ---- value errors: bits, state unchanged ------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad_id", [E, E + 7, -2, -(2**31)])
def test_an_expert_id_outside_the_layer_sets_err_expert_id(mode, bad_id):
    state = warm_state()
    routes = ids(0, bad_id, 1)
    after, plan = op(mode, "ensure")(state, 0, routes)
    assert_refused(state, after, plan, pc.ERR_EXPERT_ID)
    assert_empty_ensure_plan(plan, (8,), E)
    after, plan = op(mode, "ensure_hybrid")(state, 0, routes, pc.FetchPolicy.fraction(0.4))
    assert_refused(state, after, plan, pc.ERR_EXPERT_ID)
    assert_empty_ensure_plan(plan, (8,), E)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad_layer", [-1, L, 1000])
def test_a_layer_outside_the_model_sets_err_layer(mode, bad_layer):
    state = warm_state()
    layer = jnp.int32(bad_layer) if mode == "jit" else bad_layer
    after, plan = op(mode, "ensure")(state, layer, ids(0, 1))
    assert_refused(state, after, plan, pc.ERR_LAYER)
    after, plan = op(mode, "ensure_hybrid")(state, layer, ids(0, 1), pc.FetchPolicy.full())
    assert_refused(state, after, plan, pc.ERR_LAYER)
    after, plan = op(mode, "materialize_layer")(state, layer)
    assert_refused(state, after, plan, pc.ERR_LAYER)
    assert (np.asarray(plan.copy.dst_slots) == -1).all() and int(plan.copy.count) == 0


@pytest.mark.parametrize("mode", MODES)
def test_every_failing_check_sets_its_bit(mode):
    state = warm_state()
    after, plan = op(mode, "ensure_hybrid")(state, L, ids(0, E), pc.FetchPolicy.fraction(0.4))
    assert_refused(state, after, plan, pc.ERR_EXPERT_ID | pc.ERR_LAYER)
    after, plan = op(mode, "prefetch_prefill_layer")(state, -1, bank_feat_bytes=(BIG_BANK,))
    assert_refused(state, after, plan, pc.ERR_LAYER | pc.ERR_PREFILL_NOT_BEGUN)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad_slot", [-1, S, S + 100])
def test_forgetting_a_slot_outside_the_pool_sets_err_slot(mode, bad_slot):
    state = warm_state()
    after, plan = op(mode, "forget_slot")(state, bad_slot)
    assert_refused(state, after, plan, pc.ERR_SLOT)
    assert int(plan.old) == -1


@pytest.mark.parametrize("mode", MODES)
def test_staging_without_begin_prefill_sets_err_prefill_not_begun(mode):
    state = warm_state()
    after, plan = op(mode, "prefetch_prefill_layer")(state, 0, bank_feat_bytes=(BIG_BANK,))
    assert_refused(state, after, plan, pc.ERR_PREFILL_NOT_BEGUN)
    assert int(plan.transfers.count) == 0 and int(plan.gather.count) == 0 and int(plan.runs.count) == 0
    assert not bool(plan.already_loaded)


@pytest.mark.parametrize("mode", MODES)
def test_staging_into_an_unreleased_buffer_sets_err_prefill_busy(mode):
    state = pc.begin_prefill(warm_state())
    state, plan = op(mode, "prefetch_prefill_layer")(state, 0, bank_feat_bytes=(BIG_BANK,))
    assert int(plan.error) == 0
    # Layer 0 is staged in buffer 0 and not released; layer 2 would reuse the buffer -- but the
    # model has 2 layers, so build a wider one for this.
    wide = pc.begin_prefill(pc.init(4, E, 16))
    wide, _ = op(mode, "prefetch_prefill_layer")(wide, 0, bank_feat_bytes=(BIG_BANK,))
    after, plan = op(mode, "prefetch_prefill_layer")(wide, 2, bank_feat_bytes=(BIG_BANK,))
    assert_refused(wide, after, plan, pc.ERR_PREFILL_BUSY)
    assert int(plan.transfers.count) == 0 and int(plan.gather.count) == 0
    released = pc.release_prefill_layer(wide, 0)
    _, plan = op(mode, "prefetch_prefill_layer")(released, 2, bank_feat_bytes=(BIG_BANK,))
    assert int(plan.error) == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_refused_call_neither_advances_nor_rebases_the_clock(mode):
    state = warm_state(rebase_threshold=2)  # step is 2: the next accepted call renumbers
    assert int(state.step) >= 2
    after, plan = op(mode, "ensure")(state, 0, ids(E))
    assert_refused(state, after, plan, pc.ERR_EXPERT_ID)
    after, plan = op(mode, "materialize_layer")(state, 5)
    assert_refused(state, after, plan, pc.ERR_LAYER)


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
