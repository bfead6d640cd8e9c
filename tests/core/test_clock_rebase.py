"""The int32 clock (docs/semantics.md §5.12) on every adapter of conftest.py: a rebased run
makes exactly the decisions of an unrebased one, a cache just below the threshold runs across
it, and the rebase keeps the sentinels."""

from __future__ import annotations

import random

import jax.numpy as jnp
import numpy as np
import pytest

from tests.harness import PROFILE, assert_invariants, assert_same, steps
from pallas_cache import reference
from pallas_cache.testing.operations import Ensure, EnsureHybrid, Forget, Materialize, PolicySpec
from pallas_cache.state import Clock


# ---- the int32 clock (docs/semantics.md §5.12) ------------------------------------------------


POLICIES = {"fraction": PolicySpec("fraction", 0.4), "fixed_cap": PolicySpec("fixed_cap", 1),
            "full": PolicySpec("full")}


def random_ops(seed, num_layers, num_experts, cache_size, steps):
    """A reproducible list of mixed decode operation records (those that advance the clock)."""
    rng = random.Random(seed)
    ops = []
    for _ in range(steps):
        layer = rng.randrange(num_layers)
        routes = [rng.randrange(-1, num_experts) for _ in range(rng.randint(1, 6))]
        kind = rng.random()
        if kind < 0.3:
            ops.append(Ensure(layer, routes))
        elif kind < 0.9:
            ops.append(EnsureHybrid(layer, routes,
                                    POLICIES[rng.choice(["fraction", "fixed_cap", "full"])],
                                    rng.choice(["recency", "lowest_id"]),
                                    rng.choice(["promote_one", "none", "reuse"])))
        elif kind < 0.95:
            ops.append(Materialize(layer))
        else:
            ops.append(Forget(rng.randrange(num_layers * num_experts) % cache_size))
    return ops


def same_order(a, b):
    """Whether two stamp vectors order every pair the same way (<, ==, >)."""
    return np.array_equal(np.sign(a[:, None] - a[None, :]), np.sign(b[:, None] - b[None, :]))


def stamps(state):
    return np.concatenate([state.residency.usage, state.routing.recency.ravel(), [state.step]]).astype(np.int64)


@pytest.mark.parametrize("seed", range(4))
def test_a_rebased_run_makes_exactly_the_decisions_of_an_unrebased_one(adapter, seed):
    """FAILS if the rebase renumbers usage and recency separately (recency-vs-usage comparisons of
    REUSE flip) or maps live stamps onto the sentinels 0 / -1."""
    if adapter.is_jax and seed and PROFILE != "deep":
        pytest.skip("ci profile: one sequence per JAX adapter (the lockstep suite crosses rebases too)")
    ops = random_ops(seed, num_layers=3, num_experts=5, cache_size=8,
                     steps=400 if not adapter.is_jax else 150)
    plain = adapter.cache(3, 5, 8)
    rebased = adapter.cache(3, 5, 8, rebase_threshold=40)
    bound = max(40, 8 + 3 * 5 + 1) + 1
    for i, op in enumerate(ops):
        assert_same(plain.apply(op), rebased.apply(op), f"op {i} {op}")
        a, b = plain.state, rebased.state
        np.testing.assert_array_equal(a.residency.slot_for_id, b.residency.slot_for_id)
        np.testing.assert_array_equal(a.residency.id_of_slot, b.residency.id_of_slot)
        assert same_order(stamps(a), stamps(b)), f"order changed at op {i}"
        assert b.step <= bound, "stamps stay bounded"
        assert (b.residency.usage[b.residency.id_of_slot >= 0] >= 1).all()
    assert plain.state.step > 100 > bound, "the run crossed the threshold several times"


def shift_clock(cache, offset):
    """Move every live stamp and the clock of ``cache`` forward, as if it had run that long."""
    state = cache.state
    usage, recency = np.asarray(state.residency.usage), np.asarray(state.routing.recency)
    fields = {"usage": np.where(usage >= 1, usage + offset, usage),
              "recency": np.where(recency >= 0, recency + offset, recency),
              "step": np.asarray(int(state.step) + offset)}
    if cache.adapter.is_jax:
        i32 = {k: jnp.asarray(v, jnp.int32) for k, v in fields.items()}
        cache.state = state.replace(
            residency=state.residency.replace(usage=i32["usage"]),
            routing=state.routing.replace(recency=i32["recency"]), clock=Clock(step=i32["step"]))
    else:
        cache.state = reference.copy_state(state)
        cache.state.residency.usage = fields["usage"]
        cache.state.routing.recency = fields["recency"]
        cache.state.clock.step = int(fields["step"])


def test_a_cache_just_below_the_default_threshold_runs_across_it(adapter):
    """FAILS if the clock wraps or if the renumbering changes any decision: the same run from a
    clock shifted to just below 2**30 crosses the threshold and decides exactly as the unshifted
    run, with forgotten slots and never-routed experts alive at the time."""
    # The geometry above: no new compiles.
    ops = random_ops(7, num_layers=3, num_experts=5, cache_size=8, steps=60)
    plain, shifted = adapter.cache(3, 5, 8), adapter.cache(3, 5, 8)
    for op in ops[:20]:
        plain.apply(op)
        shifted.apply(op)
    plain.forget_slot(1)
    shifted.forget_slot(1)
    shift_clock(shifted, 2**30 - 3 - int(shifted.state.step))
    for i, op in enumerate(ops[20:]):
        assert_same(plain.apply(op), shifted.apply(op), f"op {i}")
        assert shifted.state.step < 2**31 - 1
        assert same_order(stamps(plain.state), stamps(shifted.state)), f"order changed at op {i}"
    assert shifted.state.step < 100, "the clock was renumbered"
    np.testing.assert_array_equal(plain.state.residency.id_of_slot, shifted.state.residency.id_of_slot)
    assert_invariants(shifted.state)


@pytest.mark.traced
def test_the_rebase_keeps_the_sentinels(adapter):
    c = adapter.cache(2, 4, 6, rebase_threshold=3)
    c.ensure_hybrid(0, [0, 1], adapter.Policy.full())  # slots 0, 1
    c.ensure(1, [2])  # slot 2
    assert c.forget_slot(1).old == 1
    c.ensure(1, [2])  # step 3: the next call rebases first
    before = c.state.residency.usage
    c.ensure(1, [2])
    state = c.state
    assert before[2] == 3 and state.step == 3, "stamps {1, 3} became {1, 2}, so step 4 became 3"
    assert state.residency.usage[1] == -(2**31), "forgotten stays forgotten"
    assert (state.residency.usage[3:] == 0).all(), "empty stays 0"
    assert state.routing.recency[1, 0] == -1 and state.routing.recency[0, 0] >= 1, "never routed stays -1"

