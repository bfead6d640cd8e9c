"""Every error rule of the library, in one place (docs/semantics.md §6, docs/design.md).

Two kinds of misuse, handled two ways:

* **Static misuse** -- a float array of expert ids, a policy of the wrong rank, an unknown enum,
  bank sizes that are not positive ints -- is known from Python values, dtypes and shapes, so it
  raises ``TypeError``/``ValueError`` at call or trace time, naming the offending value. The
  ``as_*`` coercers below implement it.
* **Value errors** -- an expert id outside ``[-1, E)``, a layer outside ``[0, L)``, a slot outside
  ``[0, S)``, prefill misuse -- depend on traced values, which a jitted decode loop cannot
  inspect without a host sync. The op then returns the **input state unchanged** and a plan whose
  ``error`` field carries the bits below (an empty plan otherwise: -1 slots, zero counts). Nothing
  is ever half-applied. :func:`check` turns the bits into a readable exception eagerly;
  :func:`checked` is the ``jax.experimental.checkify`` form that raises under ``jit``.
"""

from __future__ import annotations

import numbers
import operator

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
    "ERROR_NAMES",
    "CacheError",
    "check",
    "checked",
    "describe",
    "raise_on_error",
]

ERR_EXPERT_ID = 1  # a route outside [-1, E)
ERR_LAYER = 2  # a layer outside [0, L)
ERR_SLOT = 4  # forget_slot with a slot outside [0, S)
ERR_PREFILL_NOT_BEGUN = 8  # staging a layer without begin_prefill
ERR_PREFILL_BUSY = 16  # staging into a buffer that holds another, unreleased layer

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
}


def describe(bits: int) -> str:
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

    def __init__(self, bits: int):
        self.bits = int(bits)
        super().__init__(
            f"pallas_cache refused the call and returned the state unchanged: {describe(bits)} "
            f"(error bits {self.bits:#x})"
        )


def check(plan):
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


raise_on_error = check


def checked(plan):
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
        "(1 ERR_EXPERT_ID, 2 ERR_LAYER, 4 ERR_SLOT, 8 ERR_PREFILL_NOT_BEGUN, 16 ERR_PREFILL_BUSY)",
        jnp.bitwise_or.reduce(error.ravel()) if error.ndim else error,
    )
    return plan


# ---- static misuse: coercion of user inputs, raising at call/trace time ----------------------


def _is_integer_dtype(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.integer)


_INT32_MIN = int(np.iinfo(np.int32).min)
_INT32_MAX = int(np.iinfo(np.int32).max)


def _host_integers(value) -> np.ndarray:
    """A Python int, or a (nested) list of them, as an int64 NumPy array, exactly.

    Built from Python objects, so NumPy's promotion cannot turn ``[3, 2**63]`` into floats; ints
    beyond the int32 range are clipped, in Python, to just outside it: every such value is out
    of range for any index, and clipping keeps it so (docs/semantics.md §6).
    """
    array = np.asarray(value, dtype=object)
    flat = array.ravel().tolist()
    for v in flat:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
            raise TypeError(
                f"expert_ids must be integers (layer-local ids, -1 = padding), got {v!r} "
                f"({type(v).__name__})"
            )
    clipped = [min(max(int(v), _INT32_MIN - 1), _INT32_MAX + 1) for v in flat]
    return np.asarray(clipped, np.int64).reshape(array.shape)


def narrow_to_int32(values):
    """``values`` (any integer dtype, host or device, possibly traced) as int32, exactly.

    A value outside the int32 range becomes ``INT32_MIN``, which every range check of the cache
    refuses (an expert id below -1, a negative layer or slot), so a wide input is refused with
    the right error bit instead of wrapping into a valid index (docs/semantics.md §6). The range
    test runs in the input's own dtype, before any cast; dtypes that fit int32 are cast as is.
    """
    dtype = np.dtype(values.dtype)
    info = np.iinfo(dtype)
    fits = info.min >= _INT32_MIN and info.max <= _INT32_MAX
    on_host = isinstance(values, (np.ndarray, np.generic))
    xp = np if on_host else jnp
    narrowed = values.astype(np.int32) if on_host else values.astype(jnp.int32)
    if not fits:
        outside = values > xp.asarray(_INT32_MAX, dtype)
        if info.min < 0:
            outside = outside | (values < xp.asarray(_INT32_MIN, dtype))
        narrowed = xp.where(outside, xp.int32(_INT32_MIN), narrowed)
    return jnp.asarray(narrowed, jnp.int32)


def as_routes(expert_ids) -> jax.Array:
    """Routes of any shape and any integer dtype, as int32. Floats and bools raise TypeError.

    Ids are not range-checked here: that is a value error (ERR_EXPERT_ID), known only on device.
    Ids outside int32 become ``INT32_MIN`` (:func:`narrow_to_int32`), so they are refused too.
    """
    dtype = getattr(expert_ids, "dtype", None)
    if dtype is None:  # a Python int or list: read exactly, then it is an int64 array
        expert_ids = _host_integers(expert_ids)
        dtype = expert_ids.dtype
    if not _is_integer_dtype(dtype):
        raise TypeError(
            f"expert_ids must have an integer dtype (layer-local ids, -1 = padding), "
            f"got dtype {np.dtype(dtype).name}"
        )
    return narrow_to_int32(expert_ids)


def as_host_int(name: str, value) -> int:
    """A Python/NumPy integer (not a bool) as an ``int``, else TypeError naming the value.

    For values that must be known on the host: geometry, caps, a report's layer."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        kind = type(value).__name__
        raise TypeError(f"{name} must be an integer, got {value!r} ({kind})") from None


def as_index(name: str, value) -> jax.Array:
    """A scalar integer index (layer, slot) that may be traced, as an int32 scalar.

    Python ints, NumPy integers and integer arrays of shape ``()`` are accepted; floats and bools
    raise TypeError, other shapes ValueError. The range is a value error, checked on device; an
    index outside int32 (a Python int, int64, uint32 ...) becomes ``INT32_MIN``, so it is refused
    with the op's error bit rather than wrapped into range (:func:`narrow_to_int32`).
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got the bool {value!r}")
    if isinstance(value, int):
        return jnp.asarray(value if _INT32_MIN <= value <= _INT32_MAX else _INT32_MIN, jnp.int32)
    dtype = getattr(value, "dtype", None)
    if dtype is None or not _is_integer_dtype(dtype):
        raise TypeError(f"{name} must be an integer scalar, got {value!r}")
    if np.shape(value) != ():
        raise ValueError(f"{name} must be a scalar, got shape {np.shape(value)}")
    return narrow_to_int32(value)


# ---- value errors: the bits an op sets, computed on device -----------------------------------


def layer_bits(layer: jax.Array, num_layers: int) -> jax.Array:
    """ERR_LAYER if ``layer`` is outside ``[0, num_layers)``, else 0 (int32 scalar)."""
    return jnp.where((layer < 0) | (layer >= num_layers), ERR_LAYER, 0).astype(jnp.int32)


def route_bits(routes: jax.Array, num_experts: int) -> jax.Array:
    """ERR_EXPERT_ID if any route is outside ``[-1, num_experts)``, else 0 (int32 scalar)."""
    bad = jnp.any((routes < -1) | (routes >= num_experts))
    return jnp.where(bad, ERR_EXPERT_ID, 0).astype(jnp.int32)


def slot_bits(slot: jax.Array, cache_size: int) -> jax.Array:
    """ERR_SLOT if ``slot`` is outside ``[0, cache_size)``, else 0 (int32 scalar)."""
    return jnp.where((slot < 0) | (slot >= cache_size), ERR_SLOT, 0).astype(jnp.int32)
