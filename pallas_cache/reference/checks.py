"""The rules every state and every ensure plan obey, as checks a test (or a user's decode loop) can
run after each step: docs/semantics.md §3 (the maps are mutually inverse, no slot is claimed twice,
usage never ahead of the clock, nothing past the usable size) and §4 (every route assigned exactly
once, duplicates alike, the copy arrays -1 padded). They read any state or plan whose fields
convert with ``np.asarray`` -- the library's (JAX arrays) as well as the reference's."""

from __future__ import annotations

import numpy as np


def assert_invariants(state):
    """docs/semantics.md §3: the maps are mutually inverse, no slot is claimed twice, usage <= step."""
    slot_for_id, id_of_slot = np.asarray(state.residency.slot_for_id), np.asarray(state.residency.id_of_slot)
    usage = np.asarray(state.residency.usage)
    E = slot_for_id.shape[-1]
    for slot, flat in enumerate(id_of_slot.tolist()):
        if flat >= 0:
            assert slot_for_id[flat // E, flat % E] == slot, f"slot {slot} and its occupant disagree"
    for (layer, expert), slot in np.ndenumerate(slot_for_id):
        if slot >= 0:
            assert id_of_slot[slot] == layer * E + expert, f"expert {(layer, expert)} -> slot {slot}"
    claimed = slot_for_id[slot_for_id >= 0]
    assert len(set(claimed.tolist())) == len(claimed), "a slot is claimed twice"
    assert (usage <= int(state.step)).all(), "usage ahead of the clock"
    size = int(state.cache_size)
    assert E <= size <= id_of_slot.shape[-1], f"usable size {size} outside [E, capacity]"
    assert (id_of_slot[size:] == -1).all() and (usage[size:] == 0).all(), \
        "a slot past the usable size holds something"


def assert_plan_well_formed(plan, routes, num_experts):
    """docs/semantics.md §4: every route assigned exactly once, duplicates alike, copy arrays -1 padded."""
    flat = np.asarray(routes)
    slots, cpu = np.asarray(plan.slots), np.asarray(plan.cpu)
    dst, src = np.asarray(plan.copy.dst_slots), np.asarray(plan.copy.src_rows)
    count = int(plan.copy.count)
    assert slots.shape == cpu.shape == flat.shape
    assert dst.shape == src.shape == (min(flat.size, num_experts),)
    slots, cpu, flat = slots.ravel(), cpu.ravel(), flat.ravel()
    if int(plan.error):
        assert (slots == -1).all() and not cpu.any()
        return
    route = flat >= 0
    assert ((slots >= 0) != cpu)[route].all(), "a route assigned to both devices or to neither"
    assert (slots[~route] == -1).all() and not cpu[~route].any(), "padding got an assignment"
    for expert in set(flat[route].tolist()):
        same = flat == expert
        assert len(set(slots[same].tolist())) == 1 and len(set(cpu[same].tolist())) == 1
    assert count == int(plan.fetched)
    assert (dst[count:] == -1).all() and (src[count:] == -1).all()
    assert len(set(dst[:count].tolist())) == count
