"""Static input checks of the library, in one place, and the int32 range everything lives in.

Static misuse -- a float array of expert ids, a bool where a count belongs, bank sizes that are not
positive ints -- is known from Python values, dtypes and shapes, so it raises ``TypeError`` /
``ValueError`` at call or trace time, naming the offending value (docs/semantics.md §6). Value
errors that depend on traced numbers are not checked here: they become error bits
(``pallas_cache.errors``). The cache computes in int32 only; :data:`INT32_MIN` and
:data:`INT32_MAX` are that range (the smallest value is also the usage of a forgotten slot).
"""

from __future__ import annotations

import numbers
import operator

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "INT32_MAX",
    "INT32_MIN",
    "as_bank_sizes",
    "as_host_int",
    "as_index",
    "as_routes",
    "is_int",
    "positive_int",
]

INT32_MIN = int(np.iinfo(np.int32).min)
INT32_MAX = int(np.iinfo(np.int32).max)


def is_int(value) -> bool:
    """Whether ``value`` is a Python or NumPy integer and not a bool (``True`` is no count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


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


def positive_int(name: str, value) -> int:
    """A Python/NumPy integer >= 1, else TypeError/ValueError naming the value."""
    as_int = as_host_int(name, value)
    if as_int < 1:
        raise ValueError(f"{name} must be >= 1, got {as_int}")
    return as_int


def _is_integer_dtype(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.integer)


def as_routes(expert_ids) -> jax.Array:
    """Routes of any shape and any integer dtype, as int32. Floats and bools raise TypeError.

    Ids are not range-checked here: that is a value error (ERR_EXPERT_ID), known only on device.
    """
    dtype = getattr(expert_ids, "dtype", None)
    if dtype is None:
        expert_ids = np.asarray(expert_ids)
        dtype = expert_ids.dtype
        if expert_ids.size == 0:  # an empty list has a float dtype in NumPy; it holds no ids
            return jnp.zeros(expert_ids.shape, jnp.int32)
    if not _is_integer_dtype(dtype):
        raise TypeError(
            f"expert_ids must have an integer dtype (layer-local ids, -1 = padding), "
            f"got dtype {np.dtype(dtype).name}"
        )
    return jnp.asarray(expert_ids).astype(jnp.int32)


def as_index(name: str, value) -> jax.Array:
    """A scalar integer index (layer, slot) that may be traced, as an int32 scalar.

    Python ints, NumPy integers and integer arrays of shape ``()`` are accepted; floats and bools
    raise TypeError, other shapes ValueError. The range is a value error, checked on device.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got the bool {value!r}")
    if isinstance(value, int):
        if not INT32_MIN <= value <= INT32_MAX:
            raise ValueError(f"{name} {value} does not fit in int32")
        return jnp.asarray(value, jnp.int32)
    dtype = getattr(value, "dtype", None)
    if dtype is None or not _is_integer_dtype(dtype):
        raise TypeError(f"{name} must be an integer scalar, got {value!r}")
    if np.shape(value) != ():
        raise ValueError(f"{name} must be a scalar, got shape {np.shape(value)}")
    return jnp.asarray(value).astype(jnp.int32)


def as_bank_sizes(bank_feat_bytes) -> tuple:
    """A tuple of positive Python ints (each prefill weight bank's per-expert row bytes), else
    TypeError/ValueError naming the value (static)."""
    if isinstance(bank_feat_bytes, (str, bytes)) or not isinstance(bank_feat_bytes, (tuple, list)):
        raise TypeError(
            f"bank_feat_bytes must be a tuple of positive ints (one per weight bank), "
            f"got {bank_feat_bytes!r}"
        )
    sizes = []
    for size in bank_feat_bytes:
        if not is_int(size):
            raise TypeError(
                f"bank_feat_bytes entries must be ints, got {size!r} in {bank_feat_bytes!r}")
        if size <= 0:
            raise ValueError(
                f"bank_feat_bytes entries must be positive, got {size!r} in {bank_feat_bytes!r}")
        sizes.append(int(size))
    return tuple(sizes)
