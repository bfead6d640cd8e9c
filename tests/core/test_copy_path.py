"""The copy path reads exactly the counted rows (docs/semantics.md §5.13, docs/design.md "The copy
path"): ``apply_copy_plan`` slices from the host bank the rows of its counted entries and no
other, under ``jit``, ``scan`` with a traced layer, ``vmap`` (a batch reads the sum of its
members' counts) and ``shard_map`` (each device its own count). The rows are counted by
running the traced program step by step (tests/core/bank_reads.py): what runs, not what the code
says, so a loop over the plan's width is caught reading its padding even where a scatter drops
it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import pallas_cache as pc
from pallas_cache.moe import apply_copy_plan, put_host_bank
from pallas_cache.reference import moe as reference_moe
from tests.core.bank_reads import rows_read

S, E, L, ROW = 6, 5, 3, 4


# --- fixtures ------------------------------------------------------------------------------------

def _bank(layers=None):
    shape = (E, ROW) if layers is None else (layers, E, ROW)
    return jnp.arange(math.prod(shape), dtype=jnp.float32).reshape(shape) + 100.0


def _pool():
    return jnp.full((S, ROW), -7.0, jnp.float32)


def _copy(dst, src, count):
    return pc.CopyPlan(dst_slots=jnp.asarray(dst, jnp.int32), src_rows=jnp.asarray(src, jnp.int32),
                       count=jnp.asarray(count, jnp.int32))


def _placements(bank):
    """The bank in host memory (``put_host_bank``) and in device memory."""
    return {"host": put_host_bank(bank), "device": put_host_bank(bank, prefer_host=False)}


_APPLY = jax.jit(apply_copy_plan)


# --- one plan ------------------------------------------------------------------------------------

@pytest.mark.parametrize("placement", ["host", "device"])
@pytest.mark.parametrize("count", [0, 1, 2, 4])
def test_a_plan_reads_exactly_its_counted_rows(placement, count):
    """FAILS on a copy loop over the plan's width: with ``count = 0`` it still read all four
    entries (padding copies row 0 and the scatter drops it), and a gather reads them too."""
    bank = _placements(_bank())[placement]
    plan = _copy([3, 0, 5, 1], [2, 4, 0, 1], count)
    assert rows_read(_APPLY, _pool(), bank, plan, bank=1, row_size=ROW) == count
    want = reference_moe.apply_copy_plan(np.asarray(_pool()), np.asarray(_bank()), plan)
    np.testing.assert_array_equal(_APPLY(_pool(), bank, plan), want)


def test_every_bank_leaf_reads_the_counted_rows_and_padding_inside_count_reads_none():
    """A pytree bank (weights and their scales) moves each counted row of every leaf; a ``-1``
    inside ``count`` and an entry out of range are read by no leaf."""
    bank = put_host_bank({"w": _bank(L), "scale": jnp.arange(L * E, dtype=jnp.int32).reshape(L, E)})
    pool = {"w": _pool(), "scale": jnp.zeros((S,), jnp.int32)}
    plan = _copy([2, -1, 4, 1, 9], [1, 3, -1, 0, 2], 5)  # two valid: (2, 1) and (1, 0)
    step = jax.jit(lambda pool, bank, plan, layer: apply_copy_plan(pool, bank, plan, layer=layer))
    # each valid entry reads ROW + 1 elements (a "w" row and a "scale" row)
    assert rows_read(step, pool, bank, plan, 1, bank=1, row_size=ROW + 1) == 2
    assert rows_read(step, pool, bank, plan, L + 2, bank=1, row_size=ROW + 1) == 0  # bad layer


def test_scan_with_a_traced_layer_reads_each_layers_count():
    """A decode loop's scan over layers reads the sum of the layers' counts."""
    bank = put_host_bank(_bank(L))
    counts = [2, 0, 1]
    plans = _copy([[0, 1, 2]] * L, [[4, 3, 2]] * L, counts)

    def decode(pool, bank, plans):
        def layer_step(pool, xs):
            layer, plan = xs
            return apply_copy_plan(pool, bank, plan, layer=layer), None
        return lax.scan(layer_step, pool, (jnp.arange(L, dtype=jnp.int32), plans))[0]

    assert rows_read(jax.jit(decode), _pool(), bank, plans, bank=1, row_size=ROW) == sum(counts)


# --- vmap ----------------------------------------------------------------------------------------

_COUNTS = [1, 0, 3, 1]
_BATCH = _copy([[3, 0, 5, 1]] * 4, [[2, 4, 0, 1], [0, 1, 2, 3], [4, 3, 2, 1], [1, 1, 1, 1]],
               _COUNTS)


def _reference_batch(pools, banks, plans, layers=None):
    """The reference's pool for every member; ``pools``/``banks`` of one more axis than a
    member's are batched."""
    out = []
    for i in range(len(_COUNTS)):
        plan = jax.tree.map(lambda a: a[i], plans)
        pool = np.asarray(pools if pools.ndim == 2 else pools[i])
        bank = np.asarray(banks if banks.ndim == (2 if layers is None else 3) else banks[i])
        if layers is not None:
            bank = bank[int(layers[i])]
        out.append(reference_moe.apply_copy_plan(pool, bank, plan))
    return np.stack(out)


@pytest.mark.parametrize("batched", ["plans", "pools and plans", "banks and plans",
                                     "plans and layers"])
def test_a_vmapped_batch_reads_the_sum_of_its_counts(batched):
    """FAILS when the batch reads every entry of every member (batch x width = 16 rows): vmap
    of a loop over the width, or JAX's batching of a traced-count loop, which runs the longest
    member's trips for every member. Each member must also get its own rows."""
    pools = jnp.stack([_pool() - i for i in range(4)])
    banks = jnp.stack([_bank() * (i + 1) for i in range(4)])
    layers = jnp.asarray([2, 0, 1, 2], jnp.int32)
    layered = _bank(L)
    cases = {
        "plans": (lambda b, c: apply_copy_plan(_pool(), b, c), (None, 0), _bank(),
                  (_BATCH,), lambda: _reference_batch(_pool(), _bank(), _BATCH)),
        "pools and plans": (lambda b, p, c: apply_copy_plan(p, b, c), (None, 0, 0), _bank(),
                            (pools, _BATCH), lambda: _reference_batch(pools, _bank(), _BATCH)),
        "banks and plans": (lambda b, c: apply_copy_plan(_pool(), b, c), (0, 0), banks,
                            (_BATCH,), lambda: _reference_batch(_pool(), banks, _BATCH)),
        "plans and layers": (lambda b, c, l: apply_copy_plan(_pool(), b, c, layer=l),
                             (None, 0, 0), layered, (_BATCH, layers),
                             lambda: _reference_batch(_pool(), layered, _BATCH, layers)),
    }
    fn, in_axes, bank, rest, want = cases[batched]
    for placement, placed in _placements(bank).items():
        step = jax.jit(jax.vmap(fn, in_axes=in_axes))
        assert rows_read(step, placed, *rest, bank=0, row_size=ROW) == sum(_COUNTS), placement
        np.testing.assert_array_equal(step(placed, *rest), want(), err_msg=placement)


def test_a_nested_vmap_reads_the_sum_of_all_counts():
    """Two vmap levels (banks outside, plans inside): 2 banks x the plans' counts."""
    banks = put_host_bank(jnp.stack([_bank(L), _bank(L) * 2.0]))
    inner = jax.vmap(lambda c, b: apply_copy_plan(_pool(), b, c, layer=1), in_axes=(0, None))
    nested = jax.jit(jax.vmap(inner, in_axes=(None, 0)))
    assert rows_read(nested, _BATCH, banks, bank=1, row_size=ROW) == 2 * sum(_COUNTS)
    got = nested(_BATCH, banks)
    for k in range(2):
        np.testing.assert_array_equal(
            got[k], _reference_batch(_pool(), np.asarray(banks[k])[1], _BATCH))


# --- shard_map -----------------------------------------------------------------------------------

def test_each_device_of_a_shard_map_reads_its_own_count():
    """The per-device program of a ``shard_map`` (``check_vma`` on; the layer traced and varying
    over the axis) reads its own plan's count, and copies what the reference copies.
    tests/core/mesh_checks.py counts it on four devices with four different counts."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))

    def body(pool, bank, plan):
        layer = lax.axis_index("d") + 1
        return apply_copy_plan(pool[0], bank, jax.tree.map(lambda a: a[0], plan),
                               layer=layer)[None]

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P(), P("d")),
                                 out_specs=P("d")))
    bank = put_host_bank(_bank(L))
    for count in (0, 1, 3):
        plan = jax.tree.map(lambda a: a[None], _copy([3, 0, 5, 1], [2, 4, 0, 1], count))
        assert rows_read(step, _pool()[None], bank, plan, bank=1, row_size=ROW) == count
        want = reference_moe.apply_copy_plan(np.asarray(_pool()), np.asarray(_bank(L)),
                                             jax.tree.map(lambda a: a[0], plan), layer=1)
        np.testing.assert_array_equal(step(_pool()[None], bank, plan)[0], want)


# --- every plan ----------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, S), st.integers(-1, E)), min_size=1, max_size=6),
       st.integers(-1, 7))
def test_random_plans_read_their_valid_entries_and_match_the_reference(entries, count):
    """Any plan, traced (so out-of-range entries are masked, not raised): the rows read are the
    counted entries with a slot in ``[0, S)`` and a row in ``[0, E)``, and the pool is the
    reference's, bit for bit."""
    dst, src = (list(x) for x in zip(*entries))
    plan = _copy(dst, src, count)
    valid = sum(1 for i, (d, s) in enumerate(entries) if i < count and 0 <= d < S and 0 <= s < E)
    bank = put_host_bank(_bank())
    assert rows_read(_APPLY, _pool(), bank, plan, bank=1, row_size=ROW) == valid
    want = reference_moe.apply_copy_plan(np.asarray(_pool()), np.asarray(_bank()), plan,
                                         traced=True)
    np.testing.assert_array_equal(_APPLY(_pool(), bank, plan), want)
