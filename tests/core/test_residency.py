"""The step's residency rules on every adapter of conftest.py (docs/semantics.md §5.2):
what a miss fetches and where it lands, which slot a step evicts (hits refreshed first, LRU
with ties to the lowest slot, never a slot the step reads or claimed), and a residency map that
stays bijective. A docstring says how its test catches the naive implementation where that is
a real temptation."""

from __future__ import annotations

import pytest

from tests.harness import assert_invariants, resident_slots, slot_of, valid


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

