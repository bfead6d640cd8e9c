"""ROUTE_KNN, the eviction that predicts next use from the nearest earlier tokens
(docs/semantics.md §5.16): its lockstep with the reference (eager, jitted, in a scan and
vmapped), neighbours at the similarity bound, the per-slot next use, and its rules (plain LRU
without history, realignment at each token start, ties to the latest token, ``start_token``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pallas_cache as pc
from tests.harness import assert_same, deep_only, evictions_under_test, examples, slot_of, valid
from pallas_cache.reference import ReferenceCache, ReferencePolicy
from tests.lockstep.test_lockstep import run_lockstep


# ---- ROUTE_KNN -----------------------------------------------------------------------------

ROUTE_KNN = "route_knn"


@deep_only  # the fused kernel's lockstep below runs every op; the XLA step: test_lockstep
@examples(0.2, ci=0.16)
@given(data=st.data())
def test_route_knn_eager_matches_the_reference_after_every_step(data):
    """FAILS if any op, ``start_token`` included, disagrees with the reference in any state
    field (the ring as bits, similarities, head, count, last layer) or plan field."""
    run_lockstep(data, "jax-eager", eviction=ROUTE_KNN)


@deep_only  # the fused kernel's lockstep below runs every op; the XLA step: test_lockstep
@examples(0.2, ci=0.16)
@given(data=st.data())
def test_route_knn_jitted_matches_the_reference_after_every_step(data):
    """As above, every op under an outer jit with a traced layer/slot."""
    run_lockstep(data, "jax-jit", eviction=ROUTE_KNN)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("eviction", evictions_under_test(ring=True))
def test_route_knn_in_a_scan_and_vmapped_equals_the_reference(eviction, backend):
    """FAILS if ROUTE_KNN's (or ROUTE_LFU's) ring, token detection or ranking differ inside
    ``lax.scan`` with a traced layer, or across the lanes of a ``vmap`` (each lane its own
    trace, and on the interpret backend its own kernel program), from the reference called one
    layer-call at a time; a rebase threshold is crossed on the way."""
    L, E, S, K, lanes, W = 4, 6, 10, 2, 3, 5
    rng = np.random.default_rng(8)
    layers = np.tile(np.arange(L, dtype=np.int32), 30)[None].repeat(lanes, 0)
    layers[:, 7] = 0  # a token cut short
    routes = np.stack([[rng.choice(E, K, replace=False) for _ in range(layers.shape[1])]
                       for _ in range(lanes)]).astype(np.int32)
    policy = pc.FetchPolicy.fraction(0.75)

    @jax.jit
    def loop(state, layers, routes):
        def body(s, xs):
            return pc.ensure_hybrid(s, xs[0], xs[1], policy, backend=backend)
        return jax.lax.scan(body, state, (layers, routes))

    state = pc.init(L, E, S, eviction=eviction, history=W, rebase_threshold=50)
    states = jax.tree.map(lambda *x: jnp.stack(x), *[state] * lanes)
    states, plans = jax.vmap(loop)(states, jnp.asarray(layers), jnp.asarray(routes))
    for i in range(lanes):
        ref = ReferenceCache(L, E, S, eviction=eviction, history=W, rebase_threshold=50)
        for t in range(layers.shape[1]):
            want = ref.ensure_hybrid(int(layers[i, t]), routes[i, t], ReferencePolicy.fraction(0.75))
            got = jax.tree.map(lambda x: x[i, t], plans)
            assert_same(got, want, f"lane {i} call {t}")
        assert_same(jax.tree.map(lambda x: x[i], states), ref, f"lane {i}")
        assert ref.eviction_state.count == W and ref.step < 50  # the ring wrapped


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_route_knn_neighbours_at_the_similarity_bound(backend):
    """FAILS if the neighbours' one-key selection under-bounds the similarity (``sim`` reaches
    ``3 L E`` when consecutive tokens route every expert of every layer: ``L E`` aligned plus
    ``2 L E`` matched), breaks a tie other than to the latest token, or if the step's XLA:CPU
    branches (unbatched, inside a scan) or the fused kernel change a plan: every call checked
    against the reference."""
    L, E, S, W = 3, 4, 8, 6
    rng = np.random.default_rng(40)
    tokens = 24
    layers = np.tile(np.arange(L, dtype=np.int32), tokens)
    full = rng.random(tokens) < 0.5  # tokens that route every expert
    routes = np.stack([np.arange(E) if full[i // L] else
                       np.pad(rng.choice(E, 2, replace=False), (0, E - 2), constant_values=-1)
                       for i in range(layers.shape[0])]).astype(np.int32)
    policy = pc.FetchPolicy.full()

    @jax.jit
    def loop(state, layers, routes):
        def body(s, xs):
            s, plan = pc.ensure_hybrid(s, xs[0], xs[1], policy, backend=backend)
            return s, (plan, s.eviction_state.sim)
        return jax.lax.scan(body, state, (layers, routes))

    state, (plans, sims) = loop(pc.init(L, E, S, eviction="route_knn", history=W),
                                jnp.asarray(layers), jnp.asarray(routes))
    assert int(np.asarray(sims).max()) == 3 * L * E
    ref = ReferenceCache(L, E, S, eviction="route_knn", history=W)
    for t in range(layers.shape[0]):
        want = ref.ensure_hybrid(int(layers[t]), routes[t], ReferencePolicy.full())
        assert_same(jax.tree.map(lambda x: x[t], plans), want, f"call {t}")
    assert_same(state, ref, "end")


@pytest.mark.parametrize("L, E, S, usable", [(6, 8, 24, 24), (3, 40, 96, 70)])
def test_route_knn_next_use_per_slot_equals_the_per_layer_expert_form(L, E, S, usable):
    """FAILS if ROUTE_KNN's two formulations of the predicted next use (per slot over gathered
    words, per (layer, expert) by bit-sliced counters; the geometry picks one) differ for any slot
    of any reachable ring, e.g. a shift, seen or horizon bound off by one, or a bit of the
    second mask word read from the first (E = 40). The lockstep tests check the one their
    geometry picks against the reference; this checks the other against it, call by call."""
    from pallas_cache.evictions.route_knn import next_use

    K, W = 3, 6
    rng = np.random.default_rng(25)
    layers = np.tile(np.arange(L, dtype=np.int32), 14)
    layers[9] = 0  # a token cut short
    routes = np.stack([rng.choice(E, K, replace=False) for _ in layers]).astype(np.int32)
    policy = pc.FetchPolicy.full()

    @jax.jit
    def loop(state, layers, routes):
        def body(s, xs):
            s, _ = pc.ensure_hybrid(s, xs[0], xs[1], policy)
            args = (s.eviction_state, s.residency.id_of_slot, xs[0], E, s.cache_size)
            return s, (next_use(*args, per_slot=True), next_use(*args, per_slot=False),
                       s.residency.id_of_slot)
        return jax.lax.scan(body, state, (layers, routes))

    state, _ = pc.resize(pc.init(L, E, S, eviction="route_knn", history=W), usable)
    _, (per_slot, per_expert, ids) = loop(state, jnp.asarray(layers), jnp.asarray(routes))
    occupied = np.asarray(ids) >= 0
    assert occupied.any() and np.asarray(per_slot).max() > L  # rings with real predictions
    np.testing.assert_array_equal(np.where(occupied, per_slot, 0),
                                  np.where(occupied, per_expert, 0))


@pytest.mark.traced
@pytest.mark.kernels
def test_route_knn_without_history_is_plain_lru(adapter):
    """FAILS if the predicted next use does not vanish with no past token (``NU = K'·d(m) +
    ...`` with ``K' = 0``): e.g. ``d(m)`` counted without the ``K'`` factor would evict the
    layer called last instead of the least recently used. All calls are token 0 (layers
    increase), so every victim must be the LRU victim."""
    lru = adapter.cache(4, 2, 2)
    knn = adapter.cache(4, 2, 2, eviction=ROUTE_KNN)
    for layer in range(4):
        a, b = lru.ensure(layer, [layer % 2]), knn.ensure(layer, [layer % 2])
        assert valid(a.copy, "dst_slots") == valid(b.copy, "dst_slots")
    assert knn.state.eviction_state.count == 1  # still the first token
    assert slot_of(knn.state, 2, 0) is not None and slot_of(knn.state, 3, 1) is not None


@pytest.mark.traced
@pytest.mark.kernels
def test_similarities_realign_at_each_token_start(adapter):
    """FAILS if a token start does not recompute ``sim_j`` from the *previous* tokens aligned
    (``R[j-1] & R[T-1]``, 0 when ``j-1`` left the ring): carried-over sims, or ``R[j] & R[T-1]``,
    give other numbers. Tokens 0 and 1 route identically (2 matches), token 2 starts."""
    cache = adapter.cache(2, 3, 3, eviction=ROUTE_KNN, history=4)
    for _ in range(2):
        cache.ensure(0, [0])
        cache.ensure(1, [1])
    assert cache.state.eviction_state.sim.tolist() == [2 * 2, 0, 0, 0]  # token 0 vs the current token 1
    cache.ensure(0, [2])  # token 2 starts: sim_1 = |R[0] & R[1]| = 2, sim_0 = 0 (no token -1)
    assert cache.state.eviction_state.head == 2
    assert cache.state.eviction_state.sim.tolist() == [0, 2, 0, 0]
    cache.ensure(1, [1])  # + 2 * |R[j, 1] & {1}| for both past tokens
    assert cache.state.eviction_state.sim.tolist() == [2, 4, 0, 0]
    cache.ensure(0, [1])  # token 3: sim_2 = |R[1] & R[2]| = 1, sim_1 = |R[0] & R[2]| = 1
    assert cache.state.eviction_state.sim.tolist() == [0, 1, 1, 0]


@pytest.mark.traced
@pytest.mark.kernels
def test_neighbour_ties_go_to_the_latest_token(adapter):
    """FAILS if neighbours tie to the older token (or to the ring position): at the last call
    the four past tokens have sims (2, 0, 1, 0); tokens 1 and 3 tie for the third neighbour,
    and only the latest (token 3) predicts that layer 0's expert 1 is needed last, so it goes
    (slot 0); with token 1 the victim is slot 1."""
    cache = adapter.cache(2, 3, 3, eviction=ROUTE_KNN, history=8)
    calls = [(0, 0), (1, 1), (0, 2), (1, 2), (0, 1), (1, 2), (0, 2), (1, 0)]
    for layer, expert in calls:
        cache.ensure(layer, [expert])
    plan = cache.ensure(0, [0])
    assert cache.state.eviction_state.sim.tolist()[:4] == [2, 0, 1, 0]
    assert valid(plan.copy, "dst_slots") == [0]


@pytest.mark.traced
@pytest.mark.kernels
def test_start_token_starts_a_token_the_layers_do_not_show(adapter):
    """FAILS if ``start_token`` is ignored (a token calling only layer 1 after one calling only
    layer 0 would merge with it) or if it changes an LRU or PAIR_LFU state."""
    cache = adapter.cache(2, 2, 2, eviction=ROUTE_KNN, history=3)
    cache.ensure(0, [0])
    cache.start_token()
    cache.ensure(1, [1])
    assert (int(cache.state.eviction_state.head), int(cache.state.eviction_state.count)) == (1, 2)
    for eviction in (None, "pair_lfu"):
        other = adapter.cache(2, 2, 2, eviction=eviction)
        other.ensure(0, [0])
        before = other.state
        other.start_token()
        assert_same(other.state, before, eviction)

