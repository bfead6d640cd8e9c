"""The hybrid MoE decode loop of examples/decode_loop.py on a mesh of 4 devices, in both layouts.

The same small random-weight MoE (4 layers, 16 experts per layer, top-2, hidden size 64) decodes
the same kind of token stream, with the whole loop compiled into one program: ``jax.jit`` of a
``jax.shard_map`` (its default ``check_vma=True``) over a mesh axis ``"d"`` of 4 devices, and
inside it a ``lax.scan`` over tokens and a ``lax.scan`` over layers with a traced layer index.

- **Expert-parallel** (:func:`decode_expert_parallel`): device ``d`` owns 4 of each layer's 16
  experts (``pallas_cache.mesh.expert_sharding``, or your own owner map) and keeps its own cache of
  only those: its own slots, its own usable size (mismatched cards: one size per device, under
  one shared capacity), its own copy plans, its own 1/D of the host bank. Per layer, every device
  routes the same tokens (the router is replicated), keeps the routes to its experts as local ids
  (``local_routes``; the others become padding), runs ``ensure_hybrid``, ``apply_copy_plan`` and
  ``moe_hybrid`` on them, and one ``psum`` adds the four partial outputs.
- **Tensor-parallel** (:func:`decode_tensor_parallel`): each device holds a quarter of every
  expert's hidden width (``split_weights``), so a slot costs a quarter of an expert's bytes on
  each device. All devices hold the same cache: each runs the same ``ensure_hybrid`` on the same
  routes (the cache state is replicated, ``P()``, and ``check_vma`` proves that nothing in it
  varies across the devices), its ``apply_copy_plan`` copies its quarter of each fetched expert,
  ``moe_hybrid`` computes its quarter of the down-projection, and one ``psum`` adds them.

Both are checked against the dense MoE on the same stream, as in examples/decode_loop.py.
Run ``python examples/decode_mesh.py``: on a machine with fewer than 4 accelerators it runs on 4
CPU devices (``--xla_force_host_platform_device_count=4``, set before JAX starts).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4").strip()

import dataclasses
import functools
import pathlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_cache as pc
from pallas_cache import mesh as pm
from pallas_cache.moe import host_memory_kind
from pallas_cache.testing import moe_dense

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from decode_loop import (ModelConfig, ModelParams, expert_mlp, init_params,  # noqa: E402
                         make_tokens, route)

AXIS = "d"
NUM_DEVICES = 4
#: How each weight of an expert is sliced in the tensor-parallel layout: the MLP's hidden width,
#: the last axis of ``w_in`` and the second to last of ``w_out`` (negative: fits bank and pool).
TENSOR_AXES = {"w_in": -1, "w_out": -2}


@dataclasses.dataclass(frozen=True)
class MeshResult:
    """Both paths' outputs and the caches after the last step.

    Attributes:
      cached: ``[T, B, H]`` the cached path's final hidden state of every token.
      dense: ``[T, B, H]`` the dense MoE's.
      state: the caches: stacked ``[D, ...]`` (expert-parallel) or the one replicated cache
        (tensor-parallel; each device holds its own copy of it, ``addressable_shards``).
      pool: each device's pool, stacked ``[D, C, ...]``.
      fetched, cpu_routes: ``[D, T, L]`` copies and CPU routes per device and layer call.
    """

    cached: jax.Array
    dense: jax.Array
    state: pc.CacheState
    pool: dict
    fetched: jax.Array
    cpu_routes: jax.Array


jax.tree_util.register_dataclass(
    MeshResult, data_fields=["cached", "dense", "state", "pool", "fetched", "cpu_routes"],
    meta_fields=[])


def make_mesh(num_devices: int = NUM_DEVICES) -> jax.sharding.Mesh:
    """A one-axis mesh ``"d"`` over the first ``num_devices`` devices."""
    devices = jax.devices()
    if len(devices) < num_devices:
        raise RuntimeError(f"the mesh needs {num_devices} devices, JAX sees {len(devices)}; on "
                           f"the CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
                           f"{num_devices} before JAX starts")
    return jax.sharding.Mesh(np.array(devices[:num_devices]), (AXIS,))


def _place(tree, mesh, spec, *, host: bool = False):
    """``tree`` on the mesh with ``spec``; in pinned host memory where the backend has it."""
    kind = host_memory_kind(mesh.devices.flat[0]) if host else None
    return jax.device_put(tree, NamedSharding(mesh, spec, memory_kind=kind))


def _dense(params, tokens, config):
    """The dense MoE on the same stream: ``[T, B, H]``."""
    def token_step(_, token_row):
        active = token_row >= 0
        h = jnp.where(active[:, None], params.embed[jnp.maximum(token_row, 0)], 0.0)

        def layer_step(h, layer):
            ids, gates = route(h, params.router[layer], active, config.top_k)
            return h + moe_dense(h, ids, gates, params.experts, expert_mlp, layer=layer), None

        h, _ = lax.scan(layer_step, h, jnp.arange(config.num_layers, dtype=jnp.int32))
        return None, h

    return lax.scan(token_step, None, tokens)[1]


def _decode_body(embed, router, bank, cache, pool, tokens, policy, *, config, layout, sharding,
                 tamper):
    """The per-device decode loop, the body of the ``shard_map``. ``bank`` and ``pool`` are this
    device's; ``cache`` its own (expert-parallel) or the shared one (tensor-parallel)."""
    bank, pool = pm.device_view((bank, pool))
    if layout == "expert":
        cache = pm.device_view(cache)
    device = lax.axis_index(AXIS)

    def token_step(carry, token_row):
        cache, pool = carry
        active = token_row >= 0
        h = jnp.where(active[:, None], embed[jnp.maximum(token_row, 0)], 0.0)

        def layer_step(carry, layer):
            cache, pool, h = carry
            ids, gates = route(h, router[layer], active, config.top_k)
            if layout == "expert":
                ids = pm.local_routes(sharding, ids, device)
            cache, plan = pc.ensure_hybrid(cache, layer, ids, policy)
            if tamper is not None:
                plan = tamper(plan)
            pool = pc.apply_copy_plan(pool, bank, plan, layer=layer)
            partial = pc.moe_hybrid(h, ids, gates, plan, pool, bank, expert_mlp, layer=layer)
            h = h + lax.psum(partial, AXIS)  # one all-reduce per layer
            return (cache, pool, h), (plan.copy.count, jnp.sum(plan.cpu, dtype=jnp.int32))

        (cache, pool, h), counts = lax.scan(
            layer_step, (cache, pool, h), jnp.arange(config.num_layers, dtype=jnp.int32))
        return (cache, pool), (h, counts)

    (cache, pool), (cached, (fetched, cpu_routes)) = lax.scan(token_step, (cache, pool), tokens)
    if layout == "expert":
        cache = pm.stack_view(cache)
    return cached, cache, pm.stack_view((pool, fetched, cpu_routes))


@functools.partial(jax.jit, static_argnames=("mesh", "config", "layout", "sharding", "tamper"))
def _decode(params, bank, cache, pool, tokens, policy, *, mesh, config, layout, sharding, tamper):
    body = functools.partial(_decode_body, config=config, layout=layout, sharding=sharding,
                             tamper=tamper)
    cache_spec = P(AXIS) if layout == "expert" else P()
    cached, cache, (pool, fetched, cpu_routes) = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(), P(AXIS), cache_spec, P(AXIS), P(), P()),
        out_specs=(P(), cache_spec, P(AXIS)))(
            params.embed, params.router, bank, cache, pool, tokens, policy)
    return MeshResult(cached=cached, dense=_dense(params, tokens, config), state=cache, pool=pool,
                      fetched=fetched, cpu_routes=cpu_routes)


def decode_expert_parallel(params: ModelParams, tokens, cache_size, policy: pc.FetchPolicy, *,
                           mesh: jax.sharding.Mesh, config: ModelConfig = ModelConfig(),
                           sharding: pm.ExpertSharding | None = None,
                           capacity: int | None = None, eviction=pc.Eviction.LRU,
                           tamper: Callable | None = None) -> MeshResult:
    """Decode ``tokens`` with one cache per device, each of its own experts.

    Args:
      params: the model (its ``experts`` the whole host bank ``[L, E, ...]``).
      tokens: ``[T, B]`` int32, -1 = padding row.
      cache_size: every device's usable slots, or one per device (mismatched cards).
      policy: the fetch policy (traced), applied by each device to its own misses.
      mesh: a mesh with the axis ``"d"``; ``sharding``: the owner map (default: even blocks).
      capacity: the shared allocation (default the largest ``cache_size``).
      eviction: every device's eviction policy.
      tamper: optional ``plan -> plan`` (static) applied inside the ``shard_map`` to every plan
        before it is used; for tests.
    """
    D = mesh.shape[AXIS]
    sharding = sharding or pm.expert_sharding(config.num_experts, D)
    cache = pm.init_expert_parallel(sharding, config.num_layers, cache_size, capacity=capacity,
                                    eviction=eviction)
    bank = pm.local_bank(sharding, params.experts)  # [D, L, num_local, ...]
    pool = jax.tree.map(lambda b: jnp.zeros((D, cache.capacity) + b.shape[3:], b.dtype), bank)
    return _run(params, bank, cache, pool, tokens, policy, mesh, config, "expert", sharding,
                tamper)


def decode_tensor_parallel(params: ModelParams, tokens, cache_size: int, policy: pc.FetchPolicy,
                           *, mesh: jax.sharding.Mesh, config: ModelConfig = ModelConfig(),
                           eviction=pc.Eviction.LRU,
                           tamper: Callable | None = None) -> MeshResult:
    """Decode ``tokens`` with one cache decision for all devices, each holding ``1/T`` of every
    expert: ``cache_size`` slots, each ``1/T`` of an expert's bytes on every device."""
    T = mesh.shape[AXIS]
    cache = pc.init(config.num_layers, config.num_experts, cache_size, eviction=eviction)
    bank = pm.split_weights(params.experts, T, TENSOR_AXES)  # [T, L, E, H, F/T], [T, L, E, F/T, H]
    pool = jax.tree.map(lambda b: jnp.zeros((T, cache_size) + b.shape[3:], b.dtype), bank)
    return _run(params, bank, cache, pool, tokens, policy, mesh, config, "tensor", None, tamper)


def _run(params, bank, cache, pool, tokens, policy, mesh, config, layout, sharding, tamper):
    bank = _place(bank, mesh, P(AXIS), host=True)
    pool = _place(pool, mesh, P(AXIS))
    cache = _place(cache, mesh, P(AXIS) if layout == "expert" else P())
    params, tokens, policy = _place((params, tokens, policy), mesh, P())
    # Full f32 matmuls, as in examples/decode_loop.py: the paths sum the same terms in different
    # groupings, and TF32 would make them differ by more than f32 rounding.
    with jax.default_matmul_precision("highest"):
        return _decode(params, bank, cache, pool, tokens, policy, mesh=mesh, config=config,
                       layout=layout, sharding=sharding, tamper=tamper)


def max_error(result: MeshResult) -> float:
    """Largest absolute difference between the cached and the dense outputs, over all steps."""
    return float(jnp.max(jnp.abs(result.cached - result.dense)))


def main(num_steps: int = 200, seed: int = 0) -> None:
    config = ModelConfig()
    mesh = make_mesh()
    params = init_params(seed, config)
    tokens = make_tokens(seed + 1, num_steps, config)
    E, D = config.num_experts, NUM_DEVICES
    print(f"model: L={config.num_layers} E={E} top-{config.top_k} H={config.hidden}, "
          f"{num_steps} steps x {config.batch} rows; mesh of {D} {jax.devices()[0].platform} "
          f"devices")
    policy = pc.FetchPolicy.fraction(0.5)
    sizes = [E // D, E // D + 2, 2 * E // D, 3 * E // D]  # mismatched cards, slots per device
    result = decode_expert_parallel(params, tokens, sizes, policy, mesh=mesh, config=config)
    print(f"expert-parallel, usable slots per device {sizes}: max|cached - dense| = "
          f"{max_error(result):.2e}")
    for d in range(D):
        totals = pc.stats(jax.tree.map(lambda leaf: leaf[d], result.state))
        print(f"  device {d}: active={totals.active} missing={totals.missing} "
              f"fetched={totals.fetched} cpu routes={int(result.cpu_routes[d].sum())} "
              f"miss rate={totals.miss_rate:.3f}")
    result = decode_tensor_parallel(params, tokens, E, policy, mesh=mesh, config=config)
    copies = [shard.data for shard in result.state.residency.id_of_slot.addressable_shards]
    agree = all(np.array_equal(copies[0], copy) for copy in copies)
    totals = pc.stats(result.state)
    print(f"tensor-parallel, {E} slots of 1/{D} expert on each device: max|cached - dense| = "
          f"{max_error(result):.2e}, miss rate={totals.miss_rate:.3f}, the {D} devices' copies "
          f"of the cache agree: {agree}")


if __name__ == "__main__":
    main()
