"""Bad input to the library: no NaN from an expert a token never chose, nothing read for a traced
layer outside the bank, no silent wrap of a policy cap or a recorded id, and every static misuse
refused at trace time naming the value and its range."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.harness import cpu_partial_oracle
import pallas_cache as pc
from pallas_cache.moe import apply_copy_plan, put_host_bank
from pallas_cache.testing import moe_dense

H = 2


def _scale_fn(weights, x):
    """An expert that scales the token by its weights row: ``[H] * [H]``."""
    return x * weights


def _hybrid(x, ids, gates, bank, policy, placement):
    """``moe_hybrid`` of one fresh layer-call: (output, plan)."""
    num_experts = bank.shape[0]
    state, plan = pc.ensure_hybrid(pc.init(1, num_experts, num_experts), 0, ids, policy)
    pool = jnp.zeros_like(bank)
    placed = put_host_bank(bank, prefer_host=placement == "host")
    pool = apply_copy_plan(pool, placed, plan)
    return pc.moe_hybrid(x, ids, gates, plan, pool, placed, _scale_fn), plan


# ---- case 1: inf * 0 and nan * 0 from experts a token never chose -------------------------------

@pytest.mark.parametrize("placement", ["host", "device"])
@pytest.mark.parametrize("path", ["cpu", "device"])
def test_an_expert_a_token_did_not_choose_never_turns_it_into_nan(path, placement):
    """FAILS if the hybrid partials multiply an expert's output by a zero gate for the tokens
    that did not choose it instead of masking them out (``inf * 0 = nan``): in float16, expert
    0's output overflows on token 0, which routes only expert 1; token 2 is padding only with
    NaN activations. ``moe_dense`` gives [300, 300], [60000, 60000] and [0, 0]; the hybrid
    output must equal it, with every route on the CPU (fixed cap 0) or on the device (full)."""
    bank = jnp.asarray([[60000, 60000], [150, 150]], jnp.float16)
    x = jnp.asarray([[2, 2], [1, 1], [jnp.nan, jnp.nan]], jnp.float16)
    ids = jnp.asarray([[1, -1], [0, -1], [-1, -1]], jnp.int32)
    gates = jnp.asarray([[1, 0], [1, 0], [0, 0]], jnp.float16)
    policy = pc.FetchPolicy.fixed_cap(0) if path == "cpu" else pc.FetchPolicy.full()
    out, plan = jax.jit(_hybrid, static_argnums=(5,))(x, ids, gates, bank, policy, placement)
    assert bool(np.any(plan.cpu)) == (path == "cpu")
    want = moe_dense(x, ids, gates, bank, _scale_fn)
    assert np.all(np.isfinite(np.asarray(want, np.float32)))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(want, np.float32), [[300, 300], [60000, 60000],
                                                                 [0, 0]])


# ---- case 2: a traced layer outside the bank ---------------------------------------------------

@pytest.mark.parametrize("placement", ["host", "device"])
def test_a_traced_layer_outside_the_bank_reads_no_row(placement):
    """FAILS if ``cpu_partial`` (or its reference) slices a traced layer outside ``[0, L)``
    instead of reading nothing: a slice clamps layer 6 onto layer 3 and wraps -3 onto layer 1.
    The CPU partial must be zeros there, as ``apply_copy_plan`` copies nothing for that layer,
    and the layers inside the bank must still give their own rows."""
    num_layers, num_experts = 4, 3
    bank = (jnp.arange(1, num_layers + 1, dtype=jnp.float32)[:, None, None]
            * jnp.ones((num_layers, num_experts, H)))
    placed = put_host_bank(bank, prefer_host=placement == "host")
    ids = jnp.asarray([[0, 2]], jnp.int32)
    gates = jnp.ones((1, 2), jnp.float32)
    x = jnp.ones((1, H), jnp.float32)
    _, plan = pc.ensure_hybrid(pc.init(num_layers, num_experts, num_experts), 0, ids,
                               pc.FetchPolicy.fixed_cap(0))
    assert bool(np.all(plan.cpu))

    @jax.jit
    def partials(layer):
        pool = jnp.full((num_experts, H), 7.0)
        copied = apply_copy_plan(pool, placed, plan, layer=layer)
        return (pc.cpu_partial(x, ids, gates, plan, placed, _scale_fn, layer=layer),
                cpu_partial_oracle(x, ids, gates, plan, placed, _scale_fn, layer=layer),
                copied)

    for layer in (6, 4, -1, -3):
        cpu, reference, copied = partials(jnp.int32(layer))
        np.testing.assert_array_equal(cpu, np.zeros((1, H)), err_msg=f"layer {layer}")
        np.testing.assert_array_equal(reference, np.zeros((1, H)), err_msg=f"layer {layer}")
        np.testing.assert_array_equal(copied, np.full((num_experts, H), 7.0))
    for layer in range(num_layers):
        cpu, reference, _ = partials(jnp.int32(layer))
        np.testing.assert_array_equal(cpu, np.full((1, H), 2.0 * (layer + 1)))
        np.testing.assert_array_equal(reference, cpu)


# ---- case 3: policy caps that would wrap in int32 ----------------------------------------------

def _fetched(policy, misses=3):
    """How many of ``misses`` distinct misses a fresh cache's hybrid step fetches."""
    ids = jnp.arange(misses, dtype=jnp.int32)[None]
    _, plan = jax.jit(pc.ensure_hybrid)(pc.init(1, misses, misses), jnp.int32(0), ids, policy)
    return int(plan.fetched)


@pytest.mark.parametrize("fraction16, cap", [
    (np.int32(0), np.int64(2**32)), (np.int32(0), np.uint32(2**31)), (0, 2**32), (0, -5),
    (-5, 0), (np.int64(2**32 + 1), 0), (70000, 0)])
def test_a_concrete_policy_field_outside_its_range_is_refused_in_any_integer_form(fraction16,
                                                                                   cap):
    """FAILS if a cap or fraction is range-checked only as a NumPy/JAX array (a Python int
    -5 passes) or only after an int32 cast (a cap of 2**32 wraps to 0 and fetches no miss):
    every concrete form is refused naming the field, its range and the value."""
    name, value = ("cap", cap) if fraction16 in (0,) else ("fraction16", fraction16)
    high = 2**31 - 1 if name == "cap" else 65536
    with pytest.raises(ValueError, match=rf"FetchPolicy\.{name} must be in \[0, {high}\], got "
                                         rf"{int(value)}\b"):
        pc.FetchPolicy(fraction16, cap)


def test_a_traced_wide_cap_saturates_instead_of_wrapping():
    """FAILS if ``split`` casts a traced cap to int32 before clamping it: a uint32 cap of
    2**31 (or 0xFFFFFFFF) becomes negative and fetches 0 of 3 misses; it must fetch all 3, as
    ``fixed_cap`` does with any large cap. A negative narrow cap fetches none."""
    ids = jnp.arange(3, dtype=jnp.int32)[None]

    @jax.jit
    def fetched(cap):  # traced: the constructor cannot check it
        return pc.ensure_hybrid(pc.init(1, 3, 3), 0, ids,
                                pc.FetchPolicy(jnp.int32(0), cap))[1].fetched

    for cap in (jnp.uint32(2**31), jnp.uint32(2**32 - 1), jnp.uint16(65535)):
        assert int(fetched(cap)) == 3, cap
    assert int(fetched(jnp.int8(-3))) == 0
    assert _fetched(pc.FetchPolicy.fixed_cap(2**40)) == 3
    assert _fetched(pc.FetchPolicy(0, 2)) == 2  # a Python int in range still works


X64_CAPS = r"""
import jax, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
import pallas_cache as pc
ids = jnp.arange(3, dtype=jnp.int32)[None]
step = jax.jit(lambda cap: pc.ensure_hybrid(pc.init(1, 3, 3), 0, ids,
               pc.FetchPolicy(jnp.int32(0), cap))[1].fetched)
print([int(step(jnp.int64(c))) for c in (2**32, 2**32 + 1, 2**62, 1, -(2**32) + 1)])
"""


def test_with_x64_a_traced_int64_cap_saturates():
    """FAILS if an int64 cap is cast to int32 before clamping (x64 on): caps 2**32 and 2**32+1
    then fetch 0 and 1 of 3 misses; they must fetch all 3 (and -(2**32)+1, which wraps to 1,
    none)."""
    done = subprocess.run([sys.executable, "-c", X64_CAPS], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[3, 3, 3, 1, 0]"


# ---- case 4: recorded and read ids that would wrap ----------------------------------------------

def test_a_wide_token_or_layer_is_dropped_not_wrapped_onto_row_zero():
    """FAILS if ``record_routes`` casts a concrete int64 token 2**32 (or layer 2**32 + 1) to
    int32 before the range check: it wraps to 0 and overwrites token 0's routes with
    ``dropped == 0``; it must write nothing and count one drop. (Under ``jax.jit`` an int64
    argument is converted by jit itself before the function sees it; a traced uint32 is compared
    in its own width.)"""
    from pallas_cache.sizing.recorder import init_recorder, record_routes

    recorder = record_routes(init_recorder(4, 2, 2), 0, 0, np.array([1, 2]))
    cases = [(record_routes, np.int64(2**32), 0), (record_routes, 0, np.int64(2**32 + 1)),
             (record_routes, np.uint64(2**63), 0), (record_routes, jnp.uint32(2**32 - 1), 0),
             (jax.jit(record_routes), jnp.uint32(2**32 - 1), 0),
             (jax.jit(record_routes), 0, jnp.uint32(2**31))]
    for record, token, layer in cases:
            after = record(recorder, token, layer, np.array([3, 3]))
            np.testing.assert_array_equal(after.routes, recorder.routes)
            np.testing.assert_array_equal(after.written, recorder.written)
            assert int(after.dropped) == 1


@pytest.mark.parametrize("jitted", [False, True])
def test_a_recorded_id_outside_int32_is_refused_not_read_as_padding(jitted):
    """FAILS if a uint32 expert id 0xFFFFFFFF (or an int64 2**32 - 1) is cast to int32 as it is
    recorded: it becomes the padding -1 and ``trace_from_routes`` accepts the trace with one
    route fewer; it must be refused naming the call, as the array path refuses it."""
    from pallas_cache.sizing.recorder import init_recorder, record_routes, trace_from_routes
    from pallas_cache.sizing.traces import TraceError

    record = jax.jit(record_routes) if jitted else record_routes
    wide = [np.array([0xFFFFFFFF, 1], np.uint32), jnp.array([0xFFFFFFFF, 1], jnp.uint32)]
    if not jitted:  # jit converts an int64 argument itself, before record_routes sees it
        wide.append(np.array([2**32 - 1, 1], np.int64))
    for routes in wide:
        recorder = record(init_recorder(2, 1, 2), 0, 0, np.array([1, 2]))
        recorder = record(recorder, 1, 0, routes)
        with pytest.raises(TraceError, match=r"token 1, layer 0: an expert id outside"):
            trace_from_routes(recorder, 4)
    with pytest.raises(TraceError, match=r"4294967295 .* outside \[-1, 4\)"):
        trace_from_routes(np.array([[[1, 2]], [[0xFFFFFFFF, 1]]], np.uint32), 4)


@pytest.mark.parametrize("column", ["experts", "layer", "token_idx"])
def test_a_parquet_uint64_id_above_int64_is_refused_naming_its_row(tmp_path, column):
    """FAILS if the Parquet reader casts uint64 columns to int64 unchecked: an expert id
    2**64 - 1 reads as the padding -1 (the trace replays with one route fewer) and a layer
    2**64 - 1 is reported as "layer -1 is negative"; both must be refused naming the row, the
    column and the value."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from pallas_cache.sizing.traces import TraceError, load_trace

    big = 2**64 - 1
    columns = {"layer": [0, 0, 0], "token_idx": [0, 1, 2], "experts": [[1, 2], [1, 2], [1, 2]]}
    if column == "experts":
        columns["experts"][2] = [1, big]
    else:
        columns[column][2] = big
    table = pa.table({"layer": pa.array(columns["layer"], pa.uint64()),
                      "token_idx": pa.array(columns["token_idx"], pa.uint64()),
                      "experts": pa.array(columns["experts"], pa.list_(pa.uint64()))})
    path = tmp_path / "trace.parquet"
    pq.write_table(table, path)
    with pytest.raises(TraceError, match=rf"row 2: column '{column}': {big} is outside"):
        load_trace(path)


# ---- case 7: a host bank under vmap ------------------------------------------------------------

@pytest.mark.parametrize("over", ["layers", "plans", "banks"])
def test_a_host_bank_under_vmap_gives_the_device_banks_result(over):
    """FAILS if ``moe_hybrid``/``cpu_partial`` slice a ``put_host_bank`` bank with a plain
    ``dynamic_slice``: batched by ``vmap`` (over layers, plans or banks) it becomes a gather
    whose index JAX builds in device memory ("memory_space of all inputs passed to
    concatenate must be the same"); docs/semantics.md §5.13 promises the device bank's result."""
    num_layers, num_experts, slots = 2, 4, 4
    bank = jnp.arange(num_layers * num_experts * H, dtype=jnp.float32).reshape(
        num_layers, num_experts, H) / 7
    ids = jnp.asarray([[[0, 1], [2, 3]], [[3, 3], [1, -1]]], jnp.int32)
    x = jnp.asarray([[1.0, 2.0], [3.0, -1.0]])
    gates = jnp.asarray([[0.5, 0.25], [1.0, 2.0]])

    def one(bank, layer, routes):
        _, plan = pc.ensure_hybrid(pc.init(num_layers, num_experts, slots), layer, routes,
                                   pc.FetchPolicy.fixed_cap(1))
        pool = apply_copy_plan(jnp.zeros((slots, H)), bank, plan, layer=layer)
        return (pc.moe_hybrid(x, routes, gates, plan, pool, bank, _scale_fn, layer=layer),
                pc.cpu_partial(x, routes, gates, plan, bank, _scale_fn, layer=layer))

    layers = jnp.arange(2, dtype=jnp.int32)
    axes = {"layers": (None, 0, None), "plans": (None, None, 0), "banks": (0, None, None)}[over]
    want = None
    for placement in ("host", "device"):
        banks = jnp.stack([bank, bank[::-1]]) if over == "banks" else bank
        placed = put_host_bank(banks, prefer_host=placement == "host")
        args = (placed, layers if over == "layers" else jnp.int32(1),
                ids if over == "plans" else ids[0])
        got = jax.jit(jax.vmap(one, in_axes=axes))(*args)
        if placement == "device":
            np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)
        want = got


# ---- case 13: smaller library misuse -----------------------------------------------------------

def test_entry_bytes_past_int64_is_refused_not_wrapped():
    """FAILS if ``PrefillPlan.entry_bytes`` multiplies in int64: 4 rows of 2**62 bytes wrap to
    0 bytes; the entry must be refused naming the product (and an in-range size still works)."""
    from pallas_cache.prefill import begin_prefill, prefetch_prefill_layer

    state = begin_prefill(pc.init(2, 4, 8))
    _, plan = prefetch_prefill_layer(state, 0, (2**62,))
    assert int(np.asarray(plan.transfers.rows)[0]) == 4
    with pytest.raises(ValueError, match=r"entry 0: 4 rows x 4611686018427387904 bytes = "
                                         r"18446744073709551616 bytes"):
        plan.entry_bytes((2**62,))
    assert plan.entry_bytes((2**40,)).tolist() == [4 * 2**40, -1, -1, -1]


def _with_leaf(state, path: str, value):
    """``state`` with the leaf at the dotted ``path`` (``"residency.usage"``) replaced."""
    head, _, rest = path.partition(".")
    if not rest:
        return state.replace(**{head: value})
    return state.replace(**{head: _with_leaf(getattr(state, head), rest, value)})


@pytest.mark.parametrize("field, bad, error, message", [
    ("routing.recency", jnp.zeros((3, 8), jnp.int32), ValueError,
     r"state.routing.recency has shape \[3, 8\], expected \[2, 4\]"),
    ("residency.usage", jnp.zeros((6,), jnp.float32), TypeError,
     r"state.residency.usage has dtype float32, expected int32"),
    ("stats", jnp.zeros((2, 3), jnp.int32), ValueError, r"state.stats has shape \[2, 3\]"),
    ("settings.collect_routing", jnp.int32(0), TypeError,
     r"state.settings.collect_routing has dtype int32"),
    ("prefill.snapshot", jnp.zeros((2, 3), jnp.int32), ValueError,
     r"state.prefill.snapshot has shape \[2, 3\], expected \[2, 4\]"),
    ("clock", (jnp.int32(0),), TypeError, r"state.clock must be a Clock, got tuple"),
])
def test_a_hand_built_state_of_the_wrong_shape_or_dtype_is_refused(field, bad, error, message):
    """FAILS if a hand-built state whose field has another shape or dtype than ``init`` gives
    is accepted (error 0, its rows read with clamped indices, float steps rounded) or fails
    inside ``lax.cond`` with JAX's own message: every public op refuses it at call time naming
    the field, what it has and what the geometry asks for."""
    state = _with_leaf(pc.init(2, 4, 6), field, bad)
    ids = jnp.asarray([1, 2], jnp.int32)
    for call in (lambda s: pc.ensure(s, 0, ids),
                 lambda s: pc.ensure_hybrid(s, 0, ids, pc.FetchPolicy.full()),
                 lambda s: pc.materialize_layer(s, 0)):
        with pytest.raises(error, match=message):
            call(state)
        with pytest.raises(error, match=message):
            jax.jit(call)(state)


@pytest.mark.parametrize("eviction", [e.value for e in pc.Eviction])
def test_every_leaf_of_every_part_of_the_state_is_checked(eviction):
    """FAILS if ``check_state`` checks a hand-kept list of fields (a field, or the eviction's
    bookkeeping, left out of the list goes unchecked): every leaf of the cold state, of every
    part, given a wrong shape, is refused naming its path."""
    from pallas_cache.state import check_state

    state = pc.init(2, 4, 6, eviction=eviction)
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    assert len(paths) >= 16
    for target in paths:
        bad = jax.tree_util.tree_map_with_path(
            lambda path, x: jnp.zeros(np.shape(x) + (3,), x.dtype) if path == target else x,
            state)
        name = "state" + "".join(f".{key.name}" for key in target)
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            check_state(bad)


def test_float_expert_ids_are_refused_not_truncated():
    """FAILS if ``moe_hybrid``/``cpu_partial`` cast float expert ids to int (1.7 -> 1, 2.2 -> 2)
    as ``ensure`` refuses them: a TypeError naming the dtype."""
    bank = jnp.ones((4, H))
    ids = jnp.asarray([[1, 2]], jnp.int32)
    _, plan = pc.ensure_hybrid(pc.init(1, 4, 4), 0, ids, pc.FetchPolicy.fixed_cap(0))
    floats = jnp.asarray([[1.7, 2.2]], jnp.float32)
    for call in (pc.moe_hybrid, pc.cpu_partial):
        args = ((jnp.ones((1, H)), floats, jnp.ones((1, 2)), plan) +
                ((jnp.zeros((4, H)),) if call is pc.moe_hybrid else ()) + (bank, _scale_fn))
        with pytest.raises(TypeError, match=r"expert_ids must be integer expert ids, got dtype "
                                            r"float32"):
            call(*args)


@pytest.mark.parametrize("path", ["cpu", "device"])
def test_an_expert_fn_of_another_output_shape_is_named(path):
    """FAILS if an ``expert_fn`` that returns a scalar per token reaches ``lax.switch`` ("switch
    branches must have equal output types"): the error names the expected ``[H']`` row."""
    bank = jnp.ones((4, H))
    ids = jnp.asarray([[1, 2]], jnp.int32)
    policy = pc.FetchPolicy.fixed_cap(0) if path == "cpu" else pc.FetchPolicy.full()
    _, plan = pc.ensure_hybrid(pc.init(1, 4, 4), 0, ids, policy)
    pool = apply_copy_plan(jnp.zeros((4, H)), bank, plan)
    with pytest.raises(ValueError, match=r"must return one output row \[H'\] per token row "
                                         r"x_row \[2\], got shape \[\]"):
        pc.moe_hybrid(jnp.ones((1, H)), ids, jnp.ones((1, 2)), plan, pool, bank,
                      lambda w, x: jnp.sum(w * x))
