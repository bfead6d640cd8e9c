"""Applying plans to real weights: the copy, and a reference hybrid MoE combine (docs/semantics.md §5.13).

The cache itself only computes metadata. A decode loop still has to do two things with a plan:

1. **Copy** the fetched experts from the host bank into their device slots
   (:func:`apply_copy_plan`): ``pool[dst_slots[i]] = host_bank[src_rows[i]]`` for ``i < count``.
   It is a masked scatter: the plan is fixed-size and ``-1``-padded, and a padding entry must
   write *nothing*. JAX normalises a negative scatter index (``-1`` would silently overwrite the
   last slot), so padding entries are pointed at the out-of-range index ``S`` and the scatter uses
   ``mode="drop"``. Only the ``count`` fetched rows are gathered from the host bank, so only they
   cross the host-device link.
2. **Combine** the two halves of a hybrid step (:func:`moe_combine`): routes with ``slots >= 0``
   read their expert from the device pool, routes with ``cpu`` read it from the host bank, and the
   router's gates weight both. A padding route (expert ``-1``) contributes nothing. Comparing it
   with :func:`moe_dense` (every expert read from the host bank) is *the* end-to-end check that a
   plan is right: a route that points at the wrong slot, a copy that was dropped, or a CPU route
   that was also given a slot all change the output.

Both are pure functions: they work eagerly, under ``jax.jit``, and inside ``lax.scan`` decode
loops with a traced layer index. The pool is returned, not mutated; to let XLA update it in
place, jit the step with the pool donated, ``jax.jit(apply_copy_plan, donate_argnums=0)`` (or
donate it to the whole decode step). Donation is ignored, with a warning, on backends that do not
implement it (CPU).

Weights may be a single array or any pytree of arrays (e.g. ``{"w_in": ..., "w_out": ...}`` for an
MLP expert): every leaf of the pool has leading axis ``S``, every leaf of a host bank leading axis
``E`` (one layer) or ``L, E`` (all layers, with ``layer=`` given).

**Host memory.** :func:`put_host_bank` places a bank in the ``pinned_host`` memory of the device
where the backend has that memory kind (GPU, TPU, and recent CPU backends), so the bank does not
take device memory. Inside the functions below, a host-resident bank is read by moving the *index*
vector to host memory, gathering there, and moving the gathered rows to the device: the whole bank
never crosses the link. Where the backend has no host memory kind, ``put_host_bank`` leaves the
bank in ordinary device memory and everything works the same way with plain gathers; results are
identical either way (only where the bytes live differs).

:func:`moe_combine` is a *reference*: it computes the CPU partial by bringing the CPU routes'
rows to the device (fine for checking correctness; a real engine runs that partial on the host
CPU, which is the whole point of a CPU route). Both partials are evaluated for every route and
masked, so the cost is two expert evaluations per route; it is meant for tests and examples.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

__all__ = [
    "apply_copy_plan",
    "host_memory_kind",
    "moe_combine",
    "moe_dense",
    "put_host_bank",
]

PINNED_HOST = "pinned_host"

# The memory-space enum of traced values (jax >= 0.7); None on JAX versions without it, in which
# case every array is treated as device-resident (plain gathers).
_MEMORY_SPACE = getattr(getattr(jax, "memory", None), "Space", None)


def host_memory_kind(device=None) -> str | None:
    """``"pinned_host"`` if ``device`` (default: the first device) has that memory kind, else None.

    Args:
      device: a ``jax.Device``; the default device when None.

    Returns:
      The memory kind to put host banks in, or None where the backend does not expose one (the
      bank then stays in device memory).
    """
    device = jax.devices()[0] if device is None else device
    try:
        kinds = {memory.kind for memory in device.addressable_memories()}
    except Exception:  # backends without the memories API
        return None
    return PINNED_HOST if PINNED_HOST in kinds else None


def put_host_bank(bank, device=None, *, prefer_host: bool = True):
    """Place a bank of expert weights (array or pytree) in host memory where supported.

    Args:
      bank: the host-side weights, leaves shaped ``[E, ...]`` or ``[L, E, ...]``.
      device: the device the pool lives on; the default device when None.
      prefer_host: False keeps the bank in device memory even where host memory exists (an
        escape hatch for a backend whose compiler refuses gathers from host memory).

    Returns:
      The bank as JAX arrays in that device's ``pinned_host`` memory, or, where the backend has
      no such memory kind (or ``prefer_host`` is False), in its default (device) memory. Every
      function in this module accepts either placement and computes identical results.
    """
    device = jax.devices()[0] if device is None else device
    kind = host_memory_kind(device) if prefer_host else None
    sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
    return jax.tree.map(lambda leaf: jax.device_put(leaf, sharding), bank)


def _memory_space(x):
    """The memory space of an array or tracer (a ``jax.memory.Space``), or None if unknown."""
    if _MEMORY_SPACE is None:
        return None
    return getattr(jax.typeof(x), "memory_space", None)


def _to_space(x, space):
    """``x`` moved to memory ``space`` (a no-op when it is already there or the space is unknown)."""
    if space is None or _memory_space(x) in (None, space):
        return x
    return jax.device_put(x, space)


def _gather_rows(bank_leaf, rows, layer, out_space):
    """``bank_leaf[rows]`` (or ``bank_leaf[layer, rows]``), gathered where the bank lives.

    Args:
      bank_leaf: ``[E, ...]`` (``layer`` None) or ``[L, E, ...]``; device or host memory.
      rows: int32 indices in range (callers clamp masked entries).
      layer: None, or an int32 scalar layer index.
      out_space: the memory space the rows are wanted in (the pool's, or the device's).
    """
    if not isinstance(bank_leaf, jax.Array):  # a NumPy bank: index it as a JAX array
        bank_leaf = jnp.asarray(bank_leaf)
    bank_space = _memory_space(bank_leaf)
    index = rows if layer is None else (jnp.broadcast_to(layer, rows.shape), rows)
    # Move the small index vector to the bank, not the bank to the index.
    index = jax.tree.map(lambda i: _to_space(i, bank_space), index)
    return _to_space(bank_leaf[index], out_space)


def _check_layer(host_bank, layer):
    """Validate ``layer`` against the bank rank; returns it as an int32 scalar or None."""
    leaves = jax.tree.leaves(host_bank)
    if layer is None:
        return None
    for leaf in leaves:
        if leaf.ndim < 2:
            raise ValueError(
                f"with layer= the host bank leaves must be [L, E, ...], got shape {leaf.shape}")
    layer = jnp.asarray(layer)
    if layer.shape != () or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise TypeError(f"layer must be an integer scalar, got {layer.dtype}{list(layer.shape)}")
    return layer.astype(jnp.int32)


def apply_copy_plan(pool, host_bank, plan, *, layer=None):
    """Copy a plan's fetched experts from the host bank into their device slots.

    ``pool[dst_slots[i]] = host_bank[src_rows[i]]`` for every ``i < count``; padding entries
    (``-1``, or at or past ``count``) write nothing. Pure: returns the new pool. Jit it with the
    pool donated to update in place: ``jax.jit(apply_copy_plan, donate_argnums=0)``.

    Args:
      pool: the device slot pool, an array or pytree whose leaves are ``[S, ...]``.
      host_bank: the host weights, same pytree structure, leaves ``[E, ...]`` (one layer, the
        layer the plan was made for) or ``[L, E, ...]`` together with ``layer=``. Host memory
        (``put_host_bank``) or device memory.
      plan: an ``EnsurePlan``/``MaterializePlan`` (anything with a ``.copy``) or a ``CopyPlan``
        (``dst_slots``, ``src_rows``, ``count``). ``src_rows`` are layer-local expert ids.
      layer: optional int (possibly traced): read rows ``host_bank[layer, src_rows]`` from a bank
        holding all layers, so the decode loop never slices a whole layer out of host memory.

    Returns:
      The new pool, same structure, shapes, dtypes and memory placement as ``pool``.
    """
    copy = getattr(plan, "copy", plan)
    dst_slots = jnp.asarray(copy.dst_slots, jnp.int32)
    src_rows = jnp.asarray(copy.src_rows, jnp.int32)
    count = jnp.asarray(copy.count, jnp.int32)
    layer = _check_layer(host_bank, layer)

    pool_leaves, pool_tree = jax.tree.flatten(pool)
    bank_leaves, bank_tree = jax.tree.flatten(host_bank)
    if pool_tree != bank_tree:
        raise ValueError(f"pool and host bank differ in structure: {pool_tree} vs {bank_tree}")
    num_slots = pool_leaves[0].shape[0]
    for leaf in pool_leaves:
        if leaf.shape[0] != num_slots:
            raise ValueError(f"pool leaves disagree on the slot count: {leaf.shape[0]} vs {num_slots}")

    valid = (jnp.arange(dst_slots.shape[0]) < count) & (dst_slots >= 0) & (src_rows >= 0)
    # Out-of-range index + mode="drop" writes nothing; -1 would wrap to the last slot.
    scatter_to = jnp.where(valid, dst_slots, num_slots)
    gather_from = jnp.where(valid, src_rows, 0)  # any in-range row; its copy is dropped

    def copy_leaf(pool_leaf, bank_leaf):
        bank_row_shape = bank_leaf.shape[1:] if layer is None else bank_leaf.shape[2:]
        if bank_row_shape != pool_leaf.shape[1:]:
            raise ValueError(
                f"pool rows {pool_leaf.shape[1:]} and host bank rows {bank_row_shape} differ")
        pool_space = _memory_space(pool_leaf)
        rows = _gather_rows(bank_leaf, gather_from, layer, pool_space)
        return pool_leaf.at[_to_space(scatter_to, pool_space)].set(
            rows.astype(pool_leaf.dtype), mode="drop")

    return jax.tree.unflatten(pool_tree, [copy_leaf(p, b) for p, b in zip(pool_leaves, bank_leaves)])


def _route_inputs(x, expert_ids, gates):
    """Broadcast tokens over their routes: ``x [..., H]``, routes ``[..., k]`` -> ``[R, H]``."""
    expert_ids = jnp.asarray(expert_ids)
    gates = jnp.asarray(gates)
    if expert_ids.shape != gates.shape:
        raise ValueError(f"expert_ids {expert_ids.shape} and gates {gates.shape} differ in shape")
    if expert_ids.ndim < 1 or x.shape[:-1] != expert_ids.shape[:-1]:
        raise ValueError(
            f"x {x.shape} must be [..., H] with the leading axes of expert_ids {expert_ids.shape}")
    x_per_route = jnp.broadcast_to(x[..., None, :], expert_ids.shape + x.shape[-1:])
    return x_per_route.reshape(-1, x.shape[-1]), expert_ids.reshape(-1), gates.reshape(-1)


def _weighted_sum(route_outputs, gates, take, out_shape):
    """``sum_k gates * output`` over the routes of each token, masked routes exactly zero.

    ``jnp.where`` rather than a multiply by the mask, so garbage in a masked route's output (an
    empty slot, NaN) cannot leak into the sum.
    """
    weighted = jnp.where(take[:, None], gates[:, None].astype(route_outputs.dtype) * route_outputs, 0)
    return weighted.reshape(out_shape[:-1] + (-1, out_shape[-1])).sum(axis=-2)


def moe_dense(x, expert_ids, gates, host_bank, expert_fn: Callable[[Any, jax.Array], jax.Array],
              *, layer=None):
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
    layer = _check_layer(host_bank, layer)
    x_routes, ids, gate = _route_inputs(x, expert_ids, gates)
    routed = ids >= 0
    space = _memory_space(x)
    weights = jax.tree.map(
        lambda b: _gather_rows(b, jnp.where(routed, ids, 0), layer, space), host_bank)
    outputs = jax.vmap(expert_fn)(weights, x_routes)
    return _weighted_sum(outputs, gate, routed, x.shape)


def moe_combine(x, expert_ids, gates, plan, pool, host_bank,
                expert_fn: Callable[[Any, jax.Array], jax.Array], *, layer=None):
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
    layer = _check_layer(host_bank, layer)
    x_routes, ids, gate = _route_inputs(x, expert_ids, gates)
    slots = jnp.asarray(plan.slots).reshape(-1)
    cpu = jnp.asarray(plan.cpu).reshape(-1)
    if slots.shape != ids.shape or cpu.shape != ids.shape:
        raise ValueError(f"plan routes {plan.slots.shape} differ from expert_ids {expert_ids.shape}")
    on_device = slots >= 0
    on_cpu = cpu & (ids >= 0)

    space = _memory_space(x)
    device_weights = jax.tree.map(
        lambda p: _gather_rows(p, jnp.where(on_device, slots, 0), None, space), pool)
    device_partial = _weighted_sum(jax.vmap(expert_fn)(device_weights, x_routes), gate, on_device,
                                   x.shape)

    cpu_weights = jax.tree.map(
        lambda b: _gather_rows(b, jnp.where(on_cpu, ids, 0), layer, space), host_bank)
    cpu_partial = _weighted_sum(jax.vmap(expert_fn)(cpu_weights, x_routes), gate, on_cpu, x.shape)
    return device_partial + cpu_partial
