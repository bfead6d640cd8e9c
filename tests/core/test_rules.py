"""The cache's rules, one test per rule, each on the adapters of conftest.py (docs/semantics.md
§3-§5, §8, §10): residency, eviction and the copy plan, the hybrid split and admission, stats,
the routing histogram and the skew report, the int32 clock rebase (§5.12), value errors that
leave the state unchanged (§6) and the prefill chunk (§5.11). A docstring says how its test
catches the naive implementation where that is a real temptation."""

from __future__ import annotations

import random

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.harness import (ADAPTER, PROFILE, assert_invariants, assert_same, entries, resident_slots,
                      slot_of, steps, valid)
from pallas_cache import reference
from pallas_cache.testing import lockstep
from pallas_cache.testing.operations import (BeginPrefill, Ensure, EnsureHybrid, Forget,
                                             Materialize, PolicySpec, PrefetchPrefill,
                                             ReleasePrefill)
from pallas_cache.sizing import scenarios
from pallas_cache.state import Clock

INT32_MIN = -(2**31)


# ---- residency, eviction, the copy plan (docs/semantics.md §5.2) -----------------------------


def test_a_cold_miss_is_fetched_and_becomes_resident(adapter):
    c = adapter.cache(4, 8, 16)
    plan = c.ensure(0, [3, 5])
    assert (plan.missing, plan.fetched, plan.copy.count) == (2, 2, 2)
    assert valid(plan.copy, "src_rows") == [3, 5], "layer-local rows"
    assert (plan.slots >= 0).all() and not plan.cpu.any()
    again = c.ensure(0, [3, 5])
    assert again.missing == 0 and again.copy.count == 0
    assert (again.copy.dst_slots == -1).all()
    assert again.slots.tolist() == plan.slots.tolist(), "the second visit is free"


@pytest.mark.traced
def test_layers_share_one_pool_through_a_flat_id_space(adapter):
    """FAILS if residency is keyed by the layer-local expert id alone."""
    c = adapter.cache(4, 8, 16)
    c.ensure(0, [3])
    plan = c.ensure(1, [3])
    assert plan.missing == 1, "layer 1's expert 3 is a different expert"
    state = c.state
    assert slot_of(state, 0, 3) != slot_of(state, 1, 3)
    assert resident_slots(state) == 2
    assert state.residency.id_of_slot[slot_of(state, 1, 3)] == 1 * 8 + 3


def test_duplicate_routes_collapse_into_one_copy_and_one_slot(adapter):
    c = adapter.cache(4, 8, 16)
    plan = c.ensure(0, [7, 7, 7, 2])
    assert plan.active == 2
    assert plan.copy.count == 2, "one copy per distinct expert"
    assert plan.slots[0] == plan.slots[1] == plan.slots[2] != plan.slots[3]


def test_a_step_never_evicts_an_expert_it_is_about_to_read(adapter):
    """FAILS if victims are chosen before the hits are refreshed: the hit's slot is the LRU one."""
    c = adapter.cache(2, 4, 4)
    c.ensure(0, [0, 1, 2, 3])
    c.ensure(1, [0])
    held = slot_of(c.state, 1, 0)
    c.ensure(0, [1, 2, 3])  # every other slot is now newer than `held`
    assert c.state.residency.usage[held] == c.state.residency.usage.min()
    plan = c.ensure(1, [0, 1])
    assert plan.missing == 1
    assert slot_of(c.state, 1, 0) == held, "the hit kept its slot"
    assert plan.copy.dst_slots[0] != held
    assert plan.slots[0] == held


def test_hits_are_refreshed_before_victims_are_chosen(adapter):
    """FAILS if victims are chosen from the usage as it was on entry: the hit (layer 1,
    expert 0) sits in the oldest slot, and would be evicted by the miss beside it."""
    c = adapter.cache(2, 3, 3)
    c.ensure(1, [0])  # slot 0, the oldest stamp
    c.ensure(0, [0, 1])  # slots 1, 2
    plan = c.ensure(1, [0, 1])
    assert plan.slots[0] == 0 and plan.copy.dst_slots[0] == 1
    assert_invariants(c.state)


def test_a_step_never_evicts_a_slot_it_claimed_earlier_in_the_same_step(adapter):
    """FAILS if claimed victims are not knocked out: two misses on a full pool whose oldest
    slot is unique would both take it."""
    c = adapter.cache(2, 4, 4)
    for expert in range(4):
        c.ensure(0, [expert])
    plan = c.ensure(1, [0, 1])
    assert valid(plan.copy, "dst_slots") == [0, 1]
    assert_invariants(c.state)


def test_eviction_takes_the_least_recently_used_slot(adapter):
    c = adapter.cache(2, 4, 4)
    for expert in range(4):
        c.ensure(0, [expert])  # one step each, ascending usage
    c.ensure(0, [0])  # refresh 0, making 1 the oldest
    oldest = slot_of(c.state, 0, 1)
    plan = c.ensure(1, [0])
    assert valid(plan.copy, "dst_slots") == [oldest]
    assert slot_of(c.state, 0, 1) is None, "the oldest went"
    assert slot_of(c.state, 0, 0) is not None, "the refreshed one stayed"


@pytest.mark.kernels
def test_usage_ties_go_to_the_lowest_slot(adapter):
    """FAILS if the victim search breaks ties by anything but the slot index (a GPU kernel and
    the reference would then disagree about where an expert lives): empty slots (usage 0) and
    slots 0..3 sharing one stamp must be taken in slot order."""
    c = adapter.cache(2, 4, 8)
    plan = c.ensure(0, [2, 0])
    assert valid(plan.copy, "dst_slots") == [0, 1], "empty slots (usage 0) in slot order"
    assert valid(plan.copy, "src_rows") == [0, 2], "misses in ascending id"
    c = adapter.cache(3, 4, 8)
    c.ensure(0, [3, 2, 1, 0])  # slots 0..3, one stamp
    c.ensure(1, [0, 1, 2, 3])  # slots 4..7, a newer stamp
    plan = c.ensure(2, [3, 1])
    assert plan.copy.dst_slots.tolist() == [0, 1]
    assert plan.copy.src_rows.tolist() == [1, 3], "misses ascend by id, victims by (usage, slot)"
    assert plan.slots.tolist() == [1, 0]


def test_a_large_cold_batch_assigns_unique_slots(adapter):
    c = adapter.cache(4, 64, 256)
    plan = c.ensure(2, list(range(63, -1, -1)))  # descending, so ascending rows are the cache's doing
    assert plan.missing == 64 and plan.copy.count == 64
    assert len(set(plan.slots.tolist())) == 64, "no slot serves two experts"
    assert plan.copy.src_rows.tolist() == list(range(64)), "misses are ranked by ascending expert id"


def test_the_residency_map_stays_bijective_under_pressure(adapter):
    c = adapter.cache(4, 16, 20)
    policy = adapter.Policy.fraction(0.5)
    for step in range(120):
        layer = step % 4
        routes = [(step * 7 + i * 3) % 16 for i in range(6)]
        plan = c.ensure(layer, routes) if step % 2 == 0 else c.ensure_hybrid(layer, routes, policy)
        assert plan.slots.shape == (6,)
        assert_invariants(c.state)


# ---- the hybrid split and the fetch order (docs/semantics.md §5.3, §5.4, §10) ----------------


def test_the_hybrid_split_assigns_every_route_to_exactly_one_device(adapter):
    c = adapter.cache(1, 32, 40)
    plan = c.ensure_hybrid(0, [0, 1, 2, 3, 4, 5, 6, 7, 3], adapter.Policy.fraction(0.415))
    assert plan.missing == 8
    assert plan.fetched == 3, "0.415 * 8 = 3.32 -> 3"
    on_gpu = plan.slots >= 0
    assert on_gpu.sum() == 3 + (plan.slots[3] >= 0)
    assert plan.cpu.sum() == 9 - on_gpu.sum()
    assert (on_gpu ^ plan.cpu).all(), "each route on exactly one device"
    assert plan.cpu[3] == plan.cpu[8], "duplicates get the same answer"


def test_padding_routes_are_neither_device_nor_cpu_routes(adapter):
    c = adapter.cache(1, 8, 8)
    c.set_collect_routing(True)
    plan = c.ensure_hybrid(0, [[1, -1], [-1, 2]], adapter.Policy.fixed_cap(1))
    assert plan.slots.shape == (2, 2)
    assert plan.slots[0, 1] == -1 and not plan.cpu[0, 1]
    assert plan.active == 2 and plan.missing == 2 and plan.fetched == 1
    assert c.routing_histogram(0).sum() == 2, "padding is not routing mass"


@pytest.mark.traced
def test_a_recurring_miss_climbs_the_fetch_order(adapter):
    """FAILS under the lowest-id order: expert 9 loses the cap to the rotating cast forever."""
    policy = adapter.Policy.fixed_cap(1)
    c = adapter.cache(1, 16, 16)
    for round_ in range(6):
        c.ensure_hybrid(0, [9, round_], policy)
    assert slot_of(c.state, 0, 9) is not None, "the expert routed every step became resident"
    naive = adapter.cache(1, 16, 16)
    for round_ in range(6):
        naive.ensure_hybrid(0, [9, round_], policy, order="lowest_id")
    assert slot_of(naive.state, 0, 9) is None, "the contrast: by id, 9 never wins"


def test_recency_is_stamped_in_both_fetch_orders_and_never_by_plain_ensure(adapter):
    c = adapter.cache(1, 8, 8)
    c.ensure(0, [1])
    assert c.state.routing.recency[0, 1] == -1, "plain ensure does not touch recency"
    c.ensure_hybrid(0, [5, 2], adapter.Policy.fixed_cap(0), order="lowest_id")
    recency = c.state.routing.recency
    assert recency[0, 5] == recency[0, 2] == 2, "LOWEST_ID stamps too (docs/semantics.md §10)"
    c.ensure(0, [3])
    assert c.state.routing.recency[0, 3] == -1


def test_the_fixed_cap_fetches_at_most_cap_misses(adapter):
    c = adapter.cache(1, 32, 40)
    plan = c.ensure_hybrid(0, list(range(8)), adapter.Policy.fixed_cap(1))
    assert (plan.missing, plan.fetched, plan.copy.count) == (8, 1, 1)


# ---- materialize_layer, forget_slot (docs/semantics.md §5.6, §5.7) ---------------------------


def test_materializing_a_layer_reclaims_other_layers_slots_cleanly(adapter):
    c = adapter.cache(2, 4, 4)
    c.ensure(0, [0, 1, 2, 3])
    plan = c.materialize_layer(1)
    assert plan.copy.dst_slots.tolist() == [0, 1, 2, 3]
    assert plan.copy.src_rows.tolist() == [0, 1, 2, 3], "position == expert id"
    assert plan.copy.count == 4
    for expert in range(4):
        assert slot_of(c.state, 1, expert) == expert
        assert slot_of(c.state, 0, expert) is None, "layer 0 must not hit on layer 1's bytes"
    assert c.ensure(0, [3]).missing == 1


@pytest.mark.traced
def test_materialize_empties_this_layers_stale_placements_elsewhere(adapter):
    """FAILS if only slots [0, E) are rewritten: layer 1's expert 0 living in slot 4 would stay
    claimed by two slots."""
    c = adapter.cache(2, 4, 8)
    c.ensure(0, [0, 1, 2, 3])
    c.ensure(1, [0])  # slot 4
    assert slot_of(c.state, 1, 0) == 4
    c.materialize_layer(1)
    assert c.state.residency.id_of_slot[4] == -1 and c.state.residency.usage[4] == 0
    assert_invariants(c.state)


def test_a_second_materialize_of_the_same_layer_is_idempotent(adapter):
    c = adapter.cache(2, 4, 6)
    c.ensure(1, [3])
    c.materialize_layer(1)
    once = c.state
    c.materialize_layer(1)
    for expert in range(4):
        assert slot_of(c.state, 1, expert) == expert
    assert resident_slots(c.state) == 4
    np.testing.assert_array_equal(c.state.residency.slot_for_id, once.residency.slot_for_id)
    np.testing.assert_array_equal(c.state.residency.id_of_slot, once.residency.id_of_slot)
    assert c.state.residency.usage[4] == 0, "a slot outside [0, E) was never used"
    assert c.stats().calls == 1 and (c.state.routing.recency == -1).all(), "counters and recency untouched"


@pytest.mark.traced
def test_forget_slot_makes_the_slot_the_first_victim_and_is_idempotent(adapter):
    """FAILS if forgetting only empties the slot: with usage left as it was, the next miss on a
    full pool would evict the genuinely oldest resident instead."""
    c = adapter.cache(2, 4, 4)
    for expert in range(4):
        c.ensure(0, [expert])
    result = c.forget_slot(3)  # the newest slot
    assert (result.old, result.error) == (3, 0)
    assert slot_of(c.state, 0, 3) is None and c.state.residency.id_of_slot[3] == -1
    assert c.state.residency.usage[3] == INT32_MIN
    before = c.state
    again = c.forget_slot(3)
    assert (again.old, again.error) == (-1, 0), "idempotent"
    assert_same(c.state, before)
    plan = c.ensure(1, [0])
    assert plan.copy.dst_slots[0] == 3, "the forgotten slot is the very first victim"
    assert slot_of(c.state, 0, 0) == 0, "the oldest real resident survived"


# ---- stats, geometry, cold starts (docs/semantics.md §7, §8) ---------------------------------


def test_stats_answer_whether_the_cache_is_big_enough(adapter):
    c = adapter.cache(1, 2, 2)
    c.ensure(0, [0, 1])
    c.ensure(0, [0, 1])
    stats = c.stats()
    assert (stats.calls, stats.active, stats.missing, stats.fetched) == (2, 4, 2, 2)
    assert stats.miss_rate == 0.5 and stats.fetch_rate == 1.0 and stats.active_per_call == 2.0
    assert stats.missing_per_call == 1.0 and stats.fetched_per_call == 1.0
    empty = adapter.cache(1, 2, 2).stats()
    assert empty.miss_rate == empty.fetch_rate == empty.active_per_call == 0.0


def test_hybrid_counters_count_every_miss_and_only_the_fetches(adapter):
    c = adapter.cache(1, 16, 16)
    c.ensure_hybrid(0, list(range(8)), adapter.Policy.fixed_cap(2))
    s = c.stats()
    assert (s.missing, s.fetched) == (8, 2)
    assert s.fetch_rate == 0.25 and s.fetched_per_call == 2.0 and s.missing_per_call == 8.0


def test_a_rebuild_that_cannot_hold_a_layer_changes_nothing(adapter):
    c = adapter.cache(2, 8, 16)
    c.ensure(0, [1])
    before = c.state
    with pytest.raises(adapter.errors.RebuildRejected) as info:
        c.rebuild(4)
    assert isinstance(info.value, ValueError)
    assert (info.value.requested, info.value.minimum) == (4, 8)
    assert_same(c.state, before, "still serving the old cache")
    c.set_collect_routing(True)
    c.rebuild(8)
    assert c.state.cache_size == 8 and resident_slots(c.state) == 0, "slot ids no longer mean anything"
    assert c.state.step == 0 and c.stats().calls == 0
    assert c.state.settings.collect_routing, "a setting, kept"


def test_a_cache_too_small_for_one_layer_is_rejected_at_construction(adapter):
    with pytest.raises(ValueError, match="cannot hold one layer"):
        adapter.cache(2, 8, 4)
    for bad in ((0, 8, 8), (2, 0, 8), (2, 8, 0)):
        with pytest.raises(ValueError):
            adapter.cache(*bad)
    with pytest.raises(TypeError, match="2.5"):
        adapter.cache(2, 2.5, 8)


def test_reset_is_a_cold_start_with_the_same_geometry(adapter):
    c = adapter.cache(2, 4, 8, rebase_threshold=100)
    c.set_collect_routing(True)
    c.ensure_hybrid(0, [1, 2], adapter.Policy.full())
    c.begin_prefill()
    c.reset()
    fresh = adapter.cache(2, 4, 8, rebase_threshold=100)
    fresh.set_collect_routing(True)
    assert_same(c.state, fresh.state)
    assert resident_slots(c.state) == 0 and c.state.step == 0 and c.stats().calls == 0
    assert c.state.routing.freq.sum() == 0 and not c.state.prefill.open


# ---- per-layer stats and the routing histogram (docs/semantics.md §8) ------------------------


def test_per_layer_stats_tell_one_thrashing_layer_from_a_uniformly_tight_cache(adapter):
    """FAILS if per-layer stats are apportioned from the global window: both caches have the
    same global picture (8 active, 4 missing) and opposite per-layer ones."""
    thrashing = adapter.cache(2, 4, 8)
    thrashing.ensure(1, [0, 1])
    thrashing.reset_stats()
    for layer, routes in ((0, [0, 1]), (0, [2, 3]), (1, [0, 1]), (1, [0, 1])):
        thrashing.ensure(layer, routes)
    uniform = adapter.cache(2, 4, 8)
    uniform.ensure(0, [0])
    uniform.ensure(1, [0])
    uniform.reset_stats()
    for layer, routes in ((0, [0, 1]), (0, [0, 2]), (1, [0, 1]), (1, [0, 2])):
        uniform.ensure(layer, routes)
    a, b = thrashing.stats(), uniform.stats()
    assert (a.calls, a.active, a.missing, a.fetched) == (b.calls, b.active, b.missing, b.fetched)
    assert a.miss_rate == b.miss_rate == 0.5
    assert thrashing.layer_stats(0).miss_rate == 1.0
    assert thrashing.layer_stats(1).miss_rate == 0.0
    assert uniform.layer_stats(0).miss_rate == uniform.layer_stats(1).miss_rate == 0.5


def test_per_layer_stats_sum_to_the_global_stats(adapter):
    c = adapter.cache(3, 8, 16)
    policy = adapter.Policy.fraction(0.5)
    for step in range(30):
        routes = [(step * 5 + i * 3) % 8 for i in range(4)]
        if step % 2 == 0:
            c.ensure(step % 3, routes)
        else:
            c.ensure_hybrid(step % 3, routes, policy)
    per_layer = c.per_layer_stats()
    assert len(per_layer) == 3 and c.layer_stats(1).calls == 10
    for name in ("calls", "active", "missing", "fetched"):
        assert sum(getattr(s, name) for s in per_layer) == getattr(c.stats(), name)
    # JAX says ValueError naming the layer; the reference's NumPy index says IndexError.
    with pytest.raises((ValueError, IndexError), match="3"):
        c.layer_stats(3)


def test_resetting_stats_opens_a_new_window_but_keeps_residency_and_the_histogram(adapter):
    c = adapter.cache(2, 4, 8)
    c.set_collect_routing(True)
    c.ensure(0, [0, 1])
    c.reset_stats()
    s = c.layer_stats(0)
    assert (s.calls, s.active, s.missing, s.fetched) == (0, 0, 0, 0) and c.stats().calls == 0
    assert c.routing_histogram(0).tolist() == [1, 1, 0, 0], "the histogram survives a stats window"
    c.ensure(0, [0, 1])
    s = c.layer_stats(0)
    assert s.missing == 0 and s.active == 2, "residency survives too"
    assert s.active_per_call == 2.0 and s.missing_per_call == 0.0


def test_the_routing_histogram_counts_every_route_not_every_distinct_expert(adapter):
    """FAILS if the histogram is fed the deduplicated routes the miss accounting uses: skew is
    exactly that difference."""
    c = adapter.cache(2, 4, 8)
    c.set_collect_routing(True)
    c.ensure(0, [3, 3, 3, 1, -1])
    assert c.routing_histogram(0).tolist() == [0, 1, 0, 3]
    assert c.routing_histogram(1).tolist() == [0, 0, 0, 0]


@pytest.mark.traced
def test_routing_is_collected_only_when_switched_on(adapter):
    c = adapter.cache(2, 4, 8)
    c.ensure(0, [1, 2])
    assert c.state.routing.freq.sum() == 0, "collection is opt-in"
    c.set_collect_routing(True)
    c.ensure(0, [1])
    c.set_collect_routing(False)
    c.ensure(0, [0])
    assert c.routing_histogram(0).tolist() == [0, 1, 0, 0], "switched off again"


# ---- the routing skew report (docs/semantics.md §8) ------------------------------------------


def _routes(counts):
    return [expert for expert, count in enumerate(counts) for _ in range(count)]


def test_oracle_hit_at_slots_separates_a_skewed_layer_from_a_flat_one(adapter):
    """FAILS if the oracle is derived from the working set alone (C / working_set = 0.5 for both
    layers): the real answers are 0.96 and 0.52."""
    c = adapter.cache(2, 8, 8)
    c.set_collect_routing(True)
    c.ensure(0, _routes([24, 24, 24, 24, 1, 1, 1, 1]))
    c.ensure(1, _routes([13, 13, 13, 13, 12, 12, 12, 12]))
    report = c.routing_skew()
    assert report.slots_per_layer == 4.0 and report.oracle_slots == 4
    skewed, flat = report.per_layer
    assert skewed.routed == flat.routed == 100
    assert skewed.working_set == flat.working_set == 8
    assert skewed.oracle_hit_at_slots == pytest.approx(0.96, abs=1e-12)
    assert flat.oracle_hit_at_slots == pytest.approx(0.52, abs=1e-12)
    assert skewed.norm_entropy < flat.norm_entropy
    assert skewed.experts_for_90pct < flat.experts_for_90pct


def test_routing_skew_reports_the_working_set_coverage_and_entropy_per_layer(adapter):
    c = adapter.cache(2, 8, 8)
    c.set_collect_routing(True)
    c.ensure(0, list(range(8)))
    c.ensure(1, [2, 2, 2, 2])
    report = c.routing_skew()
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


def test_ninety_percent_coverage_counts_a_share_that_reaches_it_exactly(adapter):
    """FAILS if coverage is tested with `>` instead of `>=`: 9 of 10 routes is exactly 0.9."""
    c = adapter.cache(1, 4, 4)
    c.set_collect_routing(True)
    c.ensure(0, [0] * 9 + [1])
    assert c.routing_skew().per_layer[0].experts_for_90pct == 1


def test_oracle_slots_round_half_away_from_zero(adapter):
    """FAILS with Python's round() (half to even): S/L = 2.5 must give 3 slots, not 2."""
    c = adapter.cache(4, 8, 10)
    c.set_collect_routing(True)
    c.ensure(0, [0, 1, 2, 3])
    assert c.routing_skew().oracle_slots == 3


def test_norm_entropy_of_a_single_expert_model_is_zero_not_nan(adapter):
    c = adapter.cache(1, 1, 1)
    c.set_collect_routing(True)
    c.ensure(0, [0, 0])
    assert c.routing_skew().per_layer[0].norm_entropy == 0.0


def test_routing_skew_is_absent_until_routing_is_observed(adapter):
    c = adapter.cache(4, 8, 16)
    c.ensure(0, [1, 2])
    assert c.routing_skew() is None, "collection is opt-in"
    c.set_collect_routing(True)
    c.ensure(2, [1, 2])
    assert [s.layer for s in c.routing_skew().per_layer] == [2], "un-routed layers are absent, not zeros"
    c.reset_routing()
    assert c.routing_skew() is None


# ---- the admission rules in the promotion scenarios (docs/semantics.md §5.5) -----------------
# The scenarios (8 layers of 16 experts, a 64-slot pool, fraction 0.4) run through
# pallas_cache.sizing.scenarios (one compiled lax.scan each); the reference agrees with it step
# by step through the lockstep suite.


def test_the_promotion_scenarios_without_promotion():
    one = scenarios.one_active_layer("none")
    assert (one.fetches, one.cpu_routes) == (0, 256), "expert 7 stays on the CPU forever"
    cold = scenarios.all_layers_cold("none")
    assert (cold.fetches, cold.cpu_routes, cold.empty_slots) == (56, 2104, 8)


def test_the_promotion_scenarios_with_promote_one():
    """FAILS without the rule: a single miss at 0.4 rounds to zero fetches forever."""
    one = scenarios.one_active_layer("promote_one")
    assert (one.fetches, one.cpu_routes) == (1, 1)
    assert one.empty_slots == scenarios.CACHE_SIZE - 8, "expert 7 joined the 7 residents"
    cold = scenarios.all_layers_cold("promote_one")
    assert (cold.fetches, cold.cpu_routes, cold.empty_slots) == (64, 88, 0)


def promotion_cache(adapter):
    """One layer of 8 experts in a 16-slot pool, experts 0..6 resident, expert 7 seen before."""
    c = adapter.cache(1, 8, 16)
    c.ensure_hybrid(0, list(range(8)), adapter.Policy.fixed_cap(7))
    return c


@pytest.mark.traced
def test_a_first_time_miss_is_never_promoted(adapter):
    """FAILS if promotion ignores recency: expert 7's first appearance must run on the CPU."""
    q = adapter.Policy.fraction(0.4)
    c = adapter.cache(1, 16, 16)
    plan = c.ensure_hybrid(0, [7], q)
    assert plan.fetched == 0 and plan.cpu.tolist() == [True]
    plan = c.ensure_hybrid(0, [7], q)
    assert plan.fetched == 1 and plan.copy.dst_slots[0] == 0, "now it recurs"
    c = adapter.cache(1, 8, 16)
    c.ensure_hybrid(0, list(range(7)), adapter.Policy.fixed_cap(7))
    plan = c.ensure_hybrid(0, list(range(8)), q)
    assert plan.fetched == 0 and plan.cpu[7], "expert 7 was never routed before"
    plan = c.ensure_hybrid(0, list(range(8)), q)
    assert plan.fetched == 1 and valid(plan.copy, "src_rows") == [7]


@pytest.mark.kernels
def test_a_recurring_miss_is_promoted_even_among_first_time_misses_with_lower_ids(adapter):
    """FAILS if the promoted expert is the lowest missing id rather than the most recent one."""
    q = adapter.Policy.fraction(0.4)
    c = adapter.cache(1, 16, 32)
    c.ensure_hybrid(0, [9], adapter.Policy.fixed_cap(0))  # 9 seen, not fetched
    plan = c.ensure_hybrid(0, [1, 9], q)
    assert plan.fetched == 1 and valid(plan.copy, "src_rows") == [9]
    assert valid(plan.copy, "dst_slots") == [0], "into the empty argmin slot"
    assert plan.cpu[0] and plan.slots[1] == 0
    c = adapter.cache(1, 16, 16)
    c.ensure_hybrid(0, [9], q)
    c.ensure_hybrid(0, [1, 9], adapter.Policy.fixed_cap(0))  # refresh 9's recency; 1 seen too
    c.ensure_hybrid(0, [9], q)  # promote 9 (M = 1, F = 0)
    assert slot_of(c.state, 0, 9) == 0
    plan = c.ensure_hybrid(0, [3], q)
    assert plan.fetched == 0, "3 is a first-time miss"


@pytest.mark.traced
@pytest.mark.parametrize("policy, order", [
    (("fixed_cap", 0), "recency"),
    (("fixed_cap", 1), "recency"),
    (("fraction", 0.4), "lowest_id"),
])
def test_fixed_caps_and_the_lowest_id_order_keep_the_plain_split(adapter, policy, order):
    """FAILS if PROMOTE_ONE acts outside the recency order with a fraction policy."""
    policy = getattr(adapter.Policy, policy[0])(policy[1])
    c = promotion_cache(adapter)  # expert 7 recurs and an empty slot is the argmin
    for _ in range(4):
        plain = c.clone().ensure_hybrid(0, [7], policy, order=order, admission="none")
        promoted = c.ensure_hybrid(0, [7], policy, order=order, admission="promote_one")
        assert_same(promoted, plain)


def test_promotion_needs_an_empty_argmin_slot(adapter):
    """FAILS if the emptiness check is skipped: a recurring miss is promoted into an empty LRU
    slot, never by evicting a resident from a full pool."""
    q = adapter.Policy.fraction(0.4)
    plan = promotion_cache(adapter).ensure_hybrid(0, [7], q)  # slots 7..15 empty
    assert (plan.missing, plan.fetched) == (1, 1)
    assert valid(plan.copy, "dst_slots") == [7] and valid(plan.copy, "src_rows") == [7]
    c = adapter.cache(2, 4, 4)
    c.ensure(1, [0, 1, 2, 3])  # the pool is full of layer 1
    for _ in range(4):
        plan = c.ensure_hybrid(0, [2], q)
        assert plan.fetched == 0 and plan.missing == 1
    # Expert 0 of layer 0 was routed, then evicted by layer 1; the LRU slot holds a resident.
    full = adapter.cache(2, 2, 2)
    full.ensure_hybrid(0, [0, 1], adapter.Policy.fixed_cap(2))
    full.ensure(1, [0])
    assert slot_of(full.state, 0, 0) is None and full.state.routing.recency[0, 0] >= 0
    plan = full.clone().ensure_hybrid(0, [0], q)
    assert plan.fetched == 0 and plan.cpu[0]
    # Forget the LRU slot: now it is empty and the argmin, and the rule fires.
    lru = int(np.argmin(full.state.residency.usage))
    full.forget_slot(lru)
    plan = full.clone().ensure_hybrid(0, [0], q)
    assert plan.fetched == 1 and valid(plan.copy, "dst_slots") == [lru]
    plan = full.clone().ensure_hybrid(0, [0], q, admission="none")
    assert plan.fetched == 0, "NONE is the plain split"


def test_reuse_admits_misses_more_recent_than_their_victims_and_stops_at_the_first_rejection(adapter):
    """FAILS if REUSE admits past a rejected victim, admits never-routed experts, or acts
    without the recency order and a fraction policy."""
    q = adapter.Policy.fraction(0.4)
    # Layer 1 fills the pool at step 1; layer 0's experts are routed at steps 2 and 3 (CPU).
    c = adapter.cache(2, 4, 4)
    c.ensure(1, [0, 1, 2, 3])
    c.ensure_hybrid(0, [0], adapter.Policy.fixed_cap(0))
    c.ensure_hybrid(0, [1], adapter.Policy.fixed_cap(0))
    # q = 0.4, M = 3 -> F = 1. Recency order: 1 (3), 0 (2), 2 (-1). Victims have usage 1.
    plan = c.ensure_hybrid(0, [0, 1, 2], q, admission="reuse")
    assert plan.missing == 3
    assert valid(plan.copy, "src_rows") == [1, 0], "2 was never routed: rejected"
    # Expert 2 was routed at step 4, after its would-be victim (usage 1) was last used.
    plan = c.clone().ensure_hybrid(0, [2], q, admission="reuse")
    assert plan.fetched == 1, "admitted past F = 0"
    for policy, order in ((adapter.Policy.fixed_cap(0), "recency"), (q, "lowest_id")):
        plan = c.clone().ensure_hybrid(0, [2], policy, order=order, admission="reuse")
        assert plan.fetched == 0, "REUSE needs the recency order and a fraction policy"

    c = adapter.cache(2, 8, 8)
    plan = c.ensure_hybrid(0, list(range(8)), q, admission="reuse")
    assert plan.fetched == 3, "first-time misses are never admitted past the split"
    # Misses 3 and 4 (routed at step 1); the split says 1; the second victim is an empty slot
    # (usage 0 <= 1), so REUSE admits it too.
    plan = c.ensure_hybrid(0, [3, 4], q, admission="reuse")
    assert valid(plan.copy, "dst_slots") == [3, 4] and plan.fetched == 2
    plain = adapter.cache(2, 8, 8)
    plain.ensure_hybrid(0, list(range(8)), q, admission="none")
    assert plain.ensure_hybrid(0, [3, 4], q, admission="none").fetched == 1
    # Fill the pool, give layer 1 three slots, then walk layer 0 against newer victims.
    c.ensure_hybrid(0, [5, 6, 7], q, admission="reuse")  # 1 by split + 2 admitted
    assert (c.state.residency.id_of_slot >= 0).all()
    c.ensure_hybrid(1, [0, 1, 2], q, admission="reuse")  # step 4: takes slot 0
    c.ensure_hybrid(1, [1, 2], q, admission="reuse")  # step 5: slots 1 and 2
    assert c.state.residency.slot_for_id[1, :3].tolist() == [0, 1, 2]
    # Step 6: misses 0, 1, 2 of layer 0 (recency 1), hit 3. Split: 1 fetch into slot 4
    # (usage 2). The next victim, slot 5, was used at step 3 > recency 1: rejected, walk ends.
    plan = c.ensure_hybrid(0, [0, 1, 2, 3], q, admission="reuse")
    assert plan.copy.count == 1 and plan.copy.dst_slots[0] == 4 and plan.copy.src_rows[0] == 0
    assert plan.cpu.tolist() == [False, True, True, False]


BIG_BANK = 512 * 1024
SMALL_BANK = 4 * 1024


# ---- the int32 clock (docs/semantics.md §5.12) ------------------------------------------------


POLICIES = {"fraction": PolicySpec("fraction", 0.4), "fixed_cap": PolicySpec("fixed_cap", 1),
            "full": PolicySpec("full")}


def random_ops(seed, num_layers, num_experts, cache_size, steps):
    """A reproducible list of mixed decode operation records (those that advance the clock)."""
    rng = random.Random(seed)
    ops = []
    for _ in range(steps):
        layer = rng.randrange(num_layers)
        routes = [rng.randrange(-1, num_experts) for _ in range(rng.randint(1, 6))]
        kind = rng.random()
        if kind < 0.3:
            ops.append(Ensure(layer, routes))
        elif kind < 0.9:
            ops.append(EnsureHybrid(layer, routes,
                                    POLICIES[rng.choice(["fraction", "fixed_cap", "full"])],
                                    rng.choice(["recency", "lowest_id"]),
                                    rng.choice(["promote_one", "none", "reuse"])))
        elif kind < 0.95:
            ops.append(Materialize(layer))
        else:
            ops.append(Forget(rng.randrange(num_layers * num_experts) % cache_size))
    return ops


def same_order(a, b):
    """Whether two stamp vectors order every pair the same way (<, ==, >)."""
    return np.array_equal(np.sign(a[:, None] - a[None, :]), np.sign(b[:, None] - b[None, :]))


def stamps(state):
    return np.concatenate([state.residency.usage, state.routing.recency.ravel(), [state.step]]).astype(np.int64)


@pytest.mark.parametrize("seed", range(4))
def test_a_rebased_run_makes_exactly_the_decisions_of_an_unrebased_one(adapter, seed):
    """FAILS if the rebase renumbers usage and recency separately (recency-vs-usage comparisons of
    REUSE flip) or maps live stamps onto the sentinels 0 / -1."""
    if adapter.is_jax and seed and PROFILE != "deep":
        pytest.skip("ci profile: one sequence per JAX adapter (the lockstep suite crosses rebases too)")
    ops = random_ops(seed, num_layers=3, num_experts=5, cache_size=8,
                     steps=400 if not adapter.is_jax else 150)
    plain = adapter.cache(3, 5, 8)
    rebased = adapter.cache(3, 5, 8, rebase_threshold=40)
    bound = max(40, 8 + 3 * 5 + 1) + 1
    for i, op in enumerate(ops):
        assert_same(plain.apply(op), rebased.apply(op), f"op {i} {op}")
        a, b = plain.state, rebased.state
        np.testing.assert_array_equal(a.residency.slot_for_id, b.residency.slot_for_id)
        np.testing.assert_array_equal(a.residency.id_of_slot, b.residency.id_of_slot)
        assert same_order(stamps(a), stamps(b)), f"order changed at op {i}"
        assert b.step <= bound, "stamps stay bounded"
        assert (b.residency.usage[b.residency.id_of_slot >= 0] >= 1).all()
    assert plain.state.step > 100 > bound, "the run crossed the threshold several times"


def shift_clock(cache, offset):
    """Move every live stamp and the clock of ``cache`` forward, as if it had run that long."""
    state = cache.state
    usage, recency = np.asarray(state.residency.usage), np.asarray(state.routing.recency)
    fields = {"usage": np.where(usage >= 1, usage + offset, usage),
              "recency": np.where(recency >= 0, recency + offset, recency),
              "step": np.asarray(int(state.step) + offset)}
    if cache.adapter.is_jax:
        i32 = {k: jnp.asarray(v, jnp.int32) for k, v in fields.items()}
        cache.state = state.replace(
            residency=state.residency.replace(usage=i32["usage"]),
            routing=state.routing.replace(recency=i32["recency"]), clock=Clock(step=i32["step"]))
    else:
        cache.state = reference.copy_state(state)
        cache.state.residency.usage = fields["usage"]
        cache.state.routing.recency = fields["recency"]
        cache.state.clock.step = int(fields["step"])


def test_a_cache_just_below_the_default_threshold_runs_across_it(adapter):
    """FAILS if the clock wraps or if the renumbering changes any decision: the same run from a
    clock shifted to just below 2**30 crosses the threshold and decides exactly as the unshifted
    run, with forgotten slots and never-routed experts alive at the time."""
    # The geometry above: no new compiles.
    ops = random_ops(7, num_layers=3, num_experts=5, cache_size=8, steps=60)
    plain, shifted = adapter.cache(3, 5, 8), adapter.cache(3, 5, 8)
    for op in ops[:20]:
        plain.apply(op)
        shifted.apply(op)
    plain.forget_slot(1)
    shifted.forget_slot(1)
    shift_clock(shifted, 2**30 - 3 - int(shifted.state.step))
    for i, op in enumerate(ops[20:]):
        assert_same(plain.apply(op), shifted.apply(op), f"op {i}")
        assert shifted.state.step < 2**31 - 1
        assert same_order(stamps(plain.state), stamps(shifted.state)), f"order changed at op {i}"
    assert shifted.state.step < 100, "the clock was renumbered"
    np.testing.assert_array_equal(plain.state.residency.id_of_slot, shifted.state.residency.id_of_slot)
    assert_invariants(shifted.state)


@pytest.mark.traced
def test_the_rebase_keeps_the_sentinels(adapter):
    c = adapter.cache(2, 4, 6, rebase_threshold=3)
    c.ensure_hybrid(0, [0, 1], adapter.Policy.full())  # slots 0, 1
    c.ensure(1, [2])  # slot 2
    assert c.forget_slot(1).old == 1
    c.ensure(1, [2])  # step 3: the next call rebases first
    before = c.state.residency.usage
    c.ensure(1, [2])
    state = c.state
    assert before[2] == 3 and state.step == 3, "stamps {1, 3} became {1, 2}, so step 4 became 3"
    assert state.residency.usage[1] == -(2**31), "forgotten stays forgotten"
    assert (state.residency.usage[3:] == 0).all(), "empty stays 0"
    assert state.routing.recency[1, 0] == -1 and state.routing.recency[0, 0] >= 1, "never routed stays -1"


# ---- bad input: an error bit and nothing changed (docs/semantics.md §6) -----------------------

L, E, S = 3, 4, 12


def busy_cache(adapter, rebase_threshold=None):
    """A cache with history: residents, recency, counters, a histogram, a forgotten slot."""
    c = adapter.cache(L, E, S, rebase_threshold=rebase_threshold)
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
    assert_same(c.state, before)


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
    assert plan.copy.dst_slots.shape == plan.copy.src_rows.shape == (4,)
    assert (plan.copy.dst_slots == -1).all() and (plan.copy.src_rows == -1).all()
    assert (plan.copy.count, plan.active, plan.missing, plan.fetched) == (0, 0, 0, 0)
    plan = c.ensure(0, [0, 1, E])
    assert (plan.slots == -1).all() and (plan.copy.count, plan.active, plan.missing) == (0, 0, 0)
    materialized = c.materialize_layer(L)
    assert (materialized.copy.dst_slots == -1).all() and materialized.copy.count == 0
    assert c.forget_slot(S).old == -1
    staged = c.prefetch_prefill_layer(0, (BIG_BANK,))
    assert (staged.transfers.count, staged.gather.count, staged.runs.count) == (0, 0, 0)
    assert not staged.already_loaded


@pytest.mark.traced
def test_a_refused_call_neither_advances_nor_rebases_the_clock(adapter):
    c = busy_cache(adapter, rebase_threshold=2)  # step >= 2: the next accepted call renumbers
    before = c.state
    assert before.step >= 2
    assert c.ensure(0, [E]).error == adapter.errors.ERR_EXPERT_ID
    assert c.materialize_layer(5).error == adapter.errors.ERR_LAYER
    assert_same(c.state, before)


def test_staging_into_an_unreleased_buffer_is_refused_and_changes_nothing(adapter):
    c = adapter.cache(4, 4, 16)
    c.begin_prefill()
    assert c.prefetch_prefill_layer(0, (BIG_BANK,)).error == 0
    before = c.state
    plan = c.prefetch_prefill_layer(2, (BIG_BANK,))  # buffer 0 still holds layer 0
    assert plan.error == adapter.errors.ERR_PREFILL_BUSY
    assert plan.transfers.count == 0 and plan.gather.count == 0
    assert_same(c.state, before)
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
        adapter.cache(2, 8, 12).begin_prefill()


# ---- prefill double buffers (docs/semantics.md §5.11) -----------------------------------------


def one_layer_per_quarter(adapter):
    """Layer l owns slots [4l, 4l + 4); the buffers borrow [0, 8) = layers 0 and 1."""
    c = adapter.cache(4, 4, 16)
    for layer in range(4):
        c.ensure(layer, [0, 1, 2, 3])
    assert c.state.residency.slot_for_id.tolist() == [[4 * l + e for e in range(4)] for l in range(4)]
    return c


def test_a_slot_inside_the_prefill_buffers_is_a_miss_however_resident_it_looks(adapter):
    """FAILS if hits are classified as "has a slot": layer 1 lives in slots 4..8, exactly the
    buffer it is staged into, and a gather from there would race the staging copy."""
    c = one_layer_per_quarter(adapter)
    c.begin_prefill()
    plan = c.prefetch_prefill_layer(1, (BIG_BANK,))
    assert plan.buffer_id == 1 and plan.gather.count == 0
    assert valid(plan.runs, "starts") == [0] and valid(plan.runs, "lens") == [4]
    assert (c.state.prefill.hit_rows, c.state.prefill.rows) == (0, 4)


def test_a_resident_expert_above_the_buffer_slots_is_gathered_device_side(adapter):
    c = one_layer_per_quarter(adapter)
    c.begin_prefill()
    plan = c.prefetch_prefill_layer(2, (BIG_BANK,))
    assert plan.buffer_id == 0
    assert valid(plan.gather, "dst_slots") == [0, 1, 2, 3]
    assert valid(plan.gather, "src_slots") == [8, 9, 10, 11]
    assert plan.runs.count == 0 and plan.transfers.count == 0, "a big bank with no misses ships nothing"
    assert (c.state.prefill.hit_rows, c.state.prefill.rows) == (4, 4)


def test_invalidating_a_prefill_buffer_makes_its_slots_the_first_victims(adapter):
    """FAILS if invalidation leaves usage alone: the buffer slots are the newest in the pool, so
    the next decode miss would evict a live resident while four empty slots sit unused."""
    c = one_layer_per_quarter(adapter)
    c.ensure(0, [0, 1, 2, 3])
    c.ensure(1, [0, 1, 2, 3])
    c.begin_prefill()
    c.prefetch_prefill_layer(0, (BIG_BANK,))
    assert (c.state.residency.slot_for_id[0] == -1).all(), "the buffer's occupants lost their residency"
    assert (c.state.residency.usage[:4] == 0).all()
    plan = c.ensure(0, [0])
    assert valid(plan.copy, "dst_slots") == [0]
    assert c.state.residency.slot_for_id[2, 0] == 8, "no live resident was evicted while free slots existed"


def test_prefill_misses_ship_as_contiguous_expert_runs(adapter):
    """FAILS if each missing expert ships as its own entry (five entries instead of two)."""
    c = adapter.cache(4, 8, 32)
    for layer, routes in ((0, range(8)), (2, range(8)), (1, (3, 4, 7))):
        c.ensure(layer, list(routes))  # layer 1's experts land in slots 16, 17, 18
    c.begin_prefill()
    plan = c.prefetch_prefill_layer(1, (BIG_BANK,))
    assert plan.buffer_id == 1
    assert valid(plan.gather, "dst_slots") == [11, 12, 15]
    assert valid(plan.gather, "src_slots") == [16, 17, 18]
    assert valid(plan.runs, "starts") == [0, 5]
    assert valid(plan.runs, "lens") == [3, 2]
    assert entries(plan, (BIG_BANK,)) == [
        (0, 8, 0, 3, 3 * BIG_BANK, False),
        (0, 13, 5, 2, 2 * BIG_BANK, False),
    ]


def test_a_small_bank_ships_its_whole_layer_even_with_no_misses(adapter):
    """FAILS if entries are only emitted for misses: the gather skips small banks, so their rows
    would never arrive."""
    c = adapter.cache(4, 8, 32)
    for layer in (0, 2, 1):
        c.ensure(layer, list(range(8)))
    c.begin_prefill()
    plan = c.prefetch_prefill_layer(1, (BIG_BANK, SMALL_BANK))
    assert plan.gather.count == 8 and plan.runs.count == 0
    assert plan.gather.banks.tolist() == [0, -1], "the small bank is not gathered"
    assert entries(plan, (BIG_BANK, SMALL_BANK)) == [(1, 8, 0, 8, 8 * SMALL_BANK, True)]


@pytest.mark.traced
def test_the_two_prefill_buffers_rotate_by_layer_parity(adapter):
    c = adapter.cache(4, 4, 16)
    c.begin_prefill()
    assert c.state.prefill.layer.tolist() == [-1, -1]
    assert c.prefetch_prefill_layer(0, (BIG_BANK,)).buffer_id == 0
    assert c.prefetch_prefill_layer(1, (BIG_BANK,)).buffer_id == 1
    assert c.state.prefill.layer.tolist() == [0, 1]
    again = c.prefetch_prefill_layer(1, (BIG_BANK,))
    assert again.already_loaded and again.transfers.count == 0 and again.error == 0
    assert c.state.prefill.rows == 8, "the no-op staged no rows"
    c.release_prefill_layer(0)
    plan = c.prefetch_prefill_layer(2, (BIG_BANK,))
    assert plan.buffer_id == 0 and plan.error == 0
    assert c.state.prefill.layer.tolist() == [2, 1]


@pytest.mark.traced
def test_releasing_a_layer_that_is_not_staged_is_ignored(adapter):
    c = adapter.cache(4, 4, 16)
    c.begin_prefill()
    c.prefetch_prefill_layer(0, (BIG_BANK,))
    before = c.state
    for layer in (2, -1, -2, 9):
        c.release_prefill_layer(layer)
        assert_same(c.state, before)
    assert c.prefetch_prefill_layer(2, (BIG_BANK,)).error == adapter.errors.ERR_PREFILL_BUSY


def test_the_chunk_snapshot_and_the_live_map_agree_on_every_row(adapter):
    c = adapter.cache(4, 4, 16)
    for layer in range(4):
        c.ensure(layer, [0, 1, 2, 3])
    c.begin_prefill()
    for layer in (2, 3, 2):
        live = [int(s) for s in c.state.residency.slot_for_id[layer] if s >= 8]
        plan = c.prefetch_prefill_layer(layer, (BIG_BANK,))
        c.release_prefill_layer(layer)
        if not plan.already_loaded:
            assert valid(plan.gather, "src_slots") == live


def test_a_pool_that_cannot_lend_the_buffers_their_slots_says_so(adapter):
    small = adapter.cache(2, 8, 12)
    assert not small.prefill_overlap_fits()
    assert adapter.cache(2, 8, 16).prefill_overlap_fits()
    with pytest.raises(adapter.errors.PrefillDoesNotFit, match="12"):
        small.begin_prefill()
    with pytest.raises(adapter.errors.PrefillDoesNotFit):
        small.prefetch_prefill_layer(0, (BIG_BANK,))


def test_nothing_staged_is_registered_as_resident(adapter):
    c = adapter.cache(2, 4, 8)
    c.begin_prefill()
    c.prefetch_prefill_layer(0, (BIG_BANK,))
    assert (c.state.residency.slot_for_id == -1).all() and (c.state.residency.id_of_slot == -1).all()


def test_reset_stats_zeroes_the_prefill_row_counters(adapter):
    c = one_layer_per_quarter(adapter)
    c.begin_prefill()
    c.prefetch_prefill_layer(2, (BIG_BANK,))
    c.reset_stats()
    assert (c.state.prefill.hit_rows, c.state.prefill.rows) == (0, 0)


STALE_BANKS = (1 << 20,)  # one large bank: hits are gathered, misses travel as runs


def warm_three_layers(adapter, L, E, S):
    """Layers 0..2 resident; layer 2's experts sit at or above 2E (snapshot hits)."""
    cache = adapter.cache(L, E, S)
    for layer in range(3):
        cache.ensure(layer, np.arange(E))
    return cache


def gathers(plan):
    return list(zip(valid(plan.gather, "dst_slots"),
                    valid(plan.gather, "src_slots")))


def test_an_expert_evicted_after_begin_prefill_is_copied_from_the_host(adapter):
    """FAILS if the prefetch trusts the snapshot: it gathered from slots that now hold another
    layer's experts, with error == 0."""
    L, E, S = 4, 2, 6
    cache = warm_three_layers(adapter, L, E, S)
    cache.begin_prefill()
    assert cache.state.prefill.snapshot[2].tolist() == [4, 5]  # both are snapshot hits
    for layer in (0, 1, 3):  # refresh layers 0 and 1, then layer 3's misses evict slots 4, 5
        cache.ensure(layer, np.arange(E))
    assert cache.state.residency.slot_for_id[2].tolist() == [-1, -1]
    before = int(cache.state.prefill.hit_rows)
    plan = cache.prefetch_prefill_layer(2, STALE_BANKS)
    assert plan.error == 0 and plan.gather.count == 0
    assert (plan.runs.count, plan.runs.starts[0], plan.runs.lens[0]) == (1, 0, 2)
    assert int(cache.state.prefill.hit_rows) == before


def test_a_snapshot_hit_still_in_place_is_gathered(adapter):
    """FAILS if re-validation is too strict and drops hits that are still resident."""
    cache = warm_three_layers(adapter, 4, 2, 6)
    cache.begin_prefill()
    cache.ensure(2, np.arange(2))  # a hit refresh moves nothing
    assert gathers(cache.prefetch_prefill_layer(2, STALE_BANKS)) == [(0, 4), (1, 5)]


@given(st.lists(st.tuples(st.sampled_from(["ensure", "prefetch_prefill_layer",
                                           "release_prefill_layer", "begin_prefill"]),
                          st.integers(0, 3), st.lists(st.integers(-1, 3), min_size=1,
                                                      max_size=3)),
                min_size=1, max_size=25))
def test_interleaved_decode_and_prefill_gather_only_resident_rows(calls):
    """FAILS if any interleaving of decode ensures and prefill stages gathers from a slot that
    does not hold the expert, or if the JAX functions and the reference disagree on a plan or
    a state field."""
    L, E, S = 4, 4, 10
    records = {"ensure": lambda layer, ids: Ensure(layer, np.asarray(ids, np.int32)),
               "prefetch_prefill_layer": lambda layer, _: PrefetchPrefill(layer, STALE_BANKS),
               "release_prefill_layer": lambda layer, _: ReleasePrefill(layer),
               "begin_prefill": lambda *_: BeginPrefill()}
    ops = [BeginPrefill()] + [records[kind](layer, ids) for kind, layer, ids in calls]
    ref, cache = ADAPTER["reference"].cache(L, E, S), ADAPTER["jax-eager"].cache(L, E, S)
    resident = [ref.state.residency.id_of_slot]

    def compare(context, op, expected, got):
        (theirs, truth), (mine, jax_cache) = expected, got
        if isinstance(op, PrefetchPrefill):
            for dst, src in gathers(theirs):
                assert resident[0][src] == op.layer * E + dst % E, \
                    f"{context}: a gather reads slot {src}, which holds {resident[0][src]}"
        if mine is None:
            assert theirs is None, context
        else:
            assert_same(mine, theirs, context)
        assert_same(jax_cache.state, truth.state, context)
        resident[0] = truth.state.residency.id_of_slot

    lockstep.run(ops, steps(ref, ops), {"jax-eager": steps(cache, ops)}, compare)
