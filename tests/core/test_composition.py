"""Composition (docs/semantics.md §9): a compiled ``lax.scan`` / ``fori_loop`` decode loop with a
traced layer equals the step-by-step Python loop (final state and stacked plans), and a ``vmap``
over a batch of caches equals a Python loop over them."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_cache as pc

L, E, S, K = 4, 8, 16, 8
TOKENS = 6


def routing_trace(seed, tokens=TOKENS, batch=1):
    """int32[tokens, L, batch * K]: skewed top-k routing with -1 padding, duplicates across rows."""
    rng = np.random.default_rng(seed)
    hot = rng.dirichlet(np.full(E, 0.4), size=L)
    routes = np.empty((tokens, L, batch * K), np.int32)
    for t in range(tokens):
        for layer in range(L):
            for row in range(batch):
                chosen = rng.choice(E, size=K // 2, replace=False, p=hot[layer])
                pad = -np.ones(K - K // 2, np.int32) if rng.random() < 0.3 else rng.choice(E, K - K // 2)
                routes[t, layer, row * K:(row + 1) * K] = np.concatenate([chosen, pad])
    return jnp.asarray(routes)


def stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


@pytest.mark.parametrize("admission", ["promote_one", "reuse"])
def test_a_scanned_decode_loop_equals_the_python_loop(admission):
    routes = routing_trace(0)
    policy = pc.FetchPolicy.fraction(0.4)
    state0 = pc.init(L, E, S)

    def layer_step(state, xs):
        layer, layer_routes = xs
        return pc.ensure_hybrid(state, layer, layer_routes, policy, admission=admission)

    def token_step(state, token_routes):
        return lax.scan(layer_step, state, (jnp.arange(L, dtype=jnp.int32), token_routes))

    scanned_state, scanned_plans = jax.jit(lambda s, r: lax.scan(token_step, s, r))(state0, routes)

    state, plans = state0, []
    for t in range(TOKENS):
        for layer in range(L):
            state, plan = pc.ensure_hybrid(state, layer, routes[t, layer], policy, admission=admission)
            plans.append(plan)
    chex.assert_trees_all_equal(scanned_state, state)
    expected = jax.tree.map(lambda x: x.reshape((TOKENS, L) + x.shape[1:]), stack(plans))
    chex.assert_trees_all_equal(scanned_plans, expected)
    assert pc.stats(scanned_state).calls == TOKENS * L


def test_a_fori_loop_with_plain_ensure_and_materialize_equals_the_python_loop():
    routes = routing_trace(1)[0]  # one token: [L, K]

    def body(layer, state):
        state, _ = pc.materialize_layer(state, (layer + 1) % L)
        state, _ = pc.ensure(state, layer, routes[layer])
        return state

    looped = jax.jit(lambda s: lax.fori_loop(0, L, body, s))(pc.init(L, E, S))
    state = pc.init(L, E, S)
    for layer in range(L):
        state = body(layer, state)
    chex.assert_trees_all_equal(looped, state)


def test_vmap_over_caches_with_different_fractions_equals_a_loop():
    fractions = (0.0, 0.25, 0.4, 1.0)
    policies = stack([pc.FetchPolicy.fraction(q) for q in fractions])
    states = stack([pc.init(L, E, S)] * len(fractions))
    routes = routing_trace(2)

    def sweep_step(states, xs):
        layer, layer_routes = xs
        return jax.vmap(pc.ensure_hybrid, in_axes=(0, None, None, 0))(states, layer, layer_routes, policies)

    layers = jnp.tile(jnp.arange(L, dtype=jnp.int32), TOKENS)
    flat_routes = routes.reshape(TOKENS * L, K)
    final, plans = jax.jit(lambda s: lax.scan(sweep_step, s, (layers, flat_routes)))(states)

    for i, q in enumerate(fractions):
        state, expected_plans = pc.init(L, E, S), []
        for step in range(TOKENS * L):
            state, plan = pc.ensure_hybrid(state, int(layers[step]), flat_routes[step], pc.FetchPolicy.fraction(q))
            expected_plans.append(plan)
        chex.assert_trees_all_equal(jax.tree.map(lambda x: x[i], final), state)
        chex.assert_trees_all_equal(jax.tree.map(lambda x: x[:, i], plans), stack(expected_plans))
    fetched = np.asarray(plans.fetched).sum(axis=0)
    assert fetched[0] == 0 and fetched[-1] == np.asarray(plans.missing).sum(axis=0)[-1]


def test_vmap_over_states_layers_and_routes_equals_a_loop():
    """Different histories, a different (batched, traced) layer and different routes per cache."""
    histories = []
    for seed in range(3):
        state = pc.init(L, E, S)
        trace = routing_trace(10 + seed, tokens=1)[0]
        for layer in range(seed + 1):
            state, _ = pc.ensure(state, layer, trace[layer])
        histories.append(state)
    states = stack(histories)
    layers = jnp.asarray([3, 0, 2], jnp.int32)
    routes = routing_trace(20, tokens=1)[0][:3]
    policy = pc.FetchPolicy.fraction(0.5)
    batched = jax.jit(jax.vmap(pc.ensure_hybrid, in_axes=(0, 0, 0, None)))(states, layers, routes, policy)
    for i in range(3):
        expected = pc.ensure_hybrid(histories[i], int(layers[i]), routes[i], policy)
        chex.assert_trees_all_equal(jax.tree.map(lambda x: x[i], batched), expected)


def test_vmap_of_the_other_ops_equals_a_loop():
    states = []
    for seed in range(2):
        state = pc.init(L, E, S)
        for layer, layer_routes in enumerate(routing_trace(30 + seed, tokens=1)[0]):
            state, _ = pc.ensure(state, layer, layer_routes)
        states.append(state)
    batch = stack(states)
    slots = jnp.asarray([3, 12], jnp.int32)
    layers = jnp.asarray([1, 2], jnp.int32)
    cases = [
        (lambda s, i: pc.forget_slot(s, slots[i]), lambda s, x: pc.forget_slot(s, x), slots),
        (lambda s, i: pc.materialize_layer(s, layers[i]), lambda s, x: pc.materialize_layer(s, x), layers),
        (lambda s, i: pc.prefetch_prefill_layer(pc.begin_prefill(s), layers[i], (1 << 20,)),
         lambda s, x: pc.prefetch_prefill_layer(pc.begin_prefill(s), x, (1 << 20,)), layers),
    ]
    for one, batched_op, args in cases:
        got = jax.vmap(batched_op)(batch, args)
        for i in range(2):
            chex.assert_trees_all_equal(jax.tree.map(lambda x: x[i], got), one(states[i], i))


def test_vmap_over_caches_that_rebase_at_different_steps_equals_a_loop():
    """The clock rebase keeps a real branch under ``vmap`` (a custom batching rule): FAILS if the
    rule renumbers caches that are not due, or skips ones that are, when only some of the batch
    reach their threshold on a given step."""
    thresholds = (5, 9, 2**30)
    routes = routing_trace(11, tokens=8)
    policy = pc.FetchPolicy.fraction(0.4)

    def run(state):
        def step(state, xs):
            layer, layer_routes = xs
            state, plan = pc.ensure_hybrid(state, layer, layer_routes, policy,
                                           admission=pc.Admission.REUSE)
            return state, plan

        layers = jnp.tile(jnp.arange(L, dtype=jnp.int32), routes.shape[0])
        return lax.scan(step, state, (layers, routes.reshape(-1, routes.shape[-1])))

    states = [pc.init(L, E, S, rebase_threshold=t) for t in thresholds]
    batched_state, batched_plans = jax.jit(jax.vmap(run))(stack(states))
    for i, state in enumerate(states):
        expected_state, expected_plans = jax.jit(run)(state)
        chex.assert_trees_all_equal(jax.tree.map(lambda x: x[i], batched_state), expected_state)
        chex.assert_trees_all_equal(jax.tree.map(lambda x: x[i], batched_plans), expected_plans)
    steps = np.asarray(batched_state.step)
    assert steps[0] < steps[2] and steps[1] < steps[2], "the small thresholds did rebase"
