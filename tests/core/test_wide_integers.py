"""Wide integer inputs are range-checked before they are narrowed (docs/semantics.md §6): ids,
layers and slots of every integer dtype give the reference's error bits with the state unchanged
(a cast to int32 first would wrap ``2**32 + 3`` into expert 3). The adapters narrow routes to
int32, so the two implementations are called directly; traced int64 runs in an x64 subprocess."""

import subprocess
import sys
import textwrap
import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_cache as pc
from pallas_cache.reference import ReferenceCache, ReferencePolicy

L, E, S = 4, 8, 16
ALL_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
WIDE_DTYPES = [np.int64, np.uint32, np.uint64]


def _wide_values(dtype):
    """Values of ``dtype`` outside int32 whose low 32 bits are a valid id, padding or -1."""
    info = np.iinfo(dtype)
    values = {info.max, info.max - 4}  # low bits of uint32/uint64 max are 0xFFFFFFFF = -1
    if info.max >= 2**32 + 3:
        values |= {2**32 + 3, 2**32 - 1, 2**31}
    if info.min < 0:
        values |= {info.min, -(2**32) + 2}
    if dtype == np.uint32:
        values |= {2**31, 2**32 - 1}
    return sorted(values)


def _jax_state_leaves(state):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(state)]


def _assert_jax_unchanged(before, after):
    for a, b in zip(_jax_state_leaves(before), _jax_state_leaves(after)):
        np.testing.assert_array_equal(a, b)


def _warm_jax():
    state = pc.init(L, E, S)
    for layer, ids in [(0, [1, 2]), (1, [3]), (2, [0, 7])]:
        state, _ = pc.ensure(state, layer, np.array(ids))
    return state


def _warm_reference():
    cache = ReferenceCache(L, E, S)
    for layer, ids in [(0, [1, 2]), (1, [3]), (2, [0, 7])]:
        cache.ensure(layer, np.array(ids))
    return cache


def _reference_snapshot(cache):
    return {name: np.array(operator.attrgetter(name)(cache)).copy()
            for name in ("residency.slot_for_id", "residency.id_of_slot", "residency.usage",
                         "routing.recency", "stats")} | {"step": cache.step}


def _assert_reference_unchanged(before, cache):
    after = _reference_snapshot(cache)
    for name, value in before.items():
        np.testing.assert_array_equal(value, after[name], err_msg=name)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_in_range_ids_of_every_dtype_install_the_same_expert(dtype):
    """FAILS if a narrow or unsigned dtype is refused or read differently from int32."""
    ids = np.array([5, 3], dtype)
    state, plan = pc.ensure(_warm_jax(), np.array(3, dtype), ids)
    cache = _warm_reference()
    ref_plan = cache.ensure(np.array(3, dtype).item(), ids)
    assert int(plan.error) == ref_plan.error == 0
    np.testing.assert_array_equal(np.asarray(plan.slots), ref_plan.slots)
    np.testing.assert_array_equal(np.asarray(state.residency.id_of_slot), cache.residency.id_of_slot)


@pytest.mark.parametrize("dtype", WIDE_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("hybrid", [False, True], ids=["ensure", "ensure_hybrid"])
def test_wide_ids_are_refused_like_the_reference(dtype, hybrid):
    """FAILS if an id is cast to int32 before its range check: 2**32+3 installs expert 3,
    uint32/uint64 max becomes -1 and is ignored as padding, both with error == 0."""
    for value in _wide_values(dtype):
        ids = np.array([1, value], dtype)
        jax_before, ref = _warm_jax(), _warm_reference()
        ref_before = _reference_snapshot(ref)
        if hybrid:
            state, plan = pc.ensure_hybrid(jax_before, 1, ids, pc.FetchPolicy.fraction(0.5))
            ref_plan = ref.ensure_hybrid(1, ids, ReferencePolicy.fraction(0.5))
        else:
            state, plan = pc.ensure(jax_before, 1, ids)
            ref_plan = ref.ensure(1, ids)
        assert ref_plan.error == pc.ERR_EXPERT_ID, (dtype, value)
        assert int(plan.error) == ref_plan.error, (dtype, value)
        _assert_jax_unchanged(jax_before, state)
        _assert_reference_unchanged(ref_before, ref)
        assert int(plan.copy.count) == 0 and np.all(np.asarray(plan.slots) == -1)


@pytest.mark.parametrize("ids", [[2**32 + 2], [2**70], [-(2**40)], [3, 2**63], [2**64 + 5]],
                         ids=["2^32+2", "2^70", "-2^40", "2^63", "2^64+5"])
def test_python_int_lists_beyond_int32_are_refused(ids):
    """FAILS if a Python list is narrowed first ([2**32 + 2] installs expert 2) or if a list too
    wide for int64 raises instead of setting ERR_EXPERT_ID."""
    before, ref = _warm_jax(), _warm_reference()
    ref_before = _reference_snapshot(ref)
    state, plan = pc.ensure(before, 0, ids)
    assert int(plan.error) == ref.ensure(0, ids).error == pc.ERR_EXPERT_ID
    _assert_jax_unchanged(before, state)
    _assert_reference_unchanged(ref_before, ref)


def _wide_indices():
    cases = [2**31, 2**32 + 1, 2**64, -(2**31) - 1]  # Python ints
    for dtype in WIDE_DTYPES:
        cases += [dtype(v) for v in _wide_values(dtype)]
    return cases


@pytest.mark.parametrize("layer", _wide_indices(), ids=repr)
def test_wide_layers_are_refused_by_every_layer_op(layer):
    """FAILS if a layer is narrowed first: np.int64(2**32 + 1) runs as layer 1,
    materialize_layer(np.int64(2**32)) materializes layer 0, a Python 2**31 raises."""
    before, ref = _warm_jax(), _warm_reference()
    ref_before = _reference_snapshot(ref)
    ids = np.array([1, 2])
    policy, ref_policy = pc.FetchPolicy.fraction(0.5), ReferencePolicy.fraction(0.5)
    jax_errors = [
        pc.ensure(before, layer, ids)[1].error,
        pc.ensure_hybrid(before, layer, ids, policy)[1].error,
        pc.materialize_layer(before, layer)[1].error,
    ]
    ref_errors = [ref.ensure(layer, ids).error, ref.ensure_hybrid(layer, ids, ref_policy).error,
                  ref.materialize_layer(layer).error]
    assert [int(e) for e in jax_errors] == ref_errors == [pc.ERR_LAYER] * 3
    _assert_reference_unchanged(ref_before, ref)
    for op in (lambda s: pc.ensure(s, layer, ids), lambda s: pc.materialize_layer(s, layer)):
        _assert_jax_unchanged(before, op(before)[0])

    begun = pc.begin_prefill(before)
    staged, plan = pc.prefetch_prefill_layer(begun, layer, (1024 * 1024,))
    ref.begin_prefill()
    ref_plan = ref.prefetch_prefill_layer(layer, (1024 * 1024,))
    assert int(plan.error) == ref_plan.error and int(plan.error) & pc.ERR_LAYER
    _assert_jax_unchanged(begun, staged)


@pytest.mark.parametrize("slot", _wide_indices(), ids=repr)
def test_wide_slots_are_refused_by_forget_slot(slot):
    """FAILS if forget_slot narrows first: forget_slot(s, np.int64(2**32)) drops slot 0."""
    before, ref = _warm_jax(), _warm_reference()
    ref_before = _reference_snapshot(ref)
    state, plan = pc.forget_slot(before, slot)
    assert int(plan.error) == ref.forget_slot(slot).error == pc.ERR_SLOT
    assert int(plan.old) == -1
    _assert_jax_unchanged(before, state)
    _assert_reference_unchanged(ref_before, ref)


def test_traced_uint32_ids_layers_and_slots_are_refused_under_jit():
    """FAILS if a traced uint32 0xFFFFFFFF is cast to int32 (-1: silent padding / a negative
    index that wraps) before the range check; no x64 is needed to see it."""
    state = _warm_jax()
    big = jnp.asarray(np.uint32(2**32 - 1))

    ensure = jax.jit(lambda s, layer, ids: pc.ensure(s, layer, ids))
    new, plan = ensure(state, jnp.uint32(1), jnp.stack([jnp.uint32(4), big]))
    assert int(plan.error) == pc.ERR_EXPERT_ID
    _assert_jax_unchanged(state, new)
    new, plan = ensure(state, big, jnp.array([4], jnp.uint32))
    assert int(plan.error) == pc.ERR_LAYER
    _assert_jax_unchanged(state, new)

    forget = jax.jit(pc.forget_slot)
    new, plan = forget(state, big)
    assert int(plan.error) == pc.ERR_SLOT
    _assert_jax_unchanged(state, new)


X64_SCRIPT = textwrap.dedent("""
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    import pallas_cache as pc

    state = pc.init(4, 8, 16)
    state, _ = pc.ensure(state, 0, np.array([1, 2]))
    ensure = jax.jit(lambda s, layer, ids: pc.ensure(s, layer, ids))
    forget = jax.jit(pc.forget_slot)
    results = [
        int(ensure(state, jnp.int64(1), jnp.array([2**32 + 3], jnp.int64))[1].error),
        int(ensure(state, jnp.int64(2**32 + 1), jnp.array([3], jnp.int64))[1].error),
        int(ensure(state, jnp.int64(1), jnp.array([2**64 - 1], jnp.uint64))[1].error),
        int(forget(state, jnp.int64(2**32))[1].error),
        int(ensure(state, jnp.int64(1), jnp.array([3], jnp.int64))[1].error),
    ]
    new, _ = ensure(state, jnp.int64(1), jnp.array([2**32 + 3], jnp.int64))
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new)))
    print(results, same)
""")


def test_traced_int64_under_x64_is_refused_in_a_subprocess():
    """FAILS if traced int64/uint64 inputs under jax_enable_x64 are narrowed before the check.

    x64 is process-wide, so this runs in its own interpreter and cannot leak into other tests."""
    done = subprocess.run([sys.executable, "-c", X64_SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = [pc.ERR_EXPERT_ID, pc.ERR_LAYER, pc.ERR_EXPERT_ID, pc.ERR_SLOT, 0]
    assert done.stdout.strip().splitlines()[-1] == f"{expected} True"
