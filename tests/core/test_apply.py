"""Applying plans to weights (pallas_cache.moe): ``apply_copy_plan`` and ``moe_combine`` on
hand-made plans (exactly the counted rows, padding, NaN isolation, jit/scan/vmap, host banks, the
geometry and range checks), and examples/decode_loop.py end to end: every step of the cached
hybrid path equals the dense MoE, and the comparison fails when a plan is corrupted."""

import dataclasses
import importlib.util
import pathlib
import sys
import warnings

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

import pallas_cache as pc
from pallas_cache.moe import apply_copy_plan, host_memory_kind, memory_space, put_host_bank
from pallas_cache.testing import moe_combine, moe_dense
from pallas_cache.reference import moe as reference_moe

from tests.harness import examples


def _load_example():
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "decode_loop.py"
    spec = importlib.util.spec_from_file_location("decode_loop_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


decode_loop = _load_example()

S, E, ROW = 6, 4, 3
SENTINEL = -7.0  # what an untouched pool slot holds


def _bank():
    """Host bank: every row distinct, and none equal to the sentinel."""
    return jnp.arange(E * ROW, dtype=jnp.float32).reshape(E, ROW) + 100.0


def _pool():
    return jnp.full((S, ROW), SENTINEL, jnp.float32)


def _copy(dst, src, count):
    return pc.CopyPlan(dst_slots=jnp.asarray(dst, jnp.int32), src_rows=jnp.asarray(src, jnp.int32),
                       count=jnp.asarray(count, jnp.int32))


def _expected(pool, bank, writes):
    expected = np.array(pool)
    for slot, row in writes:
        expected[slot] = np.asarray(bank)[row]
    return expected


# --- apply_copy_plan -----------------------------------------------------------------------------

def test_copies_exactly_the_counted_entries():
    pool, bank = _pool(), _bank()
    new_pool = apply_copy_plan(pool, bank, _copy([3, 0, -1, -1], [2, 1, -1, -1], 2))
    np.testing.assert_array_equal(new_pool, _expected(pool, bank, [(3, 2), (0, 1)]))


def test_entries_past_count_write_nothing_even_if_they_look_valid():
    pool, bank = _pool(), _bank()
    new_pool = apply_copy_plan(pool, bank, _copy([1, 2, 4, 5], [0, 1, 2, 3], 1))
    np.testing.assert_array_equal(new_pool, _expected(pool, bank, [(1, 0)]))


def test_padding_entry_never_wraps_to_the_last_slot():
    # A -1 inside count (or a -1 source) must be dropped, not written to slot S-1 / read from row
    # E-1 by negative indexing.
    pool, bank = _pool(), _bank()
    new_pool = apply_copy_plan(pool, bank, _copy([2, -1, 4, -1], [1, 3, -1, -1], 4))
    np.testing.assert_array_equal(new_pool, _expected(pool, bank, [(2, 1)]))
    assert np.all(np.asarray(new_pool[S - 1]) == SENTINEL)


def test_zero_count_is_the_identity():
    pool, bank = _pool(), _bank()
    new_pool = apply_copy_plan(pool, bank, _copy([0, 1, 2, 3], [0, 1, 2, 3], 0))
    np.testing.assert_array_equal(new_pool, pool)


def test_accepts_an_ensure_plan_and_fills_every_resident_slot():
    state, plan = jax.jit(pc.ensure)(pc.init(2, E, S), 1, jnp.array([3, 0, 3, -1], jnp.int32))
    new_pool = np.asarray(jax.jit(apply_copy_plan)(_pool(), _bank(), plan))
    slot_for_id, bank = np.asarray(state.residency.slot_for_id), np.asarray(_bank())
    assert int(plan.copy.count) == 2
    written = {int(slot_for_id[1, expert]) for expert in (0, 3)}
    assert len(written) == 2
    for expert in (0, 3):
        np.testing.assert_array_equal(new_pool[slot_for_id[1, expert]], bank[expert])
    for slot in set(range(S)) - written:  # and nothing else was written
        assert np.all(new_pool[slot] == SENTINEL)


def test_pytree_weights_and_a_whole_model_bank_with_traced_layer():
    num_layers = 3
    bank = {
        "w": jnp.arange(num_layers * E * 2 * 2, dtype=jnp.float32).reshape(num_layers, E, 2, 2),
        "b": jnp.arange(num_layers * E, dtype=jnp.int32).reshape(num_layers, E),
    }
    pool = {"w": jnp.zeros((S, 2, 2), jnp.float32), "b": jnp.full((S,), -1, jnp.int32)}
    copy = _copy([5, 1, -1], [2, 0, -1], 2)

    @jax.jit
    def apply_at(pool, layer):
        return apply_copy_plan(pool, bank, copy, layer=layer)

    for layer in range(num_layers):
        got = apply_at(pool, layer)
        want = jax.tree.map(lambda p, b: p.at[jnp.array([5, 1])].set(b[layer][jnp.array([2, 0])]),
                            pool, bank)
        jax.tree.map(np.testing.assert_array_equal, got, want)


def test_jit_with_donation_and_scan_match_the_eager_loop():
    plans = [_copy([0, 1, -1], [3, 2, -1], 2), _copy([4, -1, -1], [0, -1, -1], 1),
             _copy([1, 5, 2], [1, 1, 0], 3), _copy([-1, -1, -1], [-1, -1, -1], 0)]
    bank = _bank()

    eager = _pool()
    for plan in plans:
        eager = apply_copy_plan(eager, bank, plan)

    donated_step = jax.jit(apply_copy_plan, donate_argnums=0)
    jitted = _pool()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # backends without donation warn
        for plan in plans:
            jitted = donated_step(jitted, bank, plan)

    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *plans)
    scanned, _ = jax.jit(lambda pool: lax.scan(
        lambda pool, plan: (apply_copy_plan(pool, bank, plan), None), pool, stacked))(_pool())

    np.testing.assert_array_equal(jitted, eager)
    np.testing.assert_array_equal(scanned, eager)
    # the sequence really wrote something, including the overwrite of slot 1 by row 1
    np.testing.assert_array_equal(eager[1], bank[1])
    np.testing.assert_array_equal(eager[4], bank[0])


def test_vmap_over_a_batch_of_pools_and_plans():
    plans = [_copy([1, -1], [2, -1], 1), _copy([0, 3], [1, 3], 2)]
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *plans)
    pools = jnp.stack([_pool(), _pool()])
    batched = jax.jit(jax.vmap(apply_copy_plan, in_axes=(0, None, 0)))(pools, _bank(), stacked)
    for i, plan in enumerate(plans):
        np.testing.assert_array_equal(batched[i], apply_copy_plan(_pool(), _bank(), plan))
    assert not np.array_equal(batched[0], batched[1])


def test_host_bank_placement_gives_identical_results():
    bank = jnp.arange(2 * E * ROW, dtype=jnp.float32).reshape(2, E, ROW)
    host_bank = put_host_bank(bank)
    kind = host_memory_kind()
    assert host_bank.sharding.memory_kind == (kind or jax.devices()[0].default_memory().kind)
    copy = _copy([2, 0, -1], [3, 1, -1], 2)
    step = jax.jit(lambda pool, b, layer: apply_copy_plan(pool, b, copy, layer=layer))
    for layer in range(2):
        np.testing.assert_array_equal(step(_pool(), host_bank, layer), step(_pool(), bank, layer))
    # the pool stays in device memory
    assert step(_pool(), host_bank, 1).sharding.memory_kind == _pool().sharding.memory_kind
    kept_on_device = put_host_bank(bank, prefer_host=False)
    assert kept_on_device.sharding.memory_kind == jax.devices()[0].default_memory().kind



def _host_bank_or_skip(bank):
    host_bank = put_host_bank(bank)
    if memory_space(host_bank) is None or host_memory_kind() is None:
        pytest.skip("no host memory space on this backend")
    return host_bank


def _gathers_from(space, fn, *args):
    """The gathers in ``fn``'s jaxpr (nested ones included) whose operand lives in ``space``."""
    def gathers(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "gather":
                yield eqn
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from gathers(sub)

    jaxpr = jax.make_jaxpr(fn)(*args)
    return [eqn for eqn in gathers(jaxpr.jaxpr)
            if getattr(eqn.invars[0].aval, "memory_space", None) == space]


def test_a_host_bank_is_read_by_row_slices_not_by_a_gather():
    """FAILS if rows of a bank in host memory are read by a gather: XLA:GPU does not compile a
    gather from host memory ("Bitcast cannot have different memory spaces", seen on an H200 with
    jax 0.11.2 for apply_copy_plan, moe_dense and moe_combine alike), so the decode loop would
    not run on a GPU."""
    bank = jnp.arange(2 * E * ROW, dtype=jnp.float32).reshape(2, E, ROW)
    host_bank = _host_bank_or_skip(bank)
    copy = _copy([2, 0, -1], [3, 1, -1], 2)
    apply = lambda pool, b, layer: apply_copy_plan(pool, b, copy, layer=layer)  # noqa: E731
    from_host = _gathers_from(memory_space(host_bank), apply, _pool(), host_bank, 1)
    assert not from_host, f"gathers from host memory: {from_host}"
    # and the rows it copies are the right ones, as from a device bank
    np.testing.assert_array_equal(apply(_pool(), host_bank, 1), apply(_pool(), bank, 1))


def test_a_host_bank_is_read_by_row_slices_under_vmap():
    """FAILS if batching the row copies turns them into a gather: JAX refuses a gather whose
    operand is in host memory ("memory_space of all inputs passed to `gather` must be the
    same"), so vmapping apply_copy_plan, moe_dense or moe_combine over a batch of plans, layers,
    pools or tokens with a put_host_bank bank raised, on the CPU as on a GPU. Each batched call
    must also give what a device bank gives, and a batch of host banks (nested vmap included)
    what each bank gives on its own."""
    bank = jnp.arange(2 * E * ROW, dtype=jnp.float32).reshape(2, E, ROW)
    host_bank = _host_bank_or_skip(bank)
    space = memory_space(host_bank)
    copies = pc.CopyPlan(dst_slots=jnp.asarray([[2, 0, -1], [1, 5, 4]], jnp.int32),
                         src_rows=jnp.asarray([[3, 1, -1], [0, 2, 3]], jnp.int32),
                         count=jnp.asarray([2, 3], jnp.int32))
    layers = jnp.asarray([1, 0], jnp.int32)
    pools = jnp.stack([_pool(), _pool() - 1.0])
    x = jnp.arange(2 * 3 * ROW, dtype=jnp.float32).reshape(2, 3, ROW) / 10.0
    ids = jnp.asarray([[[0, 3], [2, -1], [1, 1]], [[3, 2], [-1, -1], [0, 1]]], jnp.int32)
    gates = jnp.full(ids.shape, 0.5, jnp.float32)
    weight = lambda w, v: w * v  # noqa: E731  (rows are [ROW], like the tokens)
    cases = {
        "plans": (jax.vmap(lambda c, b: apply_copy_plan(_pool(), b, c, layer=1),
                           in_axes=(0, None)), (copies,)),
        "plans and layers": (jax.vmap(lambda c, l, b: apply_copy_plan(_pool(), b, c, layer=l),
                                      in_axes=(0, 0, None)), (copies, layers)),
        "pools and plans": (jax.vmap(lambda p, c, b: apply_copy_plan(p, b, c, layer=1),
                                     in_axes=(0, 0, None)), (pools, copies)),
        "moe_dense over token batches and layers": (
            jax.vmap(lambda v, i, g, l, b: moe_dense(v, i, g, b, weight, layer=l),
                     in_axes=(0, 0, 0, 0, None)), (x, ids, gates, layers)),
        "moe_combine with plans": (
            jax.vmap(lambda v, i, g, c, b: moe_combine(
                v, i, g, pc.EnsurePlan(slots=jnp.full(i.shape, -1, jnp.int32),
                                       cpu=i >= 0, copy=c, active=0, missing=0, fetched=0,
                                       error=0), _pool(), b, weight, layer=1),
                     in_axes=(0, 0, 0, 0, None)), (x, ids, gates, copies)),
    }
    for name, (fn, args) in cases.items():
        assert not _gathers_from(space, fn, *args, host_bank), f"{name}: gathers from host memory"
        np.testing.assert_array_equal(fn(*args, host_bank), fn(*args, bank), err_msg=name)

    # A batch of host banks, and a vmap nested in another.
    banks = jnp.stack([bank, bank * 2.0 + 1.0])
    host_banks = put_host_bank(banks)
    per_bank = jax.vmap(lambda b, c: apply_copy_plan(_pool(), b, c, layer=1))
    assert not _gathers_from(space, per_bank, host_banks, copies)
    np.testing.assert_array_equal(per_bank(host_banks, copies), per_bank(banks, copies))
    nested = jax.jit(jax.vmap(jax.vmap(lambda c, b: apply_copy_plan(_pool(), b, c, layer=0),
                                       in_axes=(0, None)), in_axes=(None, 0)))
    np.testing.assert_array_equal(nested(copies, host_banks), nested(copies, banks))
    assert nested(copies, host_banks).shape == (2, 2, S, ROW)


def test_structure_mismatch_is_rejected():
    with pytest.raises(ValueError, match="structure"):
        apply_copy_plan({"w": _pool()}, _bank(), _copy([0], [0], 1))
    with pytest.raises(ValueError, match="rows"):
        apply_copy_plan(_pool(), jnp.zeros((E, ROW + 1)), _copy([0], [0], 1))


# --- bad layers and bad entries (docs/semantics.md §5.13) ---------------------------------------

NUM_LAYERS = 3


def _layered_bank():
    """[L, E, ROW], every row of every layer distinct."""
    return jnp.arange(NUM_LAYERS * E * ROW, dtype=jnp.float32).reshape(NUM_LAYERS, E, ROW) + 100.0


@pytest.mark.parametrize("layer", [NUM_LAYERS, NUM_LAYERS + 3, -1, -5, 2**31 - 1, 2**40])
def test_a_python_int_layer_out_of_range_is_refused_naming_it_and_L(layer):
    """FAILS if a Python-int layer outside [0, L) is accepted: layer L+3, -1 and 2**31-1 copied
    the last layer's rows and -5 layer 0's, silently."""
    copy = _copy([1, -1], [2, -1], 1)
    with pytest.raises(ValueError, match=rf"layer {layer} is outside \[0, {NUM_LAYERS}\)"):
        apply_copy_plan(_pool(), _layered_bank(), copy, layer=layer)
    with pytest.raises(ValueError, match=rf"layer {layer} is outside"):  # a constant under jit
        jax.jit(lambda pool: apply_copy_plan(pool, _layered_bank(), copy, layer=layer))(_pool())


def test_a_traced_layer_out_of_range_writes_nothing():
    """FAILS if a traced layer outside [0, L) writes the clamped layer's rows (the last layer's
    for L, L+3, -1 and 2**31-1, layer 0's for -5) instead of returning the pool unchanged."""
    copy = _copy([1, 4, -1], [2, 0, -1], 2)
    step = jax.jit(lambda pool, layer: apply_copy_plan(pool, _layered_bank(), copy, layer=layer))
    for layer in (NUM_LAYERS, NUM_LAYERS + 3, -1, -5, 2**31 - 1, -(2**31)):
        np.testing.assert_array_equal(step(_pool(), jnp.int32(layer)), _pool(),
                                      err_msg=f"layer {layer}")
    for layer in range(NUM_LAYERS):  # and an in-range layer still copies its own rows
        np.testing.assert_array_equal(
            step(_pool(), jnp.int32(layer)),
            _expected(_pool(), _layered_bank()[layer], [(1, 2), (4, 0)]))


@pytest.mark.parametrize("dst, src, match", [
    ([1, 20], [2, 3], r"copy entry 1: dst_slots\[1\] = 20 is outside \[0, 6\)"),
    ([1, 2], [2, 9], r"copy entry 1: src_rows\[1\] = 9 is outside \[0, 4\)"),
    ([S, 2], [2, 3], r"copy entry 0: dst_slots\[0\] = 6 is outside \[0, 6\)"),
    ([1, 2], [E, 3], r"copy entry 0: src_rows\[0\] = 4 is outside \[0, 4\)"),
])
def test_a_concrete_hand_built_entry_out_of_range_is_refused_naming_it(dst, src, match):
    """FAILS if a hand-built plan's out-of-range entry is accepted: a row past E copied row E-1
    (a clamped gather) and a slot past S was dropped, both without a word."""
    copy = _copy(dst, src, 2)
    with pytest.raises(ValueError, match=match):
        apply_copy_plan(_pool(), _bank(), copy)
    with pytest.raises(ValueError, match=match):  # a constant plan under jit is seen too
        jax.jit(lambda pool: apply_copy_plan(pool, _bank(), copy))(_pool())


def test_out_of_range_entries_past_count_or_beside_padding_are_not_refused():
    """FAILS if the entry check looks at entries that are not counted: past ``count``, or
    padding (a -1 slot or row) inside it, which write nothing whatever else they hold."""
    new_pool = apply_copy_plan(_pool(), _bank(), _copy([1, -1, 50, 70], [2, 40, -1, 80], 3))
    np.testing.assert_array_equal(new_pool, _expected(_pool(), _bank(), [(1, 2)]))


def test_a_traced_entry_out_of_range_copies_nothing_never_a_clamped_row():
    """FAILS if a traced src_rows[i] >= E copies the clamped row E-1 (or a traced slot >= S
    writes anything); the in-range entries beside it are still copied."""
    step = jax.jit(apply_copy_plan)
    got = step(_pool(), _bank(), _copy([1, 2, S + 14, 3], [9, 0, 1, E], 4))
    np.testing.assert_array_equal(got, _expected(_pool(), _bank(), [(2, 0)]))


@examples(1.0)
@given(data=st.data())
def test_bad_layers_and_entries_match_the_reference_eager_and_traced(data):
    """FAILS if the JAX function and the NumPy reference (reference/moe.py) disagree on any plan
    of in-range, padding and out-of-range entries with any layer: eagerly both raise or both
    return the same pool; traced (jit, donated pool) the pool equals the reference's
    ``traced=True`` one."""
    width = 4
    entry = st.integers(-3, 9)
    dst = data.draw(st.lists(entry, min_size=width, max_size=width), label="dst_slots")
    src = data.draw(st.lists(entry, min_size=width, max_size=width), label="src_rows")
    count = data.draw(st.integers(-1, width + 1), label="count")
    layer = data.draw(st.integers(-2, NUM_LAYERS + 1), label="layer")
    copy = _copy(dst, src, count)
    bank, pool = np.asarray(_layered_bank()), np.asarray(_pool())
    ref_copy = reference_moe.apply_copy_plan
    try:
        want = ref_copy(pool, bank, copy, layer=layer)
    except ValueError:
        want = None
    if want is None:
        with pytest.raises(ValueError):
            apply_copy_plan(_pool(), _layered_bank(), copy, layer=layer)
    else:
        np.testing.assert_array_equal(
            apply_copy_plan(_pool(), _layered_bank(), copy, layer=layer), want)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # backends without donation warn
        got = _DONATED_LAYERED(_pool(), _layered_bank(), copy, jnp.int32(layer))
    np.testing.assert_array_equal(got, ref_copy(pool, bank, copy, layer=layer, traced=True))


_DONATED_LAYERED = jax.jit(lambda pool, bank, copy, layer: apply_copy_plan(pool, bank, copy,
                                                                           layer=layer),
                           donate_argnums=0)


# --- a plan refuses a pool or bank of another geometry (docs/semantics.md §5.13) ----------------
# The plan knows (statically) the pool size and experts per layer it was made for; a mismatch is
# a shape error, raised at trace time naming both shapes.

PLAN_L, PLAN_E, PLAN_S, PLAN_H = 2, 8, 16, 4


def _geometry_plan():
    state = pc.init(PLAN_L, PLAN_E, PLAN_S)
    state, plan = pc.ensure(state, 0, jnp.array([6, 7]))
    return plan


def _expert(weights, x):
    return weights * x


def test_a_pool_with_fewer_slots_than_the_plan_is_refused():
    """FAILS if a 4-row pool for an S=16 plan is accepted: it wrote 0 of 2 copies, no error."""
    plan = _geometry_plan()
    bank = jnp.arange(PLAN_E * PLAN_H, dtype=jnp.float32).reshape(PLAN_E, PLAN_H)
    with pytest.raises(ValueError, match=r"pool of 16 slots.*\(4, 4\)"):
        pc.apply_copy_plan(jnp.zeros((4, PLAN_H)), bank, plan)
    with pytest.raises(ValueError, match="pool of 16 slots"):
        jax.jit(pc.apply_copy_plan).trace(jnp.zeros((4, PLAN_H)), bank, plan)


def test_a_bank_with_fewer_experts_than_the_plan_is_refused():
    """FAILS if a 4-row bank for E=8 is accepted: experts 6 and 7 were both read from row 3."""
    plan = _geometry_plan()
    with pytest.raises(ValueError, match=r"8 experts per layer.*\(4, 4\)"):
        pc.apply_copy_plan(jnp.zeros((PLAN_S, PLAN_H)), jnp.ones((4, PLAN_H)), plan)
    with pytest.raises(ValueError, match=r"8 experts per layer.*\(2, 4, 4\)"):
        pc.apply_copy_plan(jnp.zeros((PLAN_S, PLAN_H)), jnp.ones((PLAN_L, 4, PLAN_H)), plan,
                           layer=0)


def test_moe_combine_refuses_mismatched_geometry_and_matches_dense_when_right():
    """FAILS if moe_combine accepts a short pool (it returned 0.0 where the dense MoE gives the
    real output), or if the check rejects a matching geometry."""
    plan = _geometry_plan()
    bank = jnp.arange(PLAN_E * PLAN_H, dtype=jnp.float32).reshape(PLAN_E, PLAN_H) + 1
    pool = pc.apply_copy_plan(jnp.zeros((PLAN_S, PLAN_H)), bank, plan)
    x = jnp.ones((1, PLAN_H))
    ids, gates = jnp.array([[6, 7]]), jnp.array([[0.5, 0.5]])
    np.testing.assert_allclose(moe_combine(x, ids, gates, plan, pool, bank, _expert),
                               moe_dense(x, ids, gates, bank, _expert))
    with pytest.raises(ValueError, match="pool of 16 slots"):
        moe_combine(x, ids, gates, plan, pool[:4], bank, _expert)
    with pytest.raises(ValueError, match="8 experts per layer"):
        moe_combine(x, ids, gates, plan, pool, bank[:4], _expert)


def test_a_hand_built_copy_plan_carries_no_geometry_and_is_not_checked():
    """FAILS if a CopyPlan built by hand (no geometry) is refused."""
    copy = pc.CopyPlan(dst_slots=jnp.array([1, -1]), src_rows=jnp.array([2, -1]),
                       count=jnp.int32(1))
    pool = pc.apply_copy_plan(jnp.zeros((4, PLAN_H)), jnp.ones((3, PLAN_H)), copy)
    assert float(pool[1].sum()) == PLAN_H


def test_a_hand_built_copy_plan_is_checked_entry_by_entry_against_the_shapes():
    """FAILS if a hand-built plan (no geometry) with src_rows = 9 on an E = 8 bank copies row 7
    (a clamped gather), or one with dst_slots = 20 on a 16-slot pool is dropped without a word."""
    bank = jnp.arange(PLAN_E * PLAN_H, dtype=jnp.float32).reshape(PLAN_E, PLAN_H)
    rows = pc.CopyPlan(dst_slots=jnp.array([3, -1]), src_rows=jnp.array([9, -1]),
                       count=jnp.int32(1))
    with pytest.raises(ValueError, match=r"src_rows\[0\] = 9 is outside \[0, 8\)"):
        pc.apply_copy_plan(jnp.zeros((PLAN_S, PLAN_H)), bank, rows)
    slots = pc.CopyPlan(dst_slots=jnp.array([20, -1]), src_rows=jnp.array([2, -1]),
                        count=jnp.int32(1))
    with pytest.raises(ValueError, match=r"dst_slots\[0\] = 20 is outside \[0, 16\)"):
        pc.apply_copy_plan(jnp.zeros((PLAN_S, PLAN_H)), bank, slots)
    traced = jax.jit(pc.apply_copy_plan)(jnp.zeros((PLAN_S, PLAN_H)), bank, rows)
    np.testing.assert_array_equal(traced, jnp.zeros((PLAN_S, PLAN_H)))  # traced: nothing, not row 7


# --- moe_combine / moe_dense ---------------------------------------------------------------------

def _linear(weights, x):
    return weights @ x


def test_combine_sums_device_and_cpu_partials_and_ignores_padding():
    hidden = 2
    bank = jnp.stack([jnp.eye(hidden) * (e + 1) for e in range(E)])  # expert e scales by e+1
    x = jnp.array([[1.0, 2.0], [3.0, -1.0]])
    expert_ids = jnp.array([[0, 2], [1, -1]], jnp.int32)
    gates = jnp.array([[0.25, 0.75], [0.5, 123.0]])
    # expert 0 on device in slot 4, expert 2 on the CPU, expert 1 on device in slot 0
    pool = jnp.full((S, hidden, hidden), jnp.nan).at[4].set(bank[0]).at[0].set(bank[1])
    plan = pc.EnsurePlan(
        slots=jnp.array([[4, -1], [0, -1]], jnp.int32),
        cpu=jnp.array([[False, True], [False, False]]),
        copy=_copy([-1], [-1], 0), active=jnp.int32(3), missing=jnp.int32(0),
        fetched=jnp.int32(0), error=jnp.int32(0))

    combined = moe_combine(x, expert_ids, gates, plan, pool, bank, _linear)
    want = np.array([[1.0, 2.0], [3.0, -1.0]]) * np.array([[0.25 * 1 + 0.75 * 3], [0.5 * 2]])
    np.testing.assert_allclose(combined, want, rtol=1e-6)
    np.testing.assert_allclose(moe_dense(x, expert_ids, gates, bank, _linear), want, rtol=1e-6)
    assert np.all(np.isfinite(np.asarray(combined)))  # the NaN slots were never read into a sum


def test_combine_detects_a_route_pointing_at_the_wrong_slot():
    hidden = 2
    bank = jnp.stack([jnp.eye(hidden) * (e + 1) for e in range(E)])
    pool = jnp.zeros((S, hidden, hidden)).at[1].set(bank[3]).at[2].set(bank[0])
    x = jnp.array([[1.0, 1.0]])
    expert_ids = jnp.array([[3]], jnp.int32)
    gates = jnp.ones((1, 1))

    def plan_with_slot(slot):
        return pc.EnsurePlan(slots=jnp.array([[slot]], jnp.int32), cpu=jnp.array([[False]]),
                             copy=_copy([-1], [-1], 0), active=jnp.int32(1),
                             missing=jnp.int32(0), fetched=jnp.int32(0), error=jnp.int32(0))

    dense = moe_dense(x, expert_ids, gates, bank, _linear)
    np.testing.assert_allclose(moe_combine(x, expert_ids, gates, plan_with_slot(1), pool, bank,
                                           _linear), dense)
    assert not np.allclose(moe_combine(x, expert_ids, gates, plan_with_slot(2), pool, bank,
                                       _linear), dense)


# --- the compiled decode loop of examples/decode_loop.py -----------------------------------------

CONFIG = decode_loop.ModelConfig()
NUM_STEPS = 200
TOLERANCE = 1e-5
POLICIES = {
    "full": pc.FetchPolicy.full(),
    "fraction:0.4": pc.FetchPolicy.fraction(0.4),
    "cap:1": pc.FetchPolicy.fixed_cap(1),
}


@pytest.fixture(scope="module")
def model():
    params = decode_loop.init_params(7, CONFIG)
    params = dataclasses.replace(params, experts=put_host_bank(params.experts))
    tokens = decode_loop.make_tokens(8, NUM_STEPS, CONFIG)
    assert np.any(np.asarray(tokens) < 0), "the stream should contain padding rows"
    return params, tokens


def _assert_matches_dense(result):
    error = np.abs(np.asarray(result.cached) - np.asarray(result.dense))
    worst_step = int(np.argmax(error.max(axis=(1, 2))))
    assert error.max() <= TOLERANCE, f"cached != dense, worst step {worst_step}: {error.max():.3g}"


@pytest.mark.parametrize("cache_size", [CONFIG.num_experts, 3 * CONFIG.num_experts],
                         ids=["S=E", "S=3E"])
def test_every_step_of_the_cached_loop_equals_the_dense_moe(model, cache_size):
    params, tokens = model
    L = CONFIG.num_layers
    for name, policy in POLICIES.items():
        result = decode_loop.decode(params, tokens, cache_size, policy, config=CONFIG)
        _assert_matches_dense(result)
        counters = pc.stats(result.state)
        assert int(result.state.step) == NUM_STEPS * L
        # the run exercised what it claims to: fetches beyond the pool size (so evictions)...
        assert counters.fetched > cache_size, name
        assert int(jnp.sum(result.fetched)) == counters.fetched
        # ...and CPU routes exactly when the policy caps fetches
        cpu_routes = int(jnp.sum(result.cpu_routes))
        if name == "full":
            assert cpu_routes == 0 and counters.fetched == counters.missing
        else:
            assert cpu_routes > 0 and counters.fetched < counters.missing, name
        # every resident slot of the final pool holds the bytes of the expert the state names
        id_of_slot = np.asarray(result.state.residency.id_of_slot)
        for leaf_name, bank_leaf in params.experts.items():
            pool_leaf, bank_leaf = np.asarray(result.pool[leaf_name]), np.asarray(bank_leaf)
            for slot in np.flatnonzero(id_of_slot >= 0):
                layer, expert = divmod(int(id_of_slot[slot]), CONFIG.num_experts)
                np.testing.assert_array_equal(pool_leaf[slot], bank_leaf[layer, expert])
        # outputs are not trivially zero: the experts did contribute
        assert float(jnp.max(jnp.abs(result.dense - params.embed[jnp.maximum(tokens, 0)]))) > 0.1


def _route_reads_its_neighbours_slot(plan):
    """Route (0, 0) reads the slot of route (0, 1) -- another expert -- when both are on device."""
    slots = plan.slots
    both_on_device = (slots[0, 0] >= 0) & (slots[0, 1] >= 0)
    return dataclasses.replace(
        plan, slots=slots.at[0, 0].set(jnp.where(both_on_device, slots[0, 1], slots[0, 0])))


def _last_copy_dropped(plan):
    """The last fetched expert is never copied: its slot keeps the bytes of the evicted one."""
    copy = plan.copy
    return dataclasses.replace(plan, copy=dataclasses.replace(
        copy, count=jnp.maximum(copy.count - 1, 0)))


@pytest.mark.parametrize("tamper", [_route_reads_its_neighbours_slot, _last_copy_dropped],
                         ids=["wrong-slot", "dropped-copy"])
def test_a_corrupted_plan_is_caught_by_the_same_comparison(model, tamper):
    params, tokens = model
    result = decode_loop.decode(params, tokens, CONFIG.num_experts, pc.FetchPolicy.full(),
                                config=CONFIG, tamper=tamper)
    with pytest.raises(AssertionError, match="cached != dense"):
        _assert_matches_dense(result)
    assert decode_loop.max_error(result) > 1e-2
