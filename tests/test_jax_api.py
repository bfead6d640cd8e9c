"""The JAX API against the rules it implements, one rule per test.

The rules of the Rust seed's test module and of the seed-000 promotion, restated against
``pallas_cache``; where the naive implementation is a real temptation the docstring says how the
test catches it. Plus the API surface: shapes, dtypes, traced layers, the two backend functions
against brute force, the split against its definition, the clock rebase near 2**30, and the
host-side reports.
"""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pallas_cache as pc
from pallas_cache.kernels import dispatch as backends
from pallas_cache import clock
from pallas_cache.host.reports import CacheStats
from reference import ReferenceCache, ReferencePolicy

BIG_BANK = 512 * 1024
SMALL_BANK = 4 * 1024
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


ROUTE_WIDTH = 8


def ids(*values):
    """Routes padded with -1 to a common width, so most tests share one compiled step."""
    values = list(values) + [-1] * (ROUTE_WIDTH - len(values))
    return jnp.asarray(values, jnp.int32)


def slot_of(state, layer, expert):
    slot = int(state.slot_for_id[layer, expert])
    return slot if slot >= 0 else None


def resident_slots(state):
    return int((state.id_of_slot >= 0).sum())


def valid(array, count):
    return np.asarray(array)[: int(count)].tolist()


def assert_bijective(state):
    slot_for_id, id_of_slot = np.asarray(state.slot_for_id), np.asarray(state.id_of_slot)
    E = state.num_experts
    for slot, flat in enumerate(id_of_slot):
        if flat >= 0:
            assert slot_for_id[flat // E, flat % E] == slot, f"slot {slot} and its occupant disagree"
    claimed = slot_for_id[slot_for_id >= 0]
    assert len(set(claimed.tolist())) == len(claimed)
    assert (np.asarray(state.usage) <= int(state.step)).all()


# ---- the Rust seed's rules -----------------------------------------------------------------


def test_a_cold_miss_is_fetched_and_becomes_resident():
    state = pc.init(4, 8, 16)
    state, plan = pc.ensure(state, 0, ids(3, 5))
    assert (int(plan.missing), int(plan.fetched), int(plan.copy.count)) == (2, 2, 2)
    assert valid(plan.copy.src_rows, 2) == [3, 5], "layer-local rows"
    assert (np.asarray(plan.slots)[:2] >= 0).all() and not np.asarray(plan.cpu).any()
    assert (np.asarray(plan.slots)[2:] == -1).all(), "padding"
    state, again = pc.ensure(state, 0, ids(3, 5))
    assert int(again.missing) == 0 and int(again.copy.count) == 0
    assert (np.asarray(again.copy.dst_slots) == -1).all()
    np.testing.assert_array_equal(again.slots, plan.slots)


def test_layers_share_one_pool_through_a_flat_id_space():
    """FAILS if residency is keyed by the layer-local expert id alone."""
    state = pc.init(4, 8, 16)
    state, _ = pc.ensure(state, 0, ids(3))
    state, plan = pc.ensure(state, 1, ids(3))
    assert int(plan.missing) == 1, "layer 1's expert 3 is a different expert"
    assert slot_of(state, 0, 3) != slot_of(state, 1, 3)
    assert resident_slots(state) == 2
    assert int(state.id_of_slot[slot_of(state, 1, 3)]) == 1 * 8 + 3


def test_duplicate_routes_collapse_into_one_copy_and_one_slot():
    state = pc.init(4, 8, 16)
    state, plan = pc.ensure(state, 0, ids(7, 7, 7, 2))
    assert int(plan.active) == 2
    assert int(plan.copy.count) == 2, "one copy per distinct expert"
    slots = np.asarray(plan.slots)
    assert slots[0] == slots[1] == slots[2] != slots[3]


def test_a_step_never_evicts_an_expert_it_is_about_to_read():
    """FAILS if victims are chosen before the hits are refreshed: the hit's slot is the LRU one."""
    state = pc.init(2, 4, 4)
    state, _ = pc.ensure(state, 0, ids(0, 1, 2, 3))
    state, _ = pc.ensure(state, 1, ids(0))
    held = slot_of(state, 1, 0)
    state, _ = pc.ensure(state, 0, ids(1, 2, 3))  # every other slot is now newer than `held`
    assert int(state.usage[held]) == int(np.asarray(state.usage).min())
    state, plan = pc.ensure(state, 1, ids(0, 1))
    assert int(plan.missing) == 1
    assert slot_of(state, 1, 0) == held, "the hit kept its slot"
    assert int(plan.copy.dst_slots[0]) != held
    assert int(plan.slots[0]) == held


def test_eviction_takes_the_least_recently_used_slot():
    state = pc.init(2, 4, 4)
    for expert in range(4):
        state, _ = pc.ensure(state, 0, ids(expert))
    state, _ = pc.ensure(state, 0, ids(0))  # refresh 0, making 1 the oldest
    oldest = slot_of(state, 0, 1)
    state, plan = pc.ensure(state, 1, ids(0))
    assert valid(plan.copy.dst_slots, plan.copy.count) == [oldest]
    assert slot_of(state, 0, 1) is None, "the oldest went"
    assert slot_of(state, 0, 0) is not None, "the refreshed one stayed"


def test_ties_in_usage_go_to_the_lowest_slot():
    """FAILS if the argmin breaks ties by anything but the slot index (a GPU kernel and the
    reference would then disagree about where an expert lives)."""
    state = pc.init(2, 4, 8)
    state, plan = pc.ensure(state, 0, ids(2, 0))
    assert valid(plan.copy.dst_slots, 2) == [0, 1], "empty slots (usage 0) in slot order"
    assert valid(plan.copy.src_rows, 2) == [0, 2], "misses in ascending id"


def test_a_large_cold_batch_assigns_unique_slots():
    state = pc.init(4, 64, 256)
    state, plan = pc.ensure(state, 2, jnp.arange(64, dtype=jnp.int32))
    assert int(plan.missing) == 64 and int(plan.copy.count) == 64
    assert len(set(np.asarray(plan.slots).tolist())) == 64, "no slot serves two experts"
    assert np.asarray(plan.copy.src_rows).tolist() == list(range(64)), "ascending expert id"


def test_the_hybrid_split_assigns_every_route_to_exactly_one_device():
    state = pc.init(1, 32, 40)
    state, plan = pc.ensure_hybrid(state, 0, jnp.arange(8, dtype=jnp.int32), pc.FetchPolicy.fraction(0.415))
    assert int(plan.missing) == 8
    assert int(plan.fetched) == 3, "0.415 * 8 = 3.32 -> 3"
    slots, cpu = np.asarray(plan.slots), np.asarray(plan.cpu)
    assert ((slots >= 0) != cpu).all()
    assert (slots >= 0).sum() == 3 and cpu.sum() == 5


def test_a_recurring_miss_climbs_the_fetch_order():
    """FAILS with a LOWEST_ID order: expert 9 loses the single fetch to every lower id."""
    state = pc.init(1, 16, 16)
    for round_ in range(6):
        state, _ = pc.ensure_hybrid(state, 0, ids(9, round_), pc.FetchPolicy.fixed_cap(1))
    assert slot_of(state, 0, 9) is not None, "the expert routed every step became resident"


def test_the_fixed_cap_fetches_at_most_cap_misses():
    state = pc.init(1, 32, 40)
    state, plan = pc.ensure_hybrid(state, 0, jnp.arange(8, dtype=jnp.int32), pc.FetchPolicy.fixed_cap(1))
    assert (int(plan.missing), int(plan.fetched), int(plan.copy.count)) == (8, 1, 1)


def test_recency_is_stamped_in_both_fetch_orders_and_never_by_plain_ensure():
    state = pc.init(1, 8, 8)
    state, _ = pc.ensure(state, 0, ids(1))
    assert int(state.recency[0, 1]) == -1, "plain ensure does not touch recency"
    state, _ = pc.ensure_hybrid(state, 0, ids(1, 2), pc.FetchPolicy.fixed_cap(0), order="lowest_id")
    assert np.asarray(state.recency[0, 1:3]).tolist() == [2, 2], "LOWEST_ID stamps too (docs/semantics.md §10)"


def test_materializing_a_layer_reclaims_other_layers_slots_cleanly():
    state = pc.init(2, 4, 4)
    state, _ = pc.ensure(state, 0, ids(0, 1, 2, 3))
    state, plan = pc.materialize_layer(state, 1)
    assert np.asarray(plan.copy.dst_slots).tolist() == [0, 1, 2, 3]
    assert np.asarray(plan.copy.src_rows).tolist() == [0, 1, 2, 3], "position == expert id"
    assert int(plan.copy.count) == 4
    for expert in range(4):
        assert slot_of(state, 1, expert) == expert
        assert slot_of(state, 0, expert) is None, "layer 0 must not hit on layer 1's bytes"
    state, plan = pc.ensure(state, 0, ids(3))
    assert int(plan.missing) == 1


def test_a_second_materialize_of_the_same_layer_is_idempotent():
    state = pc.init(2, 4, 6)
    state, _ = pc.ensure(state, 1, ids(3))  # a stale placement of layer 1 outside [0, E)
    state, _ = pc.materialize_layer(state, 1)
    once = state
    state, _ = pc.materialize_layer(state, 1)
    for expert in range(4):
        assert slot_of(state, 1, expert) == expert
    assert resident_slots(state) == 4
    np.testing.assert_array_equal(state.id_of_slot, once.id_of_slot)
    assert int(state.usage[4]) == 0, "the stale slot was emptied with usage 0"


def test_forget_slot_empties_the_slot_and_makes_it_the_first_victim():
    state = pc.init(2, 4, 4)
    state, _ = pc.ensure(state, 0, ids(0, 1, 2, 3))
    held = slot_of(state, 0, 2)
    state, plan = pc.forget_slot(state, held)
    assert int(plan.old) == 2 and int(plan) == 2 and int(plan.error) == 0
    assert slot_of(state, 0, 2) is None and int(state.id_of_slot[held]) == -1
    assert int(state.usage[held]) == INT32_MIN
    again, plan = pc.forget_slot(state, held)
    assert int(plan.old) == -1, "idempotent"
    chex.assert_trees_all_equal(again, state)
    state, plan = pc.ensure(state, 1, ids(0))
    assert int(plan.copy.dst_slots[0]) == held, "the forgotten slot is the very first victim"


def test_stats_answer_whether_the_cache_is_big_enough():
    state = pc.init(1, 2, 2)
    state, _ = pc.ensure(state, 0, ids(0, 1))
    state, _ = pc.ensure(state, 0, ids(0, 1))
    stats = pc.stats(state)
    assert (stats.calls, stats.active, stats.missing, stats.fetched) == (2, 4, 2, 2)
    assert stats.miss_rate == 0.5 and stats.fetch_rate == 1.0 and stats.active_per_call == 2.0
    assert stats.missing_per_call == 1.0 and stats.fetched_per_call == 1.0
    empty = pc.stats(pc.init(1, 2, 2))
    assert (empty.miss_rate, empty.fetch_rate, empty.active_per_call) == (0.0, 0.0, 0.0)


def test_a_rebuild_that_cannot_hold_a_layer_changes_nothing():
    state = pc.init(2, 8, 16)
    state, _ = pc.ensure(state, 0, ids(1))
    with pytest.raises(pc.RebuildRejected) as rejected:
        pc.rebuild(state, 4)
    assert (rejected.value.requested, rejected.value.minimum) == (4, 8)
    assert isinstance(rejected.value, ValueError)
    assert state.cache_size == 16 and slot_of(state, 0, 1) is not None
    state = pc.set_collect_routing(state, True)
    rebuilt = pc.rebuild(state, 8)
    assert rebuilt.cache_size == 8 and resident_slots(rebuilt) == 0
    assert int(rebuilt.step) == 0 and pc.stats(rebuilt).calls == 0
    assert bool(rebuilt.collect_routing), "a setting, kept"


def test_reset_is_a_cold_start_with_the_same_geometry():
    state = pc.init(2, 4, 8, rebase_threshold=100)
    state = pc.set_collect_routing(state, True)
    state, _ = pc.ensure_hybrid(state, 0, ids(0, 1), pc.FetchPolicy.fraction(0.5))
    state = pc.begin_prefill(state)
    cold = pc.reset(state)
    fresh = pc.set_collect_routing(pc.init(2, 4, 8, rebase_threshold=100), True)
    chex.assert_trees_all_equal(cold, fresh)


def test_a_cache_too_small_for_one_layer_is_rejected_at_construction():
    with pytest.raises(ValueError, match="cannot hold one layer"):
        pc.init(2, 8, 4)
    for bad in ((0, 8, 8), (2, 0, 8), (2, 8, 0)):
        with pytest.raises(ValueError):
            pc.init(*bad)
    with pytest.raises(TypeError, match="2.5"):
        pc.init(2, 2.5, 8)


def test_the_residency_map_stays_bijective_under_pressure():
    state = pc.init(4, 16, 20)
    policy = pc.FetchPolicy.fraction(0.5)
    for step in range(120):
        layer = step % 4
        routes = ids(*[(step * 7 + i * 3) % 16 for i in range(6)])
        if step % 2 == 0:
            state, plan = pc.ensure(state, layer, routes)
        else:
            state, plan = pc.ensure_hybrid(state, layer, routes, policy)
        assert plan.slots.shape == routes.shape == (ROUTE_WIDTH,)
        assert_bijective(state)


# ---- per-layer stats and the routing histogram ------------------------------------------


def test_per_layer_stats_tell_one_thrashing_layer_from_a_uniformly_tight_cache():
    """FAILS if per-layer stats are apportioned from the global window: both caches have the
    same global picture (8 active, 4 missing) and opposite per-layer ones."""
    thrashing = pc.init(2, 4, 8)
    thrashing, _ = pc.ensure(thrashing, 1, ids(0, 1))
    thrashing = pc.reset_stats(thrashing)
    for layer, routes in ((0, (0, 1)), (0, (2, 3)), (1, (0, 1)), (1, (0, 1))):
        thrashing, _ = pc.ensure(thrashing, layer, ids(*routes))
    uniform = pc.init(2, 4, 8)
    uniform, _ = pc.ensure(uniform, 0, ids(0))
    uniform, _ = pc.ensure(uniform, 1, ids(0))
    uniform = pc.reset_stats(uniform)
    for layer, routes in ((0, (0, 1)), (0, (0, 2)), (1, (0, 1)), (1, (0, 2))):
        uniform, _ = pc.ensure(uniform, layer, ids(*routes))
    assert pc.stats(thrashing).miss_rate == pc.stats(uniform).miss_rate == 0.5
    assert pc.layer_stats(thrashing, 0).miss_rate == 1.0
    assert pc.layer_stats(thrashing, 1).miss_rate == 0.0
    assert pc.layer_stats(uniform, 0).miss_rate == pc.layer_stats(uniform, 1).miss_rate == 0.5


def test_per_layer_stats_sum_to_the_global_stats():
    state = pc.init(3, 8, 16)
    for step in range(30):
        routes = ids(*[(step * 5 + i * 3) % 8 for i in range(4)])
        if step % 2 == 0:
            state, _ = pc.ensure(state, step % 3, routes)
        else:
            state, _ = pc.ensure_hybrid(state, step % 3, routes, pc.FetchPolicy.fraction(0.5))
    per_layer = pc.per_layer_stats(state)
    assert len(per_layer) == 3 and pc.layer_stats(state, 1).calls == 10
    total = pc.stats(state)
    for name in ("calls", "active", "missing", "fetched"):
        assert sum(getattr(s, name) for s in per_layer) == getattr(total, name)
    with pytest.raises(ValueError, match="3"):
        pc.layer_stats(state, 3)


def test_resetting_stats_opens_a_new_window_but_keeps_residency_and_the_histogram():
    state = pc.set_collect_routing(pc.init(2, 4, 8), True)
    state, _ = pc.ensure(state, 0, ids(0, 1))
    state = pc.reset_stats(state)
    assert pc.layer_stats(state, 0) == CacheStats(0, 0, 0, 0)
    assert np.asarray(pc.routing_histogram(state, 0)).tolist() == [1, 1, 0, 0]
    state, _ = pc.ensure(state, 0, ids(0, 1))
    assert pc.layer_stats(state, 0).missing == 0 and pc.layer_stats(state, 0).active_per_call == 2.0


def test_the_routing_histogram_counts_every_route_not_every_distinct_expert():
    """FAILS if the histogram is fed the deduplicated routes: skew is exactly that difference."""
    state = pc.set_collect_routing(pc.init(2, 4, 8), True)
    state, _ = pc.ensure(state, 0, ids(3, 3, 3, 1, -1))
    assert np.asarray(pc.routing_histogram(state, 0)).tolist() == [0, 1, 0, 3]
    assert np.asarray(pc.routing_histogram(state, 1)).tolist() == [0, 0, 0, 0]
    off = pc.set_collect_routing(state, False)
    off, _ = pc.ensure(off, 0, ids(0))
    assert np.asarray(pc.routing_histogram(off, 0)).tolist() == [0, 1, 0, 3], "collection is opt-in"


def counts_to_routes(counts):
    return jnp.asarray([e for e, n in enumerate(counts) for _ in range(n)], jnp.int32)


def test_oracle_hit_at_slots_separates_a_skewed_layer_from_a_flat_one():
    """FAILS if the oracle is derived from the working set (C / working_set): both layers touch
    all 8 experts, so that reports 0.5 for both; the truth is 0.96 and 0.52."""
    state = pc.set_collect_routing(pc.init(2, 8, 8), True)
    state, _ = pc.ensure(state, 0, counts_to_routes([24, 24, 24, 24, 1, 1, 1, 1]))
    state, _ = pc.ensure(state, 1, counts_to_routes([13, 13, 13, 13, 12, 12, 12, 12]))
    report = pc.routing_skew(state)
    assert report.slots_per_layer == 4.0 and report.oracle_slots == 4
    skewed, flat = report.per_layer
    assert skewed.routed == flat.routed == 100
    assert skewed.working_set == flat.working_set == 8
    assert skewed.oracle_hit_at_slots == pytest.approx(0.96, abs=1e-12)
    assert flat.oracle_hit_at_slots == pytest.approx(0.52, abs=1e-12)
    assert skewed.norm_entropy < flat.norm_entropy
    assert skewed.experts_for_90pct < flat.experts_for_90pct


def test_routing_skew_reports_the_working_set_coverage_and_entropy_per_layer():
    state = pc.set_collect_routing(pc.init(2, 8, 8), True)
    state, _ = pc.ensure(state, 0, jnp.arange(8, dtype=jnp.int32))
    state, _ = pc.ensure(state, 1, ids(2, 2, 2, 2))
    report = pc.routing_skew(state)
    flat, single = report.per_layer
    assert (flat.working_set, flat.experts_for_90pct) == (8, 8), "7 experts reach 0.875, not 0.9"
    assert flat.norm_entropy == pytest.approx(1.0, abs=1e-12)
    assert flat.oracle_hit_at_slots == pytest.approx(0.5, abs=1e-12)
    assert (single.working_set, single.experts_for_90pct) == (1, 1)
    assert single.norm_entropy == 0.0 and single.oracle_hit_at_slots == 1.0
    assert report.working_set_max == 8 and report.working_set_mean == 4.5
    assert report.experts_for_90pct == 4.5
    assert report.oracle_hit_at_slots == pytest.approx(0.75, abs=1e-12)
    assert report.norm_entropy == pytest.approx(0.5, abs=1e-12)


def test_routing_skew_is_absent_until_routing_is_observed_and_rounds_half_away():
    state = pc.init(4, 8, 16)
    state, _ = pc.ensure(state, 0, ids(1, 2))
    assert pc.routing_skew(state) is None, "collection is opt-in"
    state = pc.set_collect_routing(state, True)
    state, _ = pc.ensure(state, 2, ids(1, 2))
    report = pc.routing_skew(state)
    assert [s.layer for s in report.per_layer] == [2], "un-routed layers are absent, not zeros"
    assert pc.routing_skew(pc.reset_routing(state)) is None
    # S / L = 10 / 4 = 2.5 rounds half away from zero to 3 (half-to-even would give 2).
    odd = pc.set_collect_routing(pc.init(4, 8, 10), True)
    odd, _ = pc.ensure(odd, 0, ids(0, 1, 2, 3))
    assert pc.routing_skew(odd).oracle_slots == 3
    one_expert = pc.set_collect_routing(pc.init(1, 1, 1), True)
    one_expert, _ = pc.ensure(one_expert, 0, ids(0, 0))
    assert pc.routing_skew(one_expert).norm_entropy == 0.0, "E == 1: 0.0, not NaN"


# ---- the seed-000 promotion (docs/semantics.md §5.5) -----------------------------------------------------

def one_active_layer(admission):
    state = pc.init(8, 16, 64)
    state, _ = pc.ensure_hybrid(state, 0, ids(*range(7)), pc.FetchPolicy.fixed_cap(7),
                                admission=admission)
    fetches = cpu_routes = 0
    policy = pc.FetchPolicy.fraction(0.4)
    for _ in range(256):
        state, plan = pc.ensure_hybrid(state, 0, ids(*range(8)), policy, admission=admission)
        fetches += int(plan.fetched)
        cpu_routes += int(np.asarray(plan.cpu).sum())
    return fetches, cpu_routes, slot_of(state, 0, 7) is not None


def all_layers_cold(admission):
    state = pc.init(8, 16, 64)
    policy = pc.FetchPolicy.fraction(0.4)
    fetched, cpu = [], []
    for _ in range(256):
        for layer in range(8):
            state, plan = pc.ensure_hybrid(state, layer, ids(*range(8)), policy, admission=admission)
            fetched.append(plan.fetched)
            cpu.append(plan.cpu.sum())
    return int(sum(fetched)), int(sum(cpu)), int((np.asarray(state.id_of_slot) == -1).sum())


def test_the_seed_000_table_without_promotion():
    assert one_active_layer(pc.Admission.NONE) == (0, 256, False)
    assert all_layers_cold(pc.Admission.NONE) == (56, 2104, 8)


def test_the_seed_000_table_with_promote_one():
    """FAILS without the rule: a single miss at 0.4 rounds to zero fetches forever."""
    assert one_active_layer(pc.Admission.PROMOTE_ONE) == (1, 1, True)
    assert all_layers_cold(pc.Admission.PROMOTE_ONE) == (64, 88, 0)


def promotion_state():
    """One layer of 8 experts in a 16-slot pool, experts 0..6 resident, expert 7 seen before."""
    state = pc.init(1, 8, 16)
    state, _ = pc.ensure_hybrid(state, 0, jnp.arange(8, dtype=jnp.int32), pc.FetchPolicy.fixed_cap(7))
    return state


def test_a_first_time_miss_is_never_promoted():
    state = pc.init(1, 8, 16)
    state, _ = pc.ensure_hybrid(state, 0, ids(*range(7)), pc.FetchPolicy.fixed_cap(7))
    state, plan = pc.ensure_hybrid(state, 0, jnp.arange(8, dtype=jnp.int32), pc.FetchPolicy.fraction(0.4))
    assert int(plan.fetched) == 0 and bool(plan.cpu[7]), "expert 7 was never routed before"
    state, plan = pc.ensure_hybrid(state, 0, jnp.arange(8, dtype=jnp.int32), pc.FetchPolicy.fraction(0.4))
    assert int(plan.fetched) == 1 and valid(plan.copy.src_rows, 1) == [7], "now it recurs"


def test_a_recurring_miss_is_found_among_first_time_misses_with_lower_ids():
    """FAILS if the promoted expert is the lowest missing id rather than the most recent one."""
    state = pc.init(1, 16, 32)
    state, _ = pc.ensure_hybrid(state, 0, ids(9), pc.FetchPolicy.fixed_cap(0))  # 9 seen, not fetched
    state, plan = pc.ensure_hybrid(state, 0, ids(1, 9), pc.FetchPolicy.fraction(0.4))
    assert int(plan.fetched) == 1 and valid(plan.copy.src_rows, 1) == [9]
    assert valid(plan.copy.dst_slots, 1) == [0], "into the empty argmin slot"
    assert bool(plan.cpu[0]) and int(plan.slots[1]) == 0


@pytest.mark.parametrize("policy, order", [
    (pc.FetchPolicy.fixed_cap(0), "recency"),
    (pc.FetchPolicy.fixed_cap(1), "recency"),
    (pc.FetchPolicy.fraction(0.4), "lowest_id"),
])
def test_fixed_caps_and_the_lowest_id_order_keep_the_plain_split(policy, order):
    state = promotion_state()  # expert 7 recurs and an empty slot is the argmin
    _, promoted = pc.ensure_hybrid(state, 0, ids(7), policy, order=order, admission="promote_one")
    _, plain = pc.ensure_hybrid(state, 0, ids(7), policy, order=order, admission="none")
    chex.assert_trees_all_equal(promoted, plain)


def test_promotion_needs_an_empty_argmin_slot():
    """A recurring miss is promoted into an empty LRU slot, never by evicting a resident."""
    state = promotion_state()  # expert 7 routed once (CPU), slots 7..15 empty
    _, plan = pc.ensure_hybrid(state, 0, ids(7), pc.FetchPolicy.fraction(0.4))
    assert (int(plan.missing), int(plan.fetched)) == (1, 1)
    assert valid(plan.copy.dst_slots, 1) == [7] and valid(plan.copy.src_rows, 1) == [7]
    # A full pool: expert 0 of layer 0 was routed, then evicted by layer 1; the LRU slot holds
    # a resident, so the recurring miss stays on the CPU.
    full = pc.init(2, 2, 2)
    full, _ = pc.ensure_hybrid(full, 0, ids(0, 1), pc.FetchPolicy.fixed_cap(2))
    full, _ = pc.ensure(full, 1, ids(0))
    assert slot_of(full, 0, 0) is None and int(full.recency[0, 0]) >= 0
    _, plan = pc.ensure_hybrid(full, 0, ids(0), pc.FetchPolicy.fraction(0.4))
    assert int(plan.fetched) == 0 and bool(plan.cpu[0])
    # Forget the LRU slot: now it is empty and the argmin, and the rule fires.
    lru = int(np.argmin(np.asarray(full.usage)))
    emptied, _ = pc.forget_slot(full, lru)
    _, plan = pc.ensure_hybrid(emptied, 0, ids(0), pc.FetchPolicy.fraction(0.4))
    assert int(plan.fetched) == 1 and valid(plan.copy.dst_slots, 1) == [lru]
    _, plan = pc.ensure_hybrid(emptied, 0, ids(0), pc.FetchPolicy.fraction(0.4), admission="none")
    assert int(plan.fetched) == 0, "NONE is the plain split"


def test_reuse_admits_misses_more_recent_than_their_victims_and_stops_at_the_first_rejection():
    # Layer 1 fills the pool at step 1; layer 0's experts are routed at steps 2 and 3 (CPU).
    state = pc.init(2, 4, 4)
    state, _ = pc.ensure(state, 1, ids(0, 1, 2, 3))
    state, _ = pc.ensure_hybrid(state, 0, ids(0), pc.FetchPolicy.fixed_cap(0))
    state, _ = pc.ensure_hybrid(state, 0, ids(1), pc.FetchPolicy.fixed_cap(0))
    # q = 0.4, M = 3 -> F = 1. Recency order: 1 (3), 0 (2), 2 (-1). Victims have usage 1.
    state, plan = pc.ensure_hybrid(state, 0, ids(0, 1, 2), pc.FetchPolicy.fraction(0.4),
                                   admission="reuse")
    assert int(plan.missing) == 3
    assert valid(plan.copy.src_rows, plan.copy.count) == [1, 0], "2 was never routed: rejected"
    # Expert 2 was routed at step 4, after its would-be victim (usage 1) was last used.
    _, plan = pc.ensure_hybrid(state, 0, ids(2), pc.FetchPolicy.fraction(0.4), admission="reuse")
    assert int(plan.fetched) == 1, "admitted past F = 0"
    for policy, order in ((pc.FetchPolicy.fixed_cap(0), "recency"),
                          (pc.FetchPolicy.fraction(0.4), "lowest_id")):
        _, plan = pc.ensure_hybrid(state, 0, ids(2), policy, order=order, admission="reuse")
        assert int(plan.fetched) == 0, "REUSE needs the recency order and a fraction policy"


# ---- the balanced split and the policy ------------------------------------------------------


@pytest.mark.parametrize("q, missing, fetch", [
    (0.4, 1, 0), (0.415, 3, 1), (0.415, 4, 2), (0.415, 8, 3), (0.5, 1, 0), (1.0, 5, 5),
    (0.0, 5, 0),
])
def test_the_split_examples_of_spec(q, missing, fetch):
    assert int(pc.FetchPolicy.fraction(q).split(jnp.int32(missing))) == fetch


SPLIT = jax.jit(pc.FetchPolicy.split)


@given(f=st.integers(0, 65536), missing=st.integers(0, 2**31 - 1), cap=st.integers(0, 2**31 - 1))
def test_the_split_matches_its_definition_without_overflow(f, missing, cap):
    """FAILS with the direct int32 formula: M * f overflows as soon as M >= 32768."""
    policy = pc.FetchPolicy(jnp.int32(f), jnp.int32(cap))
    expected = ReferencePolicy(fraction16=f, cap=cap).split(missing)
    assert int(SPLIT(policy, jnp.int32(missing))) == expected
    assert 0 <= expected <= missing
    if f:
        assert abs(expected - f / 65536 * missing) <= 1


def test_fraction_rounds_half_to_even_on_the_host():
    assert int(pc.FetchPolicy.fraction(0.5 / 65536).fraction16) == 0
    assert int(pc.FetchPolicy.fraction(1.5 / 65536).fraction16) == 2
    assert int(pc.FetchPolicy.fraction(2.5 / 65536).fraction16) == 2
    assert int(pc.FetchPolicy.fraction(7.0).fraction16) == 65536, "clamped to one"
    assert int(pc.FetchPolicy.fraction(-0.1).fraction16) == 0, "clamped to zero (docs/semantics.md §5.3)"
    assert int(pc.FetchPolicy.fraction(float("-inf")).fraction16) == 0
    assert int(pc.FetchPolicy.fraction(float("inf")).fraction16) == 65536
    assert int(pc.FetchPolicy.fraction(np.float32(0.25)).fraction16) == 16384
    assert int(pc.FetchPolicy.full().fraction16) == 65536
    chex.assert_type([pc.FetchPolicy.fraction(0.4).fraction16, pc.FetchPolicy.fixed_cap(3).cap], jnp.int32)


@pytest.mark.parametrize("bad, error", [
    (float("nan"), ValueError), ("0.4", TypeError), (None, TypeError),
    (True, TypeError), (complex(0.4, 0), TypeError),
])
def test_fraction_rejects_nan_and_non_numbers(bad, error):
    with pytest.raises(error, match=re.escape(repr(bad))):
        pc.FetchPolicy.fraction(bad)


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_fixed_cap_rejects_negatives_and_non_integers(bad, error):
    with pytest.raises(error, match=str(bad)):
        pc.FetchPolicy.fixed_cap(bad)


def test_enums_accept_their_string_values_and_reject_others():
    assert pc.FetchOrder.coerce("lowest_id") is pc.FetchOrder.LOWEST_ID
    assert pc.Admission.coerce("REUSE") is pc.Admission.REUSE
    with pytest.raises(ValueError, match="sideways"):
        pc.ensure_hybrid(pc.init(1, 2, 2), 0, ids(0), pc.FetchPolicy.full(), order="sideways")
    with pytest.raises(ValueError, match="promote_two"):
        pc.ensure_hybrid(pc.init(1, 2, 2), 0, ids(0), pc.FetchPolicy.full(), admission="promote_two")


def test_changing_the_fraction_never_recompiles():
    state = pc.init(2, 4, 8)
    traces = []

    @jax.jit
    def step(state, policy):
        traces.append(1)
        return pc.ensure_hybrid(state, 0, ids(0, 1, 2), policy)

    for q in (0.1, 0.4, 0.9):
        state, _ = step(state, pc.FetchPolicy.fraction(q))
    state, _ = step(state, pc.FetchPolicy.fixed_cap(2))
    assert len(traces) == 1


# ---- the backend functions against brute force ---------------------------------------------


def brute_force_victims(usage, step, n):
    order = sorted((s for s in range(len(usage)) if usage[s] != step), key=lambda s: (usage[s], s))
    return order[:n]


SELECT_VICTIMS = jax.jit(backends.select_victims, static_argnames=("num_out", "backend"))
PROMOTION_DECISION = jax.jit(backends.promotion_decision, static_argnames=("backend",))
stamps = st.one_of(st.integers(-3, 6), st.sampled_from([INT32_MIN, INT32_MAX]))


@given(size=st.sampled_from([1, 5, 12]), step=st.one_of(st.integers(-1, 6), st.just(INT32_MAX)),
       data=st.data())
def test_select_victims_is_n_repeated_argmins(size, step, data):
    usage = data.draw(st.lists(stamps, min_size=size, max_size=size), label="usage")
    num_out = size if size < 12 else 4  # a few static shapes, so a few compilations
    n = data.draw(st.integers(0, num_out), label="n")
    got = SELECT_VICTIMS(jnp.asarray(usage, jnp.int32), jnp.int32(step), jnp.int32(n), num_out=num_out)
    expected = brute_force_victims(usage, step, n)
    assert np.asarray(got).tolist() == expected + [-1] * (num_out - len(expected))


def brute_force_promotion(usage, id_of_slot, step, recency, miss, fraction16, num_fetch):
    misses = [e for e in range(len(miss)) if miss[e]]
    if not (fraction16 > 0 and num_fetch == 0 and misses):
        return -1, -1
    first = sorted(misses, key=lambda e: (-recency[e], e))[0]
    victims = brute_force_victims(usage, step, 1)
    if not victims or id_of_slot[victims[0]] != -1 or recency[first] < 0:
        return -1, -1
    return first, victims[0]


@given(data=st.data())
def test_promotion_decision_is_the_seed_000_rule(data):
    S = data.draw(st.sampled_from([1, 8]))
    E = data.draw(st.sampled_from([1, 6]))
    usage = data.draw(st.lists(st.integers(0, 5), min_size=S, max_size=S))
    id_of_slot = data.draw(st.lists(st.integers(-1, 3), min_size=S, max_size=S))
    recency = data.draw(st.lists(st.integers(-1, 5), min_size=E, max_size=E))
    miss = data.draw(st.lists(st.booleans(), min_size=E, max_size=E))
    step = data.draw(st.integers(0, 5))
    fraction16 = data.draw(st.sampled_from([0, 1, 26214, 65536]))
    num_fetch = data.draw(st.integers(0, 2))
    got = PROMOTION_DECISION(
        jnp.asarray(usage, jnp.int32), jnp.asarray(id_of_slot, jnp.int32), jnp.int32(step),
        jnp.asarray(recency, jnp.int32), jnp.asarray(miss), jnp.int32(fraction16), jnp.int32(num_fetch))
    assert tuple(int(x) for x in got) == brute_force_promotion(
        usage, id_of_slot, step, recency, miss, fraction16, num_fetch)


def test_backend_resolution():
    expected = "pallas" if jax.default_backend() == "gpu" else "xla"
    assert backends.resolve_backend(None) == expected
    with pytest.raises(ValueError, match="cuda"):
        backends.resolve_backend("cuda")
    with pytest.raises(ValueError, match="triton"):
        pc.ensure(pc.init(1, 2, 2), 0, ids(0), backend="triton")


# ---- shapes, dtypes, traced layers ----------------------------------------------------------


def test_routes_of_any_shape_come_back_in_that_shape():
    state = pc.init(2, 4, 8)
    routes = jnp.asarray([[0, 1, -1], [1, 3, 3]], jnp.int32)
    state, plan = pc.ensure_hybrid(state, 1, routes, pc.FetchPolicy.fraction(0.5))
    chex.assert_shape([plan.slots, plan.cpu], (2, 3))
    chex.assert_shape([plan.copy.dst_slots, plan.copy.src_rows], (4,))
    chex.assert_type([plan.slots, plan.copy.dst_slots, plan.active, plan.error], jnp.int32)
    chex.assert_type(plan.cpu, jnp.bool_)
    assert int(plan.slots[0, 2]) == -1 and not bool(plan.cpu[0, 2]), "padding gets neither"
    assert int(plan.slots[1, 1]) == int(plan.slots[1, 2]) and bool(plan.cpu[1, 1]) == bool(plan.cpu[1, 2])


def test_a_batch_larger_than_e_has_copy_arrays_of_length_e():
    state = pc.init(1, 3, 3)
    state, plan = pc.ensure(state, 0, ids(2, 2, 1, 1, 0, 0, -1, 2))
    chex.assert_shape([plan.copy.dst_slots, plan.copy.src_rows], (3,))
    assert int(plan.copy.count) == 3 and int(plan.active) == 3


def test_an_empty_or_all_padding_batch_is_a_call_that_touches_nothing():
    state = pc.init(1, 3, 3)
    state, plan = pc.ensure(state, 0, jnp.zeros((0,), jnp.int32))
    chex.assert_shape([plan.copy.dst_slots], (0,))
    assert int(state.step) == 1 and pc.stats(state).calls == 1 and pc.stats(state).active == 0
    state, plan = pc.ensure_hybrid(state, 0, ids(-1, -1), pc.FetchPolicy.fraction(0.4))
    assert (np.asarray(plan.slots) == -1).all() and not np.asarray(plan.cpu).any()


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int64, np.uint32])
def test_any_integer_dtype_is_accepted(dtype):
    state = pc.init(1, 4, 4)
    _, plan = pc.ensure(state, np.int64(0), np.asarray([1, 2], dtype))
    assert valid(plan.copy.src_rows, plan.copy.count) == [1, 2]


def test_the_layer_is_traced_never_static():
    traces = []

    @jax.jit
    def step(state, layer):
        traces.append(1)
        return pc.ensure(state, layer, ids(0, 1))

    state = pc.init(3, 4, 8)
    for layer in (0, 1, 2, 1):
        state, plan = step(state, jnp.int32(layer))
    assert len(traces) == 1
    assert resident_slots(state) == 6


def test_jit_and_eager_agree():
    state = pc.init(3, 4, 8)
    jitted = jax.jit(pc.ensure_hybrid, static_argnames=("order", "admission", "backend"))
    eager_state, jit_state = state, state
    rng = np.random.default_rng(3)
    for step in range(12):
        layer, routes = int(rng.integers(3)), jnp.asarray(rng.integers(-1, 4, 5), jnp.int32)
        policy = pc.FetchPolicy.fraction(float(rng.random()))
        eager_state, eager_plan = pc.ensure_hybrid(eager_state, layer, routes, policy)
        jit_state, jit_plan = jitted(jit_state, layer, routes, policy)
        chex.assert_trees_all_equal(eager_state, jit_state)
        chex.assert_trees_all_equal(eager_plan, jit_plan)


# ---- the clock rebase (docs/semantics.md §5.12) ------------------------------------------------------------


def test_dense_rank_keeps_sentinels_and_every_order():
    usage = jnp.asarray([0, 50, INT32_MIN, 70, 50, 90], jnp.int32)
    recency = jnp.asarray([[-1, 60, 90], [50, -1, 10]], jnp.int32)
    new_usage, new_recency, new_step = clock.dense_rank_stamps(usage, recency, jnp.int32(95))
    assert np.asarray(new_usage).tolist() == [0, 2, INT32_MIN, 4, 2, 5]
    assert np.asarray(new_recency).tolist() == [[-1, 3, 5], [2, -1, 1]]
    assert int(new_step) == 6


def shift_live_stamps(state, ref, offset):
    """Move both caches' clocks forward by ``offset``, as if they had run that long."""
    usage = np.asarray(state.usage)
    recency = np.asarray(state.recency)
    new_usage = np.where(usage >= 1, usage + offset, usage)
    new_recency = np.where(recency >= 0, recency + offset, recency)
    state = state.replace(usage=jnp.asarray(new_usage, jnp.int32),
                          recency=jnp.asarray(new_recency, jnp.int32),
                          step=jnp.int32(int(state.step) + offset))
    ref.usage[:] = new_usage
    ref.recency[:] = new_recency
    ref.step += offset
    return state


def test_a_cache_just_below_the_default_threshold_runs_across_it():
    """FAILS if the clock wraps or if the renumbering changes any decision: the JAX cache and the
    reference (int64, same rebase) must agree on every plan across the threshold."""
    L, E, S = 2, 4, 6
    state, ref = pc.init(L, E, S), ReferenceCache(L, E, S)
    rng = np.random.default_rng(11)
    policy, ref_policy = pc.FetchPolicy.fraction(0.4), ReferencePolicy.fraction(0.4)

    def step_both(state, i):
        layer, routes = int(rng.integers(L)), rng.integers(-1, E, 3).astype(np.int32)
        state, plan = pc.ensure_hybrid(state, layer, jnp.asarray(routes), policy,
                                       admission="reuse" if i % 2 else "promote_one")
        expected = ref.ensure_hybrid(layer, routes, ref_policy, admission="reuse" if i % 2 else "promote_one")
        np.testing.assert_array_equal(np.asarray(plan.slots), expected.slots)
        np.testing.assert_array_equal(np.asarray(plan.copy.dst_slots), expected.dst_slots)
        return state

    for i in range(10):
        state = step_both(state, i)
    state, _ = pc.forget_slot(state, 1)
    ref.forget_slot(1)
    state = shift_live_stamps(state, ref, 2**30 - 3 - int(state.step))
    for i in range(10):
        state = step_both(state, i)
        np.testing.assert_array_equal(np.asarray(state.usage), ref.usage)
        np.testing.assert_array_equal(np.asarray(state.recency), ref.recency)
        assert int(state.step) == ref.step
    assert int(state.step) < 100, "the clock was renumbered"
    assert_bijective(state)


# ---- prefill double buffers (docs/semantics.md §5.11) -------------------------------------------------------


def one_layer_per_quarter():
    """Four layers of four experts filling all sixteen slots in layer order."""
    state = pc.init(4, 4, 16)
    for layer in range(4):
        state, _ = pc.ensure(state, layer, ids(0, 1, 2, 3))
    return state


def test_a_slot_inside_the_prefill_buffers_is_a_miss_however_resident_it_looks():
    """FAILS if hits are classified as "has a slot": layer 1 lives in slots 4..8, exactly the
    buffer it is staged into, and a gather from there would race the staging copy."""
    state = pc.begin_prefill(one_layer_per_quarter())
    assert slot_of(state, 1, 0) == 4
    state, plan = pc.prefetch_prefill_layer(state, 1, (BIG_BANK,))
    assert int(plan.buffer_id) == 1 and int(plan.gather.count) == 0
    assert valid(plan.runs.starts, plan.runs.count) == [0] and valid(plan.runs.lens, plan.runs.count) == [4]
    assert (int(state.prefill_hit_rows), int(state.prefill_rows)) == (0, 4)


def test_a_resident_expert_above_the_buffer_slots_is_gathered_device_side():
    state = pc.begin_prefill(one_layer_per_quarter())
    state, plan = pc.prefetch_prefill_layer(state, 2, (BIG_BANK,))
    assert int(plan.buffer_id) == 0
    assert valid(plan.gather.dst_slots, plan.gather.count) == [0, 1, 2, 3]
    assert valid(plan.gather.src_slots, plan.gather.count) == [8, 9, 10, 11]
    assert int(plan.runs.count) == 0 and int(plan.transfers.count) == 0, "a big bank with no misses ships nothing"
    assert (int(state.prefill_hit_rows), int(state.prefill_rows)) == (4, 4)


def test_invalidating_a_prefill_buffer_makes_its_slots_the_first_victims():
    """FAILS if invalidation leaves usage alone: the buffer slots are the newest in the pool, so
    the next decode miss would evict a live resident while four empty slots sit unused."""
    state = one_layer_per_quarter()
    state, _ = pc.ensure(state, 0, ids(0, 1, 2, 3))
    state, _ = pc.ensure(state, 1, ids(0, 1, 2, 3))
    state = pc.begin_prefill(state)
    state, _ = pc.prefetch_prefill_layer(state, 0, (BIG_BANK,))
    assert all(slot_of(state, 0, e) is None for e in range(4)), "old occupants lost residency"
    assert np.asarray(state.usage[:4]).tolist() == [0, 0, 0, 0]
    state, plan = pc.ensure(state, 0, ids(0))
    assert valid(plan.copy.dst_slots, plan.copy.count) == [0]
    assert slot_of(state, 2, 0) == 8, "no real resident was evicted while free slots existed"


def test_prefill_misses_ship_as_contiguous_expert_runs():
    """FAILS if each missing expert ships as its own entry (five entries instead of two)."""
    state = pc.init(4, 8, 32)
    for layer, routes in ((0, range(8)), (2, range(8)), (1, (3, 4, 7))):
        state, _ = pc.ensure(state, layer, ids(*routes))
    state = pc.begin_prefill(state)
    state, plan = pc.prefetch_prefill_layer(state, 1, (BIG_BANK,))
    assert int(plan.buffer_id) == 1
    assert valid(plan.gather.dst_slots, plan.gather.count) == [11, 12, 15]
    assert valid(plan.gather.src_slots, plan.gather.count) == [16, 17, 18]
    assert valid(plan.runs.starts, plan.runs.count) == [0, 5]
    assert valid(plan.runs.lens, plan.runs.count) == [3, 2]
    n = int(plan.transfers.count)
    assert n == 2
    assert valid(plan.transfers.bank, n) == [0, 0] and valid(plan.transfers.dst_slot, n) == [8, 13]
    assert valid(plan.transfers.src_row, n) == [0, 5] and valid(plan.transfers.rows, n) == [3, 2]
    assert valid(plan.transfers.whole_layer, n) == [False, False]
    assert plan.entry_bytes((BIG_BANK,))[:n].tolist() == [3 * BIG_BANK, 2 * BIG_BANK]


def test_a_small_bank_ships_its_whole_layer_even_with_no_misses():
    """FAILS if entries are only emitted for misses: the gather skips small banks, so their rows
    would never arrive."""
    state = pc.init(4, 8, 32)
    for layer in (0, 2, 1):
        state, _ = pc.ensure(state, layer, jnp.arange(8, dtype=jnp.int32))
    state = pc.begin_prefill(state)
    state, plan = pc.prefetch_prefill_layer(state, 1, (BIG_BANK, SMALL_BANK))
    assert int(plan.gather.count) == 8 and int(plan.runs.count) == 0
    assert np.asarray(plan.gather.banks).tolist() == [0, -1], "the small bank is not gathered"
    n = int(plan.transfers.count)
    assert n == 1
    assert (valid(plan.transfers.bank, n), valid(plan.transfers.dst_slot, n), valid(plan.transfers.src_row, n),
            valid(plan.transfers.rows, n), valid(plan.transfers.whole_layer, n)) == ([1], [8], [0], [8], [True])
    assert plan.entry_bytes((BIG_BANK, SMALL_BANK))[:1].tolist() == [8 * SMALL_BANK]


def test_entry_bytes_do_not_overflow_int32():
    state = pc.begin_prefill(pc.init(2, 8, 16))
    huge = 2**30
    state, plan = pc.prefetch_prefill_layer(state, 0, (huge,))
    assert plan.entry_bytes((huge,))[0] == 8 * huge


def test_the_two_prefill_buffers_rotate_by_layer_parity():
    state = pc.begin_prefill(pc.init(4, 4, 16))
    assert np.asarray(state.prefill_layer).tolist() == [-1, -1]
    state, plan0 = pc.prefetch_prefill_layer(state, 0, (BIG_BANK,))
    state, plan1 = pc.prefetch_prefill_layer(state, 1, (BIG_BANK,))
    assert (int(plan0.buffer_id), int(plan1.buffer_id)) == (0, 1)
    assert np.asarray(state.prefill_layer).tolist() == [0, 1]
    state, again = pc.prefetch_prefill_layer(state, 1, (BIG_BANK,))
    assert bool(again.already_loaded) and int(again.transfers.count) == 0 and int(again.error) == 0
    assert int(state.prefill_rows) == 8, "the no-op staged no rows"
    state = pc.release_prefill_layer(state, 0)
    state, plan2 = pc.prefetch_prefill_layer(state, 2, (BIG_BANK,))
    assert int(plan2.buffer_id) == 0 and int(plan2.error) == 0
    assert np.asarray(state.prefill_layer).tolist() == [2, 1]


def test_releasing_a_layer_that_is_not_staged_is_ignored():
    state = pc.begin_prefill(pc.init(4, 4, 16))
    state, _ = pc.prefetch_prefill_layer(state, 0, (BIG_BANK,))
    for other in (2, -1, 9):
        unchanged = pc.release_prefill_layer(state, other)
        chex.assert_trees_all_equal(unchanged, state)


def test_the_chunk_snapshot_and_the_live_map_agree_on_every_row():
    state = pc.init(4, 4, 16)
    for layer in range(4):
        state, _ = pc.ensure(state, layer, ids(0, 1, 2, 3))
    state = pc.begin_prefill(state)
    for layer in (2, 3, 2):
        live = [s for s in np.asarray(state.slot_for_id[layer]).tolist() if s >= 8]
        state, plan = pc.prefetch_prefill_layer(state, layer, (BIG_BANK,))
        state = pc.release_prefill_layer(state, layer)
        if not bool(plan.already_loaded):
            assert valid(plan.gather.src_slots, plan.gather.count) == live


def test_a_pool_that_cannot_lend_the_buffers_their_slots_says_so():
    small = pc.init(2, 8, 12)
    assert not pc.prefill_overlap_fits(small)
    assert pc.prefill_overlap_fits(pc.init(2, 8, 16))
    with pytest.raises(pc.PrefillDoesNotFit, match="12"):
        pc.begin_prefill(small)
    with pytest.raises(pc.PrefillDoesNotFit, match="16"):
        pc.prefetch_prefill_layer(small, 0, (BIG_BANK,))
