"""Several devices (docs/semantics.md §5.17): the hybrid layer inside ``jax.shard_map`` with its
default ``check_vma=True`` on this process's devices, and, in one subprocess with four CPU
devices, the expert-parallel and tensor-parallel layouts of tests/core/mesh_checks.py (the device
count is fixed once per process, and the rest of the suite runs on one)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from tests.core import mesh_checks
import pallas_cache as pc
from benchmarks.lowering import abstract_gpu_mesh, count_ops
from pallas_cache import mesh as pm
from pallas_cache.testing import moe_dense


def _mlp(weights, x):
    return jax.nn.gelu(x @ weights["w_in"]) @ weights["w_out"]


def test_moe_hybrid_traces_in_shard_map_with_check_vma_when_a_partial_has_no_expert():
    """FAILS if the zeros branch of the partials' switch does not vary over the mesh axis like
    the branches that read the (device-varying) pool, bank and plan: "switch branches must have
    equal output types" at trace time. A one-device mesh suffices (varying is a type, not a
    count); the outputs are checked against the dense MoE."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    L, E, H, F, S = 2, 4, 8, 4, 4
    rng = np.random.default_rng(0)
    bank = {"w_in": jnp.asarray(rng.standard_normal((L, E, H, F), np.float32)),
            "w_out": jnp.asarray(rng.standard_normal((L, E, F, H), np.float32))}
    pool = jax.tree.map(lambda b: jnp.zeros((1, S) + b.shape[2:], b.dtype), bank)
    state = jax.tree.map(lambda a: a[None], pc.init(L, E, S))
    x = jnp.asarray(rng.standard_normal((2, H), np.float32))
    gates = jnp.full((2, 2), 0.5, jnp.float32)

    def body(state, pool, x, ids, policy):
        state, pool = jax.tree.map(lambda a: a[0], (state, pool))
        layer = lax.axis_index("d") + 1  # traced, and varying over the axis
        state, plan = pc.ensure_hybrid(state, layer, ids, policy)
        pool = pc.apply_copy_plan(pool, bank, plan, layer=layer)
        y = pc.moe_hybrid(x, ids, gates, plan, pool, bank, _mlp, layer=layer)
        return jax.tree.map(lambda a: a[None], (state, pool)), lax.psum(y, "d")

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P("d"), P(), P(), P()),
                                 out_specs=(P("d"), P())))
    with jax.default_matmul_precision("highest"):
        for ids, fraction in (([[0, 1], [1, -1]], 0.5), ([[0, -1], [0, 0]], 0.5)):
            ids = jnp.asarray(ids, jnp.int32)
            (state, pool), y = step(state, pool, x, ids, pc.FetchPolicy.fraction(fraction))
            dense = moe_dense(x, ids, gates, bank, _mlp, layer=1)
            np.testing.assert_allclose(np.asarray(y), np.asarray(dense), rtol=1e-5, atol=1e-5)


# --- the fused kernel inside a shard_map, lowered for CUDA on four abstract H200s -------------


def _lower_on_gpu_mesh(body, in_specs, out_specs, *args) -> str:
    mesh = abstract_gpu_mesh(mesh_checks.NUM_DEVICES, mesh_checks.AXIS)
    step = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _tensor_parallel_args(eviction):
    L, E, B, K = mesh_checks.L, mesh_checks.E, mesh_checks.B, mesh_checks.K
    state = pc.init(L, E, 2 * E, capacity=2 * E + 2, eviction=eviction,
                    history=mesh_checks.HISTORY)
    return state, jnp.int32(1), jnp.zeros((B, K), jnp.int32), pc.FetchPolicy.fraction(0.5)


@pytest.mark.parametrize("eviction", mesh_checks.EVICTIONS)
def test_the_mesh_step_lowers_to_one_triton_call_per_device_step_in_both_layouts(eviction):
    """FAILS if the Pallas backend falls back to the XLA step inside a ``shard_map`` (no Triton
    call, dozens of ops), or if the kernel's outputs are not typed for ``check_vma`` (its
    default: "manual_axis_type ... must not be None" at trace time)."""
    L, E, B, K = mesh_checks.L, mesh_checks.E, mesh_checks.B, mesh_checks.K
    sharding = pm.expert_sharding(E, mesh_checks.NUM_DEVICES)
    state = pm.init_expert_parallel(sharding, L, list(mesh_checks.SIZES), eviction=eviction,
                                    history=mesh_checks.HISTORY)

    def expert_parallel(state, layer, routes, policy):
        routes = pm.local_routes(sharding, routes, lax.axis_index(mesh_checks.AXIS))
        state, plan = pc.ensure_hybrid(pm.device_view(state), layer, routes, policy,
                                       backend="pallas")
        return pm.stack_view((state, plan))

    def tensor_parallel(state, layer, routes, policy):
        return pc.ensure_hybrid(state, layer, routes, policy, backend="pallas")

    axis = P(mesh_checks.AXIS)
    text = _lower_on_gpu_mesh(expert_parallel, (axis, P(), P(), P()), axis, state,
                              *_tensor_parallel_args(eviction)[1:])
    assert count_ops(text)[0] == 1, count_ops(text)
    text = _lower_on_gpu_mesh(tensor_parallel, (P(),) * 4, P(), *_tensor_parallel_args(eviction))
    assert count_ops(text) == (1, count_ops(text)[1]) and count_ops(text)[1] <= 1, count_ops(text)


@pytest.mark.parametrize("outputs", ["state and plan", "state"])
def test_the_kernel_keeps_a_perturbed_tensor_parallel_cache_refused(outputs):
    """Device 0 is given other routes, so the replicated cache would diverge: ``check_vma`` must
    refuse the replicated out_specs with the kernel as with the XLA step. FAILS if the kernel's
    outputs are declared invariant (both cases accepted), or if its state inputs are not cast to
    vary as the routes do (the state, aliased to its outputs, would keep the inputs' invariant
    type: the "state" case accepted)."""
    E = mesh_checks.E

    def perturbed(state, layer, routes, policy):
        first = lax.axis_index(mesh_checks.AXIS) == 0
        routes = jnp.where(first & (routes >= 0), (routes + 1) % E, routes)
        state, plan = pc.ensure_hybrid(state, layer, routes, policy, backend="pallas")
        return (state, plan) if outputs != "state" else state

    with pytest.raises(ValueError, match="out_specs"):
        _lower_on_gpu_mesh(perturbed, (P(),) * 4, P(), *_tensor_parallel_args("lru"))


# --- the owner map and the helpers, on the host -------------------------------------------------


def test_the_default_share_is_contiguous_blocks_the_first_devices_one_more():
    assert pm.expert_sharding(10, 4).owner == (0, 0, 0, 1, 1, 1, 2, 2, 3, 3)
    assert pm.expert_sharding(10, 4).shares == (3, 3, 2, 2)
    assert pm.expert_sharding(16, 4).experts(2) == (8, 9, 10, 11)
    # fewer experts than devices: the last devices own none, every cache still has one local id
    sharding = pm.expert_sharding(2, 4)
    assert sharding.shares == (1, 1, 0, 0) and sharding.num_local == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(experts=[[0, 1], [2], [3, 4, 1], [5]]), "expert 1 is owned by devices 0 and 2"),
    (dict(experts=[[0, 1, 1], [2, 3], [4], [5]]), "expert 1 is owned twice by device 0"),
    (dict(experts=[[0, 1], [2, 3], [4], []]), "expert 5 has no owner"),
    (dict(experts=[[0, 1], [2, 3], [4, 9], [5]]), "device 2 lists expert 9, outside \\[0, 6\\)"),
    (dict(experts=[[0, 1], [2, 3, 4, 5]]), "experts of 2 devices, the mesh axis has 4"),
    (dict(owner=[0, 1, 2, 3, 4, 0]), "expert 4's owner 4 is outside \\[0, 4\\)"),
    (dict(owner=[0, 1, -1, 3, 0, 0]), "expert 2's owner -1 is outside"),
    (dict(owner=[0, 1, 2]), "owner has 3 entries, one per expert is 6"),
    (dict(owner=[0] * 6, experts=[[0]] * 4), "not both"),
])
def test_an_owner_map_giving_an_expert_no_owner_two_or_an_id_out_of_range_is_refused(kwargs,
                                                                                     message):
    """FAILS if a bad owner map is accepted, or its error does not name the expert/device."""
    with pytest.raises(ValueError, match=message):
        pm.expert_sharding(6, 4, **kwargs)
    with pytest.raises(TypeError, match="integers"):
        pm.expert_sharding(6, 4, owner=[0, 1, 2, 3, 0.5, 0])


def test_local_routes_keep_each_devices_experts_as_ascending_local_ids_and_pad_the_rest():
    """FAILS if a route leaks to a device that does not own it, or local ids are not the rank
    among the owner's experts (checked against the owner map, route by route)."""
    experts = ((4, 0), (5, 1, 2), (3,), ())
    sharding = pm.expert_sharding(6, 4, experts=experts)
    routes = np.array([[0, 1, 2], [3, 4, 5], [-1, 2, 0]], np.int32)
    out = np.asarray(pm.local_routes(sharding, routes))
    assert out.shape == (4, 3, 3)
    for d, ids in enumerate(experts):
        mine = sorted(ids)
        expected = [[mine.index(r) if r in mine else -1 for r in row] for row in routes.tolist()]
        assert out[d].tolist() == expected
        assert np.asarray(pm.local_routes(sharding, routes, d)).tolist() == expected
    # an id outside [-1, E) is out of range on every device: each refuses the call
    bad = np.asarray(pm.local_routes(sharding, np.array([[6, 0]], np.int32)))
    assert (bad[:, 0, 0] == sharding.num_local).all()


def test_route_assignment_reads_each_route_from_its_owners_plan():
    sharding = pm.expert_sharding(4, 2)  # device 0: 0, 1; device 1: 2, 3
    routes = np.array([[0, 3], [2, -1]], np.int32)
    slots = np.array([[[5, 9], [9, 9]], [[9, 7], [-1, 9]]], np.int32)
    cpu = np.array([[[False, True], [True, True]], [[True, False], [True, True]]])
    got = pm.route_assignment(sharding, routes, slots, cpu)
    assert np.asarray(got.device).tolist() == [[0, 1], [1, -1]]
    assert np.asarray(got.slot).tolist() == [[5, 7], [-1, -1]]
    assert np.asarray(got.cpu).tolist() == [[False, False], [True, False]]
    with pytest.raises(ValueError, match=r"\[D, \.\.\.routes\]"):
        pm.route_assignment(sharding, routes, slots[0], cpu[0])


def test_per_device_sizes_share_one_capacity_and_a_size_below_the_local_experts_names_the_device():
    sharding = pm.expert_sharding(10, 4)
    state = pm.init_expert_parallel(sharding, 2, [3, 4, 5, 6], capacity=8)
    assert state.residency.id_of_slot.shape == (4, 8) and state.residency.slot_for_id.shape == (4, 2, 3)
    assert np.asarray(state.cache_size).tolist() == [3, 4, 5, 6]
    with pytest.raises(ValueError, match="device 2 .*cache_size 2 cannot hold one layer of 3"):
        pm.init_expert_parallel(sharding, 2, [3, 3, 2, 3])
    with pytest.raises(ValueError, match="device 0 .*capacity 4 is below cache_size 5"):
        pm.init_expert_parallel(sharding, 2, [5, 3, 3, 3], capacity=4)
    with pytest.raises(ValueError, match="3 sizes, the mesh axis has 4"):
        pm.init_expert_parallel(sharding, 2, [3, 3, 3])


def test_local_bank_gives_each_device_its_experts_rows_and_zeros_past_its_share():
    sharding = pm.expert_sharding(5, 2)  # 0, 1, 2 | 3, 4
    bank = np.arange(2 * 5 * 3, dtype=np.float32).reshape(2, 5, 3) + 1
    out = np.asarray(pm.local_bank(sharding, bank))
    assert out.shape == (2, 2, 3, 3)
    np.testing.assert_array_equal(out[0], bank[:, [0, 1, 2]])
    np.testing.assert_array_equal(out[1, :, :2], bank[:, [3, 4]])
    assert not out[1, :, 2].any()


def test_split_weights_slices_each_leaf_and_refuses_a_count_that_does_not_divide_the_axis():
    """FAILS if T not dividing the sliced axis is accepted (or the error does not name both)."""
    bank = {"w_in": np.arange(2 * 3 * 4 * 6).reshape(2, 3, 4, 6),
            "w_out": np.arange(2 * 3 * 6 * 4).reshape(2, 3, 6, 4)}
    out = pm.split_weights(bank, 3, {"w_in": -1, "w_out": -2})
    assert out["w_in"].shape == (3, 2, 3, 4, 2) and out["w_out"].shape == (3, 2, 3, 2, 4)
    np.testing.assert_array_equal(out["w_in"][1], bank["w_in"][..., 2:4])
    np.testing.assert_array_equal(out["w_out"][2], bank["w_out"][..., 4:6, :])
    with pytest.raises(ValueError, match=r"\['w_in'\] .* over 4 devices: its axis -1 has 6 "
                                         r"entries, which 4 does not divide"):
        pm.split_weights(bank, 4, {"w_in": -1, "w_out": -2})
    with pytest.raises(ValueError, match="has no axis 4"):
        pm.split_weights(bank, 2, 4)


# --- four CPU devices, in one subprocess -----------------------------------------------------


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory):
    """Every check of tests/core/mesh_checks.py, run once in a subprocess with four CPU devices."""
    out = tmp_path_factory.mktemp("mesh") / "results.json"
    root = pathlib.Path(__file__).resolve().parents[2]
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(root),
                                                        os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(root / "tests" / "core" / "mesh_checks.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(mesh_checks.CHECKS))
def test_on_four_devices(mesh_results, name):
    """One check of tests/core/mesh_checks.py (its docstring says what FAILS it); the lockstep checks
    compare every device's cache with the NumPy reference after every layer-call, the naive_*
    checks pass only when that comparison catches the naive variant."""
    if name not in mesh_results and name in mesh_checks.DEEP_ONLY:
        pytest.skip("runs under PALLAS_CACHE_PROFILE=deep")
    result = mesh_results[name]
    assert result["ok"], result["detail"]


def test_device_traces_keep_every_call_with_each_devices_routes_as_local_ids():
    """FAILS if a device's trace drops its all-padding calls or keeps routes it does not own
    (derived here from the owner map, not through the library's translation)."""
    from pallas_cache.sizing import Trace
    from pallas_cache.sizing.devices import device_traces

    experts = ((4, 0), (5, 1, 2), (3,))
    sharding = pm.expert_sharding(6, 3, experts=experts)
    routes = np.array([[0, 5], [3, -1], [4, 4], [-1, -1]], np.int32)
    trace = Trace(routes=routes, layers=np.array([0, 1, 0, 1], np.int32), num_layers=2,
                  num_experts=6, token_idx=np.array([0, 0, 1, 1]))
    out = device_traces(trace, sharding)
    for d, ids in enumerate(experts):
        mine = sorted(ids)
        expected = [[mine.index(r) if r in mine else -1 for r in row] for row in routes.tolist()]
        assert out[d].routes.tolist() == expected
        assert out[d].num_experts == 3 and out[d].layers.tolist() == [0, 1, 0, 1]
        assert out[d].num_tokens == trace.num_tokens
    with pytest.raises(ValueError, match="owner map is for 6 experts, the trace has 8"):
        device_traces(Trace(routes=routes, layers=np.zeros(4, np.int32), num_layers=2,
                            num_experts=8), sharding)


def test_tensor_parallel_slots_and_time_are_the_one_device_model_with_a_slot_of_w_over_t():
    from pallas_cache.sizing.sweep.cost import modeled_seconds
    from pallas_cache.sizing.devices import tensor_parallel_seconds, tensor_parallel_slots

    W = 352_321_536  # Mixtral-8x7B bf16
    gib = 2**30
    # a per-device budget B on T devices holds the slots of T * B on one device
    assert tensor_parallel_slots(10 * gib, 2, W) == (20 * gib) // W == 60
    assert tensor_parallel_slots(10 * gib, 4, W) == (40 * gib) // W
    pairs = [(2, 0, 5), (0, 3, 7), (1, 1, 11)]
    # one device is the one-device model; T devices copy W/T each, in parallel; the CPU
    # experts' bytes are W whatever T
    assert tensor_parallel_seconds(pairs, W, 1, 25e9, 60e9) == modeled_seconds(pairs, W, 25e9,
                                                                                 60e9)
    assert tensor_parallel_seconds(pairs, W, 4, 25e9, 60e9) == pytest.approx(
        5 * 2 * W / 4 / 25e9 + 7 * 3 * W / 60e9 + 11 * max(W / 4 / 25e9, W / 60e9))


# --- static arguments: checked at call time, naming the argument and its range ----------------


def test_a_direct_expert_sharding_is_checked_like_expert_sharding():
    """FAILS if ``ExpertSharding(owner=(-1, 0, 1, 1), num_devices=2)`` is accepted (expert 0 on
    no device, silently dropped; expert 3 a local id past its device's count), as it was when
    only :func:`expert_sharding` checked the map."""
    with pytest.raises(ValueError, match=r"expert 0's owner -1 is outside \[0, 2\)"):
        pm.ExpertSharding(owner=(-1, 0, 1, 1), num_devices=2)
    with pytest.raises(ValueError, match=r"expert 1's owner 2 is outside \[0, 2\)"):
        pm.ExpertSharding(owner=(0, 2), num_devices=2)
    with pytest.raises(ValueError, match="num_devices must be >= 1"):
        pm.ExpertSharding(owner=(0,), num_devices=0)
    with pytest.raises(TypeError, match="num_devices must be an integer"):
        pm.ExpertSharding(owner=(0,), num_devices=True)
    with pytest.raises(TypeError, match="owner must hold integers"):
        pm.ExpertSharding(owner=(0, 1.0), num_devices=2)
    with pytest.raises(ValueError, match="owner is empty"):
        pm.ExpertSharding(owner=(), num_devices=2)
    # a valid map built directly equals (and hashes as) the one expert_sharding builds
    direct = pm.ExpertSharding(owner=[0, np.int64(1), 1], num_devices=np.int32(2))
    assert direct == pm.expert_sharding(3, 2, owner=[0, 1, 1])
    assert hash(direct) == hash(pm.expert_sharding(3, 2, owner=[0, 1, 1]))


@pytest.mark.parametrize("device, error, message", [
    (np.int64(2**32), ValueError, r"device 4294967296 is outside \[0, 2\)"),
    (2, ValueError, r"device 2 is outside \[0, 2\)"),
    (-1, ValueError, r"device -1 is outside \[0, 2\)"),
    (1.5, TypeError, "device must be an integer"),
    (True, TypeError, "device must be an integer, got the bool"),
    (jnp.zeros((2,), jnp.int32), TypeError, "device must be an integer scalar"),
])
def test_local_routes_refuses_a_device_outside_the_axis(device, error, message):
    """FAILS if ``device=np.int64(2**32)`` wraps onto device 0 and returns its routes, or
    ``2``, ``-1`` or ``1.5`` silently return all -1 (every route dropped)."""
    sharding = pm.expert_sharding(8, 2)
    with pytest.raises(error, match=message):
        pm.local_routes(sharding, np.array([0, 5, 7]), device=device)


def test_local_routes_takes_a_host_a_concrete_and_a_traced_device():
    sharding = pm.expert_sharding(8, 2)
    routes = np.array([0, 5, 7])
    for device in (1, np.int64(1), jnp.int32(1)):
        assert np.asarray(pm.local_routes(sharding, routes, device)).tolist() == [-1, 1, 3]
    traced = jax.jit(lambda d: pm.local_routes(sharding, routes, d))(1)
    assert np.asarray(traced).tolist() == [-1, 1, 3]


@pytest.mark.parametrize("source, error, message", [
    (1, ValueError, r"source 1 is outside \[0, 1\), the devices of axis 'd'"),
    (-1, ValueError, r"source -1 is outside \[0, 1\)"),
    (True, TypeError, "source must be an integer, got the bool"),
    (0.0, TypeError, "source must be an integer"),
])
def test_broadcast_routes_refuses_a_source_outside_the_axis(source, error, message):
    """FAILS if a source past the axis (``source=4`` on 4 devices, here ``1`` on the one device
    of this process) or ``-1`` gives every device the routes ``[0, 0, ...]``: no device matches,
    the psum adds zeros, every token goes to expert 0."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))

    def run(source):
        return jax.shard_map(lambda r: pm.broadcast_routes(r, "d", source=source), mesh=mesh,
                             in_specs=P(), out_specs=P())(jnp.array([3, 1, 2]))

    assert np.asarray(run(0)).tolist() == [3, 1, 2]
    with pytest.raises(error, match=message):
        run(source)


def test_split_weights_refuses_a_bool_axis():
    """FAILS if ``axis=True`` is read as axis 1 and splits the experts instead of the hidden
    width (``num_devices=True`` is refused; so is the axis now)."""
    tree = {"w": jnp.zeros((4, 6))}
    with pytest.raises(TypeError, match=r"axis of \['w'\] must be an integer, got True"):
        pm.split_weights(tree, 2, True)
    with pytest.raises(TypeError, match="must be an integer"):
        pm.split_weights(tree, 2, {"w": 1.0})
    with pytest.raises(ValueError, match=r"has no axis 2: axis must be in \[-2, 2\)"):
        pm.split_weights(tree, 2, 2)
    assert pm.split_weights(tree, 2, np.int64(-1))["w"].shape == (2, 4, 3)


@pytest.mark.parametrize("cache_size", [jnp.int32(8), np.int64(8), 8])
def test_init_expert_parallel_takes_the_cache_size_init_takes(cache_size):
    """FAILS on "iteration over a 0-d array" for ``jnp.int32(8)``, which ``pc.init`` takes."""
    state = pm.init_expert_parallel(pm.expert_sharding(8, 2), 2, cache_size)
    assert np.asarray(state.cache_size).tolist() == [8, 8]
    assert pc.init(2, 4, cache_size).cache_size == 8


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(cache_size=8.0), TypeError, r"cache_size must be an integer, got 8.0"),
    (dict(cache_size="8"), TypeError, r"cache_size must be an integer"),
    (dict(cache_size=8, capacity=2**31), ValueError, r"capacity must fit in int32"),
    (dict(cache_size=8, capacity=8.0), TypeError, r"capacity must be an integer"),
])
def test_init_expert_parallel_names_a_bad_size_before_allocating(kwargs, error, message):
    """FAILS on "'float' object is not iterable" for ``8.0``, or on a capacity error that
    names device 0 instead of the argument."""
    with pytest.raises(error, match=message):
        pm.init_expert_parallel(pm.expert_sharding(8, 2), 2, **kwargs)


def test_the_mesh_helpers_name_a_wrong_sharding_or_a_bool_expert_axis():
    """FAILS if ``local_bank(expert_axis=True)`` is read as axis 1, or a sharding that is not an
    ExpertSharding ends in an AttributeError (audit of the mesh helpers, beside issue's cases)."""
    sharding = pm.expert_sharding(8, 2)
    with pytest.raises(TypeError, match="expert_axis must be an integer, got True"):
        pm.local_bank(sharding, {"w": jnp.zeros((2, 8, 3))}, expert_axis=True)
    for call in (lambda s: pm.local_routes(s, np.array([0])),
                 lambda s: pm.route_assignment(s, np.array([0]), np.zeros((2, 1)),
                                               np.zeros((2, 1), bool)),
                 lambda s: pm.local_bank(s, {"w": jnp.zeros((8, 3))}, expert_axis=0),
                 lambda s: pm.init_expert_parallel(s, 1, 8)):
        with pytest.raises(TypeError, match="sharding must be an ExpertSharding"):
            call((0, 0, 1, 1))
    from pallas_cache.sizing.devices import tensor_parallel_seconds
    with pytest.raises(ValueError, match="link_bandwidth must be a positive, finite number"):
        tensor_parallel_seconds([(1, 1, 1)], 100, 2, 0.0, 1.0)
