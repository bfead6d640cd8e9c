"""What the step counts, on every adapter of conftest.py (docs/semantics.md §7, §8): the stats
that say whether the cache is big enough, the hybrid counters, per-layer stats and their sum,
the stats window, the routing histogram and the routing skew report; and the geometry and
cold starts (a rebuild or construction that cannot hold a layer, reset)."""

from __future__ import annotations

import pytest

from tests.harness import assert_same, resident_slots


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

