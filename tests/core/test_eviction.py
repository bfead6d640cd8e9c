"""Eviction policies (docs/semantics.md §5.16): the PAIR_LFU rules, its lockstep with the reference
(every op interleaved, each JAX adapter, vmap, scan, the clock rebase), and the plumbing (LRU
states unchanged, REUSE refused, loop-free tracing)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pallas_cache as pc
from tests.harness import (ADAPTER, assert_same, deep_only, evictions_under_test, examples, slot_of,
                      valid)
from pallas_cache import evictions, reference
from pallas_cache.reference import ReferenceCache, ReferencePolicy
from pallas_cache.testing.operations import EnsureHybrid, PolicySpec
from tests.lockstep.test_lockstep import assert_same_caches, run_lockstep
from tests.kernels.test_loop_free import primitives, trace
from tests.toy_policies import MRU, REFERENCE_MRU

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


@examples(0.25, ci=0.16)
@pytest.mark.parametrize("eviction", evictions_under_test(kernel=True, default=False))
@given(data=st.data())
def test_the_fused_kernel_matches_the_reference_after_every_step_under_each_eviction(
        eviction, data):
    """As above with backend="interpret": ``ensure`` / ``ensure_hybrid`` are the fused kernel,
    which ranks PAIR_LFU by its tables and ROUTE_KNN / ROUTE_LFU from the token ring it updates
    in place (docs/semantics.md §7), every other op as on the XLA backend."""
    run_lockstep(data, "jax-interpret", eviction=eviction)


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


def test_reuse_is_refused_with_a_non_lru_eviction_naming_both():
    """FAILS if REUSE runs under PAIR_LFU (it compares recency with the LRU victim's usage) or if
    the refusal does not name both the admission and the eviction; jit and reference alike."""
    state = pc.init(2, 2, 2, eviction="pair_lfu")
    for call in (lambda: pc.ensure_hybrid(state, 0, jnp.array([0]), pc.FetchPolicy.full(),
                                          admission="reuse"),
                 lambda: jax.jit(pc.ensure_hybrid, static_argnames="admission")(
                     state, 0, jnp.array([0]), pc.FetchPolicy.full(), admission="reuse")):
        with pytest.raises(ValueError, match="(?i)reuse.*pair_lfu"):
            call()
    ref = ReferenceCache(2, 2, 2, eviction="pair_lfu")
    with pytest.raises(ValueError, match="(?i)reuse.*pair_lfu"):
        ref.ensure_hybrid(0, [0], ReferencePolicy.full(), admission="reuse")
    assert ref.step == 0


def test_the_hybrid_path_checks_the_admission_once(monkeypatch):
    """FAILS if ``ensure_hybrid`` checks REUSE against the eviction twice (once itself, once in
    the step it calls): the step's check, at trace time, is the one."""
    from pallas_cache import evictions

    calls = []
    check = evictions.check_admission
    monkeypatch.setattr(evictions, "check_admission",
                        lambda *args: calls.append(args) or check(*args))
    state = pc.init(3, 5, 7)  # a geometry of its own: the call is traced, not served from a cache
    pc.ensure_hybrid(state, 1, jnp.array([0, 4]), pc.FetchPolicy.full(), admission="reuse",
                     backend="xla")
    assert len(calls) == 1, calls


def test_init_validates_the_eviction_and_history():
    """FAILS if a bad eviction or history is accepted, or if the string form is not accepted."""
    assert pc.init(1, 1, 1, eviction="PAIR_LFU").eviction is pc.Eviction.PAIR_LFU.policy
    with pytest.raises(ValueError, match="eviction 'mru'"):
        pc.init(1, 1, 1, eviction="mru")
    with pytest.raises(ValueError, match="history"):
        pc.init(1, 1, 1, history=0)
    with pytest.raises(TypeError, match="history"):
        pc.init(1, 1, 1, history=2.0)


def test_the_state_holds_the_eviction_record_and_the_ops_call_it_directly():
    """FAILS if ``state.eviction`` holds the ``Eviction`` enum (or a name) rather than the record
    whose functions the ops and the kernel call, if ``Eviction(record)`` does not give back its
    member, or if a forwarder between an op and the record is still there."""
    for member in pc.Eviction:
        for given in (member, member.value, member.policy):
            state = pc.init(2, 3, 4, eviction=given)
            assert state.eviction is member.policy
            assert pc.Eviction(state.eviction) is member
        assert repr(member.policy) == f"EvictionPolicy({member.value!r})"
    assert pc.CacheState.__dataclass_fields__["eviction"].default is pc.Eviction.LRU.policy
    with pytest.raises(ValueError):
        pc.Eviction(dataclasses.replace(pc.Eviction.LRU.policy, name="lru"))
    for gone in ("policy_of", "name_of", "cold_state", "history_of", "observe_call"):
        assert not hasattr(evictions, gone), gone
        assert gone not in evictions.__all__
    assert not hasattr(reference.evictions, "policy_of")


def test_lru_states_carry_no_extra_leaves_and_keep_their_policy_through_reset_and_rebuild():
    """FAILS if the default LRU state grows a leaf (the replay's and users' compiled functions,
    checkpoints and vmapped batches would change) or reset/rebuild drop the policy."""
    lru = pc.init(2, 3, 4)
    assert lru.eviction is pc.Eviction.LRU.policy and lru.eviction_state is None
    # 16: the fields of docs/semantics.md §3, the traced usable size (§5.15) included.
    assert len(jax.tree.leaves(lru)) == 16
    lfu = pc.init(2, 3, 4, eviction=pc.Eviction.PAIR_LFU)
    assert len(jax.tree.leaves(lfu)) == 18
    assert jax.tree.structure(lru) != jax.tree.structure(lfu)
    for state in (pc.reset(lfu), pc.rebuild(lfu, 6)):
        assert state.eviction is pc.Eviction.PAIR_LFU.policy
        assert not np.asarray(state.eviction_state.freq).any()


@pytest.mark.parametrize("eviction", evictions_under_test(default=False))
@pytest.mark.parametrize("backend", ["xla", "interpret", "pallas"])
def test_evictions_are_loop_free_on_every_backend(backend, eviction):
    """FAILS if a policy's ranking or bookkeeping traces to a ``while`` outside a kernel."""
    state = pc.init(4, 16, 32, eviction=eviction)
    for admission in ("promote_one", "none"):
        prims = primitives(trace(lambda s, l, r: pc.ensure_hybrid(
            s, l, r, pc.FetchPolicy.fraction(0.4), admission=admission, backend=backend),
            state, jnp.int32(1), jnp.arange(8, dtype=jnp.int32)))
        assert "while" not in prims
    prims = primitives(trace(lambda s, l, r: pc.ensure(s, l, r, backend=backend), state,
                             jnp.int32(1), jnp.arange(8, dtype=jnp.int32)))
    assert "while" not in prims


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


# ---- the replay ----------------------------------------------------------------------------


def test_the_replay_sweeps_the_eviction_and_matches_the_reference():
    """FAILS if the replay's PAIR_LFU lanes (one vmapped program, rules as data, chunked scan)
    count differently from the reference cache called one layer-call at a time, if LRU lanes
    change, or if a result lacks its eviction."""
    from pallas_cache.sizing.sweep import ReplayConfig, replay
    from pallas_cache.sizing.synthetic import synthetic_trace

    trace = synthetic_trace("mixtral-realistic", num_tokens=24, seed=1)
    configs = [ReplayConfig(96, policy, eviction=eviction)
               for eviction in ("lru", "pair_lfu", "route_knn", "route_lfu")
               for policy in ("full", "fraction:0.4")]
    results = replay(trace, configs, bounds=False, chunk_calls=256, progress=lambda s: None)
    for config, result in zip(configs, results):
        ref = ReferenceCache(trace.num_layers, trace.num_experts, 96, eviction=config.eviction)
        policy = (ReferencePolicy.full() if config.policy == "full"
                  else ReferencePolicy.fraction(0.4))
        for layer, routes in trace:
            ref.ensure_hybrid(layer, routes, policy)
        counts = reference.stats(ref)
        assert result.eviction == config.eviction
        assert (result.active, result.missing, result.fetched) == (
            counts.active, counts.missing, counts.fetched), config
    by = {(r.eviction, r.policy): r.hit_rate for r in results}
    assert by[("lru", "full")] != by[("pair_lfu", "full")] != by[("route_knn", "full")]
    assert by[("route_lfu", "full")] not in (by[("lru", "full")], by[("route_knn", "full")])


def test_the_cli_sweeps_evictions_and_refuses_reuse_with_pair_lfu(capsys):
    """FAILS if ``--eviction`` is not swept (a JSON ``eviction`` key on every row, REUSE rows only
    for LRU), or if asking for REUSE with PAIR_LFU alone does not fail with one line."""
    import json

    from pallas_cache.sizing import cli

    small = ["replay", "--synthetic", "mixtral-like", "--tokens", "6", "--cache-size", "64",
             "--policy", "fraction:0.4"]
    assert cli.main(small + ["--admission", "promote_one", "reuse", "--eviction", "lru",
                             "pair_lfu", "route_lfu", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted((r["eviction"], r["admission"]) for r in rows) == [
        ("lru", "promote_one"), ("lru", "reuse"), ("pair_lfu", "promote_one"),
        ("route_lfu", "promote_one")]
    assert cli.main(small + ["--admission", "reuse", "--eviction", "pair_lfu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "reuse" in err and "pair_lfu" in err


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
    for eviction in (None, PAIR_LFU):
        other = adapter.cache(2, 2, 2, eviction=eviction)
        other.ensure(0, [0])
        before = other.state
        other.start_token()
        assert_same(other.state, before, eviction)


# ---- ROUTE_LFU -----------------------------------------------------------------------------

ROUTE_LFU = "route_lfu"


@deep_only  # the fused kernel's lockstep below runs every op; the XLA step: test_lockstep
@examples(0.2, ci=0.16)
@given(data=st.data())
def test_route_lfu_eager_matches_the_reference_after_every_step(data):
    """FAILS if any op, ``start_token`` included, disagrees with the reference in any state
    field or plan field under ROUTE_LFU (its ring is ROUTE_KNN's; its ranking reads the ring's
    frequencies, the latest pair of each layer and the predicted next use)."""
    run_lockstep(data, "jax-eager", eviction=ROUTE_LFU)


@deep_only  # the fused kernel's lockstep below runs every op; the XLA step: test_lockstep
@examples(0.2, ci=0.16)
@given(data=st.data())
def test_route_lfu_jitted_matches_the_reference_after_every_step(data):
    """As above, every op under an outer jit with a traced layer/slot."""
    run_lockstep(data, "jax-jit", eviction=ROUTE_LFU)


def _route_lfu_run(adapter, L, E, S, calls):
    cache = adapter.cache(L, E, S, eviction=ROUTE_LFU, history=8)
    for layer, experts in calls[:-1]:
        cache.ensure(layer, experts)
    return cache, cache.ensure(*calls[-1])


@pytest.mark.traced
@pytest.mark.kernels
def test_route_lfu_protection_outranks_the_score(adapter):
    """FAILS if ROUTE_LFU drops ``prot`` (ranks residents by ``L * F - NU`` alone): layer 0's
    expert 1, routed by this token, has the lowest score and would go.

    L=2, E=2, S=3; tokens 0-2 route expert 0 at both layers, token 3 routes expert 1 at layer 0
    (into the free slot 2), then a miss of layer 1. Keys ``(prot, L*F - NU)``: layer 0 expert 0
    ``(0, 2*3 - 7)``, layer 1 expert 0 ``(0, 2*3 - 10)``, layer 0 expert 1 ``(1, 2*1 - 9)``:
    the victim is layer 1's expert 0 in slot 1."""
    cache, plan = _route_lfu_run(adapter, 2, 2, 3, [(0, [0]), (1, [0])] * 3 + [(0, [1]), (1, [1])])
    assert valid(plan.copy, "dst_slots") == [1]
    assert slot_of(cache.state, 0, 1) == 2 and slot_of(cache.state, 0, 0) == 0


@pytest.mark.traced
@pytest.mark.kernels
def test_route_lfu_protects_the_previous_tokens_pair_of_a_layer_not_yet_called(adapter):
    """FAILS if ``prot`` reads this token's routes for every layer (``R[T, m]``, empty for the
    layers after the call) instead of the previous token's for ``m > l``: layer 1's expert 1,
    routed by token 2, has the lowest score ``2*1 - 9`` and would go at token 3's call of layer
    0. With it protected the victim is layer 0's expert 0 (``2*2 - 10 = -6`` against layer 1
    expert 0's ``2*2 - 7``), slot 2."""
    calls = [(0, [1]), (1, [0]), (0, [0]), (1, [0]), (0, [0]), (1, [1]), (0, [1])]
    cache, plan = _route_lfu_run(adapter, 2, 2, 3, calls)
    assert valid(plan.copy, "dst_slots") == [2]
    assert slot_of(cache.state, 1, 1) == 0


@pytest.mark.traced
@pytest.mark.kernels
def test_route_lfu_ring_frequency_outweighs_a_nearer_predicted_use(adapter):
    """FAILS if ROUTE_LFU ranks the unprotected residents by the predicted next use alone
    (ROUTE_KNN's order, ``-NU``): layer 0's expert 1 (routed by all three past tokens, ``F = 3``,
    ``NU = 10``) would go before layer 1's expert 1 (``F = 1``, ``NU = 9``); the scores are
    ``2*3 - 10 = -4`` and ``2*1 - 9 = -7``, so the rarer expert in slot 2 goes."""
    calls = [(0, [1]), (1, [0]), (0, [1]), (1, [1]), (0, [1]), (1, [2]), (0, [2])]
    cache, plan = _route_lfu_run(adapter, 2, 3, 3, calls)
    assert valid(plan.copy, "dst_slots") == [2]
    assert slot_of(cache.state, 0, 1) == 0


@pytest.mark.traced
@pytest.mark.kernels
def test_route_lfu_predicted_next_use_separates_equal_frequencies(adapter):
    """FAILS if ROUTE_LFU ranks by the ring frequency alone (``L * F``, then LRU): two
    unprotected residents routed once each tie on ``F``, and the older (slot 0, layer 0's expert
    1) would go; ``NU`` (5 for layer 0, the next layer called, 6 for layer 1) makes layer 1's
    expert 1 in slot 1 the victim (``2 - 6 < 2 - 5``)."""
    cache, plan = _route_lfu_run(adapter, 2, 3, 3, [(0, [1]), (1, [1]), (0, [0]), (1, [0])])
    assert valid(plan.copy, "dst_slots") == [1]
    assert slot_of(cache.state, 0, 1) == 0


@pytest.mark.traced
@pytest.mark.kernels
def test_route_lfu_frequency_counts_the_current_tokens_routes(adapter):
    """FAILS if ``F`` leaves out the current token ``T`` (counts only past tokens): it then no
    longer separates two protected residents. L=3, E=3, S=3; token 0 routes expert 0 at every
    layer, token 1 routes it at layer 0, then layer 1 misses experts 1 and 2. Victims: layer 1's
    expert 0 (unprotected), then the protected class: layer 0's expert 0 (``F = 2``, ``NU = 2``,
    score 4) stays, layer 2's expert 0 (``F = 1``, ``NU = 1``, score 2) goes; without ``T``
    the scores are 1 and 2 and slot 0 would go."""
    cache, plan = _route_lfu_run(adapter, 3, 3, 3,
                                 [(0, [0]), (1, [0]), (2, [0]), (0, [0]), (1, [1, 2])])
    assert valid(plan.copy, "dst_slots") == [1, 2]
    assert slot_of(cache.state, 0, 0) == 0


@pytest.mark.parametrize("eviction", evictions_under_test(ring=True))
def test_ring_bookkeeping_is_one_branch_on_cpu(eviction):
    """FAILS if the ring's bookkeeping of a call, and the prediction table ROUTE_KNN's ranking
    reads, are not one conditional each of XLA:CPU's compiled step (the straight-line forms:
    about twice the step's time there, docs/design.md "ROUTE_KNN's per-call cost") with one mask
    word per layer (E = 8), or if they are with several (E = 40: the straight-line forms
    measured faster at the fine-grained geometry). LRU's step is the baseline: its only branch
    is the clock rebase."""
    def step(state, layer, routes):
        return pc.ensure_hybrid(state, layer, routes, pc.FetchPolicy.full(), backend="xla")

    def branches(eviction, experts):
        state = pc.init(4, experts, experts, eviction=eviction, history=6)
        lowered = jax.jit(step).trace(state, jnp.int32(1), jnp.asarray([2, 5], jnp.int32)).lower(
            lowering_platforms=("cpu",))
        return lowered.compile().as_text().count(" conditional(")

    assert branches(eviction, 8) == branches("lru", 8) + 2
    assert branches(eviction, 40) == branches("lru", 40)


@pytest.mark.parametrize("eviction", evictions_under_test(ring=True))
def test_ring_bookkeeping_under_vmap_equals_each_lane_alone(eviction):
    """FAILS if the batched form of the ring's bookkeeping (the replay's lanes) differs from the
    unbatched one lane by lane: e.g. a lane's refused call (layer out of range, so ``accepted``
    is batched) recorded anyway, or an unbatched layer read as a batched one."""
    L, E, S, W = 3, 8, 9, 4
    rng = np.random.default_rng(31)
    calls = 20
    layers = np.tile(np.arange(L, dtype=np.int32), calls)[:calls][None].repeat(2, 0)
    layers[1, [5, 12]] = L  # refused in lane 1 only
    routes = np.stack([[rng.choice(E, 2, replace=False) for _ in range(calls)]
                       for _ in range(2)]).astype(np.int32)
    policy = pc.FetchPolicy.full()

    def loop(state, layers, routes):
        def body(s, xs):
            return pc.ensure_hybrid(s, xs[0], xs[1], policy, backend="xla")
        return jax.lax.scan(body, state, (layers, routes))

    state = pc.init(L, E, S, eviction=eviction, history=W)
    states = jax.tree.map(lambda *x: jnp.stack(x), state, state)
    batched = jax.jit(jax.vmap(loop))(states, jnp.asarray(layers), jnp.asarray(routes))
    for lane in range(2):
        alone = jax.jit(loop)(state, jnp.asarray(layers[lane]), jnp.asarray(routes[lane]))
        got = jax.tree.map(lambda x: x[lane], batched)
        assert int(np.sum(np.asarray(alone[1].error) != 0)) == (2 if lane else 0)
        for a, b in zip(jax.tree.leaves(alone), jax.tree.leaves(got)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), f"lane {lane}")


# ---- a policy outside the registry ---------------------------------------------------------


@examples(0.1, ci=0.08)
@given(data=st.data())
@pytest.mark.parametrize("adapter_name", ["jax-eager", "jax-jit"])
def test_a_new_policy_is_one_record_and_its_reference_twin(data, adapter_name):
    """FAILS if a policy needs more than its record (JAX) and its twin registered (reference):
    if an op, ``start_token``, ``reset``/``rebuild`` or the step still branches on the
    ``Eviction`` enum or reads an enum attribute of the state's policy, or if the XLA step's
    victims, plans or states differ from the twin's under the new ranking."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(reference.evictions.POLICIES, "mru", REFERENCE_MRU)
        run_lockstep(data, adapter_name, eviction=MRU)


def test_a_new_policy_runs_the_views_and_refuses_reuse():
    """FAILS if ``describe``/``diff`` or the REUSE check branch on the ``Eviction`` enum (a record
    outside it has no enum attributes), or if the record's ranking is not the one applied: MRU
    evicts the most recent resident where LRU evicts the oldest."""
    victims = {}
    for eviction in (pc.Eviction.LRU, MRU):
        state = pc.init(2, 2, 2, eviction=eviction)
        state, _ = pc.ensure(state, 0, jnp.array([0]))  # slot 0, usage 1
        state, _ = pc.ensure(state, 0, jnp.array([1]))  # slot 1, usage 2
        before = state
        state, plan = pc.ensure(state, 1, jnp.array([0]))
        victims[eviction] = int(plan.copy.dst_slots[0])
    assert victims == {pc.Eviction.LRU: 0, MRU: 1}
    view = pc.describe(state)
    assert "eviction=mru" in str(view) and view.columns == () and view.resident_count == 2
    change = pc.diff(before, state)
    assert change.evicted == [(1, 0, 1)] and change.installed == [(1, 1, 0)]
    assert pc.reset(state).eviction is MRU
    assert repr(MRU) == "EvictionPolicy('mru')"
    with pytest.raises(ValueError, match="REUSE"):
        pc.ensure_hybrid(state, 0, jnp.array([0]), pc.FetchPolicy.full(), admission="reuse")
