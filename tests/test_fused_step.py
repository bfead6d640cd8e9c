"""The fused step kernel (kernels/step.py) under the interpreter against the XLA step, whole states
and plans after every call: vmap over distinct caches, a scan of layer-calls with a traced layer,
the in-kernel clock rebase, the blocked pool scan, capacity above the usable size and a resize.

The XLA step is itself held to the NumPy reference by the lockstep suite (tests/test_lockstep.py,
which also runs the interpret adapter), so equality here is equality with the reference. Small
geometries and one compile per case keep the interpreter cheap.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_cache as pc
from pallas_cache.kernels import step as fused
from pallas_cache.ops import Rules

RULES = [("recency", "promote_one"), ("recency", "reuse"), ("lowest_id", "none")]


def assert_trees_equal(a, b, context):
    for i, (x, y) in enumerate(zip(jax.tree.leaves(a), jax.tree.leaves(b))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{context}, leaf {i}")
    assert jax.tree.structure(a) == jax.tree.structure(b), context


def random_calls(rng, num_calls, num_layers, num_experts, width):
    layers = rng.integers(0, num_layers, num_calls).astype(np.int32)
    layers[rng.random(num_calls) < 0.05] = num_layers  # a refused call now and then
    routes = rng.integers(-1, num_experts, (num_calls, width)).astype(np.int32)
    return jnp.asarray(layers), jnp.asarray(routes)


def hybrid(backend, order, admission):
    return jax.jit(functools.partial(pc.ensure_hybrid, order=order, admission=admission,
                                     backend=backend))


@pytest.mark.parametrize("eviction", ["lru", "pair_lfu"])
@pytest.mark.parametrize("order,admission", RULES)
def test_a_low_rebase_threshold_steps_in_lockstep(order, admission, eviction):
    """FAILS if the in-kernel rebase is skipped, runs when not due, reads a stamp it already
    renumbered as a fresh one, or stamps the touched entries with the old clock: with threshold
    4 nearly every call renumbers, and state and plan must equal the XLA step's."""
    if admission == "reuse" and eviction != "lru":
        pytest.skip("REUSE needs LRU")
    L, E, S, C = 3, 5, 9, 11
    state = pc.init(L, E, S, capacity=C, rebase_threshold=4, eviction=eviction)
    state = pc.set_collect_routing(state, True)
    ours, theirs = hybrid("interpret", order, admission), hybrid("xla", order, admission)
    policy = pc.FetchPolicy.fraction(0.5)
    a = b = state
    layers, routes = random_calls(np.random.default_rng(3), 30, L, E, 4)
    for call in range(30):
        (a, plan_a), (b, plan_b) = (ours(a, layers[call], routes[call], policy),
                                    theirs(b, layers[call], routes[call], policy))
        assert_trees_equal((a, plan_a), (b, plan_b), f"call {call}")
    assert int(a.step) < 20, "the clock was renumbered (28 or so accepted calls ran)"


def test_vmap_over_distinct_caches_and_policies():
    """FAILS if the batching of the kernel mixes programs (one cache's state or policy read by
    another's program) or the aliased state leaves are not per cache."""
    L, E, S = 2, 6, 8
    rng = np.random.default_rng(5)
    states = [pc.init(L, E, S, rebase_threshold=int(t)) for t in (5, 9, 1000)]
    state = jax.tree.map(lambda *x: jnp.stack(x), *states)
    policy = jax.tree.map(lambda *x: jnp.stack(x), *(pc.FetchPolicy.fraction(q)
                                                     for q in (0.0, 0.5, 1.0)))
    step = {b: jax.jit(jax.vmap(functools.partial(pc.ensure_hybrid, backend=b)))
            for b in ("interpret", "xla")}
    a = b = state
    for call in range(12):
        layer = jnp.asarray(rng.integers(0, L, 3), jnp.int32)
        routes = jnp.asarray(rng.integers(-1, E, (3, 3)), jnp.int32)
        (a, plan_a), (b, plan_b) = (step["interpret"](a, layer, routes, policy),
                                    step["xla"](b, layer, routes, policy))
        assert_trees_equal((a, plan_a), (b, plan_b), f"call {call}")


@pytest.mark.parametrize("eviction", ["lru", "pair_lfu"])
def test_a_scan_of_layer_calls_with_a_traced_layer(eviction):
    """FAILS if the kernel reads or writes another layer's rows than the traced one, or its state
    does not carry from one scan iteration to the next."""
    L, E, S = 4, 5, 9
    layers, routes = random_calls(np.random.default_rng(11), 24, L, E, 3)
    state = pc.init(L, E, S, rebase_threshold=15, eviction=eviction)
    policy = pc.FetchPolicy.fraction(0.4)

    def run(backend):
        def body(s, x):
            s, plan = pc.ensure_hybrid(s, x[0], x[1], policy, backend=backend)
            return s, plan
        return jax.jit(lambda s: lax.scan(body, s, (layers, routes)))(state)

    assert_trees_equal(run("interpret"), run("xla"), eviction)


@pytest.mark.parametrize("eviction", ["lru", "pair_lfu"])
def test_the_blocked_pool_scan_equals_one_block(eviction):
    """FAILS if the victim scan over several blocks (the GPU path for pools above 4096 slots)
    combines its blocks wrongly: a later block must win only with a strictly smaller key. Here
    the pool is scanned in blocks of 4 slots."""
    L, E, S, C = 3, 4, 13, 16
    state = pc.init(L, E, S, capacity=C, eviction=eviction)
    rules = Rules.of(hybrid=True, order="recency", admission="promote_one")
    policy = pc.FetchPolicy.full()
    blocked = jax.jit(lambda s, l, r: fused.fused_step(s, l, r, policy, rules, interpret=True,
                                                       block=4))
    whole = jax.jit(lambda s, l, r: fused.fused_step(s, l, r, policy, rules, interpret=True))
    layers, routes = random_calls(np.random.default_rng(2), 30, L, E, 3)
    a = b = state
    for call in range(30):
        out_a, out_b = blocked(a, layers[call], routes[call]), whole(b, layers[call], routes[call])
        assert_trees_equal(out_a, out_b, f"call {call}")
        a, b = out_a[0], out_b[0]


def test_ensure_after_a_resize_and_capacity_above_the_size():
    """FAILS if the kernel takes a victim at or past the usable size (the unusable tail has the
    smallest usage), before or after a shrink and a regrow."""
    L, E, S, C = 2, 4, 6, 10
    state = pc.init(L, E, S, capacity=C)
    ours = jax.jit(functools.partial(pc.ensure, backend="interpret"))
    theirs = jax.jit(functools.partial(pc.ensure, backend="xla"))
    layers, routes = random_calls(np.random.default_rng(8), 24, L, E, 3)
    a = b = state
    for call in range(24):
        if call in (8, 16):
            size = 4 if call == 8 else 10
            a, b = pc.resize(a, size)[0], pc.resize(b, size)[0]
        (a, plan_a), (b, plan_b) = (ours(a, layers[call], routes[call]),
                                    theirs(b, layers[call], routes[call]))
        assert_trees_equal((a, plan_a), (b, plan_b), f"call {call}")
        assert int(jnp.max(a.id_of_slot[int(a.cache_size):], initial=-1)) == -1


def test_a_refused_call_writes_nothing():
    """FAILS if a call with an expert id out of range writes any state leaf (the kernel's
    stores are all gated by the error bits) or returns a non-empty plan."""
    state = pc.init(2, 4, 6, rebase_threshold=1)
    state, _ = pc.ensure(state, 0, jnp.asarray([0, 1]), backend="interpret")
    after, plan = pc.ensure_hybrid(state, 1, jnp.asarray([2, 4]), pc.FetchPolicy.full(),
                                   backend="interpret")
    assert int(plan.error) == pc.errors.ERR_EXPERT_ID
    assert_trees_equal(after, state, "refused")
    assert int(plan.copy.count) == 0 and not bool(jnp.any(plan.cpu))
    assert bool(jnp.all(plan.slots == -1)) and bool(jnp.all(plan.copy.dst_slots == -1))


def test_routes_in_several_chunks(monkeypatch):
    """FAILS if the kernel's route chunks (many routes: the ``[routes, E]`` comparisons are cut
    into chunks of at most ``_PAIR_BLOCK`` pairs) drop, repeat or misplace a route in the
    histogram row, the duplicate collapse or the per-route plan. Here every chunk is 2 routes."""
    monkeypatch.setattr(fused, "_PAIR_BLOCK", 16)
    L, E, S = 2, 5, 7
    state = pc.set_collect_routing(pc.init(L, E, S), True)
    policy = pc.FetchPolicy.fraction(0.5)
    ours, theirs = hybrid("interpret", "recency", "promote_one"), hybrid("xla", "recency",
                                                                          "promote_one")
    layers, routes = random_calls(np.random.default_rng(4), 12, L, E, 11)
    a = b = state
    for call in range(12):
        (a, plan_a), (b, plan_b) = (ours(a, layers[call], routes[call], policy),
                                    theirs(b, layers[call], routes[call], policy))
        assert_trees_equal((a, plan_a), (b, plan_b), f"call {call}")
