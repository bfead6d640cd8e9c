"""Dense MoE references for tests and examples: the oracle a plan is checked against end to end.

:func:`moe_dense` reads every routed expert from the host bank; :func:`moe_combine` computes a
plan's hybrid output (slots from the pool, CPU routes from the bank), evaluating both partials
for every route and masking. Pure and jittable.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from pallas_cache.hints import IndexLike, PyTree
from pallas_cache.plans import EnsurePlan

from pallas_cache.moe import (check_bank_layer, check_plan_geometry, check_routes, gather_rows,
                               memory_space)

__all__ = ["moe_combine", "moe_dense"]


def _route_inputs(x, expert_ids, gates):
    """Broadcast tokens over their routes: ``x [..., H]``, routes ``[..., k]`` -> ``[R, H]``."""
    expert_ids, gates = check_routes(x, expert_ids, gates)
    x_per_route = jnp.broadcast_to(x[..., None, :], expert_ids.shape + x.shape[-1:])
    return x_per_route.reshape(-1, x.shape[-1]), expert_ids.reshape(-1), gates.reshape(-1)


def _weighted_sum(route_outputs, gates, take, out_shape):
    """``sum_k gates * output`` over the routes of each token, masked routes exactly zero.

    ``jnp.where`` rather than a multiply by the mask, so garbage in a masked route's output (an
    empty slot, NaN) cannot leak into the sum.
    """
    gated = gates[:, None].astype(route_outputs.dtype) * route_outputs
    weighted = jnp.where(take[:, None], gated, 0)
    return weighted.reshape(out_shape[:-1] + (-1, out_shape[-1])).sum(axis=-2)


def moe_dense(x: jax.Array, expert_ids: jax.Array, gates: jax.Array, host_bank: PyTree,
              expert_fn: Callable[[Any, jax.Array], jax.Array], *,
              layer: IndexLike | None = None) -> jax.Array:
    """The dense MoE output, every routed expert read from the host bank: the oracle.

    Args:
      x: ``[..., H]`` token activations.
      expert_ids: int ``[..., k]``: the router's layer-local choices per token, ``-1`` = padding.
      gates: ``[..., k]``: the router's weight of each choice.
      host_bank: leaves ``[E, ...]``, or ``[L, E, ...]`` with ``layer=``.
      expert_fn: ``expert_fn(weights, x_row) -> y_row`` for one expert (``weights`` has the bank's
        pytree structure with the leading axis removed) and one token ``[H]``; returns ``[H]``.
      layer: optional layer index (see :func:`apply_copy_plan`).

    Returns:
      ``[..., H]``: ``sum_k gates[..., k] * expert_fn(W[expert_ids[..., k]], x)`` over non-padding
      routes; zeros for a token whose routes are all padding.
    """
    layer = check_bank_layer(host_bank, layer)
    x_routes, ids, gate = _route_inputs(x, expert_ids, gates)
    routed = ids >= 0
    space = memory_space(x)
    weights = jax.tree.map(
        lambda b: gather_rows(b, jnp.where(routed, ids, 0), layer, space), host_bank)
    outputs = jax.vmap(expert_fn)(weights, x_routes)
    return _weighted_sum(outputs, gate, routed, x.shape)


def moe_combine(x: jax.Array, expert_ids: jax.Array, gates: jax.Array, plan: EnsurePlan,
                pool: PyTree, host_bank: PyTree, expert_fn: Callable[[Any, jax.Array], jax.Array],
                *, layer: IndexLike | None = None) -> jax.Array:
    """The hybrid MoE output: device partial (from the pool) + CPU partial (from the host bank).

    Call it after :func:`apply_copy_plan` has applied the same ``plan`` to ``pool``. If the plan
    is right, the result equals :func:`moe_dense` up to float rounding.

    Args:
      x: ``[..., H]`` token activations.
      expert_ids: int ``[..., k]``, the routes the plan was made for (``-1`` = padding). Needed
        because a CPU route's slot is ``-1``: its expert is known only from the route.
      gates: ``[..., k]`` router weights.
      plan: the ``EnsurePlan`` of ``ensure``/``ensure_hybrid`` for ``expert_ids``.
      pool: leaves ``[S, ...]``, with the plan's copies applied.
      host_bank: leaves ``[E, ...]``, or ``[L, E, ...]`` with ``layer=``.
      expert_fn: as in :func:`moe_dense`.
      layer: optional layer index for a whole-model bank.

    Returns:
      ``[..., H]``: the gate-weighted sum over routes of ``expert_fn(pool[slot], x)`` for device
      routes (``plan.slots >= 0``) and ``expert_fn(host_bank[expert], x)`` for CPU routes
      (``plan.cpu``); padding routes (and any route the plan assigned to neither) contribute 0.
    """
    layer = check_bank_layer(host_bank, layer)
    check_plan_geometry(plan.copy, pool, host_bank, layer)
    x_routes, ids, gate = _route_inputs(x, expert_ids, gates)
    slots = jnp.asarray(plan.slots).reshape(-1)
    cpu = jnp.asarray(plan.cpu).reshape(-1)
    if slots.shape != ids.shape or cpu.shape != ids.shape:
        raise ValueError(
            f"plan routes {plan.slots.shape} differ from expert_ids {expert_ids.shape}")
    on_device = slots >= 0
    on_cpu = cpu & (ids >= 0)

    space = memory_space(x)
    device_weights = jax.tree.map(
        lambda p: gather_rows(p, jnp.where(on_device, slots, 0), None, space), pool)
    device_partial = _weighted_sum(jax.vmap(expert_fn)(device_weights, x_routes), gate, on_device,
                                   x.shape)

    cpu_weights = jax.tree.map(
        lambda b: gather_rows(b, jnp.where(on_cpu, ids, 0), layer, space), host_bank)
    cpu_partial = _weighted_sum(jax.vmap(expert_fn)(cpu_weights, x_routes), gate, on_cpu, x.shape)
    return device_partial + cpu_partial
