"""Capacity and the usable size (docs/semantics.md §5.15): the rules, each on the adapters.
The lockstep properties (capacity above the usable size, resize) are in tests/lockstep/test_lockstep.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_cache as pc
from tests.harness import assert_same, resident_slots, slot_of, valid
from pallas_cache.policy import admit_promote_one
from pallas_cache.selection import select_victims

ERR_CACHE_SIZE = pc.ERR_CACHE_SIZE

# ---- rules -----------------------------------------------------------------------------------


def filled(adapter, L=3, E=2, S=4, C=8):
    """A pool of usable size S (capacity C) whose S slots hold layers 0 and 1."""
    cache = adapter.cache(L, E, S, capacity=C)
    cache.ensure(0, [0, 1])
    cache.ensure(1, [0, 1])
    return cache


@pytest.mark.kernels
@pytest.mark.traced
def test_victims_never_lie_past_the_usable_size(adapter):
    """FAILS if the victim search ignores the usable size: the unusable slots 4..7 carry usage 0,
    the smallest of all, so a naive argmin would install layer 2 there."""
    cache = filled(adapter)
    plan = cache.ensure(2, [0, 1])
    assert valid(plan.copy, "dst_slots") == [0, 1], "the two least recently used usable slots"
    state = cache.state
    assert (state.residency.id_of_slot[4:] == -1).all()
    assert slot_of(state, 0, 0) is None and slot_of(state, 0, 1) is None


@pytest.mark.kernels
@pytest.mark.traced
def test_promote_one_does_not_count_an_unusable_slot_as_empty(adapter):
    """FAILS if the promotion rule (or its kernel) reads past the usable size: the usable pool is
    full, so PROMOTE_ONE must not fire, though the slots past it are 'empty' (id -1)."""
    cache = filled(adapter)
    policy = cache.adapter.Policy.fraction(0.4)
    cache.ensure_hybrid(2, [0], policy)  # first-time miss: CPU, but now it has a recency
    plan = cache.ensure_hybrid(2, [0], policy)
    assert (plan.missing, plan.fetched) == (1, 0), "no empty usable slot: the miss stays on the CPU"
    assert plan.cpu.tolist()[0]


def test_resize_shrink_frees_the_tail_and_lists_it(adapter):
    """FAILS if a shrink keeps the freed experts resident, moves survivors, or does not list every
    freed slot with its old occupant (an empty freed slot as -1)."""
    cache = adapter.cache(2, 3, 8, capacity=10)
    cache.ensure(0, [0, 1, 2])
    cache.ensure(1, [0, 1])  # slots 0..4 hold 0,1,2,3,4; slots 5..7 empty
    plan = cache.resize(4)
    assert plan.error == 0 and plan.count == 4
    assert plan.freed_slots[:4].tolist() == [4, 5, 6, 7]
    assert plan.freed_ids[:4].tolist() == [4, -1, -1, -1]
    assert (plan.freed_slots[4:] == -1).all() and (plan.freed_ids[4:] == -1).all()
    state = cache.state
    assert int(state.cache_size) == 4
    assert state.residency.id_of_slot.tolist() == [0, 1, 2, 3] + [-1] * 6
    assert slot_of(state, 1, 1) is None and slot_of(state, 1, 0) == 3
    grow = cache.resize(10)
    assert (grow.error, grow.count) == (0, 0)
    assert int(cache.state.cache_size) == 10 and resident_slots(cache.state) == 4


@pytest.mark.traced
@pytest.mark.parametrize("target", [2, 11, -1])
def test_resize_outside_e_capacity_is_refused_unchanged(adapter, target):
    """FAILS if a size below E or above the capacity is applied (or clamped) instead of refused
    with ERR_CACHE_SIZE and the state returned unchanged."""
    cache = adapter.cache(2, 3, 8, capacity=10)
    cache.ensure(0, [0, 1, 2])
    before = cache.state
    plan = cache.resize(target)
    assert plan.error == ERR_CACHE_SIZE and plan.count == 0
    assert (plan.freed_slots == -1).all()
    assert_same(cache.state, before, "after a refused resize")


def test_a_shrink_below_2e_waits_for_the_second_buffer_and_then_ends_it(adapter):
    """FAILS if a shrink takes slots [E, 2E) while a staged layer there is unreleased, or if an
    accepted shrink leaves buffer 1's record: after growing back, re-staging layer 1 would then
    report already_loaded for bytes the caller released."""
    E = 3
    cache = adapter.cache(2, E, 9, capacity=9)
    cache.begin_prefill()
    assert cache.prefetch_prefill_layer(1, (1 << 20,)).error == 0  # buffer 1 = slots [3, 6)
    before = cache.state
    assert cache.resize(2 * E - 1).error == ERR_CACHE_SIZE
    assert_same(cache.state, before, "after a shrink refused for the busy buffer")
    assert cache.resize(2 * E).error == 0, "2E keeps both buffers: allowed"
    cache.release_prefill_layer(1)
    assert cache.resize(E).error == 0
    assert cache.state.prefill.layer.tolist() == [-1, -1]
    assert cache.prefetch_prefill_layer(1, (1 << 20,)).error == ERR_CACHE_SIZE
    assert cache.resize(9).error == 0
    again = cache.prefetch_prefill_layer(1, (1 << 20,))
    assert again.error == 0 and not again.already_loaded and again.transfers.count == 1


@pytest.mark.traced
def test_prefill_below_2e_within_a_larger_capacity_is_a_value_error(adapter):
    """FAILS if a usable size below 2E raises PrefillDoesNotFit (it is data, possibly traced) or
    if begin_prefill opens a chunk / prefetch stages into slots the pool does not have."""
    cache = adapter.cache(2, 4, 6, capacity=16)
    before = cache.state
    cache.begin_prefill()
    assert_same(cache.state, before, "begin_prefill below 2E changes nothing")
    plan = cache.prefetch_prefill_layer(1, (1 << 20,))
    assert plan.error == ERR_CACHE_SIZE | adapter.errors.ERR_PREFILL_NOT_BEGUN
    assert_same(cache.state, before, "a refused prefetch")
    assert not cache.prefill_overlap_fits()
    with pytest.raises(adapter.errors.PrefillDoesNotFit):
        adapter.cache(2, 4, 6, capacity=7).begin_prefill()


@pytest.mark.traced
def test_forget_slot_past_the_usable_size_is_err_slot(adapter):
    """FAILS if the slot range is checked against the capacity instead of the usable size."""
    cache = filled(adapter)
    before = cache.state
    plan = cache.forget_slot(5)
    assert (plan.old, plan.error) == (-1, adapter.errors.ERR_SLOT)
    assert_same(cache.state, before, "a refused forget_slot")
    assert cache.forget_slot(3).error == 0


def test_a_capacity_2048_state_resized_to_48_behaves_like_a_48_slot_pool():
    """docs/semantics.md §5.15's example: FAILS if any plan of the resized state differs from a
    fresh 48-slot pool's, or if prefill raises instead of reporting ERR_CACHE_SIZE."""
    L, E = 4, 32
    big, plan = pc.resize(pc.init(L, E, 2048), 48)
    assert int(plan.error) == 0 and int(plan.count) == 2000
    small = pc.init(L, E, 48)
    rng = np.random.default_rng(3)
    policy = pc.FetchPolicy.fraction(0.4)
    step = jax.jit(pc.ensure_hybrid)
    for call in range(60):
        layer, routes = call % L, jnp.asarray(rng.integers(-1, E, size=8), jnp.int32)
        big, mine = step(big, layer, routes, policy)
        small, theirs = step(small, layer, routes, policy)
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
            np.testing.assert_array_equal(a, b, err_msg=f"call {call}")
    np.testing.assert_array_equal(big.residency.id_of_slot[:48], small.residency.id_of_slot)
    assert (np.asarray(big.residency.id_of_slot[48:]) == -1).all()
    with pytest.raises(pc.PrefillDoesNotFit):
        pc.begin_prefill(small)
    assert bool(pc.prefill_overlap_fits(big)) is False
    _, staged = pc.prefetch_prefill_layer(pc.begin_prefill(big), 0, (1 << 20,))
    assert int(staged.error) & ERR_CACHE_SIZE


def test_describe_and_stats_see_only_the_usable_slots():
    """FAILS if describe lists (or counts as empty) the slots past the usable size."""
    state = pc.init(2, 3, 4, capacity=9)
    state, _ = pc.ensure(state, 0, jnp.asarray([0, 1], jnp.int32))
    view = pc.describe(state)
    assert len(view.rows) == 4 and view.cache_size == 4 and view.capacity == 9
    assert [r.status for r in view.rows] == ["resident", "resident", "empty", "empty"]
    assert "S=4 (capacity 9)" in view.header() and "resident=2/4" in view.header()
    shrunk, _ = pc.resize(state, 3)
    grown, _ = pc.resize(shrunk, 9)
    assert len(pc.describe(grown).rows) == 9
    assert pc.diff(state, pc.resize(state, 3)[0]).unchanged, "the freed slot 3 was empty"
    full, _ = pc.ensure(state, 1, jnp.asarray([0, 1], jnp.int32))  # slot 3: layer 1, expert 1
    change = pc.diff(full, pc.resize(full, 3)[0])
    assert change.evicted == [(3, 1, 1)] and not change.installed and not change.refreshed


def test_init_and_rebuild_check_the_capacity():
    """FAILS if a capacity below the usable size is accepted, or if rebuild inherits the old
    capacity instead of allocating as init does."""
    with pytest.raises(ValueError, match="capacity 3 is below cache_size 4"):
        pc.init(2, 3, 4, capacity=3)
    with pytest.raises(TypeError):
        pc.init(2, 3, 4, capacity=4.0)
    state = pc.init(2, 3, 4, capacity=9)
    assert (state.capacity, int(state.cache_size)) == (9, 4)
    rebuilt = pc.rebuild(state, 5)
    assert (rebuilt.capacity, int(rebuilt.cache_size)) == (5, 5)
    rebuilt = pc.rebuild(state, 5, capacity=12)
    assert (rebuilt.capacity, int(rebuilt.cache_size)) == (12, 5)
    again = pc.reset(pc.resize(state, 7)[0])
    assert (again.capacity, int(again.cache_size)) == (9, 7), "reset keeps both"


INT32_MAX = 2**31 - 1


@pytest.mark.parametrize("call, match", [
    (lambda: pc.init(4, 8, 2**31), r"cache_size must fit in int32 \(<= 2147483647\), got 2147483648"),
    (lambda: pc.init(2**31, 8, 16), "num_layers must fit in int32"),
    (lambda: pc.init(1, 2**31, 2**31), "num_experts must fit in int32"),
    (lambda: pc.init(2, 8, 16, capacity=2**31), "capacity must fit in int32"),
    (lambda: pc.init(2**16, 2**15, 2**15), r"2147483648 flat ids do not fit in int32"),
    (lambda: pc.init(1, 2**29, INT32_MAX - 1 - 2**29), r"= 2147483647 clock stamps"),
    (lambda: pc.init(2, 8, 16, rebase_threshold=2**31), "rebase_threshold must fit in int32"),
    (lambda: pc.init(2, 8, 16, history=2**31), "history must fit in int32"),
    (lambda: pc.rebuild(pc.init(2, 4, 8), 2**31), "cache_size must fit in int32"),
    (lambda: pc.rebuild(pc.init(2, 4, 8), 8, capacity=2**31), "capacity must fit in int32"),
    (lambda: pc.rebuild(pc.init(1, 2**3, 8), INT32_MAX - 2**3 - 1), "clock stamps"),
])
def test_init_and_rebuild_refuse_unrepresentable_sizes_before_allocating(call, match):
    """FAILS if a size whose int32 quantities overflow reaches the allocation (docs/semantics.md
    §5.1): ``init(4, 8, 2**31)`` took 26 s and 17 GB before an OverflowError, ``init(2**31, 8,
    16)`` tried to allocate 64 GiB, and ``capacity=None`` was not range-checked at all. The calls
    run under ``jax.eval_shape``, so a missed check fails at once (an OverflowError, or a state
    of abstract arrays where a ValueError was due), allocating nothing."""
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(call)


def test_the_largest_representable_sizes_are_accepted():
    """FAILS if the int32 checks refuse a size one below their limit (the boundary is
    ``C + L * E + 1 <= 2**31 - 2``; under ``jax.eval_shape``, so nothing is allocated)."""
    L, E = 1, 2**29
    big = jax.eval_shape(lambda: pc.init(L, E, INT32_MAX - 2 - L * E))
    assert big.residency.id_of_slot.shape == (INT32_MAX - 2 - L * E,)
    wide = jax.eval_shape(lambda: pc.init(2, 8, 16, capacity=INT32_MAX - 2 - 16))
    assert wide.residency.id_of_slot.shape == (INT32_MAX - 18,)


# ---- kernels and the dispatch point ------------------------------------------------------------


def test_select_victims_and_promotion_mask_by_data():
    """FAILS if either decision ignores the traced usable size: the unusable tail has the
    smallest usage, so it would be picked first; one compiled function serves every size."""
    usage = jnp.asarray([5, 3, 4, 6, 0, 0, 0, 0], jnp.int32)
    ids = jnp.asarray([0, 1, 2, 3, -1, -1, -1, -1], jnp.int32)
    victims = jax.jit(lambda u, size: select_victims(u, jnp.int32(7), jnp.int32(3), num_out=3,
                                                     cache_size=size))
    assert victims(usage, jnp.int32(4)).tolist() == [1, 2, 0]
    assert victims(usage, jnp.int32(8)).tolist() == [4, 5, 6]

    def decide(size):  # expert 0 (recency 2) is the first miss; F = 0
        victim = select_victims(usage, jnp.int32(7), jnp.int32(1), num_out=1, cache_size=size)
        return admit_promote_one(True, jnp.int32(0), jnp.asarray([0]), jnp.asarray([2]), victim,
                                 ids[jnp.maximum(victim, 0)], first=lambda v: v[0])

    decide = jax.jit(decide)
    assert int(decide(jnp.int32(4))) == 0, "no usable empty slot"
    assert int(decide(jnp.int32(5))) == 1
