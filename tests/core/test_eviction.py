"""What every eviction policy shares (docs/semantics.md §5.16): the fused kernel's lockstep
under each eviction, REUSE refused with a non-LRU eviction, the eviction record in the state
(validated at ``init``, called directly by the ops, no extra leaves under LRU), loop-free tracing
on every backend, the replay's and the CLI's eviction sweep, the ring evictions' bookkeeping (one
branch on CPU, equal under vmap), and a policy outside the registry (one record and its
reference twin). Each policy's own rules: test_pair_lfu.py, test_route_knn.py,
test_route_lfu.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pallas_cache as pc
from tests.harness import evictions_under_test, examples
from pallas_cache import evictions, reference
from pallas_cache.reference import ReferenceCache, ReferencePolicy
from tests.lockstep.test_lockstep import run_lockstep
from tests.kernels.test_loop_free import primitives, trace
from tests.toy_policies import MRU, REFERENCE_MRU


# ---- lockstep ------------------------------------------------------------------------------


@examples(0.25, ci=0.16)
@pytest.mark.parametrize("eviction", evictions_under_test(kernel=True, default=False))
@given(data=st.data())
def test_the_fused_kernel_matches_the_reference_after_every_step_under_each_eviction(
        eviction, data):
    """test_pair_lfu.py's lockstep with backend="interpret", under each kernel-ranked eviction:
    ``ensure`` / ``ensure_hybrid`` are the fused kernel, which ranks PAIR_LFU by its tables and
    ROUTE_KNN / ROUTE_LFU from the token ring it updates in place (docs/semantics.md §7), every
    other op as on the XLA backend."""
    run_lockstep(data, "jax-interpret", eviction=eviction)


# ---- the eviction record and its checks ----------------------------------------------------


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


# ---- the ring evictions' bookkeeping (ROUTE_KNN, ROUTE_LFU) --------------------------------


@pytest.mark.usefixtures("optimized_xla")
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

