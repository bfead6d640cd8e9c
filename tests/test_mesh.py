"""Several devices (docs/semantics.md §5.17): the hybrid layer inside ``jax.shard_map`` with its
default ``check_vma=True`` on this process's devices, and, in one subprocess with four CPU
devices, the expert-parallel and tensor-parallel layouts of tests/mesh_checks.py (the device
count is fixed once per process, and the rest of the suite runs on one)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import pallas_cache as pc
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
