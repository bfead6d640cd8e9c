"""apply_copy_plan / moe_combine refuse a pool or bank of another geometry (docs/semantics.md §5.13).

The plan knows (statically) the pool size and experts per layer it was made for; a mismatch is a
shape error, so it raises at trace time naming both shapes instead of dropping or misdirecting
copies silently.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_cache as pc
from pallas_cache.testing import moe_combine, moe_dense

L, E, S, H = 2, 8, 16, 4


def _plan():
    state = pc.init(L, E, S)
    state, plan = pc.ensure(state, 0, jnp.array([6, 7]))
    return plan


def _expert(weights, x):
    return weights * x


def test_a_pool_with_fewer_slots_than_the_plan_is_refused():
    """FAILS if a 4-row pool for an S=16 plan is accepted: it wrote 0 of 2 copies, no error."""
    plan = _plan()
    bank = jnp.arange(E * H, dtype=jnp.float32).reshape(E, H)
    with pytest.raises(ValueError, match=r"pool of 16 slots.*\(4, 4\)"):
        pc.apply_copy_plan(jnp.zeros((4, H)), bank, plan)
    with pytest.raises(ValueError, match="pool of 16 slots"):
        jax.jit(pc.apply_copy_plan).trace(jnp.zeros((4, H)), bank, plan)


def test_a_bank_with_fewer_experts_than_the_plan_is_refused():
    """FAILS if a 4-row bank for E=8 is accepted: experts 6 and 7 were both read from row 3."""
    plan = _plan()
    with pytest.raises(ValueError, match=r"8 experts per layer.*\(4, 4\)"):
        pc.apply_copy_plan(jnp.zeros((S, H)), jnp.ones((4, H)), plan)
    with pytest.raises(ValueError, match=r"8 experts per layer.*\(2, 4, 4\)"):
        pc.apply_copy_plan(jnp.zeros((S, H)), jnp.ones((L, 4, H)), plan, layer=0)


def test_moe_combine_refuses_mismatched_geometry_and_matches_dense_when_right():
    """FAILS if moe_combine accepts a short pool (it returned 0.0 where the dense MoE gives the
    real output), or if the check rejects a matching geometry."""
    plan = _plan()
    bank = jnp.arange(E * H, dtype=jnp.float32).reshape(E, H) + 1
    pool = pc.apply_copy_plan(jnp.zeros((S, H)), bank, plan)
    x = jnp.ones((1, H))
    ids, gates = jnp.array([[6, 7]]), jnp.array([[0.5, 0.5]])
    np.testing.assert_allclose(moe_combine(x, ids, gates, plan, pool, bank, _expert),
                               moe_dense(x, ids, gates, bank, _expert))
    with pytest.raises(ValueError, match="pool of 16 slots"):
        moe_combine(x, ids, gates, plan, pool[:4], bank, _expert)
    with pytest.raises(ValueError, match="8 experts per layer"):
        moe_combine(x, ids, gates, plan, pool, bank[:4], _expert)


def test_a_hand_built_copy_plan_carries_no_geometry_and_is_not_checked():
    """FAILS if a CopyPlan built by hand (no geometry) is refused."""
    copy = pc.CopyPlan(dst_slots=jnp.array([1, -1]), src_rows=jnp.array([2, -1]),
                       count=jnp.int32(1))
    pool = pc.apply_copy_plan(jnp.zeros((4, H)), jnp.ones((3, H)), copy)
    assert float(pool[1].sum()) == H


def test_a_hand_built_copy_plan_is_checked_entry_by_entry_against_the_shapes():
    """FAILS if a hand-built plan (no geometry) with src_rows = 9 on an E = 8 bank copies row 7
    (a clamped gather), or one with dst_slots = 20 on a 16-slot pool is dropped without a word."""
    bank = jnp.arange(E * H, dtype=jnp.float32).reshape(E, H)
    rows = pc.CopyPlan(dst_slots=jnp.array([3, -1]), src_rows=jnp.array([9, -1]),
                       count=jnp.int32(1))
    with pytest.raises(ValueError, match=r"src_rows\[0\] = 9 is outside \[0, 8\)"):
        pc.apply_copy_plan(jnp.zeros((S, H)), bank, rows)
    slots = pc.CopyPlan(dst_slots=jnp.array([20, -1]), src_rows=jnp.array([2, -1]),
                        count=jnp.int32(1))
    with pytest.raises(ValueError, match=r"dst_slots\[0\] = 20 is outside \[0, 16\)"):
        pc.apply_copy_plan(jnp.zeros((S, H)), bank, slots)
    traced = jax.jit(pc.apply_copy_plan)(jnp.zeros((S, H)), bank, rows)
    np.testing.assert_array_equal(traced, jnp.zeros((S, H)))  # traced: nothing, not row 7
