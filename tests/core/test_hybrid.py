"""The hybrid MoE layer (pallas_cache.hybrid, docs/semantics.md §5.13): random decode calls end to
end equal ``moe_dense``; the CPU partial runs the expert function once per distinct CPU expert
and for nothing else; lowered for CUDA, only its matmuls carry XLA's host compute type."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.harness import cpu_partial_oracle, examples

import pallas_cache as pc
from benchmarks.lowering import lower_cuda
from pallas_cache import hybrid
from pallas_cache.moe import apply_copy_plan, put_host_bank
from pallas_cache.testing import moe_dense

L, E, S, H, F = 2, 4, 5, 6, 3
T, K = 3, 2  # tokens per call, routes per token: K' = min(T * K, E) = 4


def expert_fn(weights, x):
    """A two-matrix expert on one token ``[H]``."""
    return jnp.tanh(x @ weights["w_in"]) @ weights["w_out"]


def _bank():
    rng = np.random.default_rng(0)
    return {"w_in": jnp.asarray(rng.standard_normal((L, E, H, F), np.float32) / np.sqrt(H)),
            "w_out": jnp.asarray(rng.standard_normal((L, E, F, H), np.float32) / np.sqrt(F))}


def _pool():
    # NaN in every slot: a device route that read a slot nobody filled would poison the output.
    return {"w_in": jnp.full((S, H, F), jnp.nan), "w_out": jnp.full((S, F, H), jnp.nan)}


@jax.jit
def _step(state, pool, bank, layer, ids, gates, x, policy):
    state, plan = pc.ensure_hybrid(state, layer, ids, policy)
    pool = apply_copy_plan(pool, bank, plan, layer=layer)
    out = pc.moe_hybrid(x, ids, gates, plan, pool, bank, expert_fn, layer=layer)
    cpu = pc.cpu_partial(x, ids, gates, plan, bank, expert_fn, layer=layer)
    cpu_want = cpu_partial_oracle(x, ids, gates, plan, bank, expert_fn, layer=layer)
    return state, pool, plan, out, cpu, cpu_want


_dense = jax.jit(lambda x, ids, gates, bank, layer: moe_dense(x, ids, gates, bank, expert_fn,
                                                              layer=layer))


POLICIES = st.one_of(st.just(pc.FetchPolicy.full()),
                     st.floats(0, 1).map(pc.FetchPolicy.fraction),
                     st.integers(0, 3).map(pc.FetchPolicy.fixed_cap))
CALL = st.tuples(st.integers(0, L - 1),
                 st.lists(st.integers(-1, E - 1), min_size=T * K, max_size=T * K),
                 st.lists(st.floats(0.05, 1), min_size=T * K, max_size=T * K))


@pytest.mark.parametrize("placement", ["host", "device"])
@examples(1.0, ci=0.5)
@given(policy=POLICIES, calls=st.lists(CALL, min_size=1, max_size=6), seed=st.integers(0, 99))
def test_moe_hybrid_equals_the_dense_moe_for_every_policy(placement, policy, calls, seed):
    """FAILS if a CPU expert is skipped, computed twice (duplicate routes), given another
    expert's rows or gates, if a padding route or a device route also lands in the CPU partial,
    or if a fetched or resident route is read from the wrong slot: the hybrid output then differs
    from the dense MoE (or the CPU partial from its masked reference)."""
    bank = _bank()
    placed = put_host_bank(bank, prefer_host=placement == "host")
    state, pool = pc.init(L, E, S), _pool()
    rng = np.random.default_rng(seed)
    for layer, ids, gates in calls:
        ids = jnp.asarray(ids, jnp.int32).reshape(T, K)
        gates = jnp.asarray(gates, jnp.float32).reshape(T, K)
        x = jnp.asarray(rng.standard_normal((T, H), np.float32))
        state, pool, plan, out, cpu, cpu_want = _step(state, pool, placed, jnp.int32(layer), ids,
                                                      gates, x, policy)
        assert int(plan.error) == 0
        want = _dense(x, ids, gates, bank, jnp.int32(layer))
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cpu, cpu_want, rtol=1e-5, atol=1e-5)
        expected = hybrid.cpu_experts(plan, ids, gates, E)
        assert int(expected.count) == int(plan.missing) - int(plan.fetched)  # §11.2's cpu_experts


def test_cpu_experts_are_the_distinct_cpu_experts_ascending():
    """FAILS if the CPU expert list counts routes instead of experts (duplicates twice), keeps a
    padding or device route, is not ascending, or drops a duplicate route's gate."""
    plan = type("Plan", (), {})()
    plan.cpu = jnp.array([[True, True], [True, False], [False, True]])
    ids = jnp.array([[3, 1], [3, 0], [-1, 2]], jnp.int32)
    plan.cpu = plan.cpu & (ids >= 0) | jnp.array([[0, 0], [0, 0], [1, 0]], bool)  # padding: cpu
    gates = jnp.array([[0.25, 0.5], [0.125, 1.0], [2.0, 4.0]], jnp.float32)
    chosen = hybrid.cpu_experts(plan, ids, gates, E)
    np.testing.assert_array_equal(chosen.ids, [1, 2, 3, -1])
    assert int(chosen.count) == 3
    np.testing.assert_array_equal(chosen.gates, [[0.5, 0, 0.25, 0], [0, 0, 0.125, 0],
                                                 [0, 4.0, 0, 0]])


def _tagged_bank():
    """The test bank plus a ``tag`` leaf: ``100 * layer + expert`` for every row."""
    bank = dict(_bank())
    bank["tag"] = (100 * jnp.arange(L)[:, None] + jnp.arange(E)[None]).astype(jnp.int32)
    return bank


def test_the_cpu_work_is_one_expert_evaluation_per_distinct_cpu_expert():
    """FAILS if the CPU partial evaluates every route and masks (one evaluation per route, as
    ``cpu_partial_oracle`` (conftest) and ``pallas_cache.testing.moe_combine`` do), evaluates all
    ``K'`` candidate experts whatever the count, or reads the rows of an expert the plan did not mark
    ``cpu``: the expert function, run with a host callback that records the row tag it was
    handed, must see exactly the distinct CPU experts of the layer-call, each once."""
    seen = []

    def tagged_fn(weights, x):
        jax.debug.callback(lambda tag: seen.append(int(tag)), weights["tag"])
        return expert_fn(weights, x)

    bank = put_host_bank(_tagged_bank())

    @jax.jit
    def step(state, layer, ids):
        state, plan = pc.ensure_hybrid(state, layer, ids, pc.FetchPolicy.fixed_cap(1))
        out = pc.cpu_partial(jnp.ones((T, H)), ids, jnp.ones((T, K)), plan, bank, tagged_fn,
                             layer=layer)
        return state, plan, out

    state = pc.init(L, E, S)
    calls = [(1, [[2, 3], [3, 2], [0, -1]]),   # 3 misses: cap 1 fetches one, 2 go to the CPU
             (1, [[2, 3], [3, 0], [2, -1]]),   # all resident or on the CPU again
             (0, [[-1, -1], [-1, -1], [-1, -1]]),  # padding only: nothing at all
             (0, [[1, 1], [1, 1], [1, 1]])]    # one miss, fetched: nothing on the CPU
    for layer, ids in calls:
        seen.clear()
        ids = jnp.asarray(ids, jnp.int32)
        state, plan, out = step(state, jnp.int32(layer), ids)
        out.block_until_ready()
        jax.effects_barrier()
        cpu = np.asarray(plan.cpu)
        want = sorted({100 * layer + int(e) for e in np.asarray(ids)[cpu]})
        assert sorted(seen) == want, (layer, np.asarray(ids).tolist(), cpu.tolist(), seen)
        assert len(seen) == int(plan.missing) - int(plan.fetched)


def _dots(text):
    """``(host, device)`` counts of ``dot_general`` ops in a lowered StableHLO module."""
    ops = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    host = sum('_xla_compute_type = "host"' in line for line in ops)
    return host, len(ops) - host


def test_the_cpu_partial_is_lowered_as_host_compute_for_cuda():
    """FAILS if the CPU partial is computed on the device (a gather of host rows and a device
    matmul, as ``pallas_cache.testing.moe_combine``): in the step lowered for CUDA the CPU
    experts' matmuls must carry XLA's host compute type, one switch branch per count
    ``n = 1..K'`` with ``n`` experts of two matmuls each, while the device partial's switch
    (over its distinct slots, the same branches) stays on the device; and, where the backend
    has host memory, the region reads the bank where it lives (host-annotated row slices)."""
    bank = put_host_bank(_bank())
    ids = jnp.zeros((T, K), jnp.int32)
    args = (pc.init(L, E, S), _pool(), bank, jnp.int32(0), ids, jnp.ones((T, K)),
            jnp.ones((T, H)), pc.FetchPolicy.full())

    def step(state, pool, bank, layer, ids, gates, x, policy):
        state, plan = pc.ensure_hybrid(state, layer, ids, policy)
        pool = apply_copy_plan(pool, bank, plan, layer=layer)
        return pc.moe_hybrid(x, ids, gates, plan, pool, bank, expert_fn, layer=layer)

    text = lower_cuda(step, *args).as_text()
    width = min(T * K, E)
    branches = 2 * sum(range(1, width + 1))  # two matmuls per expert, n experts in branch n
    assert _dots(text) == (branches, branches)
    if pc.moe.host_memory_kind() is not None:  # the bank slices happen in host memory
        host_slices = [line for line in text.splitlines()
                       if "stablehlo.dynamic_slice" in line and "tensor<1x1x6x3xf32" in line
                       and '_xla_compute_type = "host"' in line]
        assert host_slices, "no host-annotated slice of the bank's rows"


def test_static_misuse_raises_at_trace_time_naming_the_shapes():
    """FAILS if a plan of another routing shape, or a bank with another expert count than the
    plan's, is accepted (a short bank would clamp two experts onto one row)."""
    state, plan = pc.ensure_hybrid(pc.init(L, E, S), 0, jnp.array([[1, 2]], jnp.int32),
                                   pc.FetchPolicy.fixed_cap(0))
    bank = _bank()
    with pytest.raises(ValueError, match=r"plan.cpu \(1, 2\) differs from expert_ids \(2, 1\)"):
        pc.cpu_partial(jnp.ones((2, H)), jnp.array([[1], [2]], jnp.int32), jnp.ones((2, 1)),
                       plan, bank, expert_fn, layer=0)
    short = jax.tree.map(lambda b: b[:, :3], bank)
    with pytest.raises(ValueError, match=r"plan is for 4 experts .* \(3 rows"):
        pc.cpu_partial(jnp.ones((1, H)), jnp.array([[1, 2]], jnp.int32), jnp.ones((1, 2)), plan,
                       short, expert_fn, layer=0)


def test_a_refused_call_computes_nothing_on_the_cpu():
    """FAILS if a traced out-of-range expert id (a refused call, error bits set, empty plan) puts
    work on the CPU or changes the output: the refused plan marks no route ``cpu``."""
    seen = []

    def tagged_fn(weights, x):
        jax.debug.callback(lambda tag: seen.append(int(tag)), weights["tag"])
        return expert_fn(weights, x)

    bank = _tagged_bank()

    @jax.jit
    def step(ids):
        _, plan = pc.ensure_hybrid(pc.init(L, E, S), jnp.int32(0), ids,
                                   pc.FetchPolicy.fixed_cap(0))
        return plan, pc.cpu_partial(jnp.ones((1, H)), ids, jnp.ones((1, 2)), plan, bank,
                                    tagged_fn, layer=0)

    plan, out = step(jnp.array([[1, E]], jnp.int32))
    out.block_until_ready()
    jax.effects_barrier()
    assert int(plan.error) & pc.ERR_EXPERT_ID
    assert seen == [] and not np.any(np.asarray(out))


def test_moe_hybrid_runs_in_a_scan_with_a_traced_layer():
    """FAILS if the hybrid layer needs a concrete layer or count (a host sync in the step): a
    whole decode of tokens x layers compiles as one ``lax.scan`` and matches the dense MoE."""
    bank = _bank()
    placed = put_host_bank(bank)
    ids = jnp.asarray(np.random.default_rng(3).integers(-1, E, (5, L, T, K)), jnp.int32)
    gates = jnp.full((T, K), 0.5)
    x = jnp.ones((T, H))

    @jax.jit
    def decode(state, pool):
        def token(carry, token_ids):
            def layer_step(carry, inputs):
                state, pool = carry
                layer, layer_ids = inputs
                state, plan = pc.ensure_hybrid(state, layer, layer_ids,
                                               pc.FetchPolicy.fraction(0.5))
                pool = apply_copy_plan(pool, placed, plan, layer=layer)
                out = pc.moe_hybrid(x, layer_ids, gates, plan, pool, placed, expert_fn,
                                    layer=layer)
                return (state, pool), out
            return jax.lax.scan(layer_step, carry, (jnp.arange(L, dtype=jnp.int32), token_ids))
        return jax.lax.scan(token, (state, pool), ids)[1]

    got = decode(pc.init(L, E, S), _pool())
    want = jnp.stack([jnp.stack([moe_dense(x, ids[t, l], gates, bank, expert_fn, layer=l)
                                 for l in range(L)]) for t in range(ids.shape[0])])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert re.search("while", jax.jit(decode).lower(pc.init(L, E, S), _pool()).as_text())
