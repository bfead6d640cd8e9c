"""Batches of caches (stack_states, take_state, unstack_states, pad_capacity), the reports on a
batch (stats, layer_stats, per_layer_stats, describe: one entry per cache), the CPU count of
CacheStats, and the one-line errors of host-side reports under jit and of a traced fraction."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_cache as pc
from pallas_cache import testing as pct
from pallas_cache.batch import batch_shape, pad_capacity, unstack_states


def _run(state, routes, policy):
    """Token by token, layer by layer, eager hybrid calls; the plans in order."""
    plans = []
    for token in routes:
        for layer, layer_routes in enumerate(token):
            state, plan = pc.ensure_hybrid(state, layer, layer_routes, policy)
            plans.append(plan)
    return state, plans


def _routes(seed, tokens=12, L=3, k=3, E=6):
    rng = np.random.default_rng(seed)
    routes = rng.integers(-1, E, (tokens, L, k)).astype(np.int32)
    return routes


def test_stack_take_and_unstack_are_inverse():
    """FAILS if take_state(stack_states(xs), i) is not xs[i] leaf for leaf (e.g. the batch axis
    put last, or an index read from the wrong axis), for any eviction's bookkeeping."""
    states = [_run(pc.init(3, 6, 8, eviction=e), _routes(i), pc.FetchPolicy.fraction(0.5))[0]
              for i, e in enumerate(["route_lfu", "route_lfu", "route_lfu"])]
    batch = pc.stack_states(states)
    assert batch_shape(batch) == (3,)
    for i, state in enumerate(states):
        pct.assert_states_equal(pc.take_state(batch, i), state)
    pct.assert_states_equal(pc.take_state(batch, -1), states[-1])
    for got, want in zip(unstack_states(batch), states):
        pct.assert_states_equal(got, want)
    with pytest.raises(ValueError, match="index 3 outside a batch of 3"):
        pc.take_state(batch, 3)
    with pytest.raises(ValueError, match="one cache"):
        pc.take_state(states[0], 0)


def test_stacking_different_sizes_says_how_and_works_with_capacity():
    """FAILS if stacking two allocations fails with JAX's shape error instead of naming
    capacity=, or if padding to a common capacity changes a single plan or count: every cache
    of a vmapped padded batch decides as the same cache run alone (docs/semantics.md §5.15)."""
    sizes = [6, 9, 12]
    with pytest.raises(ValueError, match=r"pass capacity=12") as failure:
        pc.stack_states([pc.init(3, 6, s) for s in sizes])
    assert "\n" not in str(failure.value)
    routes = _routes(7)
    policy = pc.FetchPolicy.fraction(0.4)
    alone = [_run(pc.init(3, 6, s), routes, policy) for s in sizes]
    batch = pc.stack_states([pc.init(3, 6, s) for s in sizes], capacity=12)
    step = jax.jit(jax.vmap(pc.ensure_hybrid, in_axes=(0, None, None, None)))
    plans = []
    for token in routes:
        for layer, layer_routes in enumerate(token):
            batch, plan = step(batch, layer, layer_routes, policy)
            plans.append(plan)
    for i, (state, expected) in enumerate(alone):
        got = pc.take_state(batch, i)
        # Same usable part; the padded slots stay empty with usage 0.
        C = state.capacity
        usable = got.residency.replace(id_of_slot=got.residency.id_of_slot[:C],
                                       usage=got.residency.usage[:C])
        pct.assert_states_equal(got.replace(residency=usable), state)
        assert np.all(np.asarray(got.residency.id_of_slot[C:]) == -1)
        pct.check_state(got)  # the padded slots are unusable: empty, usage 0
        for plan, want in zip(plans, expected):
            one = jax.tree.map(lambda x: x[i], plan)
            for name in ("slots", "cpu", "active", "missing", "fetched", "error"):
                np.testing.assert_array_equal(getattr(one, name), getattr(want, name), name)
            np.testing.assert_array_equal(one.copy.dst_slots, want.copy.dst_slots)
            np.testing.assert_array_equal(one.copy.src_rows, want.copy.src_rows)


def test_stack_states_names_what_differs():
    """FAILS if states of another model, eviction or ring stack silently (a vmap over them
    would then fail far from the cause) or the message does not name both."""
    with pytest.raises(ValueError, match=r"states\[0\] \(L=2.*states\[1\] \(L=3"):
        pc.stack_states([pc.init(2, 4, 4), pc.init(3, 4, 4)])
    with pytest.raises(ValueError, match="eviction=lru.*eviction=pair_lfu"):
        pc.stack_states([pc.init(2, 4, 4), pc.init(2, 4, 4, eviction="pair_lfu")])
    with pytest.raises(ValueError, match="history=4.*history=5"):
        pc.stack_states([pc.init(2, 4, 4, eviction="route_knn", history=4),
                         pc.init(2, 4, 4, eviction="route_knn", history=5)])
    with pytest.raises(ValueError, match="at least one"):
        pc.stack_states([])
    with pytest.raises(ValueError, match="below the state's capacity 8"):
        pad_capacity(pc.init(2, 4, 8), 6)


def test_stats_and_describe_read_a_batch_per_cache():
    """FAILS if stats, layer_stats or per_layer_stats of a batch differ from those of each
    cache alone (e.g. summed over the batch, or the batch axis taken for the layer axis), or
    describe of a batch is not each cache's view."""
    policy = pc.FetchPolicy.fraction(0.5)
    states = [_run(pc.init(3, 6, 8), _routes(seed), policy)[0] for seed in range(3)]
    batch = pc.stack_states(states)
    totals = pc.stats(batch)
    per_layer = pc.per_layer_stats(batch)
    for i, state in enumerate(states):
        one = pc.stats(state)
        for name in ("calls", "active", "missing", "fetched", "cpu_experts", "miss_rate",
                     "fetch_rate", "fetched_per_call"):
            assert getattr(totals, name)[i] == getattr(one, name), name
        assert pc.layer_stats(batch, 2).active[i] == pc.layer_stats(state, 2).active
        assert [s.missing[i] for s in per_layer] == [s.missing for s in pc.per_layer_stats(state)]
        assert str(pc.describe(batch)[i]) == str(pc.describe(state))
    assert totals.missing.shape == (3,) and isinstance(pc.stats(states[0]).missing, int)
    empty = pc.stats(pc.stack_states([pc.init(1, 2, 2), pc.init(1, 2, 2)]))
    np.testing.assert_array_equal(empty.miss_rate, [0.0, 0.0])
    with pytest.raises(ValueError, match="take_state"):
        pc.routing_skew(batch)


def test_cache_stats_count_the_cpu_experts_the_plans_gave():
    """FAILS if CacheStats.cpu_experts is not the distinct CPU experts per call summed over the
    plans (e.g. the CPU routes, which count duplicates and tokens, or fetched - missing), or the
    numbers do not add up: hits + fetched + cpu_experts == active."""
    routes = _routes(3)
    state, plans = _run(pc.init(3, 6, 8), routes, pc.FetchPolicy.fraction(0.3))
    flat = routes.reshape(-1, routes.shape[-1])
    cpu_experts = sum(np.unique(r[np.asarray(p.cpu)]).size for r, p in zip(flat, plans))
    cpu_routes = sum(int(np.asarray(p.cpu).sum()) for p in plans)
    totals = pc.stats(state)
    assert totals.cpu_experts == cpu_experts > 0
    assert cpu_routes > cpu_experts  # the routes count duplicates: a different number
    assert totals.hits + totals.fetched + totals.cpu_experts == totals.active
    assert totals.cpu_experts_per_call == cpu_experts / totals.calls
    plain, _ = pc.ensure(pc.init(3, 6, 8), 0, np.array([1, 2, 3]))
    assert pc.stats(plain).cpu_experts == 0


def test_host_reports_under_jit_say_so_in_one_line():
    """FAILS if stats or describe under jit raise JAX's TracerArrayConversionError instead of
    saying that they read the host and what to do."""
    state = pc.init(2, 4, 4)
    for report in (pc.stats, pc.describe):
        with pytest.raises(TypeError, match="on the host") as failure:
            jax.jit(report)(state)
        assert "\n" not in str(failure.value)


def test_a_traced_fraction_points_to_the_forms_that_work():
    """FAILS if FetchPolicy.fraction of a traced q raises JAX's conversion error instead of
    naming the forms that work, or the device form it names builds a different policy than
    the host constructor (for fractions exact in float32)."""
    with pytest.raises(TypeError, match=r"cannot be traced.*FetchPolicy\(fraction16="):
        jax.jit(pc.FetchPolicy.fraction)(0.4)

    @jax.jit
    def on_device(q):
        return pc.FetchPolicy(fraction16=jnp.round(q * 65536).astype(jnp.int32),
                              cap=jnp.int32(0))

    for q in (0.0, 0.25, 0.4, 0.5, 1.0):
        pct.assert_plans_equal(on_device(jnp.float32(q)), pc.FetchPolicy.fraction(q))


def test_the_decode_loop_example_prints_counts_that_add_up(capsys):
    """FAILS if examples/decode_loop.py's line does not say what each number counts, or its
    numbers do not add up (routed = hits + fetched + cpu, missing = fetched + cpu), as the
    line printed missing, fetched and CPU routes, which no sum relates."""
    import importlib.util
    import re
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "decode_loop.py"
    spec = importlib.util.spec_from_file_location("decode_loop_counts", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    module.main(num_steps=6)
    out = capsys.readouterr().out
    assert "routed = hits + fetched + cpu" in out and "cpu routes: every (row, route)" in out
    rows = re.findall(r"routed=(\d+) = hits (\d+) \+ fetched (\d+) \+ cpu (\d+) "
                      r"\(missing=(\d+)\)  cpu routes=(\d+)", out)
    assert len(rows) == 6, out
    for routed, hits, fetched, cpu, missing, cpu_routes in (map(int, r) for r in rows):
        assert routed == hits + fetched + cpu and missing == fetched + cpu
        assert cpu_routes >= cpu


@pytest.mark.parametrize("capacity, message", [
    (2**31, r"capacity must fit in int32 \(<= 2147483647\), got 2147483648"),
    (2**40, r"capacity must fit in int32"),
    (2**31 - 8, r"clock stamps leave the int32 clock no room"),
])
def test_pad_capacity_refuses_what_init_refuses_before_allocating(monkeypatch, capacity, message):
    """FAILS if ``pad_capacity`` / ``stack_states(capacity=2**31)`` allocate the padding (8 GiB;
    4 TiB at 2**40) before any check, where ``init(capacity=2**31)`` refuses the same value.
    ``jnp.full`` is replaced by a tripwire: nothing may be allocated."""
    state = pc.init(2, 4, 8)

    def tripwire(*args, **kwargs):
        raise AssertionError("allocated before the capacity was checked")

    monkeypatch.setattr(jnp, "full", tripwire)
    with pytest.raises(ValueError, match=message):
        pad_capacity(state, capacity)
    with pytest.raises(ValueError, match=message):
        pc.stack_states([state, state], capacity=capacity)


def test_pad_capacity_takes_a_concrete_integer_array_as_init_does():
    state = pc.init(2, 4, 8)
    for capacity in (jnp.int32(10), np.int64(10)):
        assert pad_capacity(state, capacity).capacity == 10
        assert pc.stack_states([state], capacity=capacity).capacity == 10
    with pytest.raises(TypeError, match="capacity must be an integer"):
        pad_capacity(state, 10.0)
