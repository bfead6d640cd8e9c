"""The reference's clock rebase, error handling and prefill double buffers."""

import random

import numpy as np
import pytest

from reference import (
    ERR_EXPERT_ID,
    ERR_LAYER,
    ERR_PREFILL_BUSY,
    ERR_PREFILL_NOT_BEGUN,
    ERR_SLOT,
    PrefillDoesNotFit,
    ReferenceCache,
    ReferencePolicy,
)

STATE_FIELDS = (
    "slot_for_id", "id_of_slot", "usage", "step", "recency", "stats_table", "routing_freq",
    "collect_routing", "prefill_layer", "prefill_released", "prefill_open", "prefill_snapshot",
    "prefill_hit_rows", "prefill_rows", "cache_size",
)


def snapshot(c):
    return {name: np.array(getattr(c, name), copy=True) for name in STATE_FIELDS}


def assert_same_state(c, before):
    for name, value in before.items():
        np.testing.assert_array_equal(getattr(c, name), value, err_msg=name)


PLAN_FIELDS = ("slots", "cpu", "dst_slots", "src_rows", "count", "active", "missing", "fetched", "error")


def assert_same_plan(a, b, context=""):
    for name in PLAN_FIELDS:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=f"{name} {context}")


def random_ops(seed, num_layers, num_experts, steps):
    """A reproducible list of mixed decode operations (those that advance the clock)."""
    rng = random.Random(seed)
    policies = [ReferencePolicy.fraction(0.4), ReferencePolicy.fixed_cap(1), ReferencePolicy.full()]
    ops = []
    for _ in range(steps):
        layer = rng.randrange(num_layers)
        routes = [rng.randrange(-1, num_experts) for _ in range(rng.randint(1, 6))]
        kind = rng.random()
        if kind < 0.3:
            ops.append(("ensure", layer, routes))
        elif kind < 0.9:
            ops.append(("hybrid", layer, routes, rng.choice(policies),
                        rng.choice(["recency", "lowest_id"]),
                        rng.choice(["promote_one", "none", "reuse"])))
        elif kind < 0.95:
            ops.append(("materialize", layer))
        else:
            ops.append(("forget", rng.randrange(num_layers * num_experts)))
    return ops


def apply(c, op):
    if op[0] == "ensure":
        return c.ensure(op[1], op[2])
    if op[0] == "hybrid":
        return c.ensure_hybrid(op[1], op[2], op[3], order=op[4], admission=op[5])
    if op[0] == "materialize":
        return c.materialize_layer(op[1])
    return c.forget_slot(op[1] % c.cache_size)


def same_order(a, b):
    """Whether two stamp vectors order every pair the same way (<, ==, >)."""
    return np.array_equal(np.sign(a[:, None] - a[None, :]), np.sign(b[:, None] - b[None, :]))


# ---- the int32 clock (docs/semantics.md §5.12) --------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_a_rebased_run_makes_exactly_the_decisions_of_an_unrebased_one(seed):
    """FAILS if the rebase renumbers usage and recency separately (recency-vs-usage comparisons of
    REUSE flip) or maps live stamps onto the sentinels 0 / -1."""
    ops = random_ops(seed, num_layers=3, num_experts=5, steps=400)
    plain = ReferenceCache(3, 5, 8)
    rebased = ReferenceCache(3, 5, 8, rebase_threshold=40)
    bound = max(40, 8 + 3 * 5 + 1) + 1
    for i, op in enumerate(ops):
        expected, got = apply(plain, op), apply(rebased, op)
        if op[0] == "forget":
            assert (expected.old, expected.error) == (got.old, got.error)
        else:
            assert_same_plan(expected, got, f"op {i} {op}")
        np.testing.assert_array_equal(plain.slot_for_id, rebased.slot_for_id)
        np.testing.assert_array_equal(plain.id_of_slot, rebased.id_of_slot)
        stamps = lambda c: np.concatenate([c.usage, c.recency.ravel(), [c.step]])  # noqa: E731
        assert same_order(stamps(plain), stamps(rebased)), f"order changed at op {i}"
        assert rebased.step <= bound, "stamps stay bounded"
        assert (rebased.usage[rebased.id_of_slot >= 0] >= 1).all()
    assert plain.step > 300 > bound


def test_a_cache_started_just_below_the_default_threshold_runs_across_it():
    """The same run from a clock shifted to just below 2**30 crosses the threshold and decides
    exactly as the unshifted run."""
    ops = random_ops(7, num_layers=2, num_experts=4, steps=120)
    plain, shifted = ReferenceCache(2, 4, 6), ReferenceCache(2, 4, 6)
    for op in ops[:20]:
        apply(plain, op)
        apply(shifted, op)
    offset = 2**30 - 10 - shifted.step
    shifted.usage[shifted.usage >= 1] += offset
    shifted.recency[shifted.recency >= 0] += offset
    shifted.step += offset
    for i, op in enumerate(ops[20:]):
        expected, got = apply(plain, op), apply(shifted, op)
        if op[0] != "forget":
            assert_same_plan(expected, got, f"op {i}")
        assert shifted.step < 2**31 - 1
    assert shifted.step < 2**30, "the clock was renumbered"
    np.testing.assert_array_equal(plain.id_of_slot, shifted.id_of_slot)


def test_the_rebase_keeps_the_sentinels():
    c = ReferenceCache(2, 4, 6, rebase_threshold=3)
    c.ensure_hybrid(0, [0, 1], ReferencePolicy.full())  # slots 0, 1
    c.ensure(1, [2])  # slot 2
    assert c.forget_slot(1).old == 1
    c.ensure(1, [2])  # step 3: the next call rebases first
    before = c.usage.copy()
    c.ensure(1, [2])
    assert before[2] == 3 and c.step == 3, "stamps {1, 3} became {1, 2}, so step 4 became 3"
    assert c.usage[1] == -(2**31), "forgotten stays forgotten"
    assert (c.usage[3:] == 0).all(), "empty stays 0"
    assert c.recency[1, 0] == -1 and c.recency[0, 0] >= 1, "never routed stays -1"


# ---- bad input: an error bit and nothing changed (docs/semantics.md §6) --------------------------------------


def busy_cache():
    c = ReferenceCache(3, 4, 12)
    c.set_collect_routing(True)
    c.ensure(0, [0, 1])
    c.ensure_hybrid(1, [2, 3], ReferencePolicy.fraction(0.5))
    return c


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda c: c.ensure(0, [1, 4]), ERR_EXPERT_ID),
        (lambda c: c.ensure(0, [1, -2]), ERR_EXPERT_ID),
        (lambda c: c.ensure(3, [1]), ERR_LAYER),
        (lambda c: c.ensure(-1, [9]), ERR_LAYER | ERR_EXPERT_ID),
        (lambda c: c.ensure_hybrid(1, [[0, 7]], ReferencePolicy.fraction(0.4)), ERR_EXPERT_ID),
        (lambda c: c.ensure_hybrid(5, [0], ReferencePolicy.full()), ERR_LAYER),
        (lambda c: c.materialize_layer(3), ERR_LAYER),
        (lambda c: c.forget_slot(12), ERR_SLOT),
        (lambda c: c.forget_slot(-1), ERR_SLOT),
        (lambda c: c.prefetch_prefill_layer(0, (1 << 20,)), ERR_PREFILL_NOT_BEGUN),
        (lambda c: c.prefetch_prefill_layer(7, (1 << 20,)), ERR_LAYER | ERR_PREFILL_NOT_BEGUN),
    ],
)
def test_a_value_error_sets_its_bit_and_changes_nothing(call, error):
    c = busy_cache()
    before = snapshot(c)
    plan = call(c)
    assert plan.error == error
    assert_same_state(c, before)


def test_an_error_plan_is_empty_and_keeps_the_input_shape():
    c = busy_cache()
    plan = c.ensure_hybrid(1, [[0, 7], [1, 1]], ReferencePolicy.fraction(0.4))
    assert plan.slots.shape == (2, 2) and (plan.slots == -1).all() and not plan.cpu.any()
    assert plan.dst_slots.shape == (4,) and (plan.dst_slots == -1).all()
    assert (plan.count, plan.active, plan.missing, plan.fetched) == (0, 0, 0, 0)


def test_reusing_an_unreleased_prefill_buffer_is_refused_and_changes_nothing():
    c = ReferenceCache(4, 4, 16)
    c.begin_prefill()
    c.prefetch_prefill_layer(0, (1 << 20,))
    before = snapshot(c)
    plan = c.prefetch_prefill_layer(2, (1 << 20,))
    assert plan.error == ERR_PREFILL_BUSY and plan.transfers.count == 0
    assert_same_state(c, before)


def test_static_misuse_raises_with_the_value():
    c = busy_cache()
    with pytest.raises(TypeError, match="float"):
        c.ensure(0, [1.5])
    with pytest.raises(ValueError, match="'sideways'"):
        c.ensure_hybrid(0, [1], ReferencePolicy.full(), order="sideways")
    with pytest.raises(ValueError, match="-3"):
        c.prefetch_prefill_layer(0, (-3,))
    with pytest.raises(PrefillDoesNotFit, match="cannot lend 16"):
        ReferenceCache(2, 8, 12).begin_prefill()


# ---- prefill double buffers (docs/semantics.md §5.11) -------------------------------------------------------

BIG_BANK = 512 * 1024
SMALL_BANK = 4 * 1024


def cache_with_one_layer_per_quarter():
    """Layer l owns slots [4l, 4l + 4); the buffers borrow [0, 8) = layers 0 and 1."""
    c = ReferenceCache(4, 4, 16)
    for layer in range(4):
        c.ensure(layer, [0, 1, 2, 3])
    assert c.slot_for_id.tolist() == [[4 * l + e for e in range(4)] for l in range(4)]
    return c


def entries(plan, banks):
    n = plan.transfers.count
    return list(zip(plan.transfers.bank[:n].tolist(), plan.transfers.dst_slot[:n].tolist(),
                    plan.transfers.src_row[:n].tolist(), plan.transfers.rows[:n].tolist(),
                    plan.entry_bytes(banks), plan.transfers.whole_layer[:n].tolist()))


def test_a_slot_inside_the_prefill_buffers_is_a_miss_however_resident_it_looks():
    """FAILS if hits are classified as `slot >= 0`: layer 1 lives in slots 4..8, exactly the
    buffer about to be overwritten, and would be gathered from there."""
    c = cache_with_one_layer_per_quarter()
    c.begin_prefill()
    plan = c.prefetch_prefill_layer(1, (BIG_BANK,))
    assert plan.buffer_id == 1 and plan.gather.count == 0
    assert (plan.runs.count, plan.runs.starts[0], plan.runs.lens[0]) == (1, 0, 4)
    assert (c.prefill_hit_rows, c.prefill_rows) == (0, 4)


def test_a_resident_expert_above_the_buffer_slots_is_gathered_device_side():
    c = cache_with_one_layer_per_quarter()
    c.begin_prefill()
    plan = c.prefetch_prefill_layer(2, (BIG_BANK,))
    assert plan.buffer_id == 0
    assert plan.gather.dst_slots.tolist() == [0, 1, 2, 3]
    assert plan.gather.src_slots.tolist() == [8, 9, 10, 11]
    assert plan.runs.count == 0 and plan.transfers.count == 0, "a big bank with no misses ships nothing"
    assert (c.prefill_hit_rows, c.prefill_rows) == (4, 4)


def test_invalidating_a_prefill_buffer_makes_its_slots_the_first_victims():
    """FAILS if invalidation leaves usage alone: the re-touched buffer slots would look newest
    and the next decode miss would evict layer 2's expert from slot 8."""
    c = cache_with_one_layer_per_quarter()
    c.ensure(0, [0, 1, 2, 3])
    c.ensure(1, [0, 1, 2, 3])
    c.begin_prefill()
    c.prefetch_prefill_layer(0, (BIG_BANK,))
    assert (c.slot_for_id[0] == -1).all(), "the buffer's occupants lost their residency"
    assert (c.usage[:4] == 0).all()
    plan = c.ensure(0, [0])
    assert plan.dst_slots[0] == 0
    assert c.slot_for_id[2, 0] == 8, "no live resident was evicted while free slots existed"


def test_prefill_misses_ship_as_contiguous_expert_runs():
    """FAILS if each missing expert ships as its own entry (five entries instead of two)."""
    c = ReferenceCache(4, 8, 32)
    c.ensure(0, list(range(8)))
    c.ensure(2, list(range(8)))
    c.ensure(1, [3, 4, 7])  # slots 16, 17, 18, above the buffers
    c.begin_prefill()
    plan = c.prefetch_prefill_layer(1, (BIG_BANK,))
    assert plan.buffer_id == 1
    assert plan.gather.dst_slots[: plan.gather.count].tolist() == [11, 12, 15]
    assert plan.gather.src_slots[: plan.gather.count].tolist() == [16, 17, 18]
    assert plan.runs.starts[:2].tolist() == [0, 5] and plan.runs.lens[:2].tolist() == [3, 2]
    assert entries(plan, (BIG_BANK,)) == [
        (0, 8, 0, 3, 3 * BIG_BANK, False),
        (0, 13, 5, 2, 2 * BIG_BANK, False),
    ]


def test_a_small_bank_ships_its_whole_layer_even_with_no_misses():
    """FAILS if entries are only emitted for misses: the gather skips small banks, so their rows
    would never arrive."""
    c = ReferenceCache(4, 8, 32)
    for layer in (0, 2, 1):
        c.ensure(layer, list(range(8)))
    c.begin_prefill()
    plan = c.prefetch_prefill_layer(1, (BIG_BANK, SMALL_BANK))
    assert plan.gather.count == 8 and plan.runs.count == 0
    assert plan.gather.banks.tolist() == [0, -1], "the small bank is not gathered"
    assert entries(plan, (BIG_BANK, SMALL_BANK)) == [(1, 8, 0, 8, 8 * SMALL_BANK, True)]


def test_the_two_prefill_buffers_rotate_by_layer_parity():
    c = ReferenceCache(4, 4, 16)
    c.begin_prefill()
    assert c.prefetch_prefill_layer(0, (BIG_BANK,)).buffer_id == 0
    assert c.prefetch_prefill_layer(1, (BIG_BANK,)).buffer_id == 1
    assert c.prefill_layer.tolist() == [0, 1]
    again = c.prefetch_prefill_layer(1, (BIG_BANK,))
    assert again.already_loaded and again.transfers.count == 0 and again.error == 0
    assert c.prefill_rows == 8, "the no-op staged no rows"
    c.release_prefill_layer(0)
    assert c.prefetch_prefill_layer(2, (BIG_BANK,)).buffer_id == 0
    assert c.prefill_layer.tolist() == [2, 1]


def test_releasing_a_layer_that_is_not_staged_is_ignored():
    c = ReferenceCache(4, 4, 16)
    c.begin_prefill()
    c.prefetch_prefill_layer(0, (BIG_BANK,))
    for layer in (2, -2, 9):
        c.release_prefill_layer(layer)
    assert c.prefetch_prefill_layer(2, (BIG_BANK,)).error == ERR_PREFILL_BUSY


def test_the_chunk_snapshot_and_the_live_map_agree_on_every_row():
    c = ReferenceCache(4, 4, 16)
    for layer in range(4):
        c.ensure(layer, [0, 1, 2, 3])
    c.begin_prefill()
    for layer in (2, 3, 2):
        live = [int(s) for s in c.slot_for_id[layer] if s >= 8]
        plan = c.prefetch_prefill_layer(layer, (BIG_BANK,))
        c.release_prefill_layer(layer)
        if not plan.already_loaded:
            assert plan.gather.src_slots[: plan.gather.count].tolist() == live


def test_a_pool_that_cannot_lend_the_buffers_their_slots_says_so():
    assert not ReferenceCache(2, 8, 12).prefill_overlap_fits()
    assert ReferenceCache(2, 8, 16).prefill_overlap_fits()
    with pytest.raises(PrefillDoesNotFit):
        ReferenceCache(2, 8, 12).prefetch_prefill_layer(0, (BIG_BANK,))


def test_nothing_staged_is_registered_as_resident():
    c = ReferenceCache(2, 4, 8)
    c.begin_prefill()
    c.prefetch_prefill_layer(0, (BIG_BANK,))
    assert (c.slot_for_id == -1).all() and (c.id_of_slot == -1).all()


def test_reset_stats_zeroes_the_prefill_row_counters():
    c = cache_with_one_layer_per_quarter()
    c.begin_prefill()
    c.prefetch_prefill_layer(2, (BIG_BANK,))
    c.reset_stats()
    assert (c.prefill_hit_rows, c.prefill_rows) == (0, 0)
