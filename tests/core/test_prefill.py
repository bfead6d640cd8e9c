"""The prefill double buffers on every adapter of conftest.py (docs/semantics.md §5.11): slots
inside the buffers are misses, residents above them are gathered device-side, misses ship as
contiguous expert runs, the buffers rotate by layer parity and are released, the chunk snapshot
agrees with the live map, and an expert evicted after ``begin_prefill`` is copied from the
host."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.harness import ADAPTER, BIG_BANK, assert_same, entries, steps, valid
from pallas_cache.testing import lockstep
from pallas_cache.testing.operations import BeginPrefill, Ensure, PrefetchPrefill, ReleasePrefill


SMALL_BANK = 4 * 1024


# ---- prefill double buffers (docs/semantics.md §5.11) -----------------------------------------


def one_layer_per_quarter(adapter):
    """Layer l owns slots [4l, 4l + 4); the buffers borrow [0, 8) = layers 0 and 1."""
    c = adapter.cache(4, 4, 16)
    for layer in range(4):
        c.ensure(layer, [0, 1, 2, 3])
    assert c.state.residency.slot_for_id.tolist() == [[4 * l + e for e in range(4)] for l in range(4)]
    return c


def test_a_slot_inside_the_prefill_buffers_is_a_miss_however_resident_it_looks(adapter):
    """FAILS if hits are classified as "has a slot": layer 1 lives in slots 4..8, exactly the
    buffer it is staged into, and a gather from there would race the staging copy."""
    c = one_layer_per_quarter(adapter)
    c.begin_prefill()
    plan = c.prefetch_prefill_layer(1, (BIG_BANK,))
    assert plan.buffer_id == 1 and plan.gather.count == 0
    assert valid(plan.runs, "starts") == [0] and valid(plan.runs, "lens") == [4]
    assert (c.state.prefill.hit_rows, c.state.prefill.rows) == (0, 4)


def test_a_resident_expert_above_the_buffer_slots_is_gathered_device_side(adapter):
    c = one_layer_per_quarter(adapter)
    c.begin_prefill()
    plan = c.prefetch_prefill_layer(2, (BIG_BANK,))
    assert plan.buffer_id == 0
    assert valid(plan.gather, "dst_slots") == [0, 1, 2, 3]
    assert valid(plan.gather, "src_slots") == [8, 9, 10, 11]
    assert plan.runs.count == 0 and plan.transfers.count == 0, "a big bank with no misses ships nothing"
    assert (c.state.prefill.hit_rows, c.state.prefill.rows) == (4, 4)


def test_invalidating_a_prefill_buffer_makes_its_slots_the_first_victims(adapter):
    """FAILS if invalidation leaves usage alone: the buffer slots are the newest in the pool, so
    the next decode miss would evict a live resident while four empty slots sit unused."""
    c = one_layer_per_quarter(adapter)
    c.ensure(0, [0, 1, 2, 3])
    c.ensure(1, [0, 1, 2, 3])
    c.begin_prefill()
    c.prefetch_prefill_layer(0, (BIG_BANK,))
    assert (c.state.residency.slot_for_id[0] == -1).all(), "the buffer's occupants lost their residency"
    assert (c.state.residency.usage[:4] == 0).all()
    plan = c.ensure(0, [0])
    assert valid(plan.copy, "dst_slots") == [0]
    assert c.state.residency.slot_for_id[2, 0] == 8, "no live resident was evicted while free slots existed"


def test_prefill_misses_ship_as_contiguous_expert_runs(adapter):
    """FAILS if each missing expert ships as its own entry (five entries instead of two)."""
    c = adapter.cache(4, 8, 32)
    for layer, routes in ((0, range(8)), (2, range(8)), (1, (3, 4, 7))):
        c.ensure(layer, list(routes))  # layer 1's experts land in slots 16, 17, 18
    c.begin_prefill()
    plan = c.prefetch_prefill_layer(1, (BIG_BANK,))
    assert plan.buffer_id == 1
    assert valid(plan.gather, "dst_slots") == [11, 12, 15]
    assert valid(plan.gather, "src_slots") == [16, 17, 18]
    assert valid(plan.runs, "starts") == [0, 5]
    assert valid(plan.runs, "lens") == [3, 2]
    assert entries(plan, (BIG_BANK,)) == [
        (0, 8, 0, 3, 3 * BIG_BANK, False),
        (0, 13, 5, 2, 2 * BIG_BANK, False),
    ]


def test_a_small_bank_ships_its_whole_layer_even_with_no_misses(adapter):
    """FAILS if entries are only emitted for misses: the gather skips small banks, so their rows
    would never arrive."""
    c = adapter.cache(4, 8, 32)
    for layer in (0, 2, 1):
        c.ensure(layer, list(range(8)))
    c.begin_prefill()
    plan = c.prefetch_prefill_layer(1, (BIG_BANK, SMALL_BANK))
    assert plan.gather.count == 8 and plan.runs.count == 0
    assert plan.gather.banks.tolist() == [0, -1], "the small bank is not gathered"
    assert entries(plan, (BIG_BANK, SMALL_BANK)) == [(1, 8, 0, 8, 8 * SMALL_BANK, True)]


@pytest.mark.traced
def test_the_two_prefill_buffers_rotate_by_layer_parity(adapter):
    c = adapter.cache(4, 4, 16)
    c.begin_prefill()
    assert c.state.prefill.layer.tolist() == [-1, -1]
    assert c.prefetch_prefill_layer(0, (BIG_BANK,)).buffer_id == 0
    assert c.prefetch_prefill_layer(1, (BIG_BANK,)).buffer_id == 1
    assert c.state.prefill.layer.tolist() == [0, 1]
    again = c.prefetch_prefill_layer(1, (BIG_BANK,))
    assert again.already_loaded and again.transfers.count == 0 and again.error == 0
    assert c.state.prefill.rows == 8, "the no-op staged no rows"
    c.release_prefill_layer(0)
    plan = c.prefetch_prefill_layer(2, (BIG_BANK,))
    assert plan.buffer_id == 0 and plan.error == 0
    assert c.state.prefill.layer.tolist() == [2, 1]


@pytest.mark.traced
def test_releasing_a_layer_that_is_not_staged_is_ignored(adapter):
    c = adapter.cache(4, 4, 16)
    c.begin_prefill()
    c.prefetch_prefill_layer(0, (BIG_BANK,))
    before = c.state
    for layer in (2, -1, -2, 9):
        c.release_prefill_layer(layer)
        assert_same(c.state, before)
    assert c.prefetch_prefill_layer(2, (BIG_BANK,)).error == adapter.errors.ERR_PREFILL_BUSY


def test_the_chunk_snapshot_and_the_live_map_agree_on_every_row(adapter):
    c = adapter.cache(4, 4, 16)
    for layer in range(4):
        c.ensure(layer, [0, 1, 2, 3])
    c.begin_prefill()
    for layer in (2, 3, 2):
        live = [int(s) for s in c.state.residency.slot_for_id[layer] if s >= 8]
        plan = c.prefetch_prefill_layer(layer, (BIG_BANK,))
        c.release_prefill_layer(layer)
        if not plan.already_loaded:
            assert valid(plan.gather, "src_slots") == live


def test_a_pool_that_cannot_lend_the_buffers_their_slots_says_so(adapter):
    small = adapter.cache(2, 8, 12)
    assert not small.prefill_overlap_fits()
    assert adapter.cache(2, 8, 16).prefill_overlap_fits()
    with pytest.raises(adapter.errors.PrefillDoesNotFit, match="12"):
        small.begin_prefill()
    with pytest.raises(adapter.errors.PrefillDoesNotFit):
        small.prefetch_prefill_layer(0, (BIG_BANK,))


def test_nothing_staged_is_registered_as_resident(adapter):
    c = adapter.cache(2, 4, 8)
    c.begin_prefill()
    c.prefetch_prefill_layer(0, (BIG_BANK,))
    assert (c.state.residency.slot_for_id == -1).all() and (c.state.residency.id_of_slot == -1).all()


def test_reset_stats_zeroes_the_prefill_row_counters(adapter):
    c = one_layer_per_quarter(adapter)
    c.begin_prefill()
    c.prefetch_prefill_layer(2, (BIG_BANK,))
    c.reset_stats()
    assert (c.state.prefill.hit_rows, c.state.prefill.rows) == (0, 0)


STALE_BANKS = (1 << 20,)  # one large bank: hits are gathered, misses travel as runs


def warm_three_layers(adapter, L, E, S):
    """Layers 0..2 resident; layer 2's experts sit at or above 2E (snapshot hits)."""
    cache = adapter.cache(L, E, S)
    for layer in range(3):
        cache.ensure(layer, np.arange(E))
    return cache


def gathers(plan):
    return list(zip(valid(plan.gather, "dst_slots"),
                    valid(plan.gather, "src_slots")))


def test_an_expert_evicted_after_begin_prefill_is_copied_from_the_host(adapter):
    """FAILS if the prefetch trusts the snapshot: it gathered from slots that now hold another
    layer's experts, with error == 0."""
    L, E, S = 4, 2, 6
    cache = warm_three_layers(adapter, L, E, S)
    cache.begin_prefill()
    assert cache.state.prefill.snapshot[2].tolist() == [4, 5]  # both are snapshot hits
    for layer in (0, 1, 3):  # refresh layers 0 and 1, then layer 3's misses evict slots 4, 5
        cache.ensure(layer, np.arange(E))
    assert cache.state.residency.slot_for_id[2].tolist() == [-1, -1]
    before = int(cache.state.prefill.hit_rows)
    plan = cache.prefetch_prefill_layer(2, STALE_BANKS)
    assert plan.error == 0 and plan.gather.count == 0
    assert (plan.runs.count, plan.runs.starts[0], plan.runs.lens[0]) == (1, 0, 2)
    assert int(cache.state.prefill.hit_rows) == before


def test_a_snapshot_hit_still_in_place_is_gathered(adapter):
    """FAILS if re-validation is too strict and drops hits that are still resident."""
    cache = warm_three_layers(adapter, 4, 2, 6)
    cache.begin_prefill()
    cache.ensure(2, np.arange(2))  # a hit refresh moves nothing
    assert gathers(cache.prefetch_prefill_layer(2, STALE_BANKS)) == [(0, 4), (1, 5)]


@given(st.lists(st.tuples(st.sampled_from(["ensure", "prefetch_prefill_layer",
                                           "release_prefill_layer", "begin_prefill"]),
                          st.integers(0, 3), st.lists(st.integers(-1, 3), min_size=1,
                                                      max_size=3)),
                min_size=1, max_size=25))
def test_interleaved_decode_and_prefill_gather_only_resident_rows(calls):
    """FAILS if any interleaving of decode ensures and prefill stages gathers from a slot that
    does not hold the expert, or if the JAX functions and the reference disagree on a plan or
    a state field."""
    L, E, S = 4, 4, 10
    records = {"ensure": lambda layer, ids: Ensure(layer, np.asarray(ids, np.int32)),
               "prefetch_prefill_layer": lambda layer, _: PrefetchPrefill(layer, STALE_BANKS),
               "release_prefill_layer": lambda layer, _: ReleasePrefill(layer),
               "begin_prefill": lambda *_: BeginPrefill()}
    ops = [BeginPrefill()] + [records[kind](layer, ids) for kind, layer, ids in calls]
    ref, cache = ADAPTER["reference"].cache(L, E, S), ADAPTER["jax-eager"].cache(L, E, S)
    resident = [ref.state.residency.id_of_slot]

    def compare(context, op, expected, got):
        (theirs, truth), (mine, jax_cache) = expected, got
        if isinstance(op, PrefetchPrefill):
            for dst, src in gathers(theirs):
                assert resident[0][src] == op.layer * E + dst % E, \
                    f"{context}: a gather reads slot {src}, which holds {resident[0][src]}"
        if mine is None:
            assert theirs is None, context
        else:
            assert_same(mine, theirs, context)
        assert_same(jax_cache.state, truth.state, context)
        resident[0] = truth.state.residency.id_of_slot

    lockstep.run(ops, steps(ref, ops), {"jax-eager": steps(cache, ops)}, compare)

