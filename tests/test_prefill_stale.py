"""A prefill never gathers from a slot that no longer holds the expert (docs/semantics.md §5.11).

begin_prefill snapshots the residency map; a decode ensure between it and a prefetch may evict
a snapshot hit. The prefetch re-validates every snapshot hit against the live map and copies
the moved ones from the host, in both implementations.
"""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import pallas_cache as pc
from reference import ReferenceCache

BANKS = (1 << 20,)  # one large bank: hits are gathered, misses travel as runs


def _warm(L, E, S):
    """Layers 0..2 resident; layer 2's experts sit at or above 2E (snapshot hits)."""
    state, ref = pc.init(L, E, S), ReferenceCache(L, E, S)
    for layer in range(3):
        ids = np.arange(E)
        state, _ = pc.ensure(state, layer, ids)
        ref.ensure(layer, ids)
    return state, ref


def _gathers(plan):
    count = int(plan.gather.count)
    return list(zip(np.asarray(plan.gather.dst_slots)[:count].tolist(),
                    np.asarray(plan.gather.src_slots)[:count].tolist()))


def _assert_gathers_hold(plan, id_of_slot, layer, E):
    for dst, src in _gathers(plan):
        expert = dst % E
        assert int(id_of_slot[src]) == layer * E + expert, (
            f"gather of expert {expert} reads slot {src}, which holds {int(id_of_slot[src])}")


def test_an_expert_evicted_after_begin_prefill_is_copied_from_the_host():
    """FAILS if the prefetch trusts the snapshot: it gathered from slots that now hold another
    layer's experts, with error == 0."""
    L, E, S = 4, 2, 6
    state, ref = _warm(L, E, S)
    state = pc.begin_prefill(state)
    ref.begin_prefill()
    assert np.asarray(state.prefill_snapshot)[2].tolist() == [4, 5]  # both are snapshot hits
    for layer in (0, 1, 3):  # refresh layers 0 and 1, then layer 3's misses evict slots 4, 5
        state, _ = pc.ensure(state, layer, np.arange(E))
        ref.ensure(layer, np.arange(E))
    assert np.asarray(state.slot_for_id)[2].tolist() == [-1, -1]

    before = int(state.prefill_hit_rows)
    state, plan = pc.prefetch_prefill_layer(state, 2, BANKS)
    ref_plan = ref.prefetch_prefill_layer(2, BANKS)
    assert int(plan.error) == 0 and int(plan.gather.count) == 0 == ref_plan.gather.count
    assert (int(plan.runs.count), np.asarray(plan.runs.starts)[0], np.asarray(plan.runs.lens)[0]) \
        == (1, 0, 2)
    assert int(state.prefill_hit_rows) == before == ref.prefill_hit_rows


def test_a_snapshot_hit_still_in_place_is_gathered():
    """FAILS if re-validation is too strict and drops hits that are still resident."""
    L, E, S = 4, 2, 6
    state, ref = _warm(L, E, S)
    state = pc.begin_prefill(state)
    state, _ = pc.ensure(state, 2, np.arange(E))  # a hit refresh moves nothing
    state, plan = pc.prefetch_prefill_layer(state, 2, BANKS)
    assert _gathers(plan) == [(0, 4), (1, 5)]


@given(st.lists(st.tuples(st.sampled_from(["ensure", "prefetch", "release", "begin"]),
                          st.integers(0, 3), st.lists(st.integers(-1, 3), min_size=1,
                                                      max_size=3)),
                min_size=1, max_size=25))
def test_interleaved_decode_and_prefill_gather_only_resident_rows(ops):
    """FAILS if any interleaving of decode ensures and prefill stages gathers from a slot that
    does not hold the expert, or if the two implementations disagree on a plan."""
    L, E, S = 4, 4, 10
    state, ref = pc.init(L, E, S), ReferenceCache(L, E, S)
    state = pc.begin_prefill(state)
    ref.begin_prefill()
    for kind, layer, ids in ops:
        if kind == "ensure":
            state, plan = pc.ensure(state, layer, np.array(ids))
            assert int(plan.error) == ref.ensure(layer, np.array(ids)).error
        elif kind == "prefetch":
            id_of_slot = np.asarray(state.id_of_slot)
            state, plan = pc.prefetch_prefill_layer(state, layer, BANKS)
            ref_plan = ref.prefetch_prefill_layer(layer, BANKS)
            _assert_gathers_hold(plan, id_of_slot, layer, E)
            assert int(plan.error) == ref_plan.error
            assert _gathers(plan) == list(zip(
                ref_plan.gather.dst_slots[:ref_plan.gather.count].tolist(),
                ref_plan.gather.src_slots[:ref_plan.gather.count].tolist()))
        elif kind == "release":
            state = pc.release_prefill_layer(state, layer)
            ref.release_prefill_layer(layer)
        else:
            state = pc.begin_prefill(state)
            ref.begin_prefill()
        np.testing.assert_array_equal(np.asarray(state.id_of_slot), ref.id_of_slot)
        np.testing.assert_array_equal(np.asarray(state.slot_for_id), ref.slot_for_id)
