"""``materialize_layer`` and ``forget_slot`` on every adapter of conftest.py (docs/semantics.md
§5.6, §5.7): a materialized layer reclaims other layers' slots and empties its own stale
placements, a second call is idempotent, and a forgotten slot is the first victim."""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import assert_invariants, assert_same, resident_slots, slot_of


INT32_MIN = -(2**31)


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

