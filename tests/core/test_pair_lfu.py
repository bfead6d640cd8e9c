"""PAIR_LFU, the pair-frequency eviction (docs/semantics.md §5.16): its lockstep with the
reference (every op interleaved, eager and jitted, across the clock rebase, in a scan, vmapped),
its rules on every adapter (exact decay, protection before frequency, free slots first, the k-th
miss to the k-th victim, promotion, materialize and forget) and its key in ``describe``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pallas_cache as pc
from tests.harness import ADAPTER, assert_same, examples, slot_of, valid
from pallas_cache.reference import ReferenceCache, ReferencePolicy
from pallas_cache.testing.operations import EnsureHybrid, PolicySpec
from tests.lockstep.test_lockstep import assert_same_caches, run_lockstep


PAIR_LFU = "pair_lfu"


def pair_lfu(adapter, L, E, S, **kwargs):
    return adapter.cache(L, E, S, eviction=PAIR_LFU, **kwargs)


# ---- lockstep ------------------------------------------------------------------------------


@examples(0.25, ci=0.16)
@given(data=st.data())
def test_pair_lfu_eager_matches_the_reference_after_every_step(data):
    """FAILS if any op (ensure, ensure_hybrid, materialize, forget, prefill, reset, rebuild,
    stats, routing, rebase) disagrees with the reference in any state field (freq and prot
    included) or plan field, under PAIR_LFU."""
    run_lockstep(data, "jax-eager", eviction=PAIR_LFU)


@examples(0.25, ci=0.16)
@given(data=st.data())
def test_pair_lfu_jitted_matches_the_reference_after_every_step(data):
    """As above, every op under an outer jit with a traced layer/slot."""
    run_lockstep(data, "jax-jit", eviction=PAIR_LFU)


def test_pair_lfu_long_run_across_the_clock_rebase_matches_the_reference():
    """FAILS if the rebase of docs/semantics.md §5.12 changes a PAIR_LFU decision: last_use is
    the slot's usage, renumbered with it; freq is not a stamp and must survive untouched."""
    L, E, S = 3, 4, 9
    cache = pair_lfu(ADAPTER["jax-jit"], L, E, S, rebase_threshold=20)
    cache.pad_routes = False
    ref = pair_lfu(ADAPTER["reference"], L, E, S, rebase_threshold=20)
    rng = np.random.default_rng(11)
    rebased = 0
    for step in range(240):
        layer = int(rng.integers(L))
        routes = rng.integers(-1, E, size=5).astype(np.int32)
        spec = (PolicySpec("fraction", 0.4), PolicySpec("fixed_cap", 1), PolicySpec("full"))[
            step % 3]
        op = EnsureHybrid(layer, routes, spec, "recency", "promote_one" if step % 2 else "none")
        before = int(ref.state.step)
        plan, expected = cache.apply(op), ref.apply(op)
        rebased += int(ref.state.step) <= before
        assert_same(plan, expected, f"step {step}")
        if step % 13 == 0:
            assert_same(cache.forget_slot(step % S), ref.forget_slot(step % S), "forget")
        if step % 29 == 0:
            assert_same(cache.materialize_layer(layer), ref.materialize_layer(layer), "mat")
        assert_same_caches(cache, ref, f"step {step}")
    assert rebased >= 5
    assert ref.state.eviction_state.freq.max() > 65536  # the sequence reached the decayed regime


def _reference_run(L, E, S, calls, policy_q):
    ref = ReferenceCache(L, E, S, eviction=PAIR_LFU)
    plans = [ref.ensure_hybrid(l, r, ReferencePolicy.fraction(policy_q)) for l, r in calls]
    return ref, plans


def test_pair_lfu_in_a_scan_decode_loop_equals_the_reference_step_by_step():
    """FAILS if PAIR_LFU's bookkeeping is wrong with a traced layer inside ``lax.scan`` (the
    decode loop's shape): every plan of the scan and the final state equal the reference's."""
    L, E, S, K = 4, 6, 13, 3
    rng = np.random.default_rng(3)
    calls = [(t % L, rng.choice(E, K, replace=False).astype(np.int32)) for t in range(96)]
    layers = jnp.asarray([l for l, _ in calls], jnp.int32)
    routes = jnp.asarray(np.stack([r for _, r in calls]))
    policy = pc.FetchPolicy.fraction(0.75)

    @jax.jit
    def loop(state):
        def body(s, xs):
            s, plan = pc.ensure_hybrid(s, xs[0], xs[1], policy)
            return s, plan
        return jax.lax.scan(body, state, (layers, routes))

    state, plans = loop(pc.init(L, E, S, eviction=PAIR_LFU))
    ref, expected = _reference_run(L, E, S, calls, 0.75)
    for t, want in enumerate(expected):
        got = jax.tree.map(lambda x: x[t], plans)
        assert_same(got, want, f"call {t}")
    assert_same(state, ref, "end")


def test_pair_lfu_vmapped_over_caches_equals_a_loop_of_references():
    """FAILS if a vmapped batch of PAIR_LFU caches mixes lanes (each lane has its own routes,
    layer and history) or differs from one reference per lane."""
    L, E, S, K, lanes = 3, 5, 9, 3, 4
    rng = np.random.default_rng(5)
    refs = [ReferenceCache(L, E, S, eviction=PAIR_LFU) for _ in range(lanes)]
    states = jax.tree.map(lambda *x: jnp.stack(x), *[pc.init(L, E, S, eviction=PAIR_LFU)] * lanes)
    step = jax.jit(jax.vmap(lambda s, l, r: pc.ensure_hybrid(s, l, r, pc.FetchPolicy.full())))
    for t in range(40):
        layers = rng.integers(L, size=lanes).astype(np.int32)
        routes = rng.integers(-1, E, size=(lanes, K)).astype(np.int32)
        states, plans = step(states, jnp.asarray(layers), jnp.asarray(routes))
        for i, ref in enumerate(refs):
            want = ref.ensure_hybrid(int(layers[i]), routes[i], ReferencePolicy.full())
            got = jax.tree.map(lambda x: x[i], plans)
            assert_same(got, want, f"call {t} lane {i}")
            lane = jax.tree.map(lambda x: x[i], states)
            np.testing.assert_array_equal(lane.eviction_state.freq, ref.eviction_state.freq)
            np.testing.assert_array_equal(lane.eviction_state.prot, ref.eviction_state.prot)
            np.testing.assert_array_equal(lane.residency.id_of_slot, ref.residency.id_of_slot)


# ---- the rules (every adapter) -------------------------------------------------------------


def _decayed(freq, calls):
    for _ in range(calls):
        freq = (freq * 64132) >> 16
    return freq


@pytest.mark.traced
def test_frequency_decays_exactly_past_32_bits(adapter):
    """FAILS if the Q16 decay ``(freq * 64132) >> 16`` is computed naively in int32: the
    product overflows from the second visit on (65536 * 64132 > 2**31), so freq would wrap
    negative. Checked against Python's unbounded ints after 300 visits (freq settles near 3.06M)."""
    cache = pair_lfu(adapter, 1, 4, 4)
    expected = np.zeros(4, dtype=object)
    for t in range(300):
        routed = [0, 1] if t % 3 else [0, 2]
        cache.ensure(0, routed)
        expected = np.array([_decayed(int(f), 1) for f in expected], dtype=object)
        for e in routed:
            expected[e] += 65536
    assert cache.state.eviction_state.freq[0].tolist() == expected.tolist()
    assert 3_000_000 < expected[0] < 2**22


@pytest.mark.traced
def test_protection_outranks_frequency(adapter):
    """FAILS if ``prot`` is left out of the key (victims by (freq, last_use, slot) alone): the
    expert routed by its layer's last call survives although another layer's unprotected
    expert is far more frequent.

    Layer 0 routes expert 0 eight times (freq ~7.5 units, then unprotected once layer 0 routes
    expert 1); layer 1's expert 0 is routed once (freq 1, protected). A miss of layer 2 must
    evict layer 0's expert 0, not the protected, rarer layer-1 expert."""
    cache = pair_lfu(adapter, 3, 2, 3)
    for _ in range(8):
        cache.ensure(0, [0])
    cache.ensure(1, [0])           # slot 1: layer 1 expert 0, freq 65536, protected
    cache.ensure(0, [1])           # slot 2: layer 0 expert 1; layer 0 expert 0 loses protection
    state = cache.state
    assert state.eviction_state.prot[0].tolist() == [False, True] and state.eviction_state.prot[1, 0]
    assert state.eviction_state.freq[0, 0] > 7 * 65536 > state.eviction_state.freq[1, 0]
    plan = cache.ensure(2, [0])
    assert valid(plan.copy, "dst_slots") == [0], "the unprotected, frequent expert is the victim"
    assert slot_of(cache.state, 1, 0) == 1 and slot_of(cache.state, 0, 0) is None


@pytest.mark.traced
def test_among_unprotected_residents_the_least_frequent_goes_first(adapter):
    """FAILS if PAIR_LFU falls back to recency among unprotected residents: the older but more
    frequent expert stays, the newer one-off goes."""
    cache = pair_lfu(adapter, 3, 2, 3)
    for _ in range(4):
        cache.ensure(0, [0])       # slot 0: layer 0 expert 0, used often, long ago
    cache.ensure(1, [0])           # slot 1: layer 1 expert 0, once, recently
    cache.ensure(0, [1])           # slot 2; layer 0 expert 0 loses protection
    cache.ensure(1, [1])           # a miss with a full pool; layer 1 expert 0 loses protection
    state = cache.state
    assert not state.eviction_state.prot[0, 0] and not state.eviction_state.prot[1, 0]
    assert slot_of(state, 0, 0) is not None and slot_of(state, 1, 0) is None


@pytest.mark.traced
def test_free_slots_come_first_in_lru_order_before_any_resident(adapter):
    """FAILS if free slots are ranked like residents (e.g. keyed by the freq/prot of the expert
    their -1 occupant clips to, flat id 0) instead of first, or if free slots are taken in slot
    order rather than ``(usage, slot)``: a forgotten slot (usage INT32_MIN) beats lower slots a
    prefill emptied (usage 0).

    Setup: flat id 0 (layer 0, expert 0) is protected and hotter than its protected neighbour,
    so a free slot keyed by it would rank after that neighbour."""
    cache = pair_lfu(adapter, 3, 2, 5)
    cache.ensure(1, [0, 1])           # slots 0, 1
    for _ in range(3):
        cache.ensure(0, [0])          # slot 2: layer 0 expert 0, hot
    cache.ensure(0, [0, 1])           # slot 3: layer 0 expert 1; both protected
    cache.ensure(2, [0])              # slot 4
    cache.forget_slot(4)              # free, usage INT32_MIN
    cache.begin_prefill()
    cache.prefetch_prefill_layer(0, (512 * 1024,))  # slots 0, 1 emptied with usage 0
    state = cache.state
    assert state.eviction_state.prot[0].all() and state.eviction_state.freq[0, 0] > state.eviction_state.freq[0, 1]
    assert state.residency.usage.tolist()[:2] == [0, 0] and state.residency.usage[4] == -(2**31)
    plan = cache.ensure(1, [0, 1])
    assert valid(plan.copy, "dst_slots") == [4, 0]


@pytest.mark.traced
def test_the_kth_installed_miss_takes_the_kth_victim_in_fetch_order(adapter):
    """FAILS if PAIR_LFU re-pairs misses and victims (e.g. by id) instead of the k-th miss in
    fetch order taking the k-th victim: recency order installs expert 3 (routed before) first,
    into the first victim."""
    cache = pair_lfu(adapter, 2, 4, 4)
    policy = adapter.Policy.full()
    cache.ensure_hybrid(1, [3], policy)          # layer 1 expert 3 has recency
    cache.ensure_hybrid(0, [0, 1, 2, 3], policy)  # fills every slot with layer 0
    cache.ensure_hybrid(0, [0, 2], policy)        # layer 0: 1 and 3 unprotected, lower freq
    plan = cache.ensure_hybrid(1, [1, 3], policy)
    # Victims: layer 0's unprotected experts 3 (slot 0) and 1 (slot 2): equal freq and last use,
    # so slot order; fetch order: expert 3 (routed before) then expert 1.
    assert valid(plan.copy, "src_rows") == [3, 1]
    assert valid(plan.copy, "dst_slots") == [0, 2]


@pytest.mark.traced
def test_promote_one_still_fires_only_into_a_free_slot(adapter):
    """FAILS if PAIR_LFU's first victim (a resident when no slot is free) lets PROMOTE_ONE
    evict: with a full pool the rounded-down miss stays on the CPU; with a forgotten slot it is
    promoted into that slot."""
    cache = pair_lfu(adapter, 2, 2, 2)
    q = adapter.Policy.fraction(0.4)
    cache.ensure_hybrid(0, [0, 1], adapter.Policy.full())
    cache.ensure_hybrid(1, [0], q)            # first-time miss: never promoted
    plan = cache.ensure_hybrid(1, [0], q)      # recurring, but no free slot
    assert plan.copy.count == 0 and plan.cpu[0]
    cache.forget_slot(1)
    plan = cache.ensure_hybrid(1, [0], q)
    assert valid(plan.copy, "dst_slots") == [1] and plan.copy.count == 1


@pytest.mark.traced
def test_materialize_and_forget_leave_the_frequencies_alone(adapter):
    """FAILS if materialize_layer or forget_slot counts as a routed call (decays or adds to freq,
    or rewrites prot): only accepted ensure/ensure_hybrid calls feed PAIR_LFU."""
    cache = pair_lfu(adapter, 2, 2, 4)
    cache.ensure(0, [0])
    cache.ensure(1, [1])
    before = cache.state
    cache.materialize_layer(1)
    cache.forget_slot(0)
    cache.ensure(5, [0])              # refused: ERR_LAYER, nothing changes
    after = cache.state
    np.testing.assert_array_equal(after.eviction_state.freq, before.eviction_state.freq)
    np.testing.assert_array_equal(after.eviction_state.prot, before.eviction_state.prot)


def test_describe_shows_the_pair_lfu_key_of_each_resident():
    """FAILS if describe under PAIR_LFU hides the ranking a victim is chosen by (prot, freq), or
    if diff compares states of different policies."""
    state = pc.init(2, 2, 3, eviction="pair_lfu")
    state, _ = pc.ensure(state, 0, jnp.array([0, 1]))
    state, _ = pc.ensure(state, 1, jnp.array([1]))
    view = pc.describe(state)
    assert "eviction=pair_lfu" in str(view)
    rows = {(r.layer, r.expert): r for r in view.rows if r.layer is not None}
    assert rows[(1, 1)].prot and rows[(1, 1)].freq == 65536
    assert rows[(0, 0)].prot and rows[(0, 0)].freq == 65536
    assert "freq" in str(view) and "prot" in str(view)
    assert pc.describe(pc.init(2, 2, 3)).rows[0].freq is None
    with pytest.raises(ValueError, match="pair_lfu.*lru|lru.*pair_lfu"):
        pc.diff(state, pc.init(2, 2, 3))

