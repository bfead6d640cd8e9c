"""Static input checks (types, dtypes, shapes, enums) that raise at call or trace time.

They name the offending value (docs/semantics.md §6); :data:`INT32_MIN` and :data:`INT32_MAX`
are the int32 range the cache computes in.
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
    "coerce_enum",
    "is_int",
    "narrow_to_int32",
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


def coerce_enum(cls, value, what: str):
    """``value`` as a member of the string enum ``cls`` (a member, or its value in any case);
    anything else raises ValueError naming ``what`` and the choices."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls(value.lower())
        except ValueError:
            pass
    choices = ", ".join(f"{cls.__name__}.{m.name}" for m in cls)
    raise ValueError(f"unknown {what} {value!r}; expected one of {choices}")


def positive_int(name: str, value) -> int:
    """A Python/NumPy integer >= 1, else TypeError/ValueError naming the value."""
    as_int = as_host_int(name, value)
    if as_int < 1:
        raise ValueError(f"{name} must be >= 1, got {as_int}")
    return as_int


def _is_integer_dtype(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.integer)


def _host_integers(value) -> np.ndarray:
    """A Python int, or a (nested) list of them, as an int64 NumPy array, exactly.

    Built from Python objects, so NumPy's promotion cannot turn ``[3, 2**63]`` into floats; ints
    beyond the int32 range are clipped, in Python, to just outside it: every such value is out
    of range for any index, and clipping keeps it so (docs/semantics.md §6).
    """
    array = np.asarray(value, dtype=object)
    flat = array.ravel().tolist()
    for v in flat:
        if not is_int(v):
            raise TypeError(
                f"expert_ids must be integers (layer-local ids, -1 = padding), got {v!r} "
                f"({type(v).__name__})"
            )
    clipped = [min(max(int(v), INT32_MIN - 1), INT32_MAX + 1) for v in flat]
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
    fits = info.min >= INT32_MIN and info.max <= INT32_MAX
    on_host = isinstance(values, (np.ndarray, np.generic))
    xp = np if on_host else jnp
    narrowed = values.astype(np.int32) if on_host else values.astype(jnp.int32)
    if not fits:
        outside = values > xp.asarray(INT32_MAX, dtype)
        if info.min < 0:
            outside = outside | (values < xp.asarray(INT32_MIN, dtype))
        narrowed = xp.where(outside, xp.int32(INT32_MIN), narrowed)
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
        return jnp.asarray(value if INT32_MIN <= value <= INT32_MAX else INT32_MIN, jnp.int32)
    dtype = getattr(value, "dtype", None)
    if dtype is None or not _is_integer_dtype(dtype):
        raise TypeError(f"{name} must be an integer scalar, got {value!r}")
    if np.shape(value) != ():
        raise ValueError(f"{name} must be a scalar, got shape {np.shape(value)}")
    return narrow_to_int32(value)


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
