"""describe / diff (pallas_cache.host.views) on real states produced by the cache operations.

The hand-worked sequence (L=2, E=4, S=5, every call a plain ``ensure``):

=====  ===================  ===========================================================
step   call                 effect
=====  ===================  ===========================================================
1      layer 0, [0, 1]      misses 0, 1 -> slots 0, 1
2      layer 1, [2, 3, 0]   misses 0, 2, 3 (ascending) -> slots 2, 3, 4
3      layer 0, [1, 3]      hit (0,1) refreshes slot 1; miss 3 takes the LRU slot 0,
                            evicting (0,0)
-      forget_slot(2)       slot 2 loses (1,0) and becomes "forgotten"
4      layer 1, [0]         (1,0) misses and takes the forgotten slot 2 first
=====  ===================  ===========================================================
"""

import html
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_cache as pc
from pallas_cache.host.views import SlotEntry, SlotRow, describe, diff

INT32_MIN = int(np.iinfo(np.int32).min)


def _ids(*experts):
    """Routes padded to one length with -1 (ignored), so a single jit compile serves them all."""
    return jnp.array(list(experts) + [-1] * (3 - len(experts)), jnp.int32)


ensure = jax.jit(pc.ensure)


@pytest.fixture(scope="module")
def states():
    s0 = pc.init(2, 4, 5)
    s1, _ = ensure(s0, 0, _ids(0, 1))
    s2, _ = ensure(s1, 1, _ids(2, 3, 0))
    s3, _ = ensure(s2, 0, _ids(1, 3))
    s_forgot, forget_plan = jax.jit(pc.forget_slot)(s3, 2)
    assert int(forget_plan.old) == 1 * 4 + 0
    s4, _ = ensure(s_forgot, 1, _ids(0))
    return {"s0": s0, "s1": s1, "s2": s2, "s3": s3, "forgot": s_forgot, "s4": s4}


# --- diff ----------------------------------------------------------------------------------------

def test_diff_of_a_hand_worked_step(states):
    change = diff(states["s2"], states["s3"])
    assert change.installed == [(0, 0, 3)]
    assert change.evicted == [(0, 0, 0)]
    assert change.refreshed == [(1, 0, 1)]
    assert (change.step_before, change.step_after) == (2, 3)
    assert change.usage_before == {0: 1, 1: 1}
    assert change.usage_after == {0: 3, 1: 3}
    assert isinstance(change.installed[0], SlotEntry) and change.installed[0].expert == 3


def test_diff_of_a_cold_fill_installs_without_evicting(states):
    change = diff(states["s1"], states["s2"])
    assert change.installed == [(2, 1, 0), (3, 1, 2), (4, 1, 3)]
    assert change.evicted == [] and change.refreshed == []


def test_diff_of_forget_and_of_the_refill(states):
    forgot = diff(states["s3"], states["forgot"])
    assert forgot.evicted == [(2, 1, 0)]
    assert forgot.installed == [] and forgot.refreshed == []
    assert forgot.usage_after == {2: INT32_MIN}
    refill = diff(states["forgot"], states["s4"])
    assert refill.installed == [(2, 1, 0)]  # the forgotten slot is the first victim
    assert refill.evicted == [] and refill.refreshed == []


def test_diff_of_identical_states_is_empty(states):
    change = diff(states["s3"], states["s3"])
    assert change.unchanged
    assert str(change) == "step 3 -> 3: 0 installed, 0 evicted, 0 refreshed"
    assert not diff(states["s2"], states["s3"]).unchanged


def test_diff_materialize_reports_displaced_and_moved_experts(states):
    # s3: slots 0..4 hold (0,3) (0,1) (1,0) (1,2) (1,3). Materializing layer 1 puts expert e in
    # slot e for e < 4: every slot changes hands, and slot 4 -- layer 1's old copy of
    # expert 3 -- is emptied. A moved expert shows as evicted at its old slot, installed at its new.
    after, _ = jax.jit(pc.materialize_layer)(states["s3"], 1)
    change = diff(states["s3"], after)
    assert change.installed == [(0, 1, 0), (1, 1, 1), (2, 1, 2), (3, 1, 3)]
    assert change.evicted == [(0, 0, 3), (1, 0, 1), (2, 1, 0), (3, 1, 2), (4, 1, 3)]
    assert change.refreshed == []


def test_diff_agrees_with_the_plans_over_a_random_sequence():
    """For every hybrid step: installed = the copy plan, evicted = the victims' old occupants,
    refreshed = the slots of the hits."""
    num_layers, num_experts, cache_size = 3, 4, 6
    rng = np.random.default_rng(0)
    step = jax.jit(pc.ensure_hybrid)
    policies = [pc.FetchPolicy.full(), pc.FetchPolicy.fraction(0.4), pc.FetchPolicy.fixed_cap(1)]
    state = pc.init(num_layers, num_experts, cache_size)
    totals = {"installed": 0, "evicted": 0, "refreshed": 0}
    for i in range(40):
        layer = int(rng.integers(num_layers))
        routes = rng.integers(-1, num_experts, size=3).astype(np.int32)
        before_slot_for_id = np.asarray(state.residency.slot_for_id)
        before_id_of_slot = np.asarray(state.residency.id_of_slot)
        after, plan = step(state, layer, jnp.asarray(routes), policies[i % 3])
        change = diff(state, after)

        count = int(plan.copy.count)
        dst = np.asarray(plan.copy.dst_slots)[:count]
        src = np.asarray(plan.copy.src_rows)[:count]
        assert sorted(change.installed) == sorted((int(d), layer, int(e)) for d, e in zip(dst, src))
        expected_evicted = sorted(
            (int(d), *divmod(int(before_id_of_slot[d]), num_experts))
            for d in dst if before_id_of_slot[d] >= 0)
        assert sorted(change.evicted) == expected_evicted
        hits = {int(e) for e in routes if e >= 0 and before_slot_for_id[layer, e] >= 0}
        assert sorted(change.refreshed) == sorted(
            (int(before_slot_for_id[layer, e]), layer, e) for e in hits)
        for key in totals:
            totals[key] += len(getattr(change, key))
        state = after
    assert all(total > 0 for total in totals.values()), totals  # every kind of change occurred


def test_diff_rejects_different_geometries():
    with pytest.raises(ValueError, match="geometry"):
        diff(pc.init(2, 4, 5), pc.init(2, 4, 6))


# --- describe ------------------------------------------------------------------------------------

def _table_lines(view):
    """The text table as token lists, header line and column line removed."""
    lines = str(view).splitlines()
    assert lines[1].split() == ["slot", "layer", "expert", "usage", "age"]
    return [line.split() for line in lines[2:]]


def test_describe_rows_of_a_full_cache(states):
    view = describe(states["s3"])
    assert view.rows == [
        SlotRow(0, 0, 3, 3, 0, "resident"),
        SlotRow(1, 0, 1, 3, 0, "resident"),
        SlotRow(2, 1, 0, 2, 1, "resident"),
        SlotRow(3, 1, 2, 2, 1, "resident"),
        SlotRow(4, 1, 3, 2, 1, "resident"),
    ]
    assert view.residents == [(0, 0, 3), (1, 0, 1), (2, 1, 0), (3, 1, 2), (4, 1, 3)]
    assert view.resident_count == 5 and view.resident_per_layer() == [2, 3]
    assert (view.num_layers, view.num_experts, view.cache_size, view.step) == (2, 4, 5, 3)


def test_describe_text_shows_header_and_every_resident(states):
    view = describe(states["s3"])
    header = str(view).splitlines()[0]
    assert "L=2 E=4 S=5" in header and "step=3" in header and "resident=5/5" in header
    lines = _table_lines(view)
    assert len(lines) == 5
    for row in view.rows:
        assert [str(row.slot), str(row.layer), str(row.expert), str(row.usage), str(row.age)] in lines
    assert repr(view) == str(view)


def test_describe_shows_empty_and_forgotten_slots(states):
    cold = describe(states["s1"])
    assert [row.status for row in cold.rows] == ["resident", "resident", "empty", "empty", "empty"]
    assert _table_lines(cold)[2] == ["2", "-", "-", "0", "empty"]
    assert "resident=2/5" in str(cold).splitlines()[0]

    forgot = describe(states["forgot"])
    assert forgot.rows[2] == SlotRow(2, None, None, INT32_MIN, None, "forgotten")
    assert _table_lines(forgot)[2] == ["2", "-", "-", "INT32_MIN", "forgotten"]
    assert forgot.resident_count == 4 and (2, 1, 0) not in forgot.residents


def test_describe_ages_grow_with_the_clock(states):
    view = describe(states["s4"])  # step 4: slot 2 refilled now, slots 3 and 4 touched at step 2
    ages = {row.slot: row.age for row in view.rows}
    assert ages == {0: 1, 1: 1, 2: 0, 3: 2, 4: 2}


def test_html_reprs_are_tables(states):
    view_html = describe(states["s3"])._repr_html_()
    assert view_html.count("<table>") == 1
    assert view_html.count("<tr>") == 1 + 5  # header + one row per slot
    assert re.search(r"<tr><td>0</td><td>0</td><td>3</td><td>3</td><td>0</td></tr>", view_html)
    assert html.escape("step=3") in view_html

    diff_html = diff(states["s2"], states["s3"])._repr_html_()
    assert diff_html.count("<tr>") == 1 + 3
    for change in ("installed", "evicted", "refreshed"):
        assert f"<td>{change}</td>" in diff_html
    text = str(diff(states["s2"], states["s3"]))
    assert text.splitlines()[0] == "step 2 -> 3: 1 installed, 1 evicted, 1 refreshed"
    assert text.splitlines()[2].split() == ["installed", "0", "0", "3", "1", "3"]


def test_describe_reads_a_batch_per_cache_and_diff_rejects_one():
    """FAILS if describe of a stacked state is not the list of each cache's view (e.g. every
    entry read from cache 0), or diff silently compares batches."""
    one, two = pc.init(1, 2, 2), pc.ensure(pc.init(1, 2, 2), 0, [1])[0]
    batch = jax.tree.map(lambda *leaves: jnp.stack(leaves), one, two)
    assert [str(v) for v in describe(batch)] == [str(describe(one)), str(describe(two))]
    with pytest.raises(ValueError, match="batch"):
        diff(batch, batch)
