"""The hybrid split and the fetch order on every adapter of conftest.py (docs/semantics.md
§5.3, §5.4, §10): each route goes to exactly one device, padding to none, a recurring miss
climbs the RECENCY order, recency is stamped by the hybrid op only, a fixed cap fetches at most
its cap."""

from __future__ import annotations

import pytest

from tests.harness import slot_of


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

