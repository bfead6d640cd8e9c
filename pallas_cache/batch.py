"""Batches of caches: stack states along a leading axis for ``jax.vmap``, and take one out.

A batch is a :class:`~pallas_cache.CacheState` whose every leaf has the same leading batch
axes; ``vmap`` over it runs the caches independently (docs/semantics.md §1). Stacking needs
one tree structure: the same ``L``, ``E``, eviction and ring, and the same capacity
``C`` (a shape). Caches of different usable sizes share a capacity: build them with
``init(L, E, S, capacity=C)``, or pass ``capacity=`` here to pad the smaller ones with
unusable slots, which changes no plan or count (docs/semantics.md §5.15).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_cache import validate
from pallas_cache import state as state_lib
from pallas_cache.state import CacheState

__all__ = ["batch_shape", "pad_capacity", "stack_states", "take_state", "unstack_states"]


def batch_shape(state: CacheState) -> tuple[int, ...]:
    """The leading batch axes of a state: ``()`` for one cache, ``(B,)`` for a stack of ``B``."""
    return tuple(np.shape(state.residency.id_of_slot)[:-1])


def pad_capacity(state: CacheState, capacity: int) -> CacheState:
    """One cache (or a batch) with ``capacity`` allocated slots, the added ones unusable (empty,
    usage 0): the same cache for every rule (docs/semantics.md §5.15); a pool for it needs
    ``capacity`` slots. ``capacity`` is what :func:`~pallas_cache.init` takes (a Python or NumPy
    integer, or a concrete 0-d integer array), checked before anything is allocated: below the
    state's capacity, or a capacity ``init`` refuses (above ``2**31 - 1``, or no room for the
    clock after a rebase), raises ``ValueError``; a non-integer ``TypeError``."""
    capacity = validate.positive_int("capacity", capacity)
    state_lib.check_capacity(state.num_layers, state.num_experts, capacity)
    have = state.capacity
    if capacity < have:
        raise ValueError(f"capacity {capacity} is below the state's capacity {have}; "
                         f"a capacity only grows (rebuild allocates a new, smaller pool)")
    if capacity == have:
        return state
    extra = capacity - have
    batch = batch_shape(state)

    def pad(leaf: jax.Array, value: int) -> jax.Array:
        return jnp.concatenate([leaf, jnp.full(batch + (extra,), value, leaf.dtype)], axis=-1)

    return state.replace(residency=state.residency.replace(
        id_of_slot=pad(state.residency.id_of_slot, -1), usage=pad(state.residency.usage, 0)))


def _signature(state: CacheState) -> str:
    history = state.eviction.history_of(state.eviction_state)
    ring = f", history={history}" if history is not None else ""
    return (f"L={state.num_layers}, E={state.num_experts}, C={state.capacity}, "
            f"eviction={state.eviction.name}{ring}")


def stack_states(states: Sequence[CacheState], *, capacity: int | None = None) -> CacheState:
    """Stack caches along a new leading axis: ``batch[i]`` is ``states[i]``; vmap over it.

    Args:
      states: one or more ``CacheState`` of one geometry (``L``, ``E``, eviction, ring); each
        may itself be a batch of the same batch shape.
      capacity: pad every state to this many allocated slots first (:func:`pad_capacity`), so
        caches allocated with different capacities stack; the pool of the batch then needs
        ``capacity`` slots per cache. Default: the capacities must already agree.

    Raises:
      ValueError: no states, or states that differ in a shape or the eviction (naming
        both, with how to make them agree); a ``capacity`` :func:`pad_capacity` refuses
        (checked once, before any state is padded).
    """
    states = list(states)
    if not states:
        raise ValueError("stack_states needs at least one state")
    for i, state in enumerate(states):
        if not isinstance(state, CacheState):
            raise TypeError(f"stack_states takes CacheState values; states[{i}] is "
                            f"{type(state).__name__}")
    if capacity is not None:
        capacity = validate.positive_int("capacity", capacity)
        for state in states:
            state_lib.check_capacity(state.num_layers, state.num_experts, capacity)
        states = [pad_capacity(s, capacity) for s in states]
    first = _signature(states[0])
    for i, state in enumerate(states[1:], start=1):
        if _signature(state) != first or batch_shape(state) != batch_shape(states[0]):
            if state.capacity != states[0].capacity and capacity is None:
                largest = max(s.capacity for s in states)
                raise ValueError(
                    f"states[0] and states[{i}] allocate {states[0].capacity} and "
                    f"{state.capacity} slots; pass capacity={largest} to pad them (or build "
                    f"each with pc.init(L, E, S, capacity={largest}))")
            raise ValueError(f"states[0] ({first}, batch {batch_shape(states[0])}) and "
                             f"states[{i}] ({_signature(state)}, batch {batch_shape(state)}) "
                             f"cannot share a batch")
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)


def take_state(batch: CacheState, index: int) -> CacheState:
    """Cache ``index`` of a batch (along the first batch axis; negative counts from the end).

    Raises ``ValueError`` for a state with no batch axis or an index out of range, naming the
    batch size."""
    shape = batch_shape(batch)
    if not shape:
        raise ValueError("take_state needs a batch (stack_states); this state is one cache")
    i = validate.as_host_int("index", index)
    if not -shape[0] <= i < shape[0]:
        raise ValueError(f"index {i} outside a batch of {shape[0]} caches")
    return jax.tree.map(lambda leaf: leaf[i], batch)


def unstack_states(batch: CacheState) -> list[CacheState]:
    """Every cache of a batch, in order (along the first batch axis): the inverse of
    :func:`stack_states`."""
    shape = batch_shape(batch)
    if not shape:
        raise ValueError("unstack_states needs a batch (stack_states); this state is one cache")
    return [take_state(batch, i) for i in range(shape[0])]
