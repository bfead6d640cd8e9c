"""The error bits of traced misuse, and the checks that turn them into exceptions.

A refused call returns its input state and a plan whose ``error`` carries the bits below
(docs/semantics.md §6); :func:`check` raises eagerly, :func:`checked` under ``jit`` (checkify).
"""

from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

__all__ = [
    "ERR_EXPERT_ID",
    "ERR_LAYER",
    "ERR_SLOT",
    "ERR_PREFILL_NOT_BEGUN",
    "ERR_PREFILL_BUSY",
    "ERR_CACHE_SIZE",
    "ERROR_NAMES",
    "CacheError",
    "check",
    "checked",
    "describe_bits",
]

_Plan = TypeVar("_Plan")  # any plan with an ``error`` field

ERR_EXPERT_ID = 1  # a route outside [-1, E)
ERR_LAYER = 2  # a layer outside [0, L)
ERR_SLOT = 4  # forget_slot with a slot outside [0, S)
ERR_PREFILL_NOT_BEGUN = 8  # staging a layer without begin_prefill
ERR_PREFILL_BUSY = 16  # staging into a buffer that holds another, unreleased layer
# resize outside [E, capacity] or under a busy prefill buffer; prefill on a usable size < 2E
ERR_CACHE_SIZE = 64

ERROR_NAMES = {
    ERR_EXPERT_ID: ("ERR_EXPERT_ID", "an expert id outside [-1, num_experts)"),
    ERR_LAYER: ("ERR_LAYER", "a layer outside [0, num_layers)"),
    ERR_SLOT: ("ERR_SLOT", "a slot outside [0, cache_size)"),
    ERR_PREFILL_NOT_BEGUN: (
        "ERR_PREFILL_NOT_BEGUN", "a prefill layer staged without begin_prefill"),
    ERR_PREFILL_BUSY: (
        "ERR_PREFILL_BUSY",
        "a prefill buffer still holds another layer that was not released",
    ),
    ERR_CACHE_SIZE: (
        "ERR_CACHE_SIZE",
        "a cache size outside [num_experts, capacity], a shrink under a busy prefill buffer, "
        "or prefill on a usable pool below 2 * num_experts",
    ),
}


def describe_bits(bits: int) -> str:
    """The names and meanings of the error bits set in ``bits``, ``'no error'`` for 0."""
    bits = int(bits)
    if bits == 0:
        return "no error"
    parts = [f"{name} ({meaning})" for bit, (name, meaning) in ERROR_NAMES.items() if bits & bit]
    unknown = bits & ~sum(ERROR_NAMES)
    if unknown:
        parts.append(f"unknown bits {unknown:#x}")
    return ", ".join(parts)


class CacheError(ValueError):
    """A cache op was refused; the state it returned is the state it was given.

    Attributes:
      bits: the OR of the error bits of every refused call in the plan (a batched plan from a
        ``vmap`` reports the union over the batch).
    """

    def __init__(self, bits: int) -> None:
        self.bits = int(bits)
        super().__init__(
            f"pallas_cache refused the call and returned the state unchanged: "
            f"{describe_bits(bits)} (error bits {self.bits:#x})"
        )


def check(plan: _Plan) -> _Plan:
    """Raise :class:`CacheError` if ``plan.error`` has any bit set; otherwise return ``plan``.

    Eager (host) check: it reads the error back from the device, so call it outside ``jit``. A
    batched plan (from a ``vmap``) raises if any member failed. Use :func:`checked` inside
    ``jit``.
    """
    bits = np.asarray(jax.device_get(plan.error)).astype(np.int64).ravel()
    union = int(np.bitwise_or.reduce(bits)) if bits.size else 0
    if union:
        raise CacheError(union)
    return plan


def checked(plan: _Plan) -> _Plan:
    """The ``checkify`` form of :func:`check`, for use under ``jit``; returns ``plan``.

    Wrap the jitted function with ``jax.experimental.checkify.checkify`` and the error (with its
    bits) surfaces from ``err.throw()``::

        f = checkify.checkify(jax.jit(lambda s, ids: pc.checked(pc.ensure(s, 0, ids)[1])))
        err, plan = f(state, ids)
        err.throw()
    """
    error = jnp.asarray(plan.error)
    checkify.check(
        jnp.all(error == 0),
        "pallas_cache refused the call and returned the state unchanged: error bits {} "
        "(1 ERR_EXPERT_ID, 2 ERR_LAYER, 4 ERR_SLOT, 8 ERR_PREFILL_NOT_BEGUN, 16 ERR_PREFILL_BUSY, "
        "64 ERR_CACHE_SIZE)",
        jnp.bitwise_or.reduce(error.ravel()) if error.ndim else error,
    )
    return plan


# ---- value errors: the bits an op sets, computed on device -----------------------------------


def layer_bits(layer: jax.Array, num_layers: int) -> jax.Array:
    """ERR_LAYER if ``layer`` is outside ``[0, num_layers)``, else 0 (int32 scalar)."""
    return jnp.where((layer < 0) | (layer >= num_layers), ERR_LAYER, 0).astype(jnp.int32)


def route_bits(routes: jax.Array, num_experts: int) -> jax.Array:
    """ERR_EXPERT_ID if any route is outside ``[-1, num_experts)``, else 0 (int32 scalar)."""
    bad = jnp.any((routes < -1) | (routes >= num_experts))
    return jnp.where(bad, ERR_EXPERT_ID, 0).astype(jnp.int32)


def size_bits(cache_size, num_experts: int, capacity: int) -> jax.Array:
    """ERR_CACHE_SIZE if the state's usable size (traced) is outside ``[num_experts,
    capacity]`` (a hand-built state), else 0 (int32 scalar)."""
    bad = (cache_size < num_experts) | (cache_size > capacity)
    return jnp.where(bad, ERR_CACHE_SIZE, 0).astype(jnp.int32)


def slot_bits(slot: jax.Array, cache_size) -> jax.Array:
    """ERR_SLOT if ``slot`` is outside ``[0, cache_size)`` (the usable size, possibly traced),
    else 0 (int32 scalar)."""
    return jnp.where((slot < 0) | (slot >= cache_size), ERR_SLOT, 0).astype(jnp.int32)
