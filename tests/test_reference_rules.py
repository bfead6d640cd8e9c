"""Every rule of the Rust seed's test module, restated against the NumPy reference.

Each test is named after the rule it pins; where the naive implementation is a real temptation,
the docstring says how the test would catch it.
"""

import numpy as np
import pytest

from reference import ReferenceCache, ReferencePolicy, RebuildRejected


def cache():
    return ReferenceCache(4, 8, 16)


def resident_slots(c):
    return int((c.id_of_slot >= 0).sum())


def slot_of(c, layer, expert):
    slot = int(c.slot_for_id[layer, expert])
    return slot if slot >= 0 else None


def assert_bijective(c):
    E = c.num_experts
    for slot, flat in enumerate(c.id_of_slot):
        if flat >= 0:
            assert c.slot_for_id[flat // E, flat % E] == slot, f"slot {slot} and its occupant disagree"
    for layer in range(c.num_layers):
        for expert in range(E):
            slot = c.slot_for_id[layer, expert]
            if slot >= 0:
                assert c.id_of_slot[slot] == layer * E + expert
    claimed = c.slot_for_id[c.slot_for_id >= 0]
    assert len(set(claimed.tolist())) == len(claimed), "a slot is claimed twice"
    assert resident_slots(c) <= c.cache_size
    assert (c.usage <= c.step).all()


def test_a_cold_miss_is_fetched_and_becomes_resident():
    c = cache()
    plan = c.ensure(0, [3, 5])
    assert (plan.missing, plan.fetched, plan.count) == (2, 2, 2)
    assert plan.src_rows[:2].tolist() == [3, 5], "layer-local rows"
    assert (plan.slots >= 0).all()
    again = c.ensure(0, [3, 5])
    assert again.missing == 0 and again.count == 0
    assert (again.dst_slots == -1).all()
    assert again.slots.tolist() == plan.slots.tolist(), "the second visit is free"


def test_layers_share_one_pool_through_a_flat_id_space():
    """FAILS if residency is keyed by the layer-local expert id alone."""
    c = cache()
    c.ensure(0, [3])
    plan = c.ensure(1, [3])
    assert plan.missing == 1, "layer 1's expert 3 is a different expert"
    assert slot_of(c, 0, 3) != slot_of(c, 1, 3)
    assert resident_slots(c) == 2
    assert c.id_of_slot[slot_of(c, 1, 3)] == 1 * 8 + 3


def test_duplicate_routes_collapse_into_one_copy_and_one_slot():
    c = cache()
    plan = c.ensure(0, [7, 7, 7, 2])
    assert plan.active == 2
    assert plan.count == 2, "one copy per distinct expert"
    assert plan.slots[0] == plan.slots[1] == plan.slots[2]
    assert plan.slots[0] != plan.slots[3]


def test_a_step_never_evicts_an_expert_it_is_about_to_read():
    """FAILS if victims are chosen among all slots: the hit's slot (layer 1, expert 0) is not
    the oldest by much, and a naive argmin over every slot would take it."""
    c = ReferenceCache(2, 4, 4)
    c.ensure(0, [0, 1, 2, 3])
    c.ensure(1, [0])
    held = slot_of(c, 1, 0)
    plan = c.ensure(1, [0, 1])
    assert plan.missing == 1
    assert slot_of(c, 1, 0) == held, "the hit kept its slot"
    assert plan.dst_slots[0] != held
    assert plan.slots[0] == held


def test_hits_are_refreshed_before_victims_are_chosen():
    """FAILS if victims are chosen from the usage as it was on entry: the hit (layer 1,
    expert 0) sits in the oldest slot, and would be evicted by the miss beside it."""
    c = ReferenceCache(2, 3, 3)
    c.ensure(1, [0])  # slot 0, the oldest stamp
    c.ensure(0, [0, 1])  # slots 1, 2
    plan = c.ensure(1, [0, 1])
    assert plan.slots[0] == 0 and plan.dst_slots[0] == 1
    assert_bijective(c)


def test_a_step_never_evicts_a_slot_it_claimed_earlier_in_the_same_step():
    """FAILS if claimed victims are not knocked out: two misses on a full pool whose oldest
    slot is unique would both take it."""
    c = ReferenceCache(2, 4, 4)
    for expert in range(4):
        c.ensure(0, [expert])
    plan = c.ensure(1, [0, 1])
    assert plan.dst_slots[:2].tolist() == [0, 1]
    assert_bijective(c)


def test_eviction_takes_the_least_recently_used_slot():
    c = ReferenceCache(2, 4, 4)
    for expert in range(4):
        c.ensure(0, [expert])  # one step each, ascending usage
    c.ensure(0, [0])  # refresh 0, making 1 the oldest
    oldest = slot_of(c, 0, 1)
    plan = c.ensure(1, [0])
    assert plan.dst_slots[:1].tolist() == [oldest]
    assert slot_of(c, 0, 1) is None, "the oldest went"
    assert slot_of(c, 0, 0) is not None, "the refreshed one stayed"


def test_usage_ties_go_to_the_lowest_slot():
    """FAILS if the victim search breaks ties toward the highest slot: slots 0..3 share one
    usage stamp, and the misses must take them in slot order."""
    c = ReferenceCache(3, 4, 8)
    c.ensure(0, [3, 2, 1, 0])  # slots 0..3, one stamp
    c.ensure(1, [0, 1, 2, 3])  # slots 4..7, a newer stamp
    plan = c.ensure(2, [3, 1])
    assert plan.dst_slots.tolist() == [0, 1]
    assert plan.src_rows.tolist() == [1, 3], "misses ascend by id, victims by (usage, slot)"
    assert plan.slots.tolist() == [1, 0]


def test_a_large_cold_batch_assigns_unique_slots():
    c = ReferenceCache(4, 64, 256)
    ids = list(range(63, -1, -1))  # descending, so the ascending rows are the cache's doing
    plan = c.ensure(2, ids)
    assert plan.missing == 64 and plan.count == 64
    assert len(set(plan.slots.tolist())) == 64, "no slot serves two experts"
    assert plan.src_rows.tolist() == list(range(64)), "misses are ranked by ascending expert id"


def test_the_hybrid_split_assigns_every_route_to_exactly_one_device():
    c = ReferenceCache(1, 32, 40)
    plan = c.ensure_hybrid(0, [0, 1, 2, 3, 4, 5, 6, 7, 3], ReferencePolicy.fraction(0.415))
    assert plan.missing == 8
    assert plan.fetched == 3, "0.415 * 8 = 3.32 -> 3"
    on_gpu = plan.slots >= 0
    assert on_gpu.sum() == 3 + (plan.slots[3] >= 0)
    assert (on_gpu ^ plan.cpu).all(), "each route on exactly one device"
    assert plan.cpu[3] == plan.cpu[8], "duplicates get the same answer"


def test_padding_routes_are_neither_device_nor_cpu_routes():
    c = ReferenceCache(1, 8, 8)
    c.set_collect_routing(True)
    plan = c.ensure_hybrid(0, [[1, -1], [-1, 2]], ReferencePolicy.fixed_cap(1))
    assert plan.slots.shape == (2, 2)
    assert plan.slots[0, 1] == -1 and not plan.cpu[0, 1]
    assert plan.active == 2 and plan.missing == 2 and plan.fetched == 1
    assert c.routing_histogram(0).sum() == 2, "padding is not routing mass"


def test_a_recurring_miss_climbs_the_fetch_order():
    """FAILS under the lowest-id order: expert 9 loses the cap to the rotating cast forever."""
    c = ReferenceCache(1, 16, 16)
    policy = ReferencePolicy.fixed_cap(1)
    for round_ in range(6):
        c.ensure_hybrid(0, [9, round_], policy)
    assert slot_of(c, 0, 9) is not None, "the expert routed every step became resident"

    naive = ReferenceCache(1, 16, 16)
    for round_ in range(6):
        naive.ensure_hybrid(0, [9, round_], policy, order="lowest_id")
    assert slot_of(naive, 0, 9) is None, "the contrast: by id, 9 never wins"


def test_recency_is_updated_for_every_routed_expert_under_both_orders():
    c = ReferenceCache(1, 8, 8)
    c.ensure_hybrid(0, [5, 1], ReferencePolicy.fixed_cap(0), order="lowest_id")
    assert c.recency[0, 5] == c.recency[0, 1] == 1
    c.ensure(0, [2])
    assert c.recency[0, 2] == -1, "the plain path does not touch recency"


def test_the_fixed_cap_limits_fetches_per_step():
    c = ReferenceCache(1, 32, 40)
    plan = c.ensure_hybrid(0, list(range(8)), ReferencePolicy.fixed_cap(1))
    assert plan.missing == 8 and plan.fetched == 1 and plan.count == 1


def test_materializing_a_layer_reclaims_other_layers_slots_cleanly():
    c = ReferenceCache(2, 4, 4)
    c.ensure(0, [0, 1, 2, 3])
    plan = c.materialize_layer(1)
    assert plan.dst_slots.tolist() == [0, 1, 2, 3]
    assert plan.src_rows.tolist() == [0, 1, 2, 3], "position == expert id"
    for expert in range(4):
        assert slot_of(c, 1, expert) == expert
        assert slot_of(c, 0, expert) is None, "layer 0 must not hit on layer 1's bytes"
    assert c.ensure(0, [3]).missing == 1


def test_materialize_empties_this_layers_stale_placements_elsewhere():
    """FAILS if only slots [0, E) are rewritten: layer 1's expert 0 living in slot 5 would stay
    claimed by two slots."""
    c = ReferenceCache(2, 4, 8)
    c.ensure(0, [0, 1, 2, 3, ])
    c.ensure(1, [0])  # slot 4
    assert slot_of(c, 1, 0) == 4
    c.materialize_layer(1)
    assert c.id_of_slot[4] == -1 and c.usage[4] == 0
    assert_bijective(c)


def test_a_second_materialize_of_the_same_layer_is_idempotent():
    c = ReferenceCache(2, 4, 6)
    c.materialize_layer(1)
    first = (c.slot_for_id.copy(), c.id_of_slot.copy())
    c.materialize_layer(1)
    assert (c.slot_for_id == first[0]).all() and (c.id_of_slot == first[1]).all()
    assert resident_slots(c) == 4
    assert c.stats().calls == 0 and (c.recency == -1).all(), "counters and recency untouched"


def test_stats_answer_whether_the_cache_is_big_enough():
    c = ReferenceCache(1, 2, 2)
    c.ensure(0, [0, 1])
    c.ensure(0, [0, 1])
    stats = c.stats()
    assert (stats.calls, stats.active, stats.missing, stats.fetched) == (2, 4, 2, 2)
    assert stats.miss_rate == 0.5 and stats.fetch_rate == 1.0 and stats.active_per_call == 2.0
    empty = ReferenceCache(1, 2, 2).stats()
    assert empty.miss_rate == empty.fetch_rate == empty.active_per_call == 0.0


def test_hybrid_counters_count_every_miss_and_only_the_fetches():
    c = ReferenceCache(1, 16, 16)
    c.ensure_hybrid(0, list(range(8)), ReferencePolicy.fixed_cap(2))
    s = c.stats()
    assert (s.missing, s.fetched) == (8, 2)
    assert s.fetch_rate == 0.25 and s.fetched_per_call == 2.0 and s.missing_per_call == 8.0


def test_a_rebuild_that_cannot_hold_a_layer_changes_nothing():
    c = ReferenceCache(2, 8, 16)
    c.ensure(0, [1])
    before = c.id_of_slot.copy()
    with pytest.raises(RebuildRejected) as info:
        c.rebuild(4)
    assert isinstance(info.value, ValueError)
    assert (info.value.requested, info.value.minimum) == (4, 8)
    assert c.cache_size == 16 and (c.id_of_slot == before).all(), "still serving the old cache"
    c.rebuild(8)
    assert c.cache_size == 8 and resident_slots(c) == 0, "slot ids no longer mean anything"
    assert c.step == 0 and c.stats().calls == 0


def test_a_cache_too_small_for_one_layer_is_rejected_at_construction():
    with pytest.raises(ValueError, match="cannot hold one layer"):
        ReferenceCache(2, 8, 4)


def test_reset_is_a_cold_start():
    c = ReferenceCache(2, 4, 8)
    c.set_collect_routing(True)
    c.ensure_hybrid(0, [1, 2], ReferencePolicy.full())
    c.begin_prefill()
    c.reset()
    assert resident_slots(c) == 0 and c.step == 0 and (c.usage == 0).all()
    assert (c.recency == -1).all() and c.stats().calls == 0
    assert c.routing_freq.sum() == 0 and not c.prefill_open


def test_the_residency_map_stays_bijective_under_pressure():
    c = ReferenceCache(4, 16, 20)
    policy = ReferencePolicy.fraction(0.5)
    for step in range(200):
        layer = step % 4
        routes = [(step * 7 + i * 3) % 16 for i in range(6)]
        plan = c.ensure(layer, routes) if step % 2 == 0 else c.ensure_hybrid(layer, routes, policy)
        assert plan.slots.shape == (6,)
        assert_bijective(c)


def test_per_layer_stats_tell_one_thrashing_layer_from_a_uniformly_tight_cache():
    """FAILS if per-layer stats apportion the global window: both caches have the same global
    picture (8 active, 4 missing) and opposite per-layer ones."""
    thrashing = ReferenceCache(2, 4, 8)
    thrashing.ensure(1, [0, 1])
    thrashing.reset_stats()
    thrashing.ensure(0, [0, 1])
    thrashing.ensure(0, [2, 3])
    thrashing.ensure(1, [0, 1])
    thrashing.ensure(1, [0, 1])

    uniform = ReferenceCache(2, 4, 8)
    uniform.ensure(0, [0])
    uniform.ensure(1, [0])
    uniform.reset_stats()
    uniform.ensure(0, [0, 1])
    uniform.ensure(0, [0, 2])
    uniform.ensure(1, [0, 1])
    uniform.ensure(1, [0, 2])

    assert thrashing.stats() == uniform.stats()
    assert thrashing.stats().miss_rate == uniform.stats().miss_rate == 0.5
    assert thrashing.layer_stats(0).miss_rate == 1.0
    assert thrashing.layer_stats(1).miss_rate == 0.0
    assert uniform.layer_stats(0).miss_rate == uniform.layer_stats(1).miss_rate == 0.5


def test_per_layer_stats_sum_to_the_global_stats():
    c = ReferenceCache(3, 8, 16)
    policy = ReferencePolicy.fraction(0.5)
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


def test_resetting_stats_opens_a_new_window_and_keeps_residency():
    c = ReferenceCache(2, 4, 8)
    c.set_collect_routing(True)
    c.ensure(0, [0, 1])
    c.reset_stats()
    assert c.stats().calls == 0 and c.layer_stats(0).missing == 0
    assert c.routing_freq.sum() == 2, "the histogram survives a stats window"
    c.ensure(0, [0, 1])
    assert c.layer_stats(0).missing == 0 and c.layer_stats(0).active == 2
    assert c.layer_stats(0).missing_per_call == 0.0


def test_the_routing_histogram_counts_every_route_not_every_distinct_expert():
    """FAILS if the histogram is fed the deduplicated routes the miss accounting uses."""
    c = ReferenceCache(2, 4, 8)
    c.set_collect_routing(True)
    c.ensure(0, [3, 3, 3, 1])
    assert c.routing_histogram(0).tolist() == [0, 1, 0, 3]
    assert c.routing_histogram(1).tolist() == [0, 0, 0, 0]


def test_routing_is_collected_only_when_switched_on():
    c = ReferenceCache(2, 4, 8)
    c.ensure(0, [1, 2])
    assert c.routing_freq.sum() == 0


def _routes(counts):
    return [expert for expert, count in enumerate(counts) for _ in range(count)]


def test_oracle_hit_at_slots_separates_a_skewed_layer_from_a_flat_one():
    """FAILS if the oracle is derived from the working set alone (C / working_set = 0.5 for both
    layers): the real answers are 0.96 and 0.52."""
    c = ReferenceCache(2, 8, 8)
    c.set_collect_routing(True)
    c.ensure(0, _routes([24, 24, 24, 24, 1, 1, 1, 1]))
    c.ensure(1, _routes([13, 13, 13, 13, 12, 12, 12, 12]))
    report = c.routing_skew()
    assert report.slots_per_layer == 4.0 and report.oracle_slots == 4
    skewed, flat = report.per_layer
    assert skewed.routed == flat.routed == 100
    assert skewed.working_set == flat.working_set
    assert abs(skewed.oracle_hit_at_slots - 0.96) < 1e-12
    assert abs(flat.oracle_hit_at_slots - 0.52) < 1e-12
    assert skewed.norm_entropy < flat.norm_entropy
    assert skewed.experts_for_90pct < flat.experts_for_90pct


def test_routing_skew_reports_the_working_set_coverage_and_entropy_per_layer():
    c = ReferenceCache(2, 8, 8)
    c.set_collect_routing(True)
    c.ensure(0, list(range(8)))
    c.ensure(1, [2, 2, 2, 2])
    report = c.routing_skew()
    flat, single = report.per_layer
    assert flat.working_set == 8 and flat.experts_for_90pct == 8, "7 experts reach 0.875"
    assert abs(flat.norm_entropy - 1.0) < 1e-12 and abs(flat.oracle_hit_at_slots - 0.5) < 1e-12
    assert single.working_set == 1 and single.experts_for_90pct == 1
    assert single.norm_entropy == 0.0 and single.oracle_hit_at_slots == 1.0
    assert report.working_set_max == 8 and report.working_set_mean == 4.5
    assert report.experts_for_90pct == 4.5
    assert abs(report.oracle_hit_at_slots - 0.75) < 1e-12
    assert abs(report.norm_entropy - 0.5) < 1e-12


def test_ninety_percent_coverage_counts_a_share_that_reaches_it_exactly():
    """FAILS if coverage is tested with `>` instead of `>=`: 9 of 10 routes is exactly 0.9."""
    c = ReferenceCache(1, 4, 4)
    c.set_collect_routing(True)
    c.ensure(0, [0] * 9 + [1])
    assert c.routing_skew().per_layer[0].experts_for_90pct == 1


def test_oracle_slots_round_half_away_from_zero():
    """FAILS with Python's round() (half to even): S/L = 2.5 must give 3 slots, not 2."""
    c = ReferenceCache(2, 4, 5)
    c.set_collect_routing(True)
    c.ensure(0, [0])
    assert c.routing_skew().oracle_slots == 3


def test_norm_entropy_of_a_single_expert_model_is_zero_not_nan():
    c = ReferenceCache(1, 1, 1)
    c.set_collect_routing(True)
    c.ensure(0, [0, 0])
    assert c.routing_skew().per_layer[0].norm_entropy == 0.0


def test_routing_skew_is_absent_until_routing_is_observed():
    c = ReferenceCache(4, 8, 16)
    c.ensure(0, [1, 2])
    assert c.routing_skew() is None, "collection is opt-in"
    c.set_collect_routing(True)
    c.ensure(2, [1, 2])
    report = c.routing_skew()
    assert [s.layer for s in report.per_layer] == [2]
    c.reset_routing()
    assert c.routing_skew() is None


def test_forget_slot_makes_the_slot_the_first_victim_and_is_idempotent():
    """FAILS if forgetting only empties the slot: with usage left as it was, the next miss on a
    full pool would evict the genuinely oldest resident instead."""
    c = ReferenceCache(2, 4, 4)
    for expert in range(4):
        c.ensure(0, [expert])
    result = c.forget_slot(3)  # the newest slot
    assert result.old == 3 and int(result) == 3 and result.error == 0
    assert slot_of(c, 0, 3) is None
    again = c.forget_slot(3)
    assert again.old == -1 and again.error == 0, "idempotent"
    plan = c.ensure(1, [0])
    assert plan.dst_slots[0] == 3
    assert slot_of(c, 0, 0) == 0, "the oldest real resident survived"
