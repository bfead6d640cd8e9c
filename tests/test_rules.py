"""The decode rules, one test per rule, each run on every adapter (conftest.py).

The rules of the Rust seed's test module, per-layer stats and the routing histogram, the skew
report, and the admission rules of the promotion scenarios (docs/semantics.md §3-§5, §8, §10), restated once against
the adapter fixture: the NumPy reference and the JAX functions eagerly; under an outer ``jit`` for
``@pytest.mark.traced`` tests, and with the Pallas kernels in the interpreter for
``@pytest.mark.kernels`` tests (conftest.py says why; the deep profile runs all four). Where the naive implementation is a real temptation the docstring says how the
test catches it.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_invariants, assert_same_plan, assert_same_state
from pallas_cache.sizing import scenarios

INT32_MIN = -(2**31)


# ---- residency, eviction, the copy plan (docs/semantics.md §5.2) -----------------------------


def test_a_cold_miss_is_fetched_and_becomes_resident(adapter):
    c = adapter.init(4, 8, 16)
    plan = c.ensure(0, [3, 5])
    assert (plan.missing, plan.fetched, plan.count) == (2, 2, 2)
    assert plan.valid("src_rows") == [3, 5], "layer-local rows"
    assert (plan.slots >= 0).all() and not plan.cpu.any()
    again = c.ensure(0, [3, 5])
    assert again.missing == 0 and again.count == 0
    assert (again.dst_slots == -1).all()
    assert again.slots.tolist() == plan.slots.tolist(), "the second visit is free"


@pytest.mark.traced
def test_layers_share_one_pool_through_a_flat_id_space(adapter):
    """FAILS if residency is keyed by the layer-local expert id alone."""
    c = adapter.init(4, 8, 16)
    c.ensure(0, [3])
    plan = c.ensure(1, [3])
    assert plan.missing == 1, "layer 1's expert 3 is a different expert"
    state = c.state
    assert state.slot_of(0, 3) != state.slot_of(1, 3)
    assert state.resident_slots() == 2
    assert state.id_of_slot[state.slot_of(1, 3)] == 1 * 8 + 3


def test_duplicate_routes_collapse_into_one_copy_and_one_slot(adapter):
    c = adapter.init(4, 8, 16)
    plan = c.ensure(0, [7, 7, 7, 2])
    assert plan.active == 2
    assert plan.count == 2, "one copy per distinct expert"
    assert plan.slots[0] == plan.slots[1] == plan.slots[2] != plan.slots[3]


def test_a_step_never_evicts_an_expert_it_is_about_to_read(adapter):
    """FAILS if victims are chosen before the hits are refreshed: the hit's slot is the LRU one."""
    c = adapter.init(2, 4, 4)
    c.ensure(0, [0, 1, 2, 3])
    c.ensure(1, [0])
    held = c.state.slot_of(1, 0)
    c.ensure(0, [1, 2, 3])  # every other slot is now newer than `held`
    assert c.state.usage[held] == c.state.usage.min()
    plan = c.ensure(1, [0, 1])
    assert plan.missing == 1
    assert c.state.slot_of(1, 0) == held, "the hit kept its slot"
    assert plan.dst_slots[0] != held
    assert plan.slots[0] == held


def test_hits_are_refreshed_before_victims_are_chosen(adapter):
    """FAILS if victims are chosen from the usage as it was on entry: the hit (layer 1,
    expert 0) sits in the oldest slot, and would be evicted by the miss beside it."""
    c = adapter.init(2, 3, 3)
    c.ensure(1, [0])  # slot 0, the oldest stamp
    c.ensure(0, [0, 1])  # slots 1, 2
    plan = c.ensure(1, [0, 1])
    assert plan.slots[0] == 0 and plan.dst_slots[0] == 1
    assert_invariants(c.state)


def test_a_step_never_evicts_a_slot_it_claimed_earlier_in_the_same_step(adapter):
    """FAILS if claimed victims are not knocked out: two misses on a full pool whose oldest
    slot is unique would both take it."""
    c = adapter.init(2, 4, 4)
    for expert in range(4):
        c.ensure(0, [expert])
    plan = c.ensure(1, [0, 1])
    assert plan.valid("dst_slots") == [0, 1]
    assert_invariants(c.state)


def test_eviction_takes_the_least_recently_used_slot(adapter):
    c = adapter.init(2, 4, 4)
    for expert in range(4):
        c.ensure(0, [expert])  # one step each, ascending usage
    c.ensure(0, [0])  # refresh 0, making 1 the oldest
    oldest = c.state.slot_of(0, 1)
    plan = c.ensure(1, [0])
    assert plan.valid("dst_slots") == [oldest]
    assert c.state.slot_of(0, 1) is None, "the oldest went"
    assert c.state.slot_of(0, 0) is not None, "the refreshed one stayed"


@pytest.mark.kernels
def test_usage_ties_go_to_the_lowest_slot(adapter):
    """FAILS if the victim search breaks ties by anything but the slot index (a GPU kernel and
    the reference would then disagree about where an expert lives): empty slots (usage 0) and
    slots 0..3 sharing one stamp must be taken in slot order."""
    c = adapter.init(2, 4, 8)
    plan = c.ensure(0, [2, 0])
    assert plan.valid("dst_slots") == [0, 1], "empty slots (usage 0) in slot order"
    assert plan.valid("src_rows") == [0, 2], "misses in ascending id"
    c = adapter.init(3, 4, 8)
    c.ensure(0, [3, 2, 1, 0])  # slots 0..3, one stamp
    c.ensure(1, [0, 1, 2, 3])  # slots 4..7, a newer stamp
    plan = c.ensure(2, [3, 1])
    assert plan.dst_slots.tolist() == [0, 1]
    assert plan.src_rows.tolist() == [1, 3], "misses ascend by id, victims by (usage, slot)"
    assert plan.slots.tolist() == [1, 0]


def test_a_large_cold_batch_assigns_unique_slots(adapter):
    c = adapter.init(4, 64, 256)
    plan = c.ensure(2, list(range(63, -1, -1)))  # descending, so ascending rows are the cache's doing
    assert plan.missing == 64 and plan.count == 64
    assert len(set(plan.slots.tolist())) == 64, "no slot serves two experts"
    assert plan.src_rows.tolist() == list(range(64)), "misses are ranked by ascending expert id"


def test_the_residency_map_stays_bijective_under_pressure(adapter):
    c = adapter.init(4, 16, 20)
    policy = adapter.Policy.fraction(0.5)
    for step in range(120):
        layer = step % 4
        routes = [(step * 7 + i * 3) % 16 for i in range(6)]
        plan = c.ensure(layer, routes) if step % 2 == 0 else c.ensure_hybrid(layer, routes, policy)
        assert plan.slots.shape == (6,)
        assert_invariants(c.state)


# ---- the hybrid split and the fetch order (docs/semantics.md §5.3, §5.4, §10) ----------------


def test_the_hybrid_split_assigns_every_route_to_exactly_one_device(adapter):
    c = adapter.init(1, 32, 40)
    plan = c.ensure_hybrid(0, [0, 1, 2, 3, 4, 5, 6, 7, 3], adapter.Policy.fraction(0.415))
    assert plan.missing == 8
    assert plan.fetched == 3, "0.415 * 8 = 3.32 -> 3"
    on_gpu = plan.slots >= 0
    assert on_gpu.sum() == 3 + (plan.slots[3] >= 0)
    assert plan.cpu.sum() == 9 - on_gpu.sum()
    assert (on_gpu ^ plan.cpu).all(), "each route on exactly one device"
    assert plan.cpu[3] == plan.cpu[8], "duplicates get the same answer"


def test_padding_routes_are_neither_device_nor_cpu_routes(adapter):
    c = adapter.init(1, 8, 8)
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
    c = adapter.init(1, 16, 16)
    for round_ in range(6):
        c.ensure_hybrid(0, [9, round_], policy)
    assert c.state.slot_of(0, 9) is not None, "the expert routed every step became resident"
    naive = adapter.init(1, 16, 16)
    for round_ in range(6):
        naive.ensure_hybrid(0, [9, round_], policy, order="lowest_id")
    assert naive.state.slot_of(0, 9) is None, "the contrast: by id, 9 never wins"


def test_recency_is_stamped_in_both_fetch_orders_and_never_by_plain_ensure(adapter):
    c = adapter.init(1, 8, 8)
    c.ensure(0, [1])
    assert c.state.recency[0, 1] == -1, "plain ensure does not touch recency"
    c.ensure_hybrid(0, [5, 2], adapter.Policy.fixed_cap(0), order="lowest_id")
    recency = c.state.recency
    assert recency[0, 5] == recency[0, 2] == 2, "LOWEST_ID stamps too (docs/semantics.md §10)"
    c.ensure(0, [3])
    assert c.state.recency[0, 3] == -1


def test_the_fixed_cap_fetches_at_most_cap_misses(adapter):
    c = adapter.init(1, 32, 40)
    plan = c.ensure_hybrid(0, list(range(8)), adapter.Policy.fixed_cap(1))
    assert (plan.missing, plan.fetched, plan.count) == (8, 1, 1)


# ---- materialize_layer, forget_slot (docs/semantics.md §5.6, §5.7) ---------------------------


def test_materializing_a_layer_reclaims_other_layers_slots_cleanly(adapter):
    c = adapter.init(2, 4, 4)
    c.ensure(0, [0, 1, 2, 3])
    plan = c.materialize_layer(1)
    assert plan.dst_slots.tolist() == [0, 1, 2, 3]
    assert plan.src_rows.tolist() == [0, 1, 2, 3], "position == expert id"
    assert plan.count == 4
    for expert in range(4):
        assert c.state.slot_of(1, expert) == expert
        assert c.state.slot_of(0, expert) is None, "layer 0 must not hit on layer 1's bytes"
    assert c.ensure(0, [3]).missing == 1


@pytest.mark.traced
def test_materialize_empties_this_layers_stale_placements_elsewhere(adapter):
    """FAILS if only slots [0, E) are rewritten: layer 1's expert 0 living in slot 4 would stay
    claimed by two slots."""
    c = adapter.init(2, 4, 8)
    c.ensure(0, [0, 1, 2, 3])
    c.ensure(1, [0])  # slot 4
    assert c.state.slot_of(1, 0) == 4
    c.materialize_layer(1)
    assert c.state.id_of_slot[4] == -1 and c.state.usage[4] == 0
    assert_invariants(c.state)


def test_a_second_materialize_of_the_same_layer_is_idempotent(adapter):
    c = adapter.init(2, 4, 6)
    c.ensure(1, [3])
    c.materialize_layer(1)
    once = c.state
    c.materialize_layer(1)
    for expert in range(4):
        assert c.state.slot_of(1, expert) == expert
    assert c.state.resident_slots() == 4
    np.testing.assert_array_equal(c.state.slot_for_id, once.slot_for_id)
    np.testing.assert_array_equal(c.state.id_of_slot, once.id_of_slot)
    assert c.state.usage[4] == 0, "a slot outside [0, E) was never used"
    assert c.stats().calls == 1 and (c.state.recency == -1).all(), "counters and recency untouched"


@pytest.mark.traced
def test_forget_slot_makes_the_slot_the_first_victim_and_is_idempotent(adapter):
    """FAILS if forgetting only empties the slot: with usage left as it was, the next miss on a
    full pool would evict the genuinely oldest resident instead."""
    c = adapter.init(2, 4, 4)
    for expert in range(4):
        c.ensure(0, [expert])
    result = c.forget_slot(3)  # the newest slot
    assert (result.old, result.error) == (3, 0)
    assert c.state.slot_of(0, 3) is None and c.state.id_of_slot[3] == -1
    assert c.state.usage[3] == INT32_MIN
    before = c.state
    again = c.forget_slot(3)
    assert (again.old, again.error) == (-1, 0), "idempotent"
    assert_same_state(c.state, before)
    plan = c.ensure(1, [0])
    assert plan.dst_slots[0] == 3, "the forgotten slot is the very first victim"
    assert c.state.slot_of(0, 0) == 0, "the oldest real resident survived"


# ---- stats, geometry, cold starts (docs/semantics.md §7, §8) ---------------------------------


def test_stats_answer_whether_the_cache_is_big_enough(adapter):
    c = adapter.init(1, 2, 2)
    c.ensure(0, [0, 1])
    c.ensure(0, [0, 1])
    stats = c.stats()
    assert (stats.calls, stats.active, stats.missing, stats.fetched) == (2, 4, 2, 2)
    assert stats.miss_rate == 0.5 and stats.fetch_rate == 1.0 and stats.active_per_call == 2.0
    assert stats.missing_per_call == 1.0 and stats.fetched_per_call == 1.0
    empty = adapter.init(1, 2, 2).stats()
    assert empty.miss_rate == empty.fetch_rate == empty.active_per_call == 0.0


def test_hybrid_counters_count_every_miss_and_only_the_fetches(adapter):
    c = adapter.init(1, 16, 16)
    c.ensure_hybrid(0, list(range(8)), adapter.Policy.fixed_cap(2))
    s = c.stats()
    assert (s.missing, s.fetched) == (8, 2)
    assert s.fetch_rate == 0.25 and s.fetched_per_call == 2.0 and s.missing_per_call == 8.0


def test_a_rebuild_that_cannot_hold_a_layer_changes_nothing(adapter):
    c = adapter.init(2, 8, 16)
    c.ensure(0, [1])
    before = c.state
    with pytest.raises(adapter.errors.RebuildRejected) as info:
        c.rebuild(4)
    assert isinstance(info.value, ValueError)
    assert (info.value.requested, info.value.minimum) == (4, 8)
    assert_same_state(c.state, before, "still serving the old cache")
    c.set_collect_routing(True)
    c.rebuild(8)
    assert c.state.cache_size == 8 and c.state.resident_slots() == 0, "slot ids no longer mean anything"
    assert c.state.step == 0 and c.stats().calls == 0
    assert c.state.collect_routing, "a setting, kept"


def test_a_cache_too_small_for_one_layer_is_rejected_at_construction(adapter):
    with pytest.raises(ValueError, match="cannot hold one layer"):
        adapter.init(2, 8, 4)
    for bad in ((0, 8, 8), (2, 0, 8), (2, 8, 0)):
        with pytest.raises(ValueError):
            adapter.init(*bad)
    with pytest.raises(TypeError, match="2.5"):
        adapter.init(2, 2.5, 8)


def test_reset_is_a_cold_start_with_the_same_geometry(adapter):
    c = adapter.init(2, 4, 8, rebase_threshold=100)
    c.set_collect_routing(True)
    c.ensure_hybrid(0, [1, 2], adapter.Policy.full())
    c.begin_prefill()
    c.reset()
    fresh = adapter.init(2, 4, 8, rebase_threshold=100)
    fresh.set_collect_routing(True)
    assert_same_state(c.state, fresh.state)
    assert c.state.resident_slots() == 0 and c.state.step == 0 and c.stats().calls == 0
    assert c.state.routing_freq.sum() == 0 and not c.state.prefill_open


# ---- per-layer stats and the routing histogram (docs/semantics.md §8) ------------------------


def test_per_layer_stats_tell_one_thrashing_layer_from_a_uniformly_tight_cache(adapter):
    """FAILS if per-layer stats are apportioned from the global window: both caches have the
    same global picture (8 active, 4 missing) and opposite per-layer ones."""
    thrashing = adapter.init(2, 4, 8)
    thrashing.ensure(1, [0, 1])
    thrashing.reset_stats()
    for layer, routes in ((0, [0, 1]), (0, [2, 3]), (1, [0, 1]), (1, [0, 1])):
        thrashing.ensure(layer, routes)
    uniform = adapter.init(2, 4, 8)
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
    c = adapter.init(3, 8, 16)
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
    c = adapter.init(2, 4, 8)
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
    c = adapter.init(2, 4, 8)
    c.set_collect_routing(True)
    c.ensure(0, [3, 3, 3, 1, -1])
    assert c.routing_histogram(0).tolist() == [0, 1, 0, 3]
    assert c.routing_histogram(1).tolist() == [0, 0, 0, 0]


@pytest.mark.traced
def test_routing_is_collected_only_when_switched_on(adapter):
    c = adapter.init(2, 4, 8)
    c.ensure(0, [1, 2])
    assert c.state.routing_freq.sum() == 0, "collection is opt-in"
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
    c = adapter.init(2, 8, 8)
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
    c = adapter.init(2, 8, 8)
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
    c = adapter.init(1, 4, 4)
    c.set_collect_routing(True)
    c.ensure(0, [0] * 9 + [1])
    assert c.routing_skew().per_layer[0].experts_for_90pct == 1


def test_oracle_slots_round_half_away_from_zero(adapter):
    """FAILS with Python's round() (half to even): S/L = 2.5 must give 3 slots, not 2."""
    c = adapter.init(4, 8, 10)
    c.set_collect_routing(True)
    c.ensure(0, [0, 1, 2, 3])
    assert c.routing_skew().oracle_slots == 3


def test_norm_entropy_of_a_single_expert_model_is_zero_not_nan(adapter):
    c = adapter.init(1, 1, 1)
    c.set_collect_routing(True)
    c.ensure(0, [0, 0])
    assert c.routing_skew().per_layer[0].norm_entropy == 0.0


def test_routing_skew_is_absent_until_routing_is_observed(adapter):
    c = adapter.init(4, 8, 16)
    c.ensure(0, [1, 2])
    assert c.routing_skew() is None, "collection is opt-in"
    c.set_collect_routing(True)
    c.ensure(2, [1, 2])
    assert [s.layer for s in c.routing_skew().per_layer] == [2], "un-routed layers are absent, not zeros"
    c.reset_routing()
    assert c.routing_skew() is None


# ---- the promotion scenarios (docs/semantics.md §5.5) ------------------------------------------
# The table itself runs through pallas_cache.sizing.scenarios (one compiled lax.scan per
# scenario); the reference agrees with it step by step through the lockstep suite.


def test_the_promotion_table_without_promotion():
    one = scenarios.one_active_layer("none")
    assert (one.fetches, one.cpu_routes) == (0, 256), "expert 7 stays on the CPU forever"
    cold = scenarios.all_layers_cold("none")
    assert (cold.fetches, cold.cpu_routes, cold.empty_slots) == (56, 2104, 8)


def test_the_promotion_table_with_promote_one():
    """FAILS without the rule: a single miss at 0.4 rounds to zero fetches forever."""
    one = scenarios.one_active_layer("promote_one")
    assert (one.fetches, one.cpu_routes) == (1, 1)
    assert one.empty_slots == scenarios.CACHE_SIZE - 8, "expert 7 joined the 7 residents"
    cold = scenarios.all_layers_cold("promote_one")
    assert (cold.fetches, cold.cpu_routes, cold.empty_slots) == (64, 88, 0)


def promotion_cache(adapter):
    """One layer of 8 experts in a 16-slot pool, experts 0..6 resident, expert 7 seen before."""
    c = adapter.init(1, 8, 16)
    c.ensure_hybrid(0, list(range(8)), adapter.Policy.fixed_cap(7))
    return c


@pytest.mark.traced
def test_a_first_time_miss_is_never_promoted(adapter):
    """FAILS if promotion ignores recency: expert 7's first appearance must run on the CPU."""
    q = adapter.Policy.fraction(0.4)
    c = adapter.init(1, 16, 16)
    plan = c.ensure_hybrid(0, [7], q)
    assert plan.fetched == 0 and plan.cpu.tolist() == [True]
    plan = c.ensure_hybrid(0, [7], q)
    assert plan.fetched == 1 and plan.dst_slots[0] == 0, "now it recurs"
    c = adapter.init(1, 8, 16)
    c.ensure_hybrid(0, list(range(7)), adapter.Policy.fixed_cap(7))
    plan = c.ensure_hybrid(0, list(range(8)), q)
    assert plan.fetched == 0 and plan.cpu[7], "expert 7 was never routed before"
    plan = c.ensure_hybrid(0, list(range(8)), q)
    assert plan.fetched == 1 and plan.valid("src_rows") == [7]


@pytest.mark.kernels
def test_a_recurring_miss_is_promoted_even_among_first_time_misses_with_lower_ids(adapter):
    """FAILS if the promoted expert is the lowest missing id rather than the most recent one."""
    q = adapter.Policy.fraction(0.4)
    c = adapter.init(1, 16, 32)
    c.ensure_hybrid(0, [9], adapter.Policy.fixed_cap(0))  # 9 seen, not fetched
    plan = c.ensure_hybrid(0, [1, 9], q)
    assert plan.fetched == 1 and plan.valid("src_rows") == [9]
    assert plan.valid("dst_slots") == [0], "into the empty argmin slot"
    assert plan.cpu[0] and plan.slots[1] == 0
    c = adapter.init(1, 16, 16)
    c.ensure_hybrid(0, [9], q)
    c.ensure_hybrid(0, [1, 9], adapter.Policy.fixed_cap(0))  # refresh 9's recency; 1 seen too
    c.ensure_hybrid(0, [9], q)  # promote 9 (M = 1, F = 0)
    assert c.state.slot_of(0, 9) == 0
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
        assert_same_plan(promoted, plain)


def test_promotion_needs_an_empty_argmin_slot(adapter):
    """FAILS if the emptiness check is skipped: a recurring miss is promoted into an empty LRU
    slot, never by evicting a resident from a full pool."""
    q = adapter.Policy.fraction(0.4)
    plan = promotion_cache(adapter).ensure_hybrid(0, [7], q)  # slots 7..15 empty
    assert (plan.missing, plan.fetched) == (1, 1)
    assert plan.valid("dst_slots") == [7] and plan.valid("src_rows") == [7]
    c = adapter.init(2, 4, 4)
    c.ensure(1, [0, 1, 2, 3])  # the pool is full of layer 1
    for _ in range(4):
        plan = c.ensure_hybrid(0, [2], q)
        assert plan.fetched == 0 and plan.missing == 1
    # Expert 0 of layer 0 was routed, then evicted by layer 1; the LRU slot holds a resident.
    full = adapter.init(2, 2, 2)
    full.ensure_hybrid(0, [0, 1], adapter.Policy.fixed_cap(2))
    full.ensure(1, [0])
    assert full.state.slot_of(0, 0) is None and full.state.recency[0, 0] >= 0
    plan = full.clone().ensure_hybrid(0, [0], q)
    assert plan.fetched == 0 and plan.cpu[0]
    # Forget the LRU slot: now it is empty and the argmin, and the rule fires.
    lru = int(np.argmin(full.state.usage))
    full.forget_slot(lru)
    plan = full.clone().ensure_hybrid(0, [0], q)
    assert plan.fetched == 1 and plan.valid("dst_slots") == [lru]
    plan = full.clone().ensure_hybrid(0, [0], q, admission="none")
    assert plan.fetched == 0, "NONE is the plain split"


def test_reuse_admits_misses_more_recent_than_their_victims_and_stops_at_the_first_rejection(adapter):
    """FAILS if REUSE admits past a rejected victim, admits never-routed experts, or acts
    without the recency order and a fraction policy."""
    q = adapter.Policy.fraction(0.4)
    # Layer 1 fills the pool at step 1; layer 0's experts are routed at steps 2 and 3 (CPU).
    c = adapter.init(2, 4, 4)
    c.ensure(1, [0, 1, 2, 3])
    c.ensure_hybrid(0, [0], adapter.Policy.fixed_cap(0))
    c.ensure_hybrid(0, [1], adapter.Policy.fixed_cap(0))
    # q = 0.4, M = 3 -> F = 1. Recency order: 1 (3), 0 (2), 2 (-1). Victims have usage 1.
    plan = c.ensure_hybrid(0, [0, 1, 2], q, admission="reuse")
    assert plan.missing == 3
    assert plan.valid("src_rows") == [1, 0], "2 was never routed: rejected"
    # Expert 2 was routed at step 4, after its would-be victim (usage 1) was last used.
    plan = c.clone().ensure_hybrid(0, [2], q, admission="reuse")
    assert plan.fetched == 1, "admitted past F = 0"
    for policy, order in ((adapter.Policy.fixed_cap(0), "recency"), (q, "lowest_id")):
        plan = c.clone().ensure_hybrid(0, [2], policy, order=order, admission="reuse")
        assert plan.fetched == 0, "REUSE needs the recency order and a fraction policy"

    c = adapter.init(2, 8, 8)
    plan = c.ensure_hybrid(0, list(range(8)), q, admission="reuse")
    assert plan.fetched == 3, "first-time misses are never admitted past the split"
    # Misses 3 and 4 (routed at step 1); the split says 1; the second victim is an empty slot
    # (usage 0 <= 1), so REUSE admits it too.
    plan = c.ensure_hybrid(0, [3, 4], q, admission="reuse")
    assert plan.valid("dst_slots") == [3, 4] and plan.fetched == 2
    plain = adapter.init(2, 8, 8)
    plain.ensure_hybrid(0, list(range(8)), q, admission="none")
    assert plain.ensure_hybrid(0, [3, 4], q, admission="none").fetched == 1
    # Fill the pool, give layer 1 three slots, then walk layer 0 against newer victims.
    c.ensure_hybrid(0, [5, 6, 7], q, admission="reuse")  # 1 by split + 2 admitted
    assert (c.state.id_of_slot >= 0).all()
    c.ensure_hybrid(1, [0, 1, 2], q, admission="reuse")  # step 4: takes slot 0
    c.ensure_hybrid(1, [1, 2], q, admission="reuse")  # step 5: slots 1 and 2
    assert c.state.slot_for_id[1, :3].tolist() == [0, 1, 2]
    # Step 6: misses 0, 1, 2 of layer 0 (recency 1), hit 3. Split: 1 fetch into slot 4
    # (usage 2). The next victim, slot 5, was used at step 3 > recency 1: rejected, walk ends.
    plan = c.ensure_hybrid(0, [0, 1, 2, 3], q, admission="reuse")
    assert plan.count == 1 and plan.dst_slots[0] == 4 and plan.src_rows[0] == 0
    assert plan.cpu.tolist() == [False, True, True, False]
