"""The clock rebase, value errors and the prefill double buffers, on every adapter.

The int32 clock (docs/semantics.md §5.12), bad input that comes back as error bits with the state
unchanged (docs/semantics.md §6), and the prefill chunk (docs/semantics.md §5.11), each rule
written once against the adapter fixture (conftest.py).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from conftest import PROFILE, assert_invariants, assert_same_plan, assert_same_state

BIG_BANK = 512 * 1024
SMALL_BANK = 4 * 1024


# ---- the int32 clock (docs/semantics.md §5.12) ------------------------------------------------


def random_ops(seed, num_layers, num_experts, steps):
    """A reproducible list of mixed decode operations (those that advance the clock)."""
    rng = random.Random(seed)
    ops = []
    for _ in range(steps):
        layer = rng.randrange(num_layers)
        routes = [rng.randrange(-1, num_experts) for _ in range(rng.randint(1, 6))]
        kind = rng.random()
        if kind < 0.3:
            ops.append(("ensure", layer, routes))
        elif kind < 0.9:
            ops.append(("hybrid", layer, routes, rng.choice(["fraction", "fixed_cap", "full"]),
                        rng.choice(["recency", "lowest_id"]),
                        rng.choice(["promote_one", "none", "reuse"])))
        elif kind < 0.95:
            ops.append(("materialize", layer))
        else:
            ops.append(("forget", rng.randrange(num_layers * num_experts)))
    return ops


def apply(adapter, c, op):
    if op[0] == "ensure":
        return c.ensure(op[1], op[2])
    if op[0] == "hybrid":
        P = adapter.Policy
        policy = {"fraction": P.fraction(0.4), "fixed_cap": P.fixed_cap(1), "full": P.full()}[op[3]]
        return c.ensure_hybrid(op[1], op[2], policy, order=op[4], admission=op[5])
    if op[0] == "materialize":
        return c.materialize_layer(op[1])
    return c.forget_slot(op[1] % c.state.cache_size)


def same_order(a, b):
    """Whether two stamp vectors order every pair the same way (<, ==, >)."""
    return np.array_equal(np.sign(a[:, None] - a[None, :]), np.sign(b[:, None] - b[None, :]))


def stamps(state):
    return np.concatenate([state.usage, state.recency.ravel(), [state.step]]).astype(np.int64)


@pytest.mark.parametrize("seed", range(4))
def test_a_rebased_run_makes_exactly_the_decisions_of_an_unrebased_one(adapter, seed):
    """FAILS if the rebase renumbers usage and recency separately (recency-vs-usage comparisons of
    REUSE flip) or maps live stamps onto the sentinels 0 / -1."""
    if adapter.is_jax and seed and PROFILE != "deep":
        pytest.skip("ci profile: one sequence per JAX adapter (the lockstep suite crosses rebases too)")
    ops = random_ops(seed, num_layers=3, num_experts=5, steps=400 if not adapter.is_jax else 150)
    plain = adapter.init(3, 5, 8)
    rebased = adapter.init(3, 5, 8, rebase_threshold=40)
    bound = max(40, 8 + 3 * 5 + 1) + 1
    for i, op in enumerate(ops):
        assert_same_plan(apply(adapter, plain, op), apply(adapter, rebased, op), f"op {i} {op}")
        a, b = plain.state, rebased.state
        np.testing.assert_array_equal(a.slot_for_id, b.slot_for_id)
        np.testing.assert_array_equal(a.id_of_slot, b.id_of_slot)
        assert same_order(stamps(a), stamps(b)), f"order changed at op {i}"
        assert b.step <= bound, "stamps stay bounded"
        assert (b.usage[b.id_of_slot >= 0] >= 1).all()
    assert plain.state.step > 100 > bound, "the run crossed the threshold several times"


def test_a_cache_just_below_the_default_threshold_runs_across_it(adapter):
    """FAILS if the clock wraps or if the renumbering changes any decision: the same run from a
    clock shifted to just below 2**30 crosses the threshold and decides exactly as the unshifted
    run, with forgotten slots and never-routed experts alive at the time."""
    ops = random_ops(7, num_layers=3, num_experts=5, steps=60)  # the geometry above: no new compiles
    plain, shifted = adapter.init(3, 5, 8), adapter.init(3, 5, 8)
    for op in ops[:20]:
        apply(adapter, plain, op)
        apply(adapter, shifted, op)
    plain.forget_slot(1)
    shifted.forget_slot(1)
    shifted.shift_clock(2**30 - 3 - int(shifted.state.step))
    for i, op in enumerate(ops[20:]):
        assert_same_plan(apply(adapter, plain, op), apply(adapter, shifted, op), f"op {i}")
        assert shifted.state.step < 2**31 - 1
        assert same_order(stamps(plain.state), stamps(shifted.state)), f"order changed at op {i}"
    assert shifted.state.step < 100, "the clock was renumbered"
    np.testing.assert_array_equal(plain.state.id_of_slot, shifted.state.id_of_slot)
    assert_invariants(shifted.state)


@pytest.mark.traced
def test_the_rebase_keeps_the_sentinels(adapter):
    c = adapter.init(2, 4, 6, rebase_threshold=3)
    c.ensure_hybrid(0, [0, 1], adapter.Policy.full())  # slots 0, 1
    c.ensure(1, [2])  # slot 2
    assert c.forget_slot(1).old == 1
    c.ensure(1, [2])  # step 3: the next call rebases first
    before = c.state.usage
    c.ensure(1, [2])
    state = c.state
    assert before[2] == 3 and state.step == 3, "stamps {1, 3} became {1, 2}, so step 4 became 3"
    assert state.usage[1] == -(2**31), "forgotten stays forgotten"
    assert (state.usage[3:] == 0).all(), "empty stays 0"
    assert state.recency[1, 0] == -1 and state.recency[0, 0] >= 1, "never routed stays -1"


# ---- bad input: an error bit and nothing changed (docs/semantics.md §6) -----------------------

L, E, S = 3, 4, 12


def busy_cache(adapter, rebase_threshold=None):
    """A cache with history: residents, recency, counters, a histogram, a forgotten slot."""
    c = adapter.init(L, E, S, rebase_threshold=rebase_threshold)
    c.set_collect_routing(True)
    c.ensure(0, [0, 1, 2])
    c.ensure_hybrid(1, [2, 3], adapter.Policy.fraction(0.5))
    c.forget_slot(1)
    return c


def assert_refused(adapter, call, bits):
    """The call comes back with exactly ``bits`` and every state field, the clock included, as it was."""
    c = busy_cache(adapter)
    before = c.state
    plan = call(c, adapter.Policy)
    assert plan.error == sum(getattr(adapter.errors, name) for name in bits.split("|"))
    assert_same_state(c.state, before)


@pytest.mark.parametrize("call", [
    lambda c, P: c.ensure(0, [1, E]),
    lambda c, P: c.ensure(0, [0, E + 7, 1]),
    lambda c, P: c.ensure(0, [1, -2]),
    lambda c, P: c.ensure(0, [-(2**31)]),
    lambda c, P: c.ensure_hybrid(1, [[0, 7]], P.fraction(0.4)),
    lambda c, P: c.ensure_hybrid(0, [0, -2], P.fraction(0.4)),
])
def test_an_expert_id_outside_the_layer_sets_err_expert_id_and_changes_nothing(adapter, call):
    """FAILS if a bad id is clipped or dropped instead of refusing the whole call."""
    assert_refused(adapter, call, "ERR_EXPERT_ID")


@pytest.mark.traced
@pytest.mark.parametrize("call", [
    lambda c, P: c.ensure(L, [1]),
    lambda c, P: c.ensure(1000, [1]),
    lambda c, P: c.ensure_hybrid(5, [0], P.full()),
    lambda c, P: c.ensure_hybrid(-1, [0, 1], P.full()),
    lambda c, P: c.materialize_layer(L),
    lambda c, P: c.materialize_layer(-1),
])
def test_a_layer_outside_the_model_sets_err_layer_and_changes_nothing(adapter, call):
    """FAILS if a bad layer is wrapped or clamped (a traced layer cannot raise)."""
    assert_refused(adapter, call, "ERR_LAYER")


@pytest.mark.traced
@pytest.mark.parametrize("slot", [S, S + 100, -1])
def test_forgetting_a_slot_outside_the_pool_sets_err_slot_and_changes_nothing(adapter, slot):
    assert_refused(adapter, lambda c, P: c.forget_slot(slot), "ERR_SLOT")


def test_staging_without_begin_prefill_sets_err_prefill_not_begun_and_changes_nothing(adapter):
    assert_refused(adapter, lambda c, P: c.prefetch_prefill_layer(0, (BIG_BANK,)), "ERR_PREFILL_NOT_BEGUN")


@pytest.mark.traced
@pytest.mark.parametrize("call, bits", [
    (lambda c, P: c.ensure(-1, [9]), "ERR_LAYER|ERR_EXPERT_ID"),
    (lambda c, P: c.ensure_hybrid(L, [0, E], P.fraction(0.4)), "ERR_LAYER|ERR_EXPERT_ID"),
    (lambda c, P: c.prefetch_prefill_layer(7, (BIG_BANK,)), "ERR_LAYER|ERR_PREFILL_NOT_BEGUN"),
    (lambda c, P: c.prefetch_prefill_layer(-1, (BIG_BANK,)), "ERR_LAYER|ERR_PREFILL_NOT_BEGUN"),
])
def test_every_failing_check_sets_its_bit(adapter, call, bits):
    """FAILS if the checks short-circuit: the caller needs every reason at once."""
    assert_refused(adapter, call, bits)


def test_an_error_plan_is_empty_and_keeps_the_input_shape(adapter):
    c = busy_cache(adapter)
    plan = c.ensure_hybrid(1, [[0, 7], [1, 1]], adapter.Policy.fraction(0.4))
    assert plan.slots.shape == (2, 2) and (plan.slots == -1).all() and not plan.cpu.any()
    assert plan.dst_slots.shape == plan.src_rows.shape == (4,)
    assert (plan.dst_slots == -1).all() and (plan.src_rows == -1).all()
    assert (plan.count, plan.active, plan.missing, plan.fetched) == (0, 0, 0, 0)
    plan = c.ensure(0, [0, 1, E])
    assert (plan.slots == -1).all() and (plan.count, plan.active, plan.missing) == (0, 0, 0)
    materialized = c.materialize_layer(L)
    assert (materialized.dst_slots == -1).all() and materialized.count == 0
    assert c.forget_slot(S).old == -1
    staged = c.prefetch_prefill_layer(0, (BIG_BANK,))
    assert (staged.entry_count, staged.gather_count, staged.run_count) == (0, 0, 0)
    assert not staged.already_loaded


@pytest.mark.traced
def test_a_refused_call_neither_advances_nor_rebases_the_clock(adapter):
    c = busy_cache(adapter, rebase_threshold=2)  # step >= 2: the next accepted call renumbers
    before = c.state
    assert before.step >= 2
    assert c.ensure(0, [E]).error == adapter.errors.ERR_EXPERT_ID
    assert c.materialize_layer(5).error == adapter.errors.ERR_LAYER
    assert_same_state(c.state, before)


def test_staging_into_an_unreleased_buffer_is_refused_and_changes_nothing(adapter):
    c = adapter.init(4, 4, 16)
    c.begin_prefill()
    assert c.prefetch_prefill_layer(0, (BIG_BANK,)).error == 0
    before = c.state
    plan = c.prefetch_prefill_layer(2, (BIG_BANK,))  # buffer 0 still holds layer 0
    assert plan.error == adapter.errors.ERR_PREFILL_BUSY
    assert plan.entry_count == 0 and plan.gather_count == 0
    assert_same_state(c.state, before)
    c.release_prefill_layer(0)
    assert c.prefetch_prefill_layer(2, (BIG_BANK,)).error == 0


def test_static_misuse_raises_with_the_value(adapter):
    c = busy_cache(adapter)
    with pytest.raises(TypeError, match="float"):
        c.ensure(0, [1.5])
    with pytest.raises(ValueError, match="'sideways'"):
        c.ensure_hybrid(0, [1], adapter.Policy.full(), order="sideways")
    with pytest.raises(ValueError, match="-3"):
        c.prefetch_prefill_layer(0, (-3,))
    with pytest.raises(adapter.errors.PrefillDoesNotFit, match="cannot lend 16"):
        adapter.init(2, 8, 12).begin_prefill()


# ---- prefill double buffers (docs/semantics.md §5.11) -----------------------------------------


def one_layer_per_quarter(adapter):
    """Layer l owns slots [4l, 4l + 4); the buffers borrow [0, 8) = layers 0 and 1."""
    c = adapter.init(4, 4, 16)
    for layer in range(4):
        c.ensure(layer, [0, 1, 2, 3])
    assert c.state.slot_for_id.tolist() == [[4 * l + e for e in range(4)] for l in range(4)]
    return c


def test_a_slot_inside_the_prefill_buffers_is_a_miss_however_resident_it_looks(adapter):
    """FAILS if hits are classified as "has a slot": layer 1 lives in slots 4..8, exactly the
    buffer it is staged into, and a gather from there would race the staging copy."""
    c = one_layer_per_quarter(adapter)
    c.begin_prefill()
    plan = c.prefetch_prefill_layer(1, (BIG_BANK,))
    assert plan.buffer_id == 1 and plan.gather_count == 0
    assert plan.valid("run_starts", "run_count") == [0] and plan.valid("run_lens", "run_count") == [4]
    assert (c.state.prefill_hit_rows, c.state.prefill_rows) == (0, 4)


def test_a_resident_expert_above_the_buffer_slots_is_gathered_device_side(adapter):
    c = one_layer_per_quarter(adapter)
    c.begin_prefill()
    plan = c.prefetch_prefill_layer(2, (BIG_BANK,))
    assert plan.buffer_id == 0
    assert plan.valid("gather_dst_slots", "gather_count") == [0, 1, 2, 3]
    assert plan.valid("gather_src_slots", "gather_count") == [8, 9, 10, 11]
    assert plan.run_count == 0 and plan.entry_count == 0, "a big bank with no misses ships nothing"
    assert (c.state.prefill_hit_rows, c.state.prefill_rows) == (4, 4)


def test_invalidating_a_prefill_buffer_makes_its_slots_the_first_victims(adapter):
    """FAILS if invalidation leaves usage alone: the buffer slots are the newest in the pool, so
    the next decode miss would evict a live resident while four empty slots sit unused."""
    c = one_layer_per_quarter(adapter)
    c.ensure(0, [0, 1, 2, 3])
    c.ensure(1, [0, 1, 2, 3])
    c.begin_prefill()
    c.prefetch_prefill_layer(0, (BIG_BANK,))
    assert (c.state.slot_for_id[0] == -1).all(), "the buffer's occupants lost their residency"
    assert (c.state.usage[:4] == 0).all()
    plan = c.ensure(0, [0])
    assert plan.valid("dst_slots") == [0]
    assert c.state.slot_for_id[2, 0] == 8, "no live resident was evicted while free slots existed"


def test_prefill_misses_ship_as_contiguous_expert_runs(adapter):
    """FAILS if each missing expert ships as its own entry (five entries instead of two)."""
    c = adapter.init(4, 8, 32)
    for layer, routes in ((0, range(8)), (2, range(8)), (1, (3, 4, 7))):
        c.ensure(layer, list(routes))  # layer 1's experts land in slots 16, 17, 18
    c.begin_prefill()
    plan = c.prefetch_prefill_layer(1, (BIG_BANK,))
    assert plan.buffer_id == 1
    assert plan.valid("gather_dst_slots", "gather_count") == [11, 12, 15]
    assert plan.valid("gather_src_slots", "gather_count") == [16, 17, 18]
    assert plan.valid("run_starts", "run_count") == [0, 5]
    assert plan.valid("run_lens", "run_count") == [3, 2]
    assert plan.entries((BIG_BANK,)) == [
        (0, 8, 0, 3, 3 * BIG_BANK, False),
        (0, 13, 5, 2, 2 * BIG_BANK, False),
    ]


def test_a_small_bank_ships_its_whole_layer_even_with_no_misses(adapter):
    """FAILS if entries are only emitted for misses: the gather skips small banks, so their rows
    would never arrive."""
    c = adapter.init(4, 8, 32)
    for layer in (0, 2, 1):
        c.ensure(layer, list(range(8)))
    c.begin_prefill()
    plan = c.prefetch_prefill_layer(1, (BIG_BANK, SMALL_BANK))
    assert plan.gather_count == 8 and plan.run_count == 0
    assert plan.gather_banks.tolist() == [0, -1], "the small bank is not gathered"
    assert plan.entries((BIG_BANK, SMALL_BANK)) == [(1, 8, 0, 8, 8 * SMALL_BANK, True)]


@pytest.mark.traced
def test_the_two_prefill_buffers_rotate_by_layer_parity(adapter):
    c = adapter.init(4, 4, 16)
    c.begin_prefill()
    assert c.state.prefill_layer.tolist() == [-1, -1]
    assert c.prefetch_prefill_layer(0, (BIG_BANK,)).buffer_id == 0
    assert c.prefetch_prefill_layer(1, (BIG_BANK,)).buffer_id == 1
    assert c.state.prefill_layer.tolist() == [0, 1]
    again = c.prefetch_prefill_layer(1, (BIG_BANK,))
    assert again.already_loaded and again.entry_count == 0 and again.error == 0
    assert c.state.prefill_rows == 8, "the no-op staged no rows"
    c.release_prefill_layer(0)
    plan = c.prefetch_prefill_layer(2, (BIG_BANK,))
    assert plan.buffer_id == 0 and plan.error == 0
    assert c.state.prefill_layer.tolist() == [2, 1]


@pytest.mark.traced
def test_releasing_a_layer_that_is_not_staged_is_ignored(adapter):
    c = adapter.init(4, 4, 16)
    c.begin_prefill()
    c.prefetch_prefill_layer(0, (BIG_BANK,))
    before = c.state
    for layer in (2, -1, -2, 9):
        c.release_prefill_layer(layer)
        assert_same_state(c.state, before)
    assert c.prefetch_prefill_layer(2, (BIG_BANK,)).error == adapter.errors.ERR_PREFILL_BUSY


def test_the_chunk_snapshot_and_the_live_map_agree_on_every_row(adapter):
    c = adapter.init(4, 4, 16)
    for layer in range(4):
        c.ensure(layer, [0, 1, 2, 3])
    c.begin_prefill()
    for layer in (2, 3, 2):
        live = [int(s) for s in c.state.slot_for_id[layer] if s >= 8]
        plan = c.prefetch_prefill_layer(layer, (BIG_BANK,))
        c.release_prefill_layer(layer)
        if not plan.already_loaded:
            assert plan.valid("gather_src_slots", "gather_count") == live


def test_a_pool_that_cannot_lend_the_buffers_their_slots_says_so(adapter):
    small = adapter.init(2, 8, 12)
    assert not small.prefill_overlap_fits()
    assert adapter.init(2, 8, 16).prefill_overlap_fits()
    with pytest.raises(adapter.errors.PrefillDoesNotFit, match="12"):
        small.begin_prefill()
    with pytest.raises(adapter.errors.PrefillDoesNotFit):
        small.prefetch_prefill_layer(0, (BIG_BANK,))


def test_nothing_staged_is_registered_as_resident(adapter):
    c = adapter.init(2, 4, 8)
    c.begin_prefill()
    c.prefetch_prefill_layer(0, (BIG_BANK,))
    assert (c.state.slot_for_id == -1).all() and (c.state.id_of_slot == -1).all()


def test_reset_stats_zeroes_the_prefill_row_counters(adapter):
    c = one_layer_per_quarter(adapter)
    c.begin_prefill()
    c.prefetch_prefill_layer(2, (BIG_BANK,))
    c.reset_stats()
    assert (c.state.prefill_hit_rows, c.state.prefill_rows) == (0, 0)
