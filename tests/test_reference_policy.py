"""The hybrid policy in the reference: balanced split, admission rules, the seed-000 table."""

import math

import numpy as np
import pytest

from reference import ReferenceCache, ReferencePolicy

# ---- the balanced split (docs/semantics.md §5.3) -----------------------------------------------------------


@pytest.mark.parametrize(
    "q, missing, fetch",
    [(0.4, 1, 0), (0.415, 3, 1), (0.415, 4, 2), (0.415, 8, 3), (0.4, 8, 3), (0.4, 2, 1)],
)
def test_the_balanced_split_matches_the_spec_examples(q, missing, fetch):
    assert ReferencePolicy.fraction(q).split(missing) == fetch


def test_the_split_has_no_minimum_of_one():
    """FAILS if the split is floored at one fetch: a single miss at q = 0.4 goes to the CPU."""
    assert ReferencePolicy.fraction(0.4).split(1) == 0


@pytest.mark.parametrize("q", [0.0, 0.01, 0.1, 0.25, 1 / 3, 0.4, 0.415, 0.5, 0.6, 0.77, 0.9, 0.999, 1.0])
def test_the_split_stays_within_one_of_q_times_m(q):
    # The bound holds for the fraction the policy holds, f / 65536; the requested q differs
    # from it by at most 2**-17, which adds at most M * 2**-17 (e.g. q = 0.01, M = 3701).
    policy = ReferencePolicy.fraction(q)
    held = policy.fraction16 / 65536
    assert abs(held - q) <= 2**-17
    for missing in range(0, 4097):
        fetch = policy.split(missing)
        assert 0 <= fetch <= missing
        assert abs(fetch - held * missing) <= 1, (q, missing, fetch)
        assert abs(fetch - q * missing) <= 1 + missing * 2**-17


def test_the_split_minimises_the_slower_side():
    """FAILS if F is plain rounding of q*M: the balanced choice minimises max(F(1-q), (M-F)q)."""
    for q in (0.3, 0.415, 0.7):
        policy = ReferencePolicy.fraction(q)
        f = policy.fraction16
        for missing in range(1, 200):
            fetch = policy.split(missing)
            cost = lambda n: max(n * (65536 - f), (missing - n) * f)  # noqa: E731
            assert cost(fetch) == min(cost(n) for n in range(missing + 1))


def test_the_fraction_is_fixed_point_rounded_half_to_even_on_the_host():
    assert ReferencePolicy.fraction(0.5 / 65536).fraction16 == 0  # 0.5 -> 0 (even)
    assert ReferencePolicy.fraction(1.5 / 65536).fraction16 == 2  # 1.5 -> 2 (even)
    assert ReferencePolicy.fraction(2.0).fraction16 == 65536, "clamped"
    assert ReferencePolicy.fraction(-1.0).fraction16 == 0, "clamped"
    assert ReferencePolicy.fraction(float("inf")).fraction16 == 65536
    assert ReferencePolicy.fraction(float("-inf")).fraction16 == 0


@pytest.mark.parametrize("bad", [math.nan, "0.4", None, True])
def test_a_fraction_that_is_not_a_number_is_refused(bad):
    with pytest.raises((TypeError, ValueError), match=repr(bad) if bad is not None else "None"):
        ReferencePolicy.fraction(bad)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_a_bad_cap_is_refused(bad):
    with pytest.raises((TypeError, ValueError)):
        ReferencePolicy.fixed_cap(bad)


def test_a_fraction_ignores_the_cap_and_the_cap_applies_only_at_zero_fraction():
    assert ReferencePolicy.fixed_cap(2).split(8) == 2
    assert ReferencePolicy.fixed_cap(0).split(8) == 0
    assert ReferencePolicy.fraction(0.0).split(8) == 0
    assert ReferencePolicy.full().split(8) == 8


# ---- the seed-000 scenario table (docs/semantics.md §5.5) ---------------------------------------------------


def one_layer_scenario(admission):
    c = ReferenceCache(8, 16, 64)
    c.ensure_hybrid(0, np.arange(7), ReferencePolicy.fixed_cap(7), admission=admission)
    policy = ReferencePolicy.fraction(0.4)
    fetches = cpu_routes = 0
    for _ in range(256):
        plan = c.ensure_hybrid(0, np.arange(8), policy, admission=admission)
        fetches += plan.count
        cpu_routes += int(plan.cpu.sum())
    return fetches, cpu_routes, c.slot_for_id[0, 7] >= 0


def all_layers_scenario(admission):
    c = ReferenceCache(8, 16, 64)
    policy = ReferencePolicy.fraction(0.4)
    fetches = cpu_routes = 0
    for _ in range(256):
        for layer in range(8):
            plan = c.ensure_hybrid(layer, np.arange(8), policy, admission=admission)
            fetches += plan.count
            cpu_routes += int(plan.cpu.sum())
    return fetches, cpu_routes, int((c.id_of_slot == -1).sum())


def test_seed_000_table_one_active_layer():
    assert one_layer_scenario("none") == (0, 256, False)
    assert one_layer_scenario("promote_one") == (1, 1, True)


def test_seed_000_table_all_layers_cold_cache():
    assert all_layers_scenario("none") == (56, 2104, 8)
    assert all_layers_scenario("promote_one") == (64, 88, 0)


def test_a_first_time_miss_is_never_promoted():
    """FAILS if promotion ignores recency: expert 7's first appearance must run on the CPU."""
    c = ReferenceCache(1, 16, 16)
    plan = c.ensure_hybrid(0, [7], ReferencePolicy.fraction(0.4))
    assert plan.fetched == 0 and plan.cpu.tolist() == [True]
    plan = c.ensure_hybrid(0, [7], ReferencePolicy.fraction(0.4))
    assert plan.fetched == 1 and plan.dst_slots[0] == 0


def test_a_recurring_miss_is_promoted_even_among_first_time_misses_with_lower_ids():
    """FAILS if the promoted expert is the lowest-id miss instead of the first in recency order."""
    c = ReferenceCache(1, 16, 16)
    policy = ReferencePolicy.fraction(0.4)
    c.ensure_hybrid(0, [9], policy)  # 9 is seen, runs on the CPU
    plan = c.ensure_hybrid(0, [9, 2], policy)  # M = 2 -> F = 1 by the split: plain
    assert plan.src_rows[0] == 9
    c2 = ReferenceCache(1, 16, 16)
    c2.ensure_hybrid(0, [9], policy)
    c2.ensure_hybrid(0, [1, 9], ReferencePolicy.fixed_cap(0))  # refresh 9's recency; 1 seen too
    c2.ensure_hybrid(0, [9], policy)  # promote 9 (M = 1, F = 0)
    assert c2.slot_for_id[0, 9] == 0
    plan = c2.ensure_hybrid(0, [3], policy)
    assert plan.fetched == 0, "3 is a first-time miss"


@pytest.mark.parametrize(
    "policy, order",
    [
        (ReferencePolicy.fixed_cap(0), "recency"),
        (ReferencePolicy.fraction(0.4), "lowest_id"),
    ],
)
def test_promotion_keeps_caps_and_lowest_id_on_the_plain_path(policy, order):
    c = ReferenceCache(1, 16, 16)
    for _ in range(4):
        plan = c.ensure_hybrid(0, [7], policy, order=order)
        assert plan.fetched == 0


def test_promotion_never_evicts_a_resident_from_a_full_cache():
    """FAILS if the emptiness check is skipped: a full pool keeps the plain split."""
    c = ReferenceCache(2, 4, 4)
    c.ensure(1, [0, 1, 2, 3])  # the pool is full of layer 1
    policy = ReferencePolicy.fraction(0.4)
    for _ in range(4):
        plan = c.ensure_hybrid(0, [2], policy)
        assert plan.fetched == 0 and plan.missing == 1


def test_reuse_admits_misses_routed_more_recently_than_their_victim_was_used():
    c = ReferenceCache(2, 8, 8)
    policy = ReferencePolicy.fraction(0.4)
    plan = c.ensure_hybrid(0, list(range(8)), policy, admission="reuse")
    assert plan.fetched == 3, "first-time misses are never admitted past the split"
    # Misses 3 and 4 (routed at step 1); the split says 1; the second victim is an empty slot
    # (usage 0 <= 1), so REUSE admits it too.
    plan = c.ensure_hybrid(0, [3, 4], policy, admission="reuse")
    assert plan.dst_slots.tolist()[:2] == [3, 4] and plan.fetched == 2
    plain = ReferenceCache(2, 8, 8)
    plain.ensure_hybrid(0, list(range(8)), policy, admission="none")
    assert plain.ensure_hybrid(0, [3, 4], policy, admission="none").fetched == 1
    # Fill the pool, give layer 1 three slots, then walk layer 0 against newer victims.
    c.ensure_hybrid(0, [5, 6, 7], policy, admission="reuse")  # 1 by split + 2 admitted
    assert (c.id_of_slot >= 0).all()
    c.ensure_hybrid(1, [0, 1, 2], policy, admission="reuse")  # step 4: takes slot 0
    c.ensure_hybrid(1, [1, 2], policy, admission="reuse")  # step 5: slots 1 and 2
    assert c.slot_for_id[1, :3].tolist() == [0, 1, 2]
    # Step 6: misses 0, 1, 2 of layer 0 (recency 1), hit 3. Split: 1 fetch into slot 4
    # (usage 2). The next victim, slot 5, was used at step 3 > recency 1: rejected, walk ends.
    plan = c.ensure_hybrid(0, [0, 1, 2, 3], policy, admission="reuse")
    assert plan.count == 1 and plan.dst_slots[0] == 4 and plan.src_rows[0] == 0
    assert plan.cpu.tolist() == [False, True, True, False]
