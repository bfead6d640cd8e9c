"""The several-devices checks (docs/semantics.md §5.17), run by tests/core/test_mesh.py in ONE
subprocess with four CPU devices (``--xla_force_host_platform_device_count=4``: the device count
is fixed once per process, and the rest of the suite runs on one device).

``python tests/core/mesh_checks.py RESULTS.json [NAME ...]`` runs the checks (all, or those named) and
writes ``{name: {"ok": bool, "detail": str, "seconds": float}}``. Each check is a function that
raises ``AssertionError`` on a failure. The lockstep checks compare, after every layer-call,
each device's cache with the NumPy reference; the ``naive_*`` checks run the same comparison on a
naive variant of the layout and pass only when the comparison catches it.

The reference (``pallas_cache.reference``) has the library's field names, so each compared state
field is read under one name from both.
"""

from __future__ import annotations

import importlib.util
import json
import operator
import os
import pathlib
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import pallas_cache as pc
from pallas_cache import mesh as pm

ROOT = pathlib.Path(__file__).resolve().parents[2]
AXIS = "d"
NUM_DEVICES = 4
EVICTIONS = ("lru", "pair_lfu", "route_knn", "route_lfu")
#: The state fields compared with the reference's after every call.
STATE_FIELDS = ("residency.slot_for_id", "residency.id_of_slot", "residency.usage", "step",
                "routing.recency", "stats")
PLAN_FIELDS = ("slots", "cpu", "active", "missing", "fetched", "error")
COPY_FIELDS = ("dst_slots", "src_rows", "count")
TOLERANCE = 1e-5  # tests/core/test_apply.py's, cached against dense

# The geometry of the lockstep runs: E = 10 over D = 4 devices is not divisible (shares 3, 3, 2,
# 2), the usable sizes differ per device under one capacity (mismatched cards), and the ring
# policies' history is short enough to wrap.
L, E, B, K = 3, 10, 3, 2
TOKENS = 14
HISTORY = 5
SIZES = (3, 4, 5, 6)
USER_EXPERTS = ((0, 5, 9), (1, 2), (3, 4, 6, 7), (8,))  # num_local 4


def _reference():
    from pallas_cache.reference import ReferenceCache, ReferencePolicy
    return ReferenceCache, ReferencePolicy


def _policies():
    """(JAX, reference) fetch policies the calls cycle through (traced: no recompile)."""
    _, ReferencePolicy = _reference()
    return [(pc.FetchPolicy.fraction(0.5), ReferencePolicy.fraction(0.5)),
            (pc.FetchPolicy.full(), ReferencePolicy.full()),
            (pc.FetchPolicy.fixed_cap(1), ReferencePolicy.fixed_cap(1)),
            (pc.FetchPolicy.fraction(0.25), ReferencePolicy.fraction(0.25))]


def _mesh():
    devices = jax.devices()
    assert len(devices) == NUM_DEVICES, f"expected {NUM_DEVICES} devices, got {len(devices)}"
    return jax.sharding.Mesh(np.array(devices), (AXIS,))


def _calls(seed: int, owner):
    """``(layer, routes [B, K])`` for ``TOKENS`` tokens of ``L`` layers: random global ids with
    padding; a quarter of the calls route only one device's experts (so the others see an
    all-padding call), and some calls are all padding."""
    rng = np.random.default_rng(seed)
    owner = np.asarray(owner)
    calls = []
    for _ in range(TOKENS):
        for layer in range(L):
            draw = rng.random()
            if draw < 0.25:
                pool = np.flatnonzero(owner == rng.integers(NUM_DEVICES))
                routes = rng.choice(pool, (B, K)) if pool.size else np.full((B, K), -1)
            else:
                routes = rng.integers(0, E, (B, K))
            routes = np.where(rng.random((B, K)) < 0.15, -1, routes)
            if draw > 0.95:
                routes[:] = -1
            calls.append((layer, routes.astype(np.int32)))
    return calls


def _derived_routes(owner, routes, device):
    """Device ``device``'s local routes, derived from the owner map directly (not through
    ``pm.local_routes``): its experts in ascending global id are local ids 0, 1, ..."""
    mine = [e for e in range(len(owner)) if owner[e] == device]
    local = {e: i for i, e in enumerate(mine)}
    return np.array([[local.get(int(r), -1) if r >= 0 else -1 for r in row] for row in routes],
                    np.int64)


def _compare(context, got_state, got_plan, cache, plan):
    """Raise AssertionError naming the first field where a JAX state/plan (NumPy views) differs
    from the reference cache and its plan. Plans first: the slot and copy assignments."""
    for field in PLAN_FIELDS:
        _equal(f"{context}: plan.{field}", getattr(got_plan, field), getattr(plan, field))
    count = int(plan.copy.count)
    for field in COPY_FIELDS[:2]:  # the counted copies first: which row goes to which slot
        _equal(f"{context}: plan.copy.{field}[:{count}]", getattr(got_plan.copy, field)[:count],
               getattr(plan.copy, field)[:count])
    for field in COPY_FIELDS:
        _equal(f"{context}: plan.copy.{field}", getattr(got_plan.copy, field),
               getattr(plan.copy, field))
    for field in STATE_FIELDS:
        _equal(f"{context}: state.{field}", operator.attrgetter(field)(got_state),
               operator.attrgetter(field)(cache))


def _equal(what, got, expected):
    got, expected = np.asarray(got), np.asarray(expected)
    if got.shape != expected.shape or not np.array_equal(got.astype(np.int64),
                                                         expected.astype(np.int64)):
        raise AssertionError(f"{what}: JAX {got.tolist()} != reference {expected.tolist()}")


def _member(tree, d):
    return jax.tree.map(lambda leaf: np.asarray(leaf)[d], tree)


# --- expert-parallel ---------------------------------------------------------------------------


def _expert_step(mesh, sharding, feed, traces, backend=None, check_vma=True):
    """The jitted per-layer-call step of the expert-parallel layout: each device maps the global
    routes to its own and runs ``ensure_hybrid`` on its own cache. ``feed`` picks what a device's
    cache is given: ``"local"`` (the layout), ``"global_ids"`` (naive: its routes under their
    global ids) or ``"unfiltered"`` (naive: every route, to a cache of all ``E`` experts)."""
    owner = jnp.asarray(sharding.owner, jnp.int32)

    def body(state, layer, routes, policy):
        traces.append(1)
        state = pm.device_view(state)
        device = lax.axis_index(AXIS)
        if feed == "local":
            routes = pm.local_routes(sharding, routes, device)
        elif feed == "global_ids":
            routes = jnp.where((routes >= 0) & (owner[jnp.maximum(routes, 0)] == device),
                               routes, -1)
        state, plan = pc.ensure_hybrid(state, layer, routes, policy, backend=backend)
        return pm.stack_view((state, plan))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P(), P(), P()),
                                 out_specs=P(AXIS), check_vma=check_vma))


def _kernel_calls(step, *args) -> int:
    """How many Pallas calls the jitted ``step`` traces to on ``args``."""
    return str(step.trace(*args).jaxpr).count("pallas_call[")


def run_expert_lockstep(eviction, *, experts=None, feed="local", seed=0, backend=None,
                        check_vma=True, kernel_calls=0):
    """Every device's cache against one reference cache fed only that device's routes, after
    every layer-call; the route assignment helper against the reference plans; all-padding calls
    advance ``step`` and ``calls``; the step is compiled once, and traces to ``kernel_calls``
    Pallas calls (the fused kernel's, once per device step). Returns a summary line."""
    ReferenceCache, _ = _reference()
    mesh = _mesh()
    sharding = pm.expert_sharding(E, NUM_DEVICES, experts=experts)
    owner = sharding.owner
    if experts is not None:  # the owner map as the user wrote it
        owner = [next(d for d, ids in enumerate(experts) if e in ids) for e in range(E)]
    num_local = E if feed == "unfiltered" else sharding.num_local
    sizes = [max(s, num_local) for s in SIZES]
    capacity = max(sizes) + 1
    if feed != "unfiltered":
        state = pm.init_expert_parallel(sharding, L, sizes, capacity=capacity, eviction=eviction,
                                        history=HISTORY)
    else:  # one cache of all E experts per device
        state = jax.tree.map(lambda *leaves: jnp.stack(leaves), *[
            pc.init(L, E, s, capacity=capacity, eviction=eviction, history=HISTORY)
            for s in sizes])
    state = jax.device_put(state, jax.sharding.NamedSharding(mesh, P(AXIS)))
    references = [ReferenceCache(L, sharding.num_local, s, capacity=capacity, eviction=eviction,
                                 history=HISTORY) for s in sizes]
    traces = []
    step = _expert_step(mesh, sharding, feed, traces, backend, check_vma)
    policies = _policies()
    calls = _kernel_calls(step, state, jnp.int32(0), jnp.zeros((B, K), jnp.int32),
                          policies[0][0])
    assert calls == kernel_calls, f"{calls} Pallas calls per device step, not {kernel_calls}"
    padding_calls = [0] * NUM_DEVICES
    previous = None
    for index, (layer, routes) in enumerate(_calls(seed, owner)):
        policy, ref_policy = policies[index % len(policies)]
        state, plans = step(state, jnp.int32(layer), jnp.asarray(routes), policy)
        got_state, got_plans = jax.device_get((state, plans))
        ref_plans = []
        for d in range(NUM_DEVICES):
            local = _derived_routes(owner, routes, d)
            ref_plan = references[d].ensure_hybrid(layer, local, ref_policy)
            ref_plans.append(ref_plan)
            context = f"call {index} (layer {layer}, routes {routes.tolist()}), device {d}"
            _compare(context, _member(got_state, d), _member(got_plans, d), references[d],
                     ref_plan)
            if np.all(local < 0):  # an all-padding call is still a call
                padding_calls[d] += 1
                before = _member(previous, d) if previous is not None else None
                now = _member(got_state, d)
                assert int(now.step) == (0 if before is None else int(before.step)) + 1, context
                calls_before = 0 if before is None else int(before.stats[:, 0].sum())
                assert int(now.stats[:, 0].sum()) == calls_before + 1, context
        assignment = jax.device_get(pm.route_assignment(sharding, routes, got_plans.slots,
                                                        got_plans.cpu))
        for (t, k), r in np.ndenumerate(routes):
            d = owner[r] if r >= 0 else -1
            expected = ((d, int(ref_plans[d].slots[t, k]), bool(ref_plans[d].cpu[t, k]))
                        if d >= 0 else (-1, -1, False))
            got = (int(assignment.device[t, k]), int(assignment.slot[t, k]),
                   bool(assignment.cpu[t, k]))
            assert got == expected, f"call {index}, route {(t, k)} = {r}: {got} != {expected}"
        previous = got_state
    assert len(traces) == 1, f"the step was traced {len(traces)} times"
    assert all(padding_calls), f"a device saw no all-padding call: {padding_calls}"
    fetched = [int(references[d].stats[:, 3].sum()) for d in range(NUM_DEVICES)]
    assert min(fetched) > 0, fetched
    return (f"{eviction}: {index + 1} calls, shares {sharding.shares}, sizes {sizes}, "
            f"all-padding calls per device {padding_calls}, fetched {fetched}")


# --- tensor-parallel ---------------------------------------------------------------------------


def _tensor_step(mesh, *, perturb=False, broadcast=False, check_vma=True, traces=None,
                 backend=None):
    """The jitted per-layer-call step of the tensor-parallel layout: the cache is replicated
    (``P()``) and every device runs ``ensure_hybrid`` on the routes it was given. ``perturb``
    changes device 0's routes (every id + 1 mod E); ``broadcast`` then gives every device device
    1's routes (``pm.broadcast_routes``)."""
    def body(state, layer, routes, policy):
        if traces is not None:
            traces.append(1)
        if perturb:
            first = lax.axis_index(AXIS) == 0
            routes = jnp.where(first & (routes >= 0), (routes + 1) % E, routes)
        if broadcast:
            routes = pm.broadcast_routes(routes, AXIS, source=1)
        return pc.ensure_hybrid(state, layer, routes, policy, backend=backend)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), P()),
                                 out_specs=P(), check_vma=check_vma))


def _device_copies(tree):
    """Each device's own buffer of every leaf of a replicated tree: ``[(device, tree)]``."""
    leaves, treedef = jax.tree.flatten(tree)
    per_device = [[np.asarray(shard.data) for shard in sorted(
        leaf.addressable_shards, key=lambda shard: shard.device.id)] for leaf in leaves]
    return [jax.tree.unflatten(treedef, [copies[d] for copies in per_device])
            for d in range(NUM_DEVICES)]


def run_tensor_lockstep(eviction, *, perturb=False, broadcast=False, check_vma=True, seed=1,
                        backend=None, kernel_calls=0):
    """The ``T`` devices' copies of the one cache (and of its plan) are identical after every
    layer-call, and equal one reference cache fed the routes; the step traces to
    ``kernel_calls`` Pallas calls."""
    ReferenceCache, _ = _reference()
    mesh = _mesh()
    S = 2 * E
    state = jax.device_put(pc.init(L, E, S, capacity=S + 2, eviction=eviction, history=HISTORY),
                           jax.sharding.NamedSharding(mesh, P()))
    reference = ReferenceCache(L, E, S, capacity=S + 2, eviction=eviction, history=HISTORY)
    traces = []
    step = _tensor_step(mesh, perturb=perturb, broadcast=broadcast, check_vma=check_vma,
                        traces=traces, backend=backend)
    policies = _policies()
    calls = _kernel_calls(step, state, jnp.int32(0), jnp.zeros((B, K), jnp.int32),
                          policies[0][0])
    assert calls == kernel_calls, f"{calls} Pallas calls per device step, not {kernel_calls}"
    for index, (layer, routes) in enumerate(_calls(seed, [e % NUM_DEVICES for e in range(E)])):
        policy, ref_policy = policies[index % len(policies)]
        state, plan = step(state, jnp.int32(layer), jnp.asarray(routes), policy)
        states, plans = _device_copies(state), _device_copies(plan)
        for d in range(1, NUM_DEVICES):
            for name, got, first in (("state", states[d], states[0]), ("plan", plans[d],
                                                                     plans[0])):
                for (path, b), a in zip(jax.tree_util.tree_flatten_with_path(first)[0],
                                        jax.tree.leaves(got)):
                    if not np.array_equal(a, b):
                        raise AssertionError(
                            f"call {index} (layer {layer}): device {d}'s {name}"
                            f"{jax.tree_util.keystr(path)} {a.tolist()} differs from device "
                            f"0's {b.tolist()}")
        ref_plan = reference.ensure_hybrid(layer, routes, ref_policy)
        _compare(f"call {index} (layer {layer}, routes {routes.tolist()})", states[0], plans[0],
                 reference, ref_plan)
    assert len(traces) == 1, f"the step was traced {len(traces)} times"
    return f"{eviction}: {index + 1} calls, {NUM_DEVICES} copies identical after every call"


# --- the example -------------------------------------------------------------------------------


def _example():
    path = ROOT / "examples" / "decode_mesh.py"
    spec = importlib.util.spec_from_file_location("decode_mesh_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


EXAMPLE_STEPS = 60


def _example_inputs():
    example = _example()
    config = example.ModelConfig()
    params = example.init_params(3, config)
    tokens = example.make_tokens(4, EXAMPLE_STEPS, config)
    return example, config, params, tokens


def _max_error(result):
    return float(np.max(np.abs(np.asarray(result.cached) - np.asarray(result.dense))))


def check_example_expert_parallel():
    """decode_mesh.py's expert-parallel decode equals the dense MoE at every step, every device's
    pool holds in each resident slot the host rows of the expert its cache names, and the
    caches fetched and sent routes to the CPU (mismatched sizes, the default share)."""
    example, config, params, tokens = _example_inputs()
    mesh = _mesh()
    sizes = [4, 5, 8, 12]
    sharding = pm.expert_sharding(config.num_experts, NUM_DEVICES)
    result = example.decode_expert_parallel(params, tokens, sizes, pc.FetchPolicy.fraction(0.5),
                                            mesh=mesh, config=config)
    error = _max_error(result)
    assert error <= TOLERANCE, f"cached != dense: {error:.3g}"
    id_of_slot = np.asarray(result.state.residency.id_of_slot)
    for d in range(NUM_DEVICES):
        for name, bank in params.experts.items():
            pool = np.asarray(result.pool[name])[d]
            for slot in np.flatnonzero(id_of_slot[d] >= 0):
                layer, local = divmod(int(id_of_slot[d, slot]), sharding.num_local)
                np.testing.assert_array_equal(
                    pool[slot], np.asarray(bank)[layer, sharding.experts(d)[local]])
    fetched, cpu = np.asarray(result.fetched), np.asarray(result.cpu_routes)
    assert np.all(fetched.sum(axis=(1, 2)) > 0) and np.all(cpu.sum(axis=(1, 2)) > 0)
    return f"max |cached - dense| = {error:.2e}, fetched per device {fetched.sum(axis=(1, 2))}"


def check_example_tensor_parallel():
    """decode_mesh.py's tensor-parallel decode equals the dense MoE; every device's copy of the
    cache is the same, and its pool holds its 1/T slice of the expert each slot names."""
    example, config, params, tokens = _example_inputs()
    mesh = _mesh()
    result = example.decode_tensor_parallel(params, tokens, config.num_experts,
                                            pc.FetchPolicy.fraction(0.5), mesh=mesh,
                                            config=config)
    error = _max_error(result)
    assert error <= TOLERANCE, f"cached != dense: {error:.3g}"
    copies = _device_copies(result.state)
    for d in range(1, NUM_DEVICES):
        for a, b in zip(jax.tree.leaves(copies[d]), jax.tree.leaves(copies[0])):
            assert np.array_equal(a, b), f"device {d}'s cache differs from device 0's"
    id_of_slot = copies[0].residency.id_of_slot
    slices = pm.split_weights(params.experts, NUM_DEVICES, example.TENSOR_AXES)
    for name in params.experts:
        pool, bank = np.asarray(result.pool[name]), np.asarray(slices[name])
        assert pool.shape[-1 if name == "w_in" else -2] == config.ffn // NUM_DEVICES
        for d in range(NUM_DEVICES):
            for slot in np.flatnonzero(id_of_slot >= 0):
                layer, expert = divmod(int(id_of_slot[slot]), config.num_experts)
                np.testing.assert_array_equal(pool[d, slot], bank[d, layer, expert])
    assert int(np.asarray(result.fetched)[0].sum()) > 0
    return f"max |cached - dense| = {error:.2e}"


def check_copy_path_reads_each_devices_count():
    """Each device of a ``shard_map`` copies its own plan's count of rows (0, 1, 2 and 3 on the
    four devices, each at its own traced layer): FAILS if a device reads another's count, the
    longest count, or the plan's width (tests/core/bank_reads.py counts the rows that device's
    program reads), or if a pool differs from the reference's."""
    from pallas_cache.reference import moe as reference_moe
    from tests.core.bank_reads import rows_read
    layers, experts, slots, row = 3, 5, 6, 4
    counts = [0, 1, 2, 3]
    bank = jnp.arange(layers * experts * row, dtype=jnp.float32).reshape(layers, experts, row)
    rng = np.random.default_rng(7)
    plans = pc.CopyPlan(
        dst_slots=jnp.asarray([rng.permutation(slots)[:4] for _ in counts], jnp.int32),
        src_rows=jnp.asarray([rng.permutation(experts)[:4] for _ in counts], jnp.int32),
        count=jnp.asarray(counts, jnp.int32))

    def body(pool, bank, plan):
        layer = lax.axis_index(AXIS) % layers
        plan = jax.tree.map(lambda a: a[0], plan)
        return pc.apply_copy_plan(pool[0], bank, plan, layer=layer)[None]

    step = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(P(AXIS), P(), P(AXIS)),
                                 out_specs=P(AXIS)))
    pools = jnp.full((NUM_DEVICES, slots, row), -1.0, jnp.float32)
    got = np.asarray(step(pools, bank, plans))
    for d, count in enumerate(counts):
        read = rows_read(step, pools, bank, plans, bank=1, row_size=row, device=d)
        assert read == count, f"device {d} read {read} rows for a count of {count}"
        plan = jax.tree.map(lambda a: np.asarray(a)[d], plans)
        want = reference_moe.apply_copy_plan(np.asarray(pools[d]), np.asarray(bank), plan,
                                             layer=d % layers)
        np.testing.assert_array_equal(got[d], want, err_msg=f"device {d}")
    return f"rows read per device {counts}"


def _first_device_plan(plan):
    """Naive: device 0's plan is applied to every device's pool (and read by its layer)."""
    first = lax.axis_index(AXIS) == 0
    return jax.tree.map(lambda leaf: lax.psum(jnp.where(first, leaf, jnp.zeros_like(leaf)),
                                              AXIS), plan)


def check_naive_one_plan_for_every_pool():
    """The example's comparison with the dense MoE catches the naive expert-parallel variant
    that applies one device's plan to every device's pool."""
    example, config, params, tokens = _example_inputs()
    result = example.decode_expert_parallel(params, tokens, 4, pc.FetchPolicy.fraction(0.5),
                                            mesh=_mesh(), config=config,
                                            tamper=_first_device_plan)
    error = _max_error(result)
    assert error > 1e-2, f"the naive variant matched the dense MoE ({error:.3g})"
    return f"caught: max |cached - dense| = {error:.2e}"


# --- sizing -------------------------------------------------------------------------------------


def check_replay_of_each_device_trace_gives_that_devices_counters():
    """A one-device replay of device d's trace (``sizing.devices.device_traces``) gives the
    counters of device d's cache in the mesh layout after the same calls: FAILS if the device
    traces drop all-padding calls, keep global ids, or keep other devices' routes."""
    from pallas_cache.sizing import ReplayConfig, Trace, replay
    from pallas_cache.sizing.devices import device_traces

    mesh = _mesh()
    sharding = pm.expert_sharding(E, NUM_DEVICES)
    calls = _calls(7, sharding.owner)
    trace = Trace(routes=np.stack([routes.reshape(-1) for _, routes in calls]),
                  layers=np.array([layer for layer, _ in calls], np.int32), num_layers=L,
                  num_experts=E)
    sizes = [4] * NUM_DEVICES  # one size: the four replays share one compiled program
    state = jax.device_put(pm.init_expert_parallel(sharding, L, sizes, capacity=max(sizes)),
                           jax.sharding.NamedSharding(mesh, P(AXIS)))
    step = _expert_step(mesh, sharding, "local", [])
    policy = pc.FetchPolicy.fraction(0.5)
    for layer, routes in calls:
        state, _ = step(state, jnp.int32(layer), jnp.asarray(routes.reshape(-1)), policy)
    counters = np.asarray(state.stats).sum(axis=1)  # [D, 4]: calls, active, missing, fetched
    got = []
    for d, device_trace in enumerate(device_traces(trace, sharding)):
        (result,) = replay(device_trace, [ReplayConfig(sizes[d], "fraction:0.5")], bounds=False,
                           progress=lambda _: None, devices=[jax.devices()[0]])
        replayed = (result.calls, result.active, result.missing, result.fetched)
        assert replayed == tuple(int(v) for v in counters[d]), (
            f"device {d}: replay {replayed} != mesh cache {counters[d].tolist()}")
        got.append(replayed)
    return f"(calls, active, missing, fetched) per device: {got}"


# --- the registry ------------------------------------------------------------------------------


def _expect_failure(run, *args, **kwargs):
    try:
        summary = run(*args, **kwargs)
    except AssertionError as error:
        return f"caught: {str(error)[:300]}"
    raise AssertionError(f"the naive variant passed the check: {summary}")


def check_tensor_perturbed_is_refused_by_check_vma():
    """With check_vma (the default), a device-dependent route makes the cache vary across the
    devices, and shard_map refuses the replicated out_specs at trace time."""
    mesh = _mesh()
    step = _tensor_step(mesh, perturb=True)
    state = pc.init(L, E, 2 * E)
    try:
        step(state, jnp.int32(0), jnp.zeros((B, K), jnp.int32), pc.FetchPolicy.full())
    except ValueError as error:
        assert "out_specs" in str(error), error
        return f"refused: {str(error).splitlines()[0][:200]}"
    raise AssertionError("a device-varying cache was accepted as replicated")


CHECKS = {
    **{f"expert_lockstep[{ev}]": (lambda ev=ev: run_expert_lockstep(ev)) for ev in EVICTIONS},
    "expert_lockstep_user_map[lru]": lambda: run_expert_lockstep("lru", experts=USER_EXPERTS),
    # The fused kernel inside a shard_map, in the Pallas interpreter: one call per device step.
    # Expert-parallel caches vary over the axis, which the interpreter refuses to mix with the
    # kernel's constants under check_vma (there "interpret" runs the XLA step, checked below):
    # the kernel's decisions per device are checked with check_vma off; tests/core/test_mesh.py
    # lowers both layouts for CUDA with check_vma on.
    **{f"expert_lockstep_kernel[{ev}]": (lambda ev=ev: run_expert_lockstep(
        ev, backend="interpret", check_vma=False, kernel_calls=1)) for ev in EVICTIONS},
    **{f"tensor_lockstep_kernel[{ev}]": (lambda ev=ev: run_tensor_lockstep(
        ev, backend="interpret", kernel_calls=1)) for ev in EVICTIONS},
    "expert_lockstep_interpret_backend[pair_lfu]": lambda: run_expert_lockstep(
        "pair_lfu", backend="interpret"),
    "naive_global_ids_fed_to_a_device_cache": lambda: _expect_failure(
        run_expert_lockstep, "lru", feed="global_ids"),
    "naive_every_route_fed_to_every_device_cache": lambda: _expect_failure(
        run_expert_lockstep, "lru", feed="unfiltered"),
    **{f"tensor_lockstep[{ev}]": (lambda ev=ev: run_tensor_lockstep(ev)) for ev in EVICTIONS},
    "tensor_perturbed_routes_refused_by_check_vma": check_tensor_perturbed_is_refused_by_check_vma,
    "naive_tensor_one_device_perturbed": lambda: _expect_failure(
        run_tensor_lockstep, "lru", perturb=True, check_vma=False),
    "tensor_perturbed_routes_broadcast": lambda: run_tensor_lockstep(
        "lru", perturb=True, broadcast=True),
    "example_expert_parallel": check_example_expert_parallel,
    "example_tensor_parallel": check_example_tensor_parallel,
    "naive_one_plan_for_every_pool": check_naive_one_plan_for_every_pool,
    "replay_of_each_device_trace": check_replay_of_each_device_trace_gives_that_devices_counters,
    "copy_path_reads_each_devices_count": check_copy_path_reads_each_devices_count,
}


#: Run only under the ``deep`` hypothesis profile (PALLAS_CACHE_PROFILE=deep): a second
#: expert-parallel run of the Pallas backend, which the tensor-parallel one already guards.
DEEP_ONLY = ("expert_lockstep_interpret_backend[pair_lfu]",)


def main(argv):
    out = pathlib.Path(argv[0])
    deep = os.environ.get("PALLAS_CACHE_PROFILE", "ci") == "deep"
    names = argv[1:] or [name for name in CHECKS if deep or name not in DEEP_ONLY]
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            detail, ok = CHECKS[name](), True
        except Exception as error:  # noqa: BLE001 -- reported to the test, which fails on it
            detail, ok = "".join(traceback.format_exception_only(error)).strip(), False
            if not isinstance(error, AssertionError):
                detail += "\n" + traceback.format_exc()[-3000:]
        results[name] = {"ok": ok, "detail": detail,
                         "seconds": round(time.perf_counter() - start, 2)}
        print(f"{name}: {'ok' if ok else 'FAILED'} ({results[name]['seconds']} s) {detail}",
              flush=True)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
