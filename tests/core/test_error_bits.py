"""Bad values on every adapter of conftest.py (docs/semantics.md §6): an expert id, layer,
slot or prefill call out of range sets its error bit, comes back as an empty plan of the
input's shape and changes nothing (the clock included); static misuse raises with the value."""

from __future__ import annotations

import pytest

from tests.harness import BIG_BANK, assert_same


# ---- bad input: an error bit and nothing changed (docs/semantics.md §6) -----------------------

L, E, S = 3, 4, 12


def busy_cache(adapter, rebase_threshold=None):
    """A cache with history: residents, recency, counters, a histogram, a forgotten slot."""
    c = adapter.cache(L, E, S, rebase_threshold=rebase_threshold)
    c.set_collect_routing(True)
    c.ensure(0, [0, 1, 2])
    c.ensure_hybrid(1, [2, 3], adapter.Policy.fraction(0.5))
    c.forget_slot(1)
    return c


def assert_refused(adapter, call, bits):
    """The call comes back with exactly ``bits`` and every state field, the clock included, as it was."""
    c = busy_cache(adapter)
    before = c.state
    plan = call(c, adapter.Policy)
    assert plan.error == sum(getattr(adapter.errors, name) for name in bits.split("|"))
    assert_same(c.state, before)


@pytest.mark.parametrize("call", [
    lambda c, P: c.ensure(0, [1, E]),
    lambda c, P: c.ensure(0, [0, E + 7, 1]),
    lambda c, P: c.ensure(0, [1, -2]),
    lambda c, P: c.ensure(0, [-(2**31)]),
    lambda c, P: c.ensure_hybrid(1, [[0, 7]], P.fraction(0.4)),
    lambda c, P: c.ensure_hybrid(0, [0, -2], P.fraction(0.4)),
])
def test_an_expert_id_outside_the_layer_sets_err_expert_id_and_changes_nothing(adapter, call):
    """FAILS if a bad id is clipped or dropped instead of refusing the whole call."""
    assert_refused(adapter, call, "ERR_EXPERT_ID")


@pytest.mark.traced
@pytest.mark.parametrize("call", [
    lambda c, P: c.ensure(L, [1]),
    lambda c, P: c.ensure(1000, [1]),
    lambda c, P: c.ensure_hybrid(5, [0], P.full()),
    lambda c, P: c.ensure_hybrid(-1, [0, 1], P.full()),
    lambda c, P: c.materialize_layer(L),
    lambda c, P: c.materialize_layer(-1),
])
def test_a_layer_outside_the_model_sets_err_layer_and_changes_nothing(adapter, call):
    """FAILS if a bad layer is wrapped or clamped (a traced layer cannot raise)."""
    assert_refused(adapter, call, "ERR_LAYER")


@pytest.mark.traced
@pytest.mark.parametrize("slot", [S, S + 100, -1])
def test_forgetting_a_slot_outside_the_pool_sets_err_slot_and_changes_nothing(adapter, slot):
    assert_refused(adapter, lambda c, P: c.forget_slot(slot), "ERR_SLOT")


def test_staging_without_begin_prefill_sets_err_prefill_not_begun_and_changes_nothing(adapter):
    assert_refused(adapter, lambda c, P: c.prefetch_prefill_layer(0, (BIG_BANK,)), "ERR_PREFILL_NOT_BEGUN")


@pytest.mark.traced
@pytest.mark.parametrize("call, bits", [
    (lambda c, P: c.ensure(-1, [9]), "ERR_LAYER|ERR_EXPERT_ID"),
    (lambda c, P: c.ensure_hybrid(L, [0, E], P.fraction(0.4)), "ERR_LAYER|ERR_EXPERT_ID"),
    (lambda c, P: c.prefetch_prefill_layer(7, (BIG_BANK,)), "ERR_LAYER|ERR_PREFILL_NOT_BEGUN"),
    (lambda c, P: c.prefetch_prefill_layer(-1, (BIG_BANK,)), "ERR_LAYER|ERR_PREFILL_NOT_BEGUN"),
])
def test_every_failing_check_sets_its_bit(adapter, call, bits):
    """FAILS if the checks short-circuit: the caller needs every reason at once."""
    assert_refused(adapter, call, bits)


def test_an_error_plan_is_empty_and_keeps_the_input_shape(adapter):
    c = busy_cache(adapter)
    plan = c.ensure_hybrid(1, [[0, 7], [1, 1]], adapter.Policy.fraction(0.4))
    assert plan.slots.shape == (2, 2) and (plan.slots == -1).all() and not plan.cpu.any()
    assert plan.copy.dst_slots.shape == plan.copy.src_rows.shape == (4,)
    assert (plan.copy.dst_slots == -1).all() and (plan.copy.src_rows == -1).all()
    assert (plan.copy.count, plan.active, plan.missing, plan.fetched) == (0, 0, 0, 0)
    plan = c.ensure(0, [0, 1, E])
    assert (plan.slots == -1).all() and (plan.copy.count, plan.active, plan.missing) == (0, 0, 0)
    materialized = c.materialize_layer(L)
    assert (materialized.copy.dst_slots == -1).all() and materialized.copy.count == 0
    assert c.forget_slot(S).old == -1
    staged = c.prefetch_prefill_layer(0, (BIG_BANK,))
    assert (staged.transfers.count, staged.gather.count, staged.runs.count) == (0, 0, 0)
    assert not staged.already_loaded


@pytest.mark.traced
def test_a_refused_call_neither_advances_nor_rebases_the_clock(adapter):
    c = busy_cache(adapter, rebase_threshold=2)  # step >= 2: the next accepted call renumbers
    before = c.state
    assert before.step >= 2
    assert c.ensure(0, [E]).error == adapter.errors.ERR_EXPERT_ID
    assert c.materialize_layer(5).error == adapter.errors.ERR_LAYER
    assert_same(c.state, before)


def test_staging_into_an_unreleased_buffer_is_refused_and_changes_nothing(adapter):
    c = adapter.cache(4, 4, 16)
    c.begin_prefill()
    assert c.prefetch_prefill_layer(0, (BIG_BANK,)).error == 0
    before = c.state
    plan = c.prefetch_prefill_layer(2, (BIG_BANK,))  # buffer 0 still holds layer 0
    assert plan.error == adapter.errors.ERR_PREFILL_BUSY
    assert plan.transfers.count == 0 and plan.gather.count == 0
    assert_same(c.state, before)
    c.release_prefill_layer(0)
    assert c.prefetch_prefill_layer(2, (BIG_BANK,)).error == 0


def test_static_misuse_raises_with_the_value(adapter):
    c = busy_cache(adapter)
    with pytest.raises(TypeError, match="float"):
        c.ensure(0, [1.5])
    with pytest.raises(ValueError, match="'sideways'"):
        c.ensure_hybrid(0, [1], adapter.Policy.full(), order="sideways")
    with pytest.raises(ValueError, match="-3"):
        c.prefetch_prefill_layer(0, (-3,))
    with pytest.raises(adapter.errors.PrefillDoesNotFit, match="cannot lend 16"):
        adapter.cache(2, 8, 12).begin_prefill()

