"""A FetchPolicy can never produce negative or impossible counts (docs/semantics.md §5.3).

Concrete out-of-range fields are refused at construction in both implementations; traced ones
(which the constructor cannot see) are clamped by the split, so a policy built by hand inside a
jitted function behaves like the nearest valid one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_cache as pc
from pallas_cache.reference import ReferencePolicy

BAD_FIELDS = [(0, -3), (-1, 0), (65537, 0), (2**31 - 1, 0)]


@pytest.mark.parametrize("fraction16,cap", BAD_FIELDS)
@pytest.mark.parametrize("wrap", [jnp.int32, np.int32, lambda v: np.array([5, v], np.int64)],
                         ids=["jax", "numpy", "stacked"])
def test_concrete_out_of_range_fields_are_refused_at_construction(fraction16, cap, wrap):
    """FAILS if FetchPolicy(jnp.int32(0), jnp.int32(-3)) is accepted (it yielded
    fetched == copy.count == -3 and negative counters)."""
    bad = cap if cap < 0 else fraction16
    with pytest.raises(ValueError, match=str(bad)):
        pc.FetchPolicy(wrap(fraction16), wrap(cap))


@pytest.mark.parametrize("fraction16,cap", BAD_FIELDS)
def test_reference_policy_refuses_out_of_range_fields(fraction16, cap):
    """FAILS if ReferencePolicy(0, -3) is accepted (negative fetch counts)."""
    with pytest.raises(ValueError, match="ReferencePolicy"):
        ReferencePolicy(fraction16, cap)
    with pytest.raises(TypeError):
        ReferencePolicy(True, 0)


def test_pytree_rebuilds_and_vmap_axis_specs_pass_through():
    """FAILS if the constructor validation breaks vmap in_axes (ints/None) or tracers."""
    axes = pc.FetchPolicy(0, None)  # an in_axes spec, not a policy
    policies = jax.tree.map(lambda *x: jnp.stack(x), pc.FetchPolicy.fraction(0.5),
                            pc.FetchPolicy.fixed_cap(2))
    state = pc.init(2, 8, 16)
    ids = jnp.array([0, 1, 2, 3])
    out = jax.vmap(lambda p: pc.ensure_hybrid(state, 0, ids, p)[1].fetched,
                   in_axes=(axes,))(pc.FetchPolicy(policies.fraction16, jnp.int32(1)))
    assert out.tolist() == [2, 1]  # fraction 0.5 of 4 misses; the shared cap 1 for f == 0


@pytest.mark.parametrize("fraction16,cap,equivalent", [
    (-5, -3, pc.FetchPolicy.fixed_cap(0)),
    (0, -3, pc.FetchPolicy.fixed_cap(0)),
    (70000, 0, pc.FetchPolicy.full()),
    (2**31 - 1, -1, pc.FetchPolicy.full()),
])
def test_traced_out_of_range_fields_are_clamped(fraction16, cap, equivalent):
    """FAILS if a traced policy is used unclamped: negative or > M fetches, negative counters."""
    @jax.jit
    def run(f, c):
        policy = pc.FetchPolicy(f, c)  # traced: the constructor cannot check it
        state = pc.init(2, 8, 16)
        state, plan = pc.ensure_hybrid(state, 0, jnp.array([0, 1, 2]), policy)
        state, plan = pc.ensure_hybrid(state, 1, jnp.array([4, 5, 6, 7]), policy)
        return state, plan

    state, plan = run(jnp.int32(fraction16), jnp.int32(cap))
    ref_state = pc.init(2, 8, 16)
    ref_state, _ = pc.ensure_hybrid(ref_state, 0, jnp.array([0, 1, 2]), equivalent)
    ref_state, ref_plan = pc.ensure_hybrid(ref_state, 1, jnp.array([4, 5, 6, 7]), equivalent)
    assert 0 <= int(plan.fetched) == int(plan.copy.count) <= int(plan.missing)
    assert np.all(np.asarray(state.stats) >= 0)
    for a, b in zip(jax.tree.leaves((state, plan)), jax.tree.leaves((ref_state, ref_plan))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
