"""The fused kernel's fixed part (docs/design.md, "The fused kernel's fixed part"): the victims of
a pool of several blocks in one streamed pass, the fetch order by rounds over the route lanes
(up to 64 routes) or over the experts (more), the hit refresh before the search. Each against the XLA step, whole states and
plans, in the interpreter; the multi-block path with an explicit block smaller than the pool
(the interpreter's default is one block)."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_cache as pc
from pallas_cache import ops
from pallas_cache.kernels import step as fused
from pallas_cache.state import Clock, Residency


DEEP = os.environ.get("PALLAS_CACHE_PROFILE", "ci") == "deep"
# Each case compiles its own interpreted kernel (about 20 s): the ci profile takes the cases
# that cover each path once; the deep profile all of them.
STREAMED = [(kind, eviction) for kind in ("descending", "ties", "random")
            for eviction in ("lru", "pair_lfu")]
ORDERS = [(order, routes) for order in ("recency", "lowest_id") for routes in (7, 12, 80)]
if not DEEP:
    STREAMED = [("descending", "lru"), ("ties", "pair_lfu")]
    ORDERS = [("recency", 7), ("lowest_id", 80)]


def _assert_equal(a, b, context):
    assert jax.tree.structure(a) == jax.tree.structure(b), context
    for i, (x, y) in enumerate(zip(jax.tree.leaves(a), jax.tree.leaves(b))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{context}, leaf {i}")


@functools.cache
def _steps(rules, block):
    policy_fn = jax.jit(lambda s, l, r, p: fused.fused_step(s, l, r, p, rules, interpret=True,
                                                           block=block))

    def xla(s, l, r, p):
        return ops.ensure_with_rules(s, l, r, p, rules, backend="xla")

    return policy_fn, jax.jit(xla)


def _usage_pattern(kind, rng, capacity, clock):
    """Pool usages that stress the merge of blocks: ``descending`` puts every block's slots
    ahead of the previous block's (each block replaces the whole set of candidates), ``ties``
    gives most slots one usage (the slot decides), ``random`` anything."""
    if kind == "descending":
        return np.arange(capacity, 0, -1) + 1
    if kind == "ties":
        return np.where(rng.random(capacity) < 0.8, 3, rng.integers(1, 6, capacity))
    return rng.integers(1, clock, capacity)


@pytest.mark.parametrize("kind,eviction", STREAMED)
def test_streamed_victims_equal_the_xla_step(kind, eviction):
    """FAILS if the streamed victim search of a pool of several blocks (each block loaded once,
    its keys merged into the set of the best seen so far) differs from the XLA step: a block
    whose keys all beat the set (``descending``: the worst must be replaced each time, not the
    last entered), ties broken by anything but the slot, a block stopped too early, or the set
    sorted wrongly. A full cache of 64 slots in blocks of 8, calls of 12 routes (up to 12
    victims, more than one block holds)."""
    L, E, S, K, clock = 4, 24, 64, 12, 10_000
    rng = np.random.default_rng({"descending": 0, "ties": 1, "random": 2}[kind])
    state = pc.init(L, E, S, eviction=eviction)
    # Every slot holds an expert of some layer; layer 0's experts are never resident, so a call
    # of layer 0 misses every routed expert.
    ids = rng.permutation(np.arange(E, L * E))[:S]
    sfi = np.full(L * E, -1, np.int32)
    sfi[ids] = np.arange(S)
    state = state.replace(
        residency=Residency(id_of_slot=jnp.asarray(ids, jnp.int32),
                            slot_for_id=jnp.asarray(sfi.reshape(L, E)),
                            usage=jnp.asarray(_usage_pattern(kind, rng, S, clock), jnp.int32)),
        clock=Clock(step=jnp.int32(clock)))
    rules = ops.Rules.of(hybrid=True, order="recency",
                         admission="reuse" if eviction == "lru" else "promote_one")
    ours, theirs = _steps(rules, 8)
    policy = pc.FetchPolicy.full()
    a = b = state
    for call in range(6):
        layer = jnp.int32(0 if call % 2 == 0 else rng.integers(1, L))
        routes = jnp.asarray(rng.integers(-1, E, K), jnp.int32)
        out_a, out_b = ours(a, layer, routes, policy), theirs(b, layer, routes, policy)
        _assert_equal(out_a, out_b, f"{kind}, call {call}")
        a, b = out_a[0], out_b[0]


@pytest.mark.parametrize("order,num_routes", ORDERS)
def test_the_fetch_order_equals_the_xla_step(order, num_routes):
    """FAILS if the fetch order differs from the XLA step's: up to 64 routes the rounds over the
    route lanes (a duplicate route taken twice, a tie of recency not broken by the lower id; a
    route's first occurrence by lane compares up to 8 routes, by a [routes, routes] tile above),
    with more than 64 routes the rounds over the experts. Recency ties are common here (most
    experts were never routed: recency -1), duplicates too."""
    L, E, S = 2, 96, 100
    rng = np.random.default_rng(num_routes)
    state = pc.init(L, E, S)
    rules = ops.Rules.of(hybrid=True, order=order, admission="none")
    ours, theirs = _steps(rules, None)
    policy = pc.FetchPolicy.fraction(0.75)
    a = b = state
    for call in range(10):
        layer = jnp.int32(rng.integers(0, L))
        routes = jnp.asarray(rng.integers(-1, E // 2, num_routes), jnp.int32)
        out_a, out_b = ours(a, layer, routes, policy), theirs(b, layer, routes, policy)
        _assert_equal(out_a, out_b, f"{order}, {num_routes} routes, call {call}")
        a, b = out_a[0], out_b[0]


@pytest.mark.parametrize("block", [None, 4])
def test_a_hit_is_never_a_victim(block):
    """FAILS if a slot hit by this call can be chosen as a victim (the hit refresh must come
    before the pool scan, in every block): the hit slots hold the smallest usage of the pool."""
    L, E, S = 2, 8, 8
    state = pc.init(L, E, S)
    # Slots 0, 2, 7 hold layer 0's experts 0, 1, 2 (with the smallest usage); the rest layer 1's.
    ids = np.asarray([0, 8, 1, 9, 10, 11, 12, 2], np.int32)
    sfi = np.full(L * E, -1, np.int32)
    sfi[ids] = np.arange(S)
    state = state.replace(
        residency=Residency(id_of_slot=jnp.asarray(ids), slot_for_id=jnp.asarray(sfi.reshape(L, E)),
                            usage=jnp.asarray([1, 9, 1, 9, 9, 9, 9, 1], jnp.int32)),
        clock=Clock(step=jnp.int32(10)))
    rules = ops.Rules.of(hybrid=False, order="lowest_id", admission="none")
    ours, theirs = _steps(rules, block)
    routes = jnp.asarray([0, 1, 2, 5, 6, 7], jnp.int32)  # hits on slots 0, 2, 7; three misses
    out_a = ours(state, jnp.int32(0), routes, pc.FetchPolicy.full())
    out_b = theirs(state, jnp.int32(0), routes, pc.FetchPolicy.full())
    _assert_equal(out_a, out_b, f"block {block}")
    assert set(np.asarray(out_a[1].copy.dst_slots)[:3].tolist()) == {1, 3, 4}
