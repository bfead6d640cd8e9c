"""Several devices: one cache per device on a JAX mesh (docs/semantics.md §5.17).

Two layouts, both run inside ``jax.shard_map`` over one mesh axis of ``D`` devices (why these
two and how the choices were made: docs/design.md, "Several devices"):

- **Expert-parallel.** Each device owns a fixed share of every layer's experts
  (:class:`ExpertSharding`) and keeps its own cache of only those, under layer-local ids
  ``0 .. num_local - 1`` (ascending global id). :func:`local_routes` maps a layer's global
  routes to a device's local routes (``-1`` for routes another device owns),
  :func:`route_assignment` maps the devices' plans back to a slot or CPU assignment per global
  route, :func:`local_bank` gives each device the host rows of its experts, and
  :func:`init_expert_parallel` the ``D`` caches, stacked on a leading device axis (one usable
  size per device under one shared capacity). Each device computes its experts' partial output;
  one ``psum`` over the axis combines them.
- **Tensor-parallel.** Each device holds a ``1/T`` slice of every expert's weights
  (:func:`split_weights`), and all devices hold the same cache: every device runs the same
  ``ensure_hybrid`` on the same routes and gets the same plan; its ``apply_copy_plan`` writes
  its slice of each fetched expert. Each device computes its slice's part of the
  down-projection; one ``psum`` adds them. :func:`broadcast_routes` makes the routes one
  device's where the devices could compute different ones.

:func:`device_view` and :func:`stack_view` drop and restore the leading device axis of a
per-device tree inside the ``shard_map`` body.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_cache import state as state_lib
from pallas_cache import validate

__all__ = [
    "ExpertSharding",
    "RouteAssignment",
    "broadcast_routes",
    "device_view",
    "expert_sharding",
    "init_expert_parallel",
    "local_bank",
    "local_routes",
    "route_assignment",
    "split_weights",
    "stack_view",
]


@dataclasses.dataclass(frozen=True)
class ExpertSharding:
    """Which device owns each expert of a layer (the same for every layer). Static and hashable:
    a ``jit`` static argument or a closure constant. Build one with :func:`expert_sharding`.

    Attributes:
      owner: ``E`` ints: ``owner[e]`` is the device that owns expert ``e`` (in ``[0, D)``).
      num_devices: ``D``, the devices on the mesh axis.

    Built directly, it is checked as :func:`expert_sharding` checks ``owner=`` (TypeError for a
    non-integer entry or count, ValueError for no expert, ``D`` below 1 or an owner outside
    ``[0, D)``, naming the expert); ``owner`` is kept as a tuple of Python ints.
    """

    owner: tuple[int, ...]
    num_devices: int

    def __post_init__(self):
        D = validate.positive_int("num_devices", self.num_devices)
        if isinstance(self.owner, (str, bytes)):
            raise TypeError(f"owner must hold integers (one device per expert), got "
                            f"{self.owner!r}")
        values = _ints("owner", self.owner)
        if not values:
            raise ValueError("owner is empty: a layer has at least one expert")
        for e, d in enumerate(values):
            if not 0 <= d < D:
                raise ValueError(f"expert {e}'s owner {d} is outside [0, {D}), the devices")
        object.__setattr__(self, "owner", tuple(values))
        object.__setattr__(self, "num_devices", D)

    @property
    def num_experts(self) -> int:
        """``E``, the experts of a layer."""
        return len(self.owner)

    def experts(self, device: int) -> tuple[int, ...]:
        """The global ids device ``device`` owns, ascending: its local ids ``0, 1, ...``."""
        return tuple(e for e, d in enumerate(self.owner) if d == device)

    @property
    def local_id(self) -> tuple[int, ...]:
        """``E`` ints: expert ``e``'s local id on its owner (its rank among the owner's ids)."""
        seen = [0] * self.num_devices
        ids = []
        for d in self.owner:
            ids.append(seen[d])
            seen[d] += 1
        return tuple(ids)

    @property
    def shares(self) -> tuple[int, ...]:
        """``D`` ints: how many experts each device owns."""
        return tuple(self.owner.count(d) for d in range(self.num_devices))

    @property
    def num_local(self) -> int:
        """The ``num_experts`` of every device's cache: the largest share (at least 1). A device
        with a smaller share never routes its highest local ids."""
        return max(1, max(self.shares))


def expert_sharding(num_experts: int, num_devices: int, *, owner=None,
                    experts=None) -> ExpertSharding:
    """The owner map of the expert-parallel layout (docs/semantics.md §5.17).

    Args:
      num_experts: ``E``, experts per layer (>= 1).
      num_devices: ``D``, devices on the mesh axis (>= 1).
      owner: optional ``E`` ints, the owning device of each expert.
      experts: optional ``D`` sequences of expert ids, the experts each device owns (every
        expert exactly once). At most one of ``owner`` and ``experts``.

    Without either, the default share: contiguous blocks in expert order, as even as possible,
    the first ``E mod D`` devices one expert more (``E = 10, D = 4``: 3, 3, 2, 2), which is the
    layout of a bank whose expert axis is sharded over the devices when ``D`` divides ``E``.

    Raises:
      TypeError: a non-integer entry. ValueError: ``E`` or ``D`` below 1, both maps given, an
        owner outside ``[0, D)``, a list of experts for another number of devices than ``D``,
        an expert id outside ``[0, E)``, or an expert with no owner or two (each error names
        the expert, and the devices).
    """
    E = validate.positive_int("num_experts", num_experts)
    D = validate.positive_int("num_devices", num_devices)
    if owner is not None and experts is not None:
        raise ValueError("give the owner map as owner= (one device per expert) or as experts= "
                         "(the experts of each device), not both")
    if experts is not None:
        return ExpertSharding(_owner_from_lists(experts, E, D), D)
    if owner is None:
        base, extra = divmod(E, D)
        starts = [d * base + min(d, extra) for d in range(D + 1)]
        return ExpertSharding(tuple(d for d in range(D) for _ in range(starts[d], starts[d + 1])),
                              D)
    values = _ints("owner", owner)
    if len(values) != E:
        raise ValueError(f"owner has {len(values)} entries, one per expert is {E}")
    return ExpertSharding(tuple(values), D)


def _ints(name, values) -> list[int]:
    """``values`` (a sequence or a 1-D array) as Python ints; TypeError names a non-integer."""
    if not isinstance(values, (list, tuple)):
        if np.ndim(values) == 0:
            raise TypeError(f"{name} must be a sequence of integers, got {values!r}")
        values = np.asarray(values, dtype=object).reshape(-1)
    out = []
    for v in values:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name} must hold integers, got {v!r} ({type(v).__name__})")
        out.append(int(v))
    return out


def _owner_from_lists(experts, E: int, D: int) -> tuple[int, ...]:
    lists = list(experts)
    if len(lists) != D:
        raise ValueError(f"experts lists the experts of {len(lists)} devices, the mesh axis has "
                         f"{D}")
    owner: list[int | None] = [None] * E
    for d, ids in enumerate(lists):
        for e in _ints(f"experts[{d}]", ids):
            if not 0 <= e < E:
                raise ValueError(f"device {d} lists expert {e}, outside [0, {E})")
            if owner[e] is not None:
                twice = (f"twice by device {d}" if owner[e] == d
                         else f"by devices {owner[e]} and {d}")
                raise ValueError(f"expert {e} is owned {twice}: every expert has one owner")
            owner[e] = d
    for e, d in enumerate(owner):
        if d is None:
            raise ValueError(f"expert {e} has no owner: every expert has one owner")
    return tuple(owner)


def local_routes(sharding: ExpertSharding, routes, device=None) -> jax.Array:
    """A layer's global routes as device ``device``'s local routes (docs/semantics.md §5.17).

    Args:
      sharding: the owner map.
      routes: int ``[...]`` global expert ids in ``[0, E)``, ``-1`` = padding.
      device: a device index in ``[0, D)`` (a Python or NumPy integer, checked here: TypeError
        for a bool or float, ValueError outside the range), or an integer scalar array (traced:
        ``lax.axis_index(axis)`` inside the ``shard_map``; a concrete one is checked as an
        int); None for every device at once.

    Returns:
      int32 ``[...]`` (``[D, ...]`` when ``device`` is None): a route to an expert the device
      owns becomes its local id, a route another device owns and padding become ``-1``. A route
      outside ``[-1, E)`` becomes the out-of-range local id ``num_local`` on every device, so
      every device's ``ensure`` refuses the call (ERR_EXPERT_ID) and writes nothing, as one
      cache refuses the whole call. Jittable.
    """
    _check_sharding(sharding)
    routes = validate.as_routes(routes)
    E = sharding.num_experts
    owner = jnp.asarray(sharding.owner, jnp.int32)
    local = jnp.asarray(sharding.local_id, jnp.int32)
    valid = (routes >= 0) & (routes < E)
    bad = (routes < -1) | (routes >= E)
    index = jnp.clip(routes, 0, E - 1).astype(jnp.int32)
    if device is None:
        device = jnp.arange(sharding.num_devices, dtype=jnp.int32).reshape(
            (-1,) + (1,) * routes.ndim)
    else:
        device = _device_index("device", device, sharding.num_devices)
    mine = valid & (owner[index] == device)
    out = jnp.where(mine, local[index], -1)
    return jnp.where(bad, sharding.num_local, out).astype(jnp.int32)


def _check_sharding(sharding) -> None:
    if not isinstance(sharding, ExpertSharding):
        raise TypeError(f"sharding must be an ExpertSharding (pallas_cache.mesh.expert_sharding), "
                        f"got {type(sharding).__name__}")


def _device_index(name: str, value, num_devices: int):
    """A device index in ``[0, num_devices)``: a host integer (or a concrete integer scalar
    array) is checked and returned as an int, a traced integer scalar as it is. TypeError for a
    bool, a float or another shape; ValueError outside the range, naming ``name``."""
    if isinstance(value, jax.core.Tracer):
        if (getattr(value, "shape", None) != () or
                not jnp.issubdtype(value.dtype, jnp.integer)):
            raise TypeError(f"{name} must be an integer scalar, got a traced "
                            f"{value.dtype}{list(value.shape)}")
        return value
    if isinstance(value, (jax.Array, np.ndarray)) and np.shape(value) != ():
        raise TypeError(f"{name} must be an integer scalar, got shape {np.shape(value)}")
    index = validate.as_host_int(name, value)
    if not 0 <= index < num_devices:
        raise ValueError(f"{name} {index} is outside [0, {num_devices}), the devices of the axis")
    return index


class RouteAssignment(NamedTuple):
    """Where each global route of a layer-call runs, read from its owner's plan.

    Attributes:
      device: int32 ``[...]``, the owning device (-1 for padding).
      slot: int32 ``[...]``, the slot of the owner's pool the route reads (-1: CPU or padding).
      cpu: bool ``[...]``, the owner computes the route on the CPU.
    """

    device: jax.Array
    slot: jax.Array
    cpu: jax.Array


def route_assignment(sharding: ExpertSharding, routes, slots, cpu) -> RouteAssignment:
    """The slot or CPU assignment of every global route, from its owner's plan.

    Args:
      sharding: the owner map.
      routes: int ``[...]``, the layer's global routes (``-1`` = padding).
      slots, cpu: ``[D, ...]``: ``plan.slots`` and ``plan.cpu`` of each device's plan for its
        :func:`local_routes` (stacked on the device axis, as a ``shard_map`` with out_specs
        ``P(axis)`` returns them).

    Returns:
      A :class:`RouteAssignment`. A route outside ``[-1, E)`` gets device -1, slot -1, no CPU
      (every device refused the call). Jittable.
    """
    _check_sharding(sharding)
    routes = validate.as_routes(routes)
    slots, cpu = jnp.asarray(slots), jnp.asarray(cpu)
    expected = (sharding.num_devices,) + routes.shape
    if slots.shape != expected or cpu.shape != expected:
        raise ValueError(f"slots {slots.shape} and cpu {cpu.shape} must be [D, ...routes] = "
                         f"{expected}: one plan per device for the routes {routes.shape}")
    E = sharding.num_experts
    valid = (routes >= 0) & (routes < E)
    owner = jnp.where(valid, jnp.asarray(sharding.owner, jnp.int32)[jnp.clip(routes, 0, E - 1)],
                      -1)
    pick = jnp.maximum(owner, 0)[None]
    slot = jnp.take_along_axis(slots, pick, axis=0)[0]
    on_cpu = jnp.take_along_axis(cpu, pick, axis=0)[0]
    return RouteAssignment(device=owner, slot=jnp.where(valid, slot, -1).astype(jnp.int32),
                           cpu=valid & on_cpu)


def local_bank(sharding: ExpertSharding, bank, *, expert_axis: int = 1):
    """Each device's host rows: leaves ``[..., E, ...]`` -> ``[D, ..., num_local, ...]``.

    Row ``j`` of device ``d`` is expert ``sharding.experts(d)[j]``; a device with a smaller share
    gets zero rows past it (never read: those local ids are never routed). ``expert_axis`` is
    the expert axis of the leaves (1 for ``[L, E, ...]``, 0 for ``[E, ...]``). Place the result
    with a ``NamedSharding(mesh, P(axis), memory_kind="pinned_host")`` to give each device its
    rows in host memory.
    """
    _check_sharding(sharding)
    if not validate.is_int(expert_axis):
        raise TypeError(f"expert_axis must be an integer, got {expert_axis!r} "
                        f"({type(expert_axis).__name__})")
    E, width = sharding.num_experts, sharding.num_local

    def per_device(leaf):
        leaf = jnp.asarray(leaf)
        if leaf.ndim <= expert_axis or leaf.shape[expert_axis] != E:
            raise ValueError(f"a bank leaf of shape {tuple(leaf.shape)} has no expert axis "
                             f"{expert_axis} of {E} rows")
        rows = []
        for d in range(sharding.num_devices):
            ids = sharding.experts(d)
            taken = jnp.take(leaf, jnp.asarray(ids, jnp.int32), axis=expert_axis)
            pad = [(0, 0)] * leaf.ndim
            pad[expert_axis] = (0, width - len(ids))
            rows.append(jnp.pad(taken, pad))
        return jnp.stack(rows)

    return jax.tree.map(per_device, bank)


def init_expert_parallel(sharding: ExpertSharding, num_layers: int, cache_size, *,
                         capacity: int | None = None, **init_kwargs) -> state_lib.CacheState:
    """The ``D`` caches of the expert-parallel layout, stacked: every leaf ``[D, ...]``.

    Args:
      sharding: the owner map; each cache has ``num_experts = sharding.num_local``.
      num_layers: ``L``.
      cache_size: one usable size for every device, or ``D`` of them (mismatched cards): device
        ``d`` uses slots ``[0, cache_size[d])`` of the shared ``capacity``.
      capacity: the allocated slots of every device (static, one shape for the stack); default
        the largest ``cache_size``.
      init_kwargs: ``eviction``, ``history``, ``rebase_threshold`` as in :func:`~pallas_cache.init`.

    Raises:
      ValueError/TypeError as :func:`~pallas_cache.init`, naming the device; a list of sizes for
        another number of devices than ``D``.
    """
    _check_sharding(sharding)
    D = sharding.num_devices
    if isinstance(cache_size, (str, bytes)) or np.ndim(cache_size) == 0:
        sizes = [validate.positive_int("cache_size", cache_size)] * D
    else:
        sizes = list(cache_size)
        if len(sizes) != D:
            raise ValueError(f"cache_size gives {len(sizes)} sizes, the mesh axis has {D} "
                             f"devices")
        sizes = [validate.positive_int(f"cache_size[{d}]", s) for d, s in enumerate(sizes)]
    capacity = (max(sizes) if capacity is None
                else validate.positive_int("capacity", capacity))
    L = validate.positive_int("num_layers", num_layers)
    state_lib.check_capacity(L, sharding.num_local, capacity)
    states = []
    for d, size in enumerate(sizes):
        try:
            states.append(state_lib.init(L, sharding.num_local, size, capacity=capacity,
                                         **init_kwargs))
        except (TypeError, ValueError) as error:
            raise type(error)(f"device {d} (owns {sharding.shares[d]} of {sharding.num_experts} "
                              f"experts, {sharding.num_local} local ids): {error}") from None
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)


def split_weights(tree, num_devices: int, axis):
    """Each device's ``1/T`` slice of every expert's weights, stacked: leaves ``[T, ...]``.

    Args:
      tree: a bank (leaves ``[L, E, ...]`` or ``[E, ...]``) or a pool (``[C, ...]``).
      num_devices: ``T``, the devices of the tensor-parallel axis.
      axis: the axis each leaf is sliced on: an int for every leaf, or a tree of ints with the
        structure of ``tree`` (a prefix of it). Negative axes count from the end, so one spec
        serves the bank and the pool (``{"w_in": -1, "w_out": -2}`` slices the hidden width of
        a two-matrix MLP).

    Returns:
      Leaves ``[T, ...]``: ``out[t]`` is the ``t``-th of ``T`` equal slices of the leaf on
      ``axis``.

    Raises:
      ValueError: ``T`` below 1, an axis outside a leaf's rank, or ``T`` not dividing the sliced
        axis, naming the leaf, its axis and size, and ``T``.
    """
    T = validate.positive_int("num_devices", num_devices)

    def split(path, leaf, ax):
        leaf = jnp.asarray(leaf)
        name = jax.tree_util.keystr(path) or "the leaf"
        if not validate.is_int(ax):
            raise TypeError(f"axis of {name} must be an integer, got {ax!r} "
                            f"({type(ax).__name__})")
        if not -leaf.ndim <= ax < leaf.ndim:
            raise ValueError(f"{name} of shape {tuple(leaf.shape)} has no axis {ax}: axis must "
                             f"be in [{-leaf.ndim}, {leaf.ndim})")
        size = leaf.shape[ax]
        if size % T:
            raise ValueError(f"cannot split {name} of shape {tuple(leaf.shape)} over {T} "
                             f"devices: its axis {ax} has {size} entries, which {T} does not "
                             f"divide")
        return jnp.stack(jnp.split(leaf, T, axis=ax))

    return jax.tree_util.tree_map_with_path(split, tree, jax.tree.broadcast(axis, tree))


def broadcast_routes(routes, axis_name, source: int = 0) -> jax.Array:
    """Inside a ``shard_map``: every device gets device ``source``'s routes (one integer
    ``psum`` of ``[...]`` int32 over ``axis_name``). The result is the same on every device, by
    value and by type (it does not vary over the axis).

    ``source`` is a Python or NumPy integer in ``[0, D)``, ``D`` the axis's size (checked at
    trace time: TypeError for a bool, a float or an array, ValueError outside the range)."""
    if isinstance(source, (jax.Array, np.ndarray)):
        raise TypeError(f"source must be a Python or NumPy integer (a static device index), got "
                        f"an array of shape {np.shape(source)}")
    source = validate.as_host_int("source", source)
    size = lax.axis_size(axis_name)
    if not 0 <= source < size:
        raise ValueError(f"source {source} is outside [0, {size}), the devices of axis "
                         f"{axis_name!r}")
    routes = validate.as_routes(routes).astype(jnp.int32)
    mine = lax.axis_index(axis_name) == source
    return lax.psum(jnp.where(mine, routes, 0), axis_name)


def device_view(tree: Any):
    """Inside a ``shard_map`` whose in_spec puts a stacked tree's device axis on the mesh axis:
    the device's own member (leaves ``[1, ...] -> [...]``)."""
    return jax.tree.map(lambda leaf: leaf[0], tree)


def stack_view(tree: Any):
    """The inverse of :func:`device_view`, for the ``shard_map``'s outputs."""
    return jax.tree.map(lambda leaf: leaf[None], tree)
