"""The admission rules of the hybrid step (docs/semantics.md §5.5): the promotion scenarios
with and without PROMOTE_ONE, when a miss is promoted and into which slot, the fixed caps and
the lowest-id order that keep the plain split, and REUSE's admission of misses more recent
than their victims; on every adapter of conftest.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import assert_same, slot_of, valid
from pallas_cache.sizing import scenarios


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

