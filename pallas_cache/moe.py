"""Applying a plan to real weights: the masked copy of its fetches (docs/semantics.md §5.13).

:func:`apply_copy_plan` writes ``pool[dst_slots[i]] = host_bank[src_rows[i]]`` for ``i < count``
(padding writes nothing), reading from the bank exactly those rows (:func:`copy_counted_rows`);
:func:`put_host_bank` places a bank in ``pinned_host`` memory where the backend has it, and
:func:`gather_rows` reads the rows it is given from it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap

from pallas_cache.hints import IndexLike, PyTree
from pallas_cache.tree import varying_like

__all__ = [
    "apply_copy_plan",
    "check_bank_layer",
    "check_bank_rank",
    "check_plan_geometry",
    "check_routes",
    "copy_counted_rows",
    "copy_host_rows",
    "gather_rows",
    "host_memory_kind",
    "memory_space",
    "put_host_bank",
    "to_space",
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


def put_host_bank(bank: PyTree, device: jax.Device | None = None, *,
                  prefer_host: bool = True) -> PyTree:
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
    sharding = jax.sharding.make_single_device_sharding(device, memory_kind=kind)
    return jax.tree.map(lambda leaf: jax.device_put(leaf, sharding), bank)


def memory_space(x):
    """The memory space of an array or tracer (a ``jax.memory.Space``), or None if unknown."""
    if _MEMORY_SPACE is None:
        return None
    return getattr(jax.typeof(x), "memory_space", None)


def to_space(x, space):
    """``x`` moved to memory ``space`` (a no-op when it is already there or the space is unknown)."""
    if space is None or memory_space(x) in (None, space):
        return x
    return jax.device_put(x, space)


def gather_rows(bank_leaf, rows, layer, out_space):
    """``bank_leaf[rows]`` (or ``bank_leaf[layer, rows]``) in memory ``out_space``.

    From a bank in host memory into another space, each row is copied on its own
    (:func:`copy_host_rows`); otherwise one gather where the bank lives, then the rows move.

    Args:
      bank_leaf: ``[E, ...]`` (``layer`` None) or ``[L, E, ...]``; device or host memory.
      rows: int32 indices in range (callers clamp masked entries).
      layer: None, or an int32 scalar layer index.
      out_space: the memory space the rows are wanted in (the pool's, or the device's).
    """
    if not isinstance(bank_leaf, jax.Array):  # a NumPy bank: index it as a JAX array
        bank_leaf = jnp.asarray(bank_leaf)
    bank_space = memory_space(bank_leaf)
    if (bank_space is not None and bank_space == getattr(_MEMORY_SPACE, "Host", None)
            and out_space not in (None, bank_space)):
        return copy_host_rows(bank_leaf, rows, layer, out_space)
    index = rows if layer is None else (jnp.broadcast_to(layer, rows.shape), rows)
    # Move the small index vector to the bank, not the bank to the index.
    index = jax.tree.map(lambda i: to_space(i, bank_space), index)
    return to_space(bank_leaf[index], out_space)


def copy_host_rows(bank_leaf, rows, layer, out_space):
    """``bank_leaf[rows]`` from host memory into ``out_space``, one row-sized copy per row.

    A gather that reads host memory is not something XLA:GPU compiles. It fails at layout
    assignment with "Bitcast cannot have different memory spaces" (measured on an H200, jax
    0.11.2; ``benchmarks/RESULTS.md``, ``gpu_moe``). What every backend moves between memories is
    a slice: a ``dynamic_slice`` of the host array followed by a transfer. So each row is sliced
    where it lives and copied on its own, in a loop with a fixed trip count: every entry of
    ``rows`` crosses the link, masked ones included (callers clamp those onto a row). A plan's
    copies, which must move only their counted rows, go through :func:`copy_counted_rows`.

    Under ``vmap`` (a batch of plans, layers or banks) the batch becomes more rows of the same
    loop (a ``custom_vmap`` rule), not the gather that batching a ``dynamic_slice`` makes, which
    JAX refuses outright for an operand in host memory.
    """
    indices = (rows,) if layer is None else (jnp.broadcast_to(layer, rows.shape), rows)

    @custom_vmap
    def copy(bank_leaf, *indices):
        return _slice_rows(bank_leaf, indices, out_space)

    @copy.def_vmap
    def _copy_vmap(axis_size, in_batched, bank_leaf, *indices):
        bank_batched, *index_batched = in_batched
        # Every index has one per-example shape (the rows' at the first vmap, more at nested ones).
        shape = (axis_size,) + indices[0].shape[1 if index_batched[0] else 0:]
        indices = tuple(index if batched else jnp.broadcast_to(index, shape)
                        for index, batched in zip(indices, index_batched))
        if bank_batched:  # a batch of banks: the batch index is one more leading index
            indices = (lax.broadcasted_iota(jnp.int32, shape, 0),) + indices
        return copy(bank_leaf, *indices), True

    return copy(bank_leaf, *indices)


def _slice_rows(bank_leaf, indices, out_space):
    """``bank_leaf[indices[0][j], indices[1][j], ...]`` for every ``j``, in ``out_space``: one
    ``dynamic_slice`` and one transfer per row, in a ``fori_loop`` (see :func:`copy_host_rows`).
    ``indices``: int arrays of one shape, one per leading axis of the bank."""
    row_shape = bank_leaf.shape[len(indices):]
    flat = [index.reshape(-1).astype(jnp.int32) for index in indices]
    out = to_space(jnp.zeros((flat[0].shape[0],) + row_shape, bank_leaf.dtype), out_space)
    out = varying_like(out, bank_leaf, flat)  # the loop's carry has the rows' type

    def copy_row(i, out):
        return _move_row(out, (i,), bank_leaf, tuple(index[i] for index in flat))

    out = lax.fori_loop(0, flat[0].shape[0], copy_row, out)
    return out.reshape(indices[0].shape + row_shape)


def _move_row(out, out_at, bank_leaf, bank_at):
    """``out`` with its row at the leading indices ``out_at`` set to ``bank_leaf``'s row at
    ``bank_at``: one ``dynamic_slice`` where the bank lives, one row-sized transfer into
    ``out``'s memory space, one ``dynamic_update_slice`` (in place in a loop's carry)."""
    row_shape = bank_leaf.shape[len(bank_at):]
    zeros = (jnp.int32(0),) * len(row_shape)
    piece = lax.dynamic_slice(bank_leaf, tuple(bank_at) + zeros,
                              (1,) * len(bank_at) + row_shape)
    piece = to_space(piece, memory_space(out)).astype(out.dtype)
    piece = piece.reshape((1,) * len(out_at) + row_shape)
    return lax.dynamic_update_slice(out, piece, tuple(out_at) + zeros)


def copy_counted_rows(outs, banks, valid, out_index, bank_index):
    """Copy the valid entries' rows: ``outs[k][out_index[:, j]] = banks[k][bank_index[:, j]]``
    for every ``j`` with ``valid[j]``, in order of ``j``, and nothing else.

    Exactly the valid rows are read and moved: the valid entries are packed to the front and a
    ``fori_loop`` whose trip count is their (traced) number copies one row of every leaf per
    trip (:func:`_move_row`), so an entry that is not valid is never sliced, let alone
    transferred. A bank in host memory is read by row slices only, never by a gather (see
    :func:`copy_host_rows`).

    Under ``vmap`` (a ``custom_vmap`` rule; nested vmaps too) a batch becomes more entries of
    the same loop, each addressed with its batch index, so a batch moves the sum of its
    members' valid rows. (JAX's own batching of the loop would run the longest member's trips
    for every member, and would turn each row slice into a gather, which it refuses for an
    operand in host memory.)

    Args:
      outs: a list of arrays ``[S, ...]``; donated, they are written in place.
      banks: a list of arrays ``[*lead, ...]``, one per out, whose rows after the ``lead`` axes
        have the shape of the out's rows.
      valid: bool ``[N]``, the entries to copy.
      out_index: a tuple of int32 ``[N]`` arrays, one per leading axis of the outs, in range
        where valid.
      bank_index: a tuple of int32 ``[N]`` arrays, one per leading axis of the banks, in range
        where valid.

    Returns:
      The list of new outs (same shapes, dtypes and memory spaces).
    """
    return _counted_copy(((),) * len(banks))(list(outs), list(banks), valid, (),
                                             tuple(out_index), tuple(bank_index))


def _counted_copy(uses):
    """The ``custom_vmap`` function of :func:`copy_counted_rows`, for banks batched by the vmap
    levels that ``uses[k]`` flags (one flag per enclosing level, outermost first: whether bank
    ``k`` has that level's axis)."""

    @custom_vmap
    def copy(outs, banks, valid, batch, out_index, bank_index):
        return _counted_loop(outs, banks, valid, batch, out_index, bank_index, uses)

    @copy.def_vmap
    def _copy_vmap(axis_size, in_batched, outs, banks, valid, batch, out_index, bank_index):
        outs_b, banks_b, valid_b, batch_b, out_index_b, bank_index_b = in_batched
        shape = (axis_size, valid.shape[-1])

        def flat(index, batched):  # [B, N], or an unbatched [N] broadcast to it -> [B * N]
            return (index if batched else jnp.broadcast_to(index, shape)).reshape(-1)

        level = lax.broadcasted_iota(jnp.int32, shape, 0).reshape(-1)
        outs = [out if batched else jnp.broadcast_to(out, (axis_size,) + out.shape)
                for out, batched in zip(outs, outs_b)]
        new_uses = tuple((batched,) + use for batched, use in zip(banks_b, uses))
        new = _counted_copy(new_uses)(
            outs, banks, flat(valid, valid_b), (level,) + tuple(map(flat, batch, batch_b)),
            tuple(map(flat, out_index, out_index_b)), tuple(map(flat, bank_index, bank_index_b)))
        return new, [True] * len(new)

    return copy


def _counted_loop(outs, banks, valid, batch, out_index, bank_index, uses):
    """:func:`copy_counted_rows` unbatched. ``batch`` holds every entry's batch index, one array
    per vmap level (outermost first); it addresses every out, and the banks that ``uses`` says
    have that level's axis."""
    valid = valid.astype(bool)
    order = jnp.argsort(~valid, stable=True).astype(jnp.int32)  # the valid entries first
    trips = jnp.sum(valid, dtype=jnp.int32)
    outs = varying_like(list(outs), banks, valid, batch, out_index, bank_index)

    def copy_entry(i, outs):
        j = order[i]
        out_at = tuple(index[j] for index in batch + out_index)
        return [_move_row(out, out_at, bank,
                          tuple(b[j] for b, has in zip(batch, use) if has)
                          + tuple(index[j] for index in bank_index))
                for out, bank, use in zip(outs, banks, uses)]

    return lax.fori_loop(0, trips, copy_entry, outs)


def check_routes(x, expert_ids, gates):
    """``x [..., H]`` and routes/gates ``[..., k]`` as arrays, after checking their shapes agree."""
    expert_ids = jnp.asarray(expert_ids)
    gates = jnp.asarray(gates)
    if expert_ids.shape != gates.shape:
        raise ValueError(f"expert_ids {expert_ids.shape} and gates {gates.shape} differ in shape")
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise TypeError(f"expert_ids must be integer expert ids, got dtype {expert_ids.dtype} "
                        f"(shape {expert_ids.shape}); a float id would be truncated")
    if expert_ids.ndim < 1 or x.shape[:-1] != expert_ids.shape[:-1]:
        raise ValueError(
            f"x {x.shape} must be [..., H] with the leading axes of expert_ids {expert_ids.shape}")
    return expert_ids, gates


def check_bank_layer(host_bank, layer):
    """Validate ``layer`` against the bank rank; returns it as an int32 scalar or None.

    A concrete ``layer`` (a Python int or a concrete array) outside ``[0, L)`` of any bank leaf
    raises ``ValueError`` naming it and ``L``; a traced one cannot be seen here (callers mask it,
    docs/semantics.md §5.13)."""
    leaves = jax.tree.leaves(host_bank)
    if layer is None:
        return None
    for leaf in leaves:
        if leaf.ndim < 2:
            raise ValueError(
                f"with layer= the host bank leaves must be [L, E, ...], got shape {leaf.shape}")
    if not isinstance(layer, jax.core.Tracer):
        value = np.asarray(layer)
        if value.shape == () and np.issubdtype(value.dtype, np.integer):
            num_layers = min(leaf.shape[0] for leaf in leaves)
            if not 0 <= int(value) < num_layers:
                raise ValueError(f"layer {int(value)} is outside [0, {num_layers}): the host "
                                 f"bank holds {num_layers} layers")
    layer = jnp.asarray(layer)
    if layer.shape != () or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise TypeError(f"layer must be an integer scalar, got {layer.dtype}{list(layer.shape)}")
    return layer.astype(jnp.int32)


def bank_rank_message(shape, has_layer: bool, why: str) -> str:
    """The error for a bank of the other rank than ``layer=`` says: a whole-model bank
    ``[L, E, ...]`` without ``layer=``, or one layer's bank ``[E, ...]`` with it."""
    shape = tuple(shape)
    if has_layer:
        return (f"layer= was given, but the host bank leaf {shape} is one layer's bank [E, ...] "
                f"({why}): drop layer=, or pass the bank of every layer [L, E, ...]")
    return (f"the host bank leaf {shape} is a whole-model bank [L, E, ...] ({why}): pass layer= "
            f"to read that layer's experts")


def check_bank_rank(host_bank, layer, pool) -> None:
    """Refuse, naming it, a whole-model bank ``[L, E, ...]`` without ``layer=`` or a one-layer
    bank ``[E, ...]`` with it: an expert's row (a pool leaf ``[S, *row]`` past its slot axis) is
    what the bank leaf holds past its expert axis at the other rank, and not at the one given."""
    bank_leaves, pool_leaves = jax.tree.leaves(host_bank), jax.tree.leaves(pool)
    if len(bank_leaves) != len(pool_leaves):
        return  # apply_copy_plan names the structures
    axis = 0 if layer is None else 1
    for bank, slots in zip(bank_leaves, pool_leaves):
        row = tuple(slots.shape[1:])
        if tuple(bank.shape[axis + 1:]) != row and tuple(bank.shape[2 - axis:]) == row:
            raise ValueError(bank_rank_message(bank.shape, layer is not None,
                                               f"the pool's expert rows are {list(row)}"))


def check_plan_geometry(copy, pool, host_bank, layer) -> None:
    """Refuse, at trace time, a pool or host bank of another geometry than the plan's.

    ``copy`` is a :class:`~pallas_cache.plans.CopyPlan`; its static ``num_slots`` / ``num_experts``
    (None on a hand-built plan: nothing to check) must equal every pool leaf's leading axis and
    every bank leaf's expert axis (axis 0, or axis 1 with ``layer=``). A smaller pool would drop
    copies past its end and a smaller bank would clamp two experts onto one row, silently
    (docs/semantics.md §5.13).
    """
    num_slots = getattr(copy, "num_slots", None)
    num_experts = getattr(copy, "num_experts", None)
    for leaf in jax.tree.leaves(pool):
        if num_slots is not None and leaf.shape[0] != num_slots:
            raise ValueError(f"the plan is for a pool of {num_slots} slots, but a pool leaf has "
                             f"shape {tuple(leaf.shape)} ({leaf.shape[0]} slots)")
    axis = 0 if layer is None else 1
    for leaf in jax.tree.leaves(host_bank):
        if num_experts is not None and leaf.ndim > axis and leaf.shape[axis] != num_experts:
            raise ValueError(f"the plan is for {num_experts} experts per layer, but a host bank "
                             f"leaf has shape {tuple(leaf.shape)} ({leaf.shape[axis]} rows on "
                             f"its expert axis {axis})")


def _check_entries(copy, num_slots, num_rows) -> None:
    """Raise ``ValueError`` naming the first counted entry of a concrete plan whose slot is not in
    ``[0, num_slots)`` or whose row is not in ``[0, num_rows)``; a traced plan is masked instead."""
    fields = (copy.dst_slots, copy.src_rows, copy.count)
    if any(isinstance(x, jax.core.Tracer) for x in fields):
        return
    dst, src, count = (np.asarray(x).astype(np.int64) for x in fields)
    counted = (np.arange(dst.shape[0]) < count) & (dst >= 0) & (src >= 0)
    for i in np.flatnonzero(counted & ((dst >= num_slots) | (src >= num_rows))):
        if dst[i] >= num_slots:
            raise ValueError(f"copy entry {i}: dst_slots[{i}] = {dst[i]} is outside [0, "
                             f"{num_slots}), the pool's slots")
        raise ValueError(f"copy entry {i}: src_rows[{i}] = {src[i]} is outside [0, {num_rows}), "
                         f"the host bank's expert rows")


def apply_copy_plan(pool: PyTree, host_bank: PyTree, plan: Any, *,
                    layer: IndexLike | None = None) -> PyTree:
    """Copy a plan's fetched experts from the host bank into their device slots.

    ``pool[dst_slots[i]] = host_bank[src_rows[i]]`` for every ``i < count``; padding entries
    (``-1``, or at or past ``count``) write nothing. Pure: returns the new pool. Jit it with the
    pool donated to update in place: ``jax.jit(apply_copy_plan, donate_argnums=0)``.

    Exactly the rows it writes are read from the bank and moved, one row slice per entry and
    bank leaf in a loop whose trip count is the (traced) number of such entries
    (:func:`copy_counted_rows`): a plan with ``count = 0`` reads nothing, and under ``vmap`` a
    batch reads the sum of its members' counts.

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

    Raises:
      ValueError: at trace time, a pool or bank whose geometry differs from the plan's
        (:func:`check_plan_geometry`), naming both shapes; a concrete ``layer`` outside
        ``[0, L)``, naming it and ``L``; a concrete plan with a counted entry whose slot is
        outside ``[0, S)`` or whose row is outside ``[0, E)``, naming the entry. Traced, the
        same values copy nothing: an entry out of range writes no slot, a layer out of range
        returns the pool unchanged (docs/semantics.md §5.13).
    """
    copy = getattr(plan, "copy", plan)
    dst_slots = jnp.asarray(copy.dst_slots, jnp.int32)
    src_rows = jnp.asarray(copy.src_rows, jnp.int32)
    count = jnp.asarray(copy.count, jnp.int32)
    check_bank_rank(host_bank, layer, pool)
    layer = check_bank_layer(host_bank, layer)
    check_plan_geometry(copy, pool, host_bank, layer)

    pool_leaves, pool_tree = jax.tree.flatten(pool)
    bank_leaves, bank_tree = jax.tree.flatten(host_bank)
    if pool_tree != bank_tree:
        raise ValueError(f"pool and host bank differ in structure: {pool_tree} vs {bank_tree}")
    num_slots = pool_leaves[0].shape[0]
    for leaf in pool_leaves:
        if leaf.shape[0] != num_slots:
            raise ValueError(f"pool leaves disagree on the slot count: {leaf.shape[0]} vs {num_slots}")

    axis = 0 if layer is None else 1
    num_rows = min(leaf.shape[axis] for leaf in bank_leaves)
    counted = (jnp.arange(dst_slots.shape[0]) < count) & (dst_slots >= 0) & (src_rows >= 0)
    _check_entries(copy, num_slots, num_rows)
    # A traced entry out of range copies nothing (a gather would clamp it onto another row),
    # and so does every entry under a traced layer out of range.
    valid = counted & (dst_slots < num_slots) & (src_rows < num_rows)
    if layer is not None:
        num_layers = min(leaf.shape[0] for leaf in bank_leaves)
        layer_ok = (layer >= 0) & (layer < num_layers)
        valid = valid & layer_ok
        layer = jnp.where(layer_ok, layer, 0)
    bank_index = (jnp.where(valid, src_rows, 0),)  # in range; not read where not valid
    if layer is not None:
        bank_index = (jnp.broadcast_to(layer, src_rows.shape),) + bank_index
    for pool_leaf, bank_leaf in zip(pool_leaves, bank_leaves):
        bank_row_shape = bank_leaf.shape[1:] if layer is None else bank_leaf.shape[2:]
        if bank_row_shape != pool_leaf.shape[1:]:
            raise ValueError(
                f"pool rows {pool_leaf.shape[1:]} and host bank rows {bank_row_shape} differ")
    bank_leaves = [leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf)
                   for leaf in bank_leaves]
    new_leaves = copy_counted_rows(pool_leaves, bank_leaves, valid,
                                   (jnp.where(valid, dst_slots, 0),), bank_index)
    return jax.tree.unflatten(pool_tree, new_leaves)
